"""The runtime's correctness bar: synchronous pipelines train exactly like one device.

After 3 steps, gpipe, 1f1b, replicated-stage, BSP and single-device plans on 2 and 3 real MPI ranks leave the
parameters allclose to single-device training of the same model, data and seed (same micro-batches, gradient
accumulation, loss = mean over the mini-batch). The asynchronous schedule is checked against a single-process
replay of PipeDream's rule: each micro-batch's gradient is taken at the weights its forward used on each stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.fx
from torch import nn

from tapp_core.measure.metrics import Measurement, run_length
from tapp_core.model.graph import layer_nodes, layer_parameters
from tapp_core.model.workload import build_traced_workload, build_workload_model, workload_of
from tapp_core.model.zoo import build_model, build_traced_model
from tapp_core.plan.plan import Plan
from tapp_core.plan.schedules import Async
from tapp_core.runtime import OptimizerConfig, WorkerPool, make_optimizer, micro_batch_loss
from tapp_core.runtime.batches import SyntheticBatches
from tapp_core.runtime.optim import predicted_weights

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]

STEPS = 3
BATCH = 16
MICRO_BATCHES = 4
SEED = 3
OPTIMIZER = OptimizerConfig(lr=0.05, momentum=0.9)
RTOL, ATOL = 1e-4, 1e-5


def traced_as_ranks_trace(model: str, seed: int = SEED) -> torch.fx.GraphModule:
    """``model`` traced as the ranks trace it: by torch.fx, else exported (nanoGPT's sliced mask needs it)."""
    return build_traced_workload(workload_of(model), seed)


def stages_by_cuts(model: str, cuts: tuple[int, ...]) -> tuple[int, ...]:
    """Stage of every layer when stage s starts at layer ``cuts[s-1]``."""
    n_layers = len(layer_nodes(traced_as_ranks_trace(model)))
    return tuple(sum(layer >= cut for cut in cuts) for layer in range(n_layers))


@dataclass(frozen=True)
class Precision:
    """How a reference trains: its floating dtype, and each initial weight scaled by ``1 + relative * N(0, 1)``
    (drawn from ``seed``): a float64 reference, perturbed at float32's rounding, shows how far rounding alone can
    move a case's result (``reference_spread``)."""

    dtype: torch.dtype = torch.float32
    relative: float = 0.0
    seed: int = 0

    def model(self, model: str) -> nn.Module:
        net = build_workload_model(workload_of(model), seed=SEED).to(self.dtype)
        if self.relative:
            generator = torch.Generator().manual_seed(self.seed)
            with torch.no_grad():
                for param in net.parameters():
                    param.mul_(1 + self.relative * torch.randn(param.shape, generator=generator, dtype=param.dtype))
        return net

    def batch(self, batches: SyntheticBatches, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batches.get(step)
        return (x.to(self.dtype) if x.is_floating_point() else x), y


FLOAT32 = Precision()


def reference(
    model: str,
    micro_batches: int,
    steps: int = STEPS,
    precision: Precision = FLOAT32,
    optimizer_config: OptimizerConfig = OPTIMIZER,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-device training: the same micro-batches, gradients accumulated, one update per step."""
    net = precision.model(model)
    optimizer = make_optimizer([p for p in net.parameters() if p.requires_grad], optimizer_config)
    batches = SyntheticBatches(BATCH, seed=SEED)
    size = BATCH // micro_batches
    losses = []
    for step in range(steps):
        x, y = precision.batch(batches, step)
        total = 0.0
        for j in range(micro_batches):
            loss = micro_batch_loss(net(x[j * size : (j + 1) * size]), y[j * size : (j + 1) * size], BATCH)
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {name: p.detach().clone() for name, p in net.named_parameters()}, losses


def assert_same_parameters(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], model: str) -> None:
    held = set(traced_as_ranks_trace(model).state_dict())  # an output the model returns unused is not trained
    want = {name: tensor for name, tensor in want.items() if name in held}
    assert set(want) <= set(got), f"missing parameters: {sorted(set(want) - set(got))}"
    initial = {n: p.detach() for n, p in build_model(model, seed=SEED).named_parameters()}
    moved = max(float((want[n] - initial[n]).abs().max()) for n in want)
    assert moved > 100 * ATOL, "training did not move the parameters: the comparison would prove nothing"
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


FINETUNE = "tests.wild_models:finetune"
"""A frozen backbone under a trained head (``tests.wild_models``)."""


def trains_like_one_device(
    pool: WorkerPool, plan: Plan, rel: float = 1e-5, optimizer: OptimizerConfig = OPTIMIZER
) -> Measurement:
    """Run ``plan`` for ``STEPS`` steps on ``pool``: its parameters and per-step losses must be one device's."""
    measurement, parameters = pool.run_steps(
        plan, steps=STEPS, warmup=1, seed=SEED, optimizer=optimizer, collect_parameters=True
    )
    assert measurement.ok, measurement.error
    want, want_losses = reference(plan.model, MICRO_BATCHES, optimizer_config=optimizer)
    assert_same_parameters(parameters, want, plan.model)
    assert measurement.extra["losses"] == pytest.approx(want_losses, rel=rel)
    return measurement


SYNC_CASES = [
    # id, pool, model, schedule, cuts, stage devices
    ("mlp-gpipe-2", "pool2", "mlp", "gpipe", (3,), (("d0",), ("d1",))),
    ("tiny_cnn-1f1b-2", "pool2", "tiny_cnn", "1f1b", (4,), (("d0",), ("d1",))),
    ("bsp-2", "pool2", "mlp", "gpipe", (), (("d0", "d1"),)),
    ("single-device", "pool2", "tiny_cnn", "1f1b", (), (("d1",),)),
    # Cuts after the stem's branch_a and after mix: two values cross the first cut and stem_relu skips stage 1.
    ("branchy-gpipe-3-skip", "pool3", "tiny_branchy", "gpipe", (3, 8), (("d0",), ("d1",), ("d2",))),
    ("branchy-1f1b-3-skip", "pool3", "tiny_branchy", "1f1b", (3, 8), (("d0",), ("d1",), ("d2",))),
    ("parameter-free-middle-1f1b-3", "pool3", "mlp", "1f1b", (2, 3), (("d0",), ("d1",), ("d2",))),
    ("replicated-last-gpipe-3", "pool3", "tiny_cnn", "gpipe", (3,), (("d0",), ("d1", "d2"))),
    ("replicated-first-1f1b-3", "pool3", "tiny_branchy", "1f1b", (6,), (("d0", "d2"), ("d1",))),
    ("bsp-3-uneven", "pool3", "tiny_cnn", "gpipe", (), (("d0", "d1", "d2"),), ((0.5, 0.3, 0.2),)),
    ("uneven-replicas-1f1b-3", "pool3", "tiny_branchy", "1f1b", (6,), (("d0", "d2"), ("d1",)), ((0.75, 0.25), (1.0,))),
    ("async-staleness-0-is-1f1b", "pool3", "tiny_branchy", "async:0", (3, 8), (("d0",), ("d1",), ("d2",))),
    # a frozen backbone (requires_grad False) on replicas: nothing of it is hooked, summed or updated
    ("frozen-backbone-bsp-2", "pool2", FINETUNE, "gpipe", (), (("d0", "d1"),)),
    # the logits of a model returning InceptionOutputs(logits, aux_logits): the auxiliary head on no stage
    ("aux-classifier-logits-1f1b-2", "pool2", "tests.output_models:aux_classifier", "1f1b", (4,), (("d0",), ("d1",))),
    ("frozen-stage-replicated-1f1b-3", "pool3", FINETUNE, "1f1b", (5,), (("d0", "d2"), ("d1",))),
    # a frozen weight read on both stages (no tie: its copies never change) by a layer whose bias trains, replicated
    ("frozen-tied-replicated-1f1b-3", "pool3", "tests.wild_models:frozen_tied", "1f1b", (5,), (("d0", "d2"), ("d1",))),
]


@pytest.mark.parametrize(
    ("pool_name", "model", "schedule", "cuts", "devices", "shares"),
    [(*c[1:6], c[6] if len(c) > 6 else ()) for c in SYNC_CASES],
    ids=[str(c[0]) for c in SYNC_CASES],
)
def test_synchronous_plan_trains_like_one_device(
    request: pytest.FixtureRequest,
    pool_name: str,
    model: str,
    schedule: str,
    cuts: tuple[int, ...],
    devices: tuple[tuple[str, ...], ...],
    shares: tuple[tuple[float, ...], ...],
) -> None:
    """Uneven shares give devices unequal rows of every micro-batch; ``async:0`` is the asynchronous schedule held
    to staleness 0, which must be synchronous 1F1B."""
    pool: WorkerPool = request.getfixturevalue(pool_name)
    name, _, bound = schedule.partition(":")
    plan = Plan(
        model, BATCH, MICRO_BATCHES, name, stages_by_cuts(model, cuts), devices,
        staleness=int(bound) if bound else None, stage_shares=shares,
    )  # fmt: skip
    measurement = trains_like_one_device(pool, plan)
    assert len(measurement.step_times_s) == STEPS and measurement.step_time_s > 0
    assert set(measurement.peak_memory_bytes) == {d for stage in devices for d in stage}


def test_a_jobs_dropout_does_not_depend_on_the_jobs_its_rank_ran_before(pool2: WorkerPool) -> None:
    """A model with dropout, one plan run twice with another job between them on the same rank: the same weights
    (what a job draws depends on its seed and place, so an experiment's training does not depend on its races)."""
    plan = Plan("alexnet", 8, 1, "gpipe", stages_by_cuts("alexnet", ()), (("d0",),))

    def trained(seed: int) -> dict[str, torch.Tensor]:
        options = {"steps": 2, "warmup": 1, "seed": seed, "optimizer": OPTIMIZER, "collect_parameters": True}
        measurement, parameters = pool2.run_steps(plan, **options)
        assert measurement.ok, measurement.error
        return parameters

    first = trained(SEED)
    trained(SEED + 1)  # draws its own dropout masks on d0
    again = trained(SEED)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_skip_value_really_skips_a_stage() -> None:
    from tapp_core.runtime.stage import split_stages

    model = "tiny_branchy"
    _, graph = split_stages(build_traced_model(model), stages_by_cuts(model, (3, 8)), 3)
    skipping = [v for v in graph.values if v.producer == 0 and 2 in v.consumers]
    assert skipping, "the test plan must have a tensor that goes from stage 0 straight to stage 2"
    assert len(graph.stage_inputs[1]) == 2, "two tensors must cross the first cut"


def test_a_reference_in_float64_and_perturbed_moves_by_rounding_only() -> None:
    """The fuzz's conditioning check (``bench/fuzz_cuts.py``'s ``reference_spread``) rests on this: on a smooth model
    the float64 reference agrees with float32's, and a float32-sized move of the initial weights moves it by about
    that much, not more."""
    single = reference("mlp", MICRO_BATCHES)[0]
    double = reference("mlp", MICRO_BATCHES, precision=Precision(torch.float64))[0]
    moved = reference("mlp", MICRO_BATCHES, precision=Precision(torch.float64, 1e-6, seed=1))[0]
    assert all(t.dtype == torch.float64 for t in double.values())
    for name, tensor in single.items():
        torch.testing.assert_close(double[name].float(), tensor, rtol=RTOL, atol=ATOL)
    spread = max(float((moved[n] - double[n]).abs().max()) for n in double)
    assert 0 < spread < ATOL


def async_reference(
    model: str,
    cuts: tuple[int, ...],
    n_stages: int,
    staleness: int | None = None,
    steps: int = STEPS,
    config: OptimizerConfig = OPTIMIZER,
    precision: Precision = FLOAT32,
) -> dict[str, torch.Tensor]:
    """PipeDream's rule replayed in one process: micro-batch g's gradient is taken, on every stage, at the
    weights that stage had when it ran g's forward (the number of updates before it in the stage's order), or,
    with ``config.stale_compensation``, at those weights predicted as many updates ahead as the stage's delay, and
    each stage updates at its own rate (``stage_lr``)."""
    schedule = Async(staleness)
    delays = [schedule.delay(s, n_stages, MICRO_BATCHES) if config.stale_compensation else 0 for s in range(n_stages)]
    version_at_forward: list[dict[int, int]] = []
    for stage in range(n_stages):
        updates, seen = 0, {}
        for action in schedule.compute_order(stage, n_stages, MICRO_BATCHES, steps):
            if action.kind == "update":
                updates += 1
            elif action.kind == "forward":
                seen[action.index] = updates
        version_at_forward.append(seen)
    stale = sum(version_at_forward[s][g] < g // MICRO_BATCHES for s in range(n_stages) for g in version_at_forward[s])
    assert stale > 0, "the replay must have micro-batches that ran on old weights"

    traced = traced_as_ranks_trace(model)
    stage_of = stages_by_cuts(model, cuts)
    net = precision.model(model)
    live = {n: p for n, p in net.named_parameters() if p.requires_grad}  # a frozen parameter is not trained
    names_of_stage: list[set[str]] = [set() for _ in range(n_stages)]
    for layer, own in enumerate(layer_parameters(traced)):  # a layer's modules' and the get_attr ones it reads
        names_of_stage[stage_of[layer]] |= set(own) & set(live)
    # One optimiser per stage, at the stage's rate, as the runtime has (a stage without parameters has none).
    optimizers = [
        make_optimizer([live[n] for n in sorted(names)], config, delay) if names else None
        for names, delay in zip(names_of_stage, delays, strict=True)
    ]

    def snapshot(stage: int) -> dict[str, torch.Tensor]:
        sgd = optimizers[stage]
        return {} if sgd is None else predicted_weights(sgd, {n: live[n] for n in names_of_stage[stage]}, delays[stage])

    history = [[snapshot(s)] for s in range(n_stages)]
    batches = SyntheticBatches(BATCH, seed=SEED)
    size = BATCH // MICRO_BATCHES
    for step in range(steps):
        x, y = precision.batch(batches, step)
        grads = {n: torch.zeros_like(p) for n, p in live.items()}
        for j in range(MICRO_BATCHES):
            g = step * MICRO_BATCHES + j
            weights = {}
            for stage in range(n_stages):
                weights.update(history[stage][version_at_forward[stage][g]])
            weights = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
            logits = torch.func.functional_call(net, weights, (x[j * size : (j + 1) * size],))
            micro_batch_loss(logits, y[j * size : (j + 1) * size], BATCH).backward()
            for n, w in weights.items():
                grads[n] += w.grad
        for n, p in live.items():
            p.grad = grads[n]
        for sgd in optimizers:
            if sgd is not None:
                sgd.step()
        for stage in range(n_stages):
            history[stage].append(snapshot(stage))
    return {n: p.detach().clone() for n, p in net.named_parameters()}


PLAIN = OptimizerConfig(lr=OPTIMIZER.lr, momentum=OPTIMIZER.momentum, stale_compensation=False)


@pytest.mark.parametrize(
    ("pool_name", "model", "cuts", "devices", "staleness", "config"),
    [
        ("pool2", "mlp", (4,), (("d0",), ("d1",)), None, OPTIMIZER),
        ("pool3", "tiny_branchy", (3, 8), (("d0",), ("d1",), ("d2",)), None, OPTIMIZER),
        ("pool3", "tiny_branchy", (3, 8), (("d0",), ("d1",), ("d2",)), None, PLAIN),
        ("pool3", "tiny_branchy", (3, 8), (("d0",), ("d1",), ("d2",)), 1, OPTIMIZER),
        ("pool3", "tiny_cnn", (4,), (("d0", "d2"), ("d1",)), None, OPTIMIZER),
        ("pool3", FINETUNE, (8,), (("d0", "d2"), ("d1",)), None, OPTIMIZER),  # frozen and trained, replicated
    ],
    ids=[
        "mlp-2",
        "branchy-3",
        "branchy-3-uncompensated",
        "branchy-3-staleness-1",
        "replicated-first-cnn",
        "replicated-frozen-backbone",
    ],
)
def test_async_uses_the_weights_of_each_forward(
    request: pytest.FixtureRequest,
    pool_name: str,
    model: str,
    cuts: tuple[int, ...],
    devices: tuple[tuple[str, ...], ...],
    staleness: int | None,
    config: OptimizerConfig,
) -> None:
    """Each forward runs on its stage's stashed weights: predicted ahead by the stage's delay (the default
    stale-gradient compensation), or as they were (compensation off)."""
    pool: WorkerPool = request.getfixturevalue(pool_name)
    plan = Plan(model, BATCH, MICRO_BATCHES, "async", stages_by_cuts(model, cuts), devices, staleness=staleness)
    measurement, parameters = pool.run_steps(
        plan, steps=STEPS, warmup=1, seed=SEED, optimizer=config, collect_parameters=True
    )
    assert measurement.ok, measurement.error
    ran, _, _ = run_length(plan.pipeline_schedule, plan.n_stages, MICRO_BATCHES, STEPS, 1)  # fill and drain too
    want = async_reference(model, cuts, len(devices), staleness, ran, config)
    assert_same_parameters(parameters, want, model)
    if config.stale_compensation:
        plain = async_reference(model, cuts, len(devices), staleness, ran, PLAIN)
        assert max(float((want[n] - plain[n]).abs().max()) for n in want) > 10 * ATOL, "the prediction did nothing"
    synchronous, _ = reference(model, MICRO_BATCHES)
    differs = max(float((want[n] - synchronous[n]).abs().max()) for n in want)
    assert differs > 10 * ATOL, "async must not train like the synchronous schedules here, or this test shows nothing"


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_the_runtime_holds_the_staleness_bound(pool3: WorkerPool, staleness: int) -> None:
    """Every backward reports how many updates its stage applied since the forward's weights were current: never
    more than K, and K itself somewhere (three stages and one micro-batch per step are deep enough for 2)."""
    plan = Plan("mlp", 4, 1, "async", stages_by_cuts("mlp", (2, 4)), (("d0",), ("d1",), ("d2",)), staleness=staleness)
    measurement, _ = pool3.run_steps(plan, steps=8, warmup=1, seed=SEED, optimizer=OPTIMIZER)
    assert measurement.ok, measurement.error
    ages = measurement.extra["weight_ages"]
    assert isinstance(ages, dict) and set(ages) == {"d0", "d1", "d2"}
    assert len({len(a) for a in ages.values()}) == 1 and len(ages["d0"]) >= 8  # the fill and drain run too
    assert max(max(a) for a in ages.values()) == staleness
    assert max(ages["d2"]) == 0, "the last stage runs each backward right after its forward"
