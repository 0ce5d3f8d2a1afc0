"""The profiler: layer rows, edges, FLOPs, bytes and in-place timing of the layer library."""

from __future__ import annotations

import math
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from tapp_core.model.graph import layer_nodes, trace_model
from tapp_core.model.zoo import build_model, build_traced_model
from tapp_core.profile.library import PROFILE_VERSION, LayerLibrary
from tapp_core.profile.profiler import (
    CpuClock,
    ProfileError,
    ProfileRequest,
    fixed_part,
    profile_graph,
    profile_model,
    small_batch_size,
)

BATCH = 4
FAST = {"repeats": 2, "warmup": 1}


@pytest.fixture(scope="module")
def branchy() -> LayerLibrary:
    return profile_model(ProfileRequest("tiny_branchy", BATCH, **FAST))


@pytest.fixture(scope="module")
def tiny_cnn() -> LayerLibrary:
    return profile_model(ProfileRequest("tiny_cnn", BATCH, **FAST))


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


class TickingClock:
    """A clock that moves only when told to: the time a profile reads is exactly the time ``tick`` added."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = False
        """Also sleep for each tick (for profiles timed on the real clock)."""

    def tick(self, seconds: float) -> None:
        self.now += seconds
        if self.sleeps:
            time.sleep(seconds)

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def sync(self) -> None:
        pass


CLOCK = TickingClock()
FORWARD_S, BACKWARD_S = 0.03, 0.05
"""What the ticking layer's forward and backward cost on ``CLOCK``; every other operation costs nothing there."""


class _Tick(torch.autograd.Function):
    """Identity whose forward and backward each move ``CLOCK`` by a known time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        CLOCK.tick(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        CLOCK.tick(BACKWARD_S)
        return grad


def tick_identity(x: torch.Tensor) -> torch.Tensor:
    return _Tick.apply(x)


torch.fx.wrap("tick_identity")  # a leaf for tracing: one call_function layer


class TickingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = tick_identity(self.relu(self.conv(x)))
        return self.fc(torch.flatten(h, 1))


def test_time_is_charged_to_the_layer_that_spends_it() -> None:
    """On a clock that only the ticking layer moves, that layer is charged all of the time and no other layer any."""
    library = profile_graph(trace_model(TickingNet()), "ticking", BATCH, clock=CLOCK, **FAST)
    ticker = next(layer for layer in library.layers if layer.op == "tick_identity")
    others = [layer for layer in library.layers if layer is not ticker]
    assert (ticker.forward_s, ticker.backward_s) == pytest.approx((FORWARD_S, BACKWARD_S))
    assert all(layer.forward_s == layer.backward_s == 0.0 for layer in others)
    assert library.extra["loss_s"] == 0.0
    # The whole-model steps, timed on the same clock, see the same two ticks: the layers add up exactly.
    assert library.whole_model_s == pytest.approx(FORWARD_S + BACKWARD_S)
    assert library.layer_time_sum_s == pytest.approx(library.whole_model_s)
    assert library.extra["ops_without_flop_rule"] == ["tick_identity"]


def test_a_slow_layer_is_charged_its_time_on_the_real_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the host's clock, where every layer costs something: the ticking layer, made to sleep, is the
    slowest layer forward and backward, and its time is at least its sleep."""
    monkeypatch.setattr(CLOCK, "sleeps", True)
    # One thread (no waits between threads on a loaded host) and medians of 5 steps, robust to two slow ones.
    library = profile_graph(
        trace_model(TickingNet()), "sleepy", BATCH, threads=1, clock=CpuClock(), repeats=5, warmup=1
    )
    ticker = next(layer for layer in library.layers if layer.op == "tick_identity")
    assert max(library.layers, key=lambda layer: layer.forward_s) is ticker
    assert max(library.layers, key=lambda layer: layer.backward_s) is ticker
    assert ticker.forward_s >= FORWARD_S and ticker.backward_s >= BACKWARD_S  # a sleep never ends early


def test_a_fixed_cost_is_fitted_as_fixed() -> None:
    """The ticking layer costs as much for 2 samples as for 16: all of it is per call (a linear fit would say none),
    and the layers whose time is nothing have no fixed part either."""
    library = profile_graph(trace_model(TickingNet()), "ticking", 16, clock=CLOCK, **FAST)
    assert library.extra["small_batch_size"] == 2 and library.extra["profile_version"] == PROFILE_VERSION
    ticker = next(layer for layer in library.layers if layer.op == "tick_identity")
    assert (ticker.forward_fixed_s, ticker.backward_fixed_s) == pytest.approx((FORWARD_S, BACKWARD_S))
    others = [layer for layer in library.layers if layer is not ticker]
    assert all(layer.forward_fixed_s == layer.backward_fixed_s == 0.0 for layer in others)


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


def test_a_library_records_what_autograd_keeps_and_an_older_one_loads_without(tiny_cnn: LayerLibrary, tmp_path) -> None:
    assert all(layer.output_saved is not None for layer in tiny_cnn.layers)
    assert any(layer.output_saved for layer in tiny_cnn.layers)
    assert by_name(tiny_cnn, "pool").saved_bytes > 0  # a max pool's indices
    tiny_cnn.save(tmp_path)
    frame = pd.read_csv(tmp_path / "layers.csv", keep_default_na=False).drop(columns=["output_saved", "saved_bytes"])
    frame.to_csv(tmp_path / "layers.csv", index=False)
    loaded = LayerLibrary.load(tmp_path)
    assert all(layer.output_saved is None and layer.saved_bytes == 0 for layer in loaded.layers)


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
    library = profile_model(ProfileRequest("mlp", BATCH, threads=1, **FAST))
    assert library.threads == 1
    assert torch.get_num_threads() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ProfileError, match="CUDA is not available"):
        profile_model(ProfileRequest("mlp", BATCH, device="cuda", **FAST))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_profile() -> None:
    library = profile_model(ProfileRequest("tiny_cnn", BATCH, device="cuda", **FAST))
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
        profile_model(ProfileRequest("mlp", **arguments))  # type: ignore[arg-type]


class FunctionalNet(nn.Module):
    """The functional forms of conv, linear and pooling, and a matmul: each counted by its function's rule."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.fc_weight = nn.Parameter(torch.randn(10, 4 * 8 * 8))
        self.mix = nn.Parameter(torch.randn(10, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.conv2d(x, self.weight, None, 1, 1)
        h = torch.nn.functional.max_pool2d(h, 4)
        h = torch.nn.functional.linear(torch.flatten(h, 1), self.fc_weight)
        return torch.matmul(h, self.mix)


def test_function_forms_have_flop_rules() -> None:
    library = profile_graph(trace_model(FunctionalNet()), "functional", BATCH, **FAST)
    flops = {layer.op: layer.flops for layer in library.layers}
    assert flops["conv2d"] == 2 * 4 * 32 * 32 * 3 * 3 * 3  # no bias
    assert flops["max_pool2d"] == 4 * 8 * 8 * 4 * 4
    assert flops["linear"] == 2 * 4 * 8 * 8 * 10
    assert flops["matmul"] == 2 * 10 * 10
    assert library.extra["ops_without_flop_rule"] == []


def test_parameters_read_through_get_attr_are_charged_to_the_layers_that_use_them() -> None:
    """A get_attr node is no layer of its own (it computes nothing and cannot be cut from its user): the bytes of
    its parameter count on the layer that takes it, so that the memory and cost models see them there."""
    library = profile_graph(trace_model(FunctionalNet()), "functional", BATCH, **FAST)
    assert "get_attr" not in {layer.op for layer in library.layers}
    param_bytes = {layer.op: layer.param_bytes for layer in library.layers}
    assert param_bytes["conv2d"] == 4 * 3 * 3 * 3 * 4
    assert param_bytes["linear"] == 10 * 4 * 8 * 8 * 4
    assert param_bytes["matmul"] == 10 * 10 * 4
    assert library.param_bytes == sum(p.numel() * 4 for p in FunctionalNet().parameters())


def test_vit_class_token_and_position_embedding_count_on_their_users() -> None:
    library = profile_model(ProfileRequest("tiny_vit", BATCH, **FAST))
    model = build_model("tiny_vit")
    assert library.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert by_name(library, "expand").param_bytes == model.cls_token.numel() * 4
    assert by_name(library, "add").param_bytes == model.pos_embed.numel() * 4
    # Shapes read from the input are layers too, with nothing to send when a cut falls after them.
    shapes = [layer for layer in library.layers if layer.op in ("getattr", "getitem") and not layer.output_shape]
    assert len(shapes) >= 1 + 4 * len(model.blocks)
    assert all(layer.activation_bytes == 0 for layer in shapes)
    assert library.extra["ops_without_flop_rule"] == []


def test_a_frozen_backbone_is_recorded_as_held_weights_and_survives_the_csv(tmp_path: Path) -> None:
    """``Layer.frozen_bytes``: the part of a layer's parameters that does not train, which the cost model holds
    without a gradient, optimiser state, stash or reduction."""
    model = "tests.wild_models:finetune"
    library = profile_model(ProfileRequest(model, BATCH, **FAST))
    frozen = sum(p.numel() * p.element_size() for p in build_model(model).parameters() if not p.requires_grad)
    assert frozen > 0 and sum(x.frozen_bytes for x in library.layers) == frozen
    assert all(0 <= x.frozen_bytes <= x.param_bytes for x in library.layers)
    assert any(x.trained_bytes > 0 for x in library.layers)
    library.save(tmp_path)
    assert [x.frozen_bytes for x in LayerLibrary.load(tmp_path).layers] == [x.frozen_bytes for x in library.layers]
