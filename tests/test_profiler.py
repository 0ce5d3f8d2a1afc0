"""The profiler: layer rows, edges, FLOPs, bytes and in-place timing of the layer library."""

from __future__ import annotations

import math
import time
from datetime import datetime

import pandas as pd
import pytest
import torch
from torch import nn

from tapp_core.graph import layer_nodes, trace_model
from tapp_core.library import LayerLibrary
from tapp_core.models import build_model, build_traced_model
from tapp_core.profiler import (
    PROFILE_VERSION,
    ProfileError,
    fixed_part,
    profile_graph,
    profile_model,
    small_batch_size,
)

BATCH = 4
FAST = {"repeats": 2, "warmup": 1}


@pytest.fixture(scope="module")
def branchy() -> LayerLibrary:
    return profile_model("tiny_branchy", BATCH, **FAST)


@pytest.fixture(scope="module")
def tiny_cnn() -> LayerLibrary:
    return profile_model("tiny_cnn", BATCH, **FAST)


def by_name(library: LayerLibrary, name: str):
    matches = [layer for layer in library.layers if layer.name == name]
    assert len(matches) == 1, f"no single layer named {name!r} in {[layer.name for layer in library.layers]}"
    return matches[0]


def test_one_row_per_layer_in_graph_order(branchy: LayerLibrary) -> None:
    nodes = layer_nodes(build_traced_model("tiny_branchy"))
    assert len(branchy) == len(nodes)
    assert [layer.index for layer in branchy.layers] == list(range(len(nodes)))
    assert [layer.name for layer in branchy.layers] == [node.name for node in nodes]
    assert len(branchy.to_frame()) == len(nodes)


def test_successors_and_predecessors_agree(branchy: LayerLibrary) -> None:
    for layer in branchy.layers:
        for succ in layer.successors:
            assert succ > layer.index
            assert layer.index in branchy.layers[succ].predecessors
        for pred in layer.predecessors:
            assert layer.index in branchy.layers[pred].successors
    stem_relu = by_name(branchy, "stem_relu")
    # The stem feeds both branches and the skip connection's add.
    assert {branchy.layers[i].name for i in stem_relu.successors} == {"branch_a", "branch_b", "add"}
    assert {branchy.layers[i].name for i in by_name(branchy, "cat").predecessors} == {"branch_a_relu", "branch_b_relu"}
    assert branchy.layers[0].predecessors == ()
    assert branchy.layers[-1].successors == ()


def test_conv_and_linear_flops_by_hand(tiny_cnn: LayerLibrary) -> None:
    # conv1: 3 -> 8 channels, 3x3, padding 1, 32x32 out; 2 FLOPs per multiply-add plus one add per output for bias.
    out = 8 * 32 * 32
    assert by_name(tiny_cnn, "conv1").flops == 2 * out * 3 * 3 * 3 + out
    # conv2: 8 -> 16 channels, 3x3, stride 2: 16x16 out.
    out = 16 * 16 * 16
    assert by_name(tiny_cnn, "conv2").flops == 2 * out * 8 * 3 * 3 + out
    assert by_name(tiny_cnn, "fc").flops == 2 * 256 * 10 + 10
    # MaxPool2d(4) on 16x16x16: 16 comparisons per output element; ReLU one per element; flatten none.
    assert by_name(tiny_cnn, "pool").flops == 16 * 4 * 4 * 16
    assert by_name(tiny_cnn, "relu1").flops == 8 * 32 * 32
    assert by_name(tiny_cnn, "flatten").flops == 0
    assert tiny_cnn.extra["ops_without_flop_rule"] == []


def test_branchy_elementwise_and_pool_flops(branchy: LayerLibrary) -> None:
    assert by_name(branchy, "add").flops == 8 * 16 * 16
    assert by_name(branchy, "cat").flops == 0
    assert by_name(branchy, "pool").flops == 8 * 4 * 4 * 16  # AvgPool2d(4): 16 adds per output element


def test_param_bytes_sum_to_model_parameters(branchy: LayerLibrary, tiny_cnn: LayerLibrary) -> None:
    for name, library in (("tiny_branchy", branchy), ("tiny_cnn", tiny_cnn)):
        model = build_model(name)
        assert library.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    conv1 = by_name(tiny_cnn, "conv1")
    assert conv1.param_bytes == (8 * 3 * 3 * 3 + 8) * 4
    assert by_name(tiny_cnn, "relu1").param_bytes == 0


class SharedBlock(nn.Module):
    """The same Linear called twice: its parameters belong to the first call only."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.down = nn.Linear(3 * 32 * 32, 16)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(self.flatten(x))
        h = self.shared(torch.relu(self.shared(h)))
        return self.head(h)


def test_module_called_twice_counts_its_parameters_once() -> None:
    model = SharedBlock()
    library = profile_graph(trace_model(model), "shared", BATCH, **FAST)
    calls = [layer for layer in library.layers if layer.op == "Linear" and layer.name.startswith("shared")]
    assert [layer.param_bytes for layer in calls] == [(16 * 16 + 16) * 4, 0]
    assert library.param_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_activation_bytes_and_output_shape(tiny_cnn: LayerLibrary) -> None:
    conv1 = by_name(tiny_cnn, "conv1")
    assert conv1.activation_bytes == 8 * 32 * 32 * 4  # float32, per sample
    assert conv1.output_shape == (BATCH, 8, 32, 32)
    assert by_name(tiny_cnn, "fc").output_shape == (BATCH, 10)
    assert by_name(tiny_cnn, "fc").activation_bytes == 10 * 4
    assert tiny_cnn.input_bytes == 3 * 32 * 32 * 4


def test_save_load_round_trip(branchy: LayerLibrary, tmp_path) -> None:
    branchy.save(tmp_path)
    loaded = LayerLibrary.load(tmp_path)
    assert loaded.layers == branchy.layers
    assert loaded.metadata() == branchy.metadata()


def test_times_and_metadata_recorded(tiny_cnn: LayerLibrary) -> None:
    assert all(layer.forward_s > 0 for layer in tiny_cnn.layers)
    # Every layer of this model creates autograd nodes, so each has a backward.
    assert all(layer.backward_s > 0 for layer in tiny_cnn.layers)
    assert tiny_cnn.whole_model_s > 0
    assert tiny_cnn.device == "cpu"
    assert tiny_cnn.batch_size == BATCH
    assert tiny_cnn.torch_version == torch.__version__
    assert datetime.fromisoformat(tiny_cnn.date).tzinfo is not None
    assert tiny_cnn.extra["flops_per_sample"] == sum(layer.flops for layer in tiny_cnn.layers)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a known time."""

    SECONDS = 0.03

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        time.sleep(_Sleep.SECONDS)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(_Sleep.SECONDS)
        return grad


def sleep_identity(x: torch.Tensor) -> torch.Tensor:
    return _Sleep.apply(x)


torch.fx.wrap("sleep_identity")  # a leaf for tracing: one call_function layer


class SleepyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = sleep_identity(self.relu(self.conv(x)))
        return self.fc(torch.flatten(h, 1))


def test_time_is_charged_to_the_layer_that_spends_it() -> None:
    library = profile_graph(trace_model(SleepyNet()), "sleepy", BATCH, **FAST)
    sleeper = next(layer for layer in library.layers if layer.op == "sleep_identity")
    others = [layer for layer in library.layers if layer is not sleeper]
    assert sleeper.forward_s >= _Sleep.SECONDS
    assert sleeper.backward_s >= _Sleep.SECONDS
    assert sum(layer.forward_s for layer in others) < _Sleep.SECONDS
    assert sum(layer.backward_s for layer in others) < _Sleep.SECONDS
    # Both sleeps happen in the whole-model step too, so the layers cannot add up to much less or more.
    assert 0.7 < library.layer_time_sum_s / library.whole_model_s < 1.3
    assert library.extra["ops_without_flop_rule"] == ["sleep_identity"]


def test_a_sleep_is_a_fixed_cost_and_the_fit_says_so() -> None:
    library = profile_graph(trace_model(SleepyNet()), "sleepy", 16, **FAST)
    assert library.extra["small_batch_size"] == 2 and library.extra["profile_version"] == PROFILE_VERSION
    sleeper = next(layer for layer in library.layers if layer.op == "sleep_identity")
    # The sleep takes as long for 2 samples as for 16: most of it is per call (a linear fit would say none). Not
    # "all": on a busy machine one of the two timings can run several milliseconds long.
    assert sleeper.forward_fixed_s >= 0.5 * sleeper.forward_s
    assert sleeper.backward_fixed_s >= 0.5 * sleeper.backward_s
    assert all(0.0 <= layer.forward_fixed_s <= layer.forward_s for layer in library.layers)
    assert all(0.0 <= layer.backward_fixed_s <= layer.backward_s for layer in library.layers)


def test_the_fixed_part_is_the_intercept_clipped_to_the_time() -> None:
    assert small_batch_size(64) == 8 and small_batch_size(16) == 2 and small_batch_size(8) is None
    # 10 s at 64 samples, 3 s at 8: 0.125 s per sample, intercept 2 s.
    assert math.isclose(fixed_part(10.0, 3.0, 64, 8), 2.0)
    assert fixed_part(10.0, 0.5, 64, 8) == 0.0  # noise below the line through the origin
    assert fixed_part(10.0, 12.0, 64, 8) == 10.0  # noise above the whole time


def test_a_library_without_fixed_parts_loads_as_linear(branchy: LayerLibrary, tmp_path) -> None:
    branchy.save(tmp_path)
    frame = pd.read_csv(tmp_path / "layers.csv").drop(columns=["forward_fixed_s", "backward_fixed_s"])
    frame.to_csv(tmp_path / "layers.csv", index=False)
    loaded = LayerLibrary.load(tmp_path)
    assert all(layer.forward_fixed_s == layer.backward_fixed_s == 0.0 for layer in loaded.layers)


def test_batchnorm_inplace_relu_and_dropout_profile() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(16, 10),
    )
    library = profile_graph(trace_model(model), "seq", BATCH, **FAST)
    flops = [layer.flops for layer in library.layers]
    assert flops[0] == 2 * 4 * 32 * 32 * 3 * 3 * 3  # no bias
    assert flops[1] == 4 * 4 * 32 * 32  # BatchNorm: 4 per element
    assert flops[2] == 4 * 32 * 32
    assert flops[3] == 4 * 32 * 32  # adaptive pooling reads every input element once
    assert flops[5] == 16  # dropout mask multiply
    assert all(layer.backward_s > 0 for layer in library.layers)


def test_threads_are_recorded_and_restored() -> None:
    before = torch.get_num_threads()
    library = profile_model("mlp", BATCH, threads=1, **FAST)
    assert library.threads == 1
    assert torch.get_num_threads() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ProfileError, match="CUDA is not available"):
        profile_model("mlp", BATCH, device="cuda", **FAST)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_profile() -> None:
    library = profile_model("tiny_cnn", BATCH, device="cuda", **FAST)
    assert library.device == "cuda"
    assert all(layer.forward_s > 0 for layer in library.layers)


def test_model_without_logits_is_refused() -> None:
    graph_module = trace_model(nn.Sequential(nn.Conv2d(3, 4, 3)))
    with pytest.raises(ProfileError, match=r"logits shaped \(batch=4, classes\)"):
        profile_graph(graph_module, "no_head", BATCH, **FAST)


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"repeats": 0}, {"threads": 0}, {"device": "tpu"}])
def test_bad_arguments_are_refused(bad: dict[str, object]) -> None:
    arguments: dict[str, object] = {"batch_size": BATCH, **FAST, **bad}
    with pytest.raises(ProfileError):
        profile_model("mlp", **arguments)  # type: ignore[arg-type]
