"""The workload and the run specification (``tapp_core.model.workload``), without MPI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.model.workload import (
    OptimizerConfig,
    RunSpec,
    TensorSpec,
    Workload,
    WorkloadError,
    build_traced_workload,
    build_workload_model,
    check_workload,
    select_output,
    selected_output,
    synthetic_samples,
    workload_of,
)
from tapp_core.runtime.batches import SyntheticBatches, pad_batch
from tapp_core.runtime.optim import compensation_warning, make_optimizer, predicted_weights
from tapp_core.runtime.stage import split_stages
from tests.output_models import OUTPUT_MODELS, InceptionOutputs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_default_workload_draws_the_batches_the_runtime_always_drew() -> None:
    generator = torch.Generator().manual_seed(7)
    images, labels = torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,), generator=generator)
    feed, targets = SyntheticBatches(4, seed=0).get(0)
    again = Workload("tiny_cnn").batch(4, torch.Generator().manual_seed(7))
    assert torch.equal(again[0], images) and torch.equal(again[1], labels)
    assert feed.shape == (4, 3, 32, 32) and targets.dtype == torch.int64


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop"])
def test_any_torch_optimiser_by_name_with_its_own_arguments(name: str) -> None:
    options = (("betas", (0.9, 0.95)),) if name.startswith("Adam") else ()
    config = OptimizerConfig(name=name, lr=0.1, weight_decay=0.01, options=options)
    optimizer = make_optimizer([nn.Parameter(torch.ones(3))], config, delay=1)
    assert type(optimizer).__name__ == name
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # lr / (delay + 1)
    assert ("momentum" in optimizer.defaults) == (name in ("SGD", "RMSprop"))
    with pytest.raises(WorkloadError, match=r"not a torch\.optim class"):
        OptimizerConfig(name="Sideways")
    with pytest.raises(WorkloadError, match="takes no option 'nesterov_please'"):
        OptimizerConfig(name=name, options=(("nesterov_please", True),))


def test_weight_prediction_follows_adam_and_names_the_optimisers_it_supports() -> None:
    weight = nn.Parameter(torch.tensor([1.0, -2.0]))
    adam = make_optimizer([weight], OptimizerConfig(name="Adam", lr=0.1))
    assert torch.equal(predicted_weights(adam, {"w": weight}, 2)["w"], weight.detach())  # no step yet
    weight.grad = torch.tensor([0.5, -0.5])
    adam.step()
    # After one Adam step the direction is sign(grad) (m_hat / sqrt(v_hat) = g / |g|), so two steps ahead is -0.2 * sign.
    predicted = predicted_weights(adam, {"w": weight}, 2)["w"]
    assert torch.allclose(predicted, weight.detach() - 0.2 * torch.tensor([1.0, -1.0]), atol=1e-6)
    line = compensation_warning(OptimizerConfig(name="RMSprop"), asynchronous=True)
    assert line is not None and "SGD, Adam, AdamW" in line and "\n" not in line
    assert compensation_warning(OptimizerConfig(name="AdamW"), asynchronous=True) is None
    assert compensation_warning(OptimizerConfig(name="RMSprop"), asynchronous=False) is None


def test_a_loss_over_every_position_splits_into_shares_that_sum_to_the_mean() -> None:
    workload = workload_of(f"{EXAMPLES / 'tiny_lm.py'}:build")
    feed, targets = workload.batch(6, torch.Generator().manual_seed(1))
    assert feed.dtype == torch.int64 and targets.shape == (6, 16)
    assert torch.equal(targets[:, :-1], feed[:, 1:])  # the next token of a counting sequence
    logits = torch.randn(6, 16, 64)
    whole = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
    shares = workload.loss_of(logits[:4], targets[:4], 6) + workload.loss_of(logits[4:], targets[4:], 6)
    assert shares == pytest.approx(float(whole), rel=1e-6)
    _, y = pad_batch(feed[:4], targets[:4], 6)
    assert y.shape == (6, 16) and bool((y[4:] == -1).all())


def test_a_model_file_declares_its_workload_and_two_inputs_run_packed_in_one_feed() -> None:
    workload = workload_of(f"{EXAMPLES / 'two_inputs.py'}:build")
    assert workload.inputs == (TensorSpec((3, 16, 16)), TensorSpec((8,)))
    assert workload.optimizer.name == "Adam" and workload.data == "synthetic"
    assert workload.feed == TensorSpec((3 * 16 * 16 + 8,))
    check_workload(workload)
    traced = build_traced_workload(workload)
    assert [n.op for n in traced.graph.nodes].count("placeholder") == 1
    n_layers = sum(1 for n in traced.graph.nodes if n.op.startswith("call"))
    half = n_layers // 2
    _, graph = split_stages(traced, [0] * half + [1] * (n_layers - half), 2, workload.feed)
    assert graph.n_stages == 2
    assert len(synthetic_samples(workload, train=False)) == 512


def test_a_run_spec_takes_the_old_keywords_by_name() -> None:
    spec = RunSpec.of("mlp", dataset="synthetic", epochs=2, seed=3, optimizer=OptimizerConfig(lr=0.05))
    assert (spec.workload.model, spec.workload.data, spec.epochs, spec.seed) == ("mlp", "synthetic", 2, 3)
    assert spec.workload.optimizer.lr == 0.05
    assert spec.with_options(model="tiny_cnn", data_dir=Path("/d")).workload.model == "tiny_cnn"
    assert spec.with_options(data_dir=Path("/d")).data_dir == "/d"
    with pytest.raises(TypeError):
        spec.with_options(epoch=3)  # a misspelt option is not silently dropped


def test_a_run_spec_carries_a_trainings_checkpoints_by_name() -> None:
    options = CheckpointOptions("/ckpt", every=5)
    spec = RunSpec.of("mlp", seed=3, checkpoints=options)
    assert spec.checkpoints == options and RunSpec.of("mlp").checkpoints is None
    assert spec.with_options(seed=None, checkpoints=None) == spec  # not resuming: the seed and options stay
    resolved = CheckpointOptions("/ckpt", 5, "/ckpt/step-00000010")
    resumed = spec.with_options(seed=9, checkpoints=resolved)  # as the pool resumes: the checkpoint's seed
    assert (resumed.seed, resumed.checkpoints, resumed.epochs) == (9, resolved, spec.epochs)


def test_a_workload_that_does_not_fit_its_model_says_what_to_give() -> None:
    with pytest.raises(WorkloadError, match="fails on a batch of 2 inputs int64\\[16\\] < 64"):
        check_workload(Workload("tiny_cnn", inputs=(TensorSpec((16,), "int64", high=64),)))
    with pytest.raises(WorkloadError, match="needs 'high'"):
        TensorSpec((4,), "int64")
    with pytest.raises(WorkloadError, match="does not give: train it on 'synthetic' data"):
        synthetic_samples(workload_of(f"{EXAMPLES / 'tiny_lm.py'}:build", data="cifar10"), train=True)


def test_the_optimiser_state_per_parameter_is_counted_from_the_optimiser() -> None:
    assert OptimizerConfig().state_per_param == 1  # SGD's momentum
    assert OptimizerConfig(momentum=0.0).state_per_param == 0
    assert OptimizerConfig(name="AdamW").state_per_param == 2
    assert OptimizerConfig(name="Adam", options=(("amsgrad", True),)).state_per_param == 3


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_is_fused_and_updates_as_pytorchs_loop_does(name: str) -> None:
    torch.manual_seed(0)
    fused_weights = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    loop_weights = [nn.Parameter(w.detach().clone()) for w in fused_weights]
    config = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.01)
    fused = make_optimizer(fused_weights, config)
    loop = getattr(torch.optim, name)(loop_weights, lr=1e-2, weight_decay=0.01, foreach=False)
    assert fused.defaults["fused"] is True
    for _ in range(3):
        grads = [torch.randn_like(w) for w in fused_weights]
        for weights, optimizer in ((fused_weights, fused), (loop_weights, loop)):
            for weight, grad in zip(weights, grads, strict=True):
                weight.grad = grad.clone()
            optimizer.step()
    for a, b in zip(fused_weights, loop_weights, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    kept = make_optimizer([nn.Parameter(torch.zeros(2))], OptimizerConfig(name=name, options=(("fused", False),)))
    assert not kept.defaults["fused"]  # the configuration's own options win
    assert not make_optimizer([nn.Parameter(torch.zeros(2))], OptimizerConfig()).defaults.get("fused")  # SGD as it was


@pytest.mark.parametrize("model", OUTPUT_MODELS)
def test_a_model_of_several_outputs_trains_on_the_one_its_workload_names_under_its_own_parameter_names(
    model: str,
) -> None:
    """A dict's key, a named tuple's field: the graph returns that output alone, the heads feeding only the others
    are dropped (their weights no stage holds), and every name is the model's own, so the trained weights load
    back into it."""
    workload = workload_of(model)
    assert workload.output == "logits"
    check_workload(workload)
    selecting = build_workload_model(workload).train()
    as_written = type(selecting).__mro__[1]()  # the model's own class
    feed = workload.example(4)
    as_written.load_state_dict(selecting.state_dict())  # strict: the same names
    written = as_written.train()(feed)
    want = written["logits"] if isinstance(written, dict) else written.logits
    assert torch.equal(selecting(feed), want)
    traced = build_traced_workload(workload)
    assert torch.equal(traced.train()(feed), want)
    held = set(traced.state_dict())
    assert held <= set(as_written.state_dict())
    assert not any(name.startswith("aux.") for name in held)  # the auxiliary head feeds no trained output


def test_an_output_is_a_key_a_field_or_a_position_and_a_wrong_one_says_what_the_model_returns() -> None:
    logits, aux = torch.ones(2, 3), torch.zeros(2, 3)
    assert selected_output({"logits": logits, "aux": aux}, "logits", "m") is logits
    assert selected_output(InceptionOutputs(logits, aux), "logits", "m") is logits
    assert selected_output((aux, logits), -1, "m") is logits
    assert selected_output(logits, "logits", "m") is logits  # one tensor (torchvision's Inception in evaluation)
    with pytest.raises(WorkloadError, match=r"returns no output 'logit'; it returns \['aux', 'logits'\]"):
        selected_output({"logits": logits, "aux": aux}, "logit", "m")
    with pytest.raises(WorkloadError, match="returns 2 outputs, so it has no output 2"):
        selected_output((logits, aux), 2, "m")
    with pytest.raises(WorkloadError, match="names a position in a tuple, and model 'm' returns a dict of"):
        selected_output({"logits": logits}, 0, "m")
    with pytest.raises(WorkloadError, match="neither a key"):
        Workload("mlp", output=True)


def test_a_model_of_several_outputs_without_one_named_stops_in_one_line_naming_them() -> None:
    from tapp_core.profile.profiler import ProfileError, ProfileRequest, profile_model

    unnamed = dataclasses.replace(workload_of(OUTPUT_MODELS[0]), output=None)
    with pytest.raises(ProfileError, match=r"returns a dict of \['features', 'logits'\], not one tensor: name the"):
        profile_model(ProfileRequest(unnamed, 4, repeats=1, warmup=0))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 3, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = self.lstm(x)
        return out


def test_an_output_of_a_tuple_torch_fx_cannot_see_into_is_taken_in_the_graph() -> None:
    model = _Recurrent()
    x = torch.randn(2, 5, 4)
    want = model(x)[0]
    select_output(model, 0)
    traced = torch.fx.symbolic_trace(model)  # the LSTM is a leaf: its (out, (h, c)) is one value to the tracer
    assert torch.equal(traced(x), want) and torch.equal(model(x), want)
