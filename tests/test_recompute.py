"""Activation recomputation: a stage that keeps only its inputs of each micro-batch in flight and runs its forward
again in the backward (``Plan.recompute``). The plan carries the choice, the cost model charges the extra forward,
the memory model drops the activations the stage no longer keeps, and the runtime trains with it exactly as
without it: like one device on the synchronous schedules, like the single-process replay on the asynchronous one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tapp_core.cost.checks import recomputing_where_needed
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.measure.metrics import run_length
from tapp_core.plan.plan import (
    Plan,
    PlanError,
    stage_input_bytes,
    stage_memory_bytes,
    stage_memory_terms,
)
from tapp_core.planners.evaluation import MemoryScreen
from tapp_core.profile.library import LayerLibrary
from tapp_core.runtime import WorkerPool
from tapp_core.runtime.stage import Stage, split_stages
from tests.factories import chain_library, library_from_edges, make_cluster
from tests.test_runtime_correctness import (
    BATCH,
    MICRO_BATCHES,
    OPTIMIZER,
    SEED,
    STEPS,
    assert_same_parameters,
    async_reference,
    stages_by_cuts,
    trains_like_one_device,
)


def toy_plan(**overrides: object) -> Plan:
    fields: dict[str, object] = {
        "model": "toy",
        "batch_size": 8,
        "micro_batches": 4,
        "schedule": "gpipe",
        "stage_of_layer": (0, 0, 1, 1),
        "stage_devices": (("d0",), ("d1",)),
    }
    return dataclasses.replace(Plan.from_dict(fields), **overrides)  # type: ignore[arg-type]


def test_the_plan_carries_the_choice_and_old_plans_keep_their_id() -> None:
    old = toy_plan()
    assert "recompute" not in old.canonical()
    recomputing = dataclasses.replace(old, recompute=(1, 0, 1))
    assert recomputing.recompute == (0, 1) and recomputing.id != old.id
    again = Plan.from_json(recomputing.to_json())
    assert again == recomputing and again.recomputes(1)
    assert "d1 (layers 2-3; recompute)" in recomputing.describe()
    with pytest.raises(PlanError, match=r"recompute names stage 2, but stages are 0\.\.1"):
        dataclasses.replace(old, recompute=(2,))
    split = Plan("toy", 8, 1, "gpipe", (0, 0), (("d0", "d1"),), signatures=((0, "col"),))
    with pytest.raises(PlanError, match="stage 0 runs split signatures and cannot recompute"):
        dataclasses.replace(split, recompute=(0,))


def test_regrouping_keeps_the_choice_with_the_group() -> None:
    plan = toy_plan(recompute=(1,))
    swapped = plan.regrouped(stage_devices=(("d1",), ("d0",)))
    assert swapped.recompute == (0,)
    moved = plan.regrouped(stage_of_layer=(0, 1, 1, 1))
    assert moved.recompute == (1,)
    assert plan.regrouped(stage_devices=(("d0",), ("d2",))).recompute == ()


def test_memory_keeps_the_inputs_and_one_micro_batch() -> None:
    # 4 layers, 1 byte of params each, 10 bytes of output per sample; 4 micro-batches of 2 samples on gpipe.
    library = chain_library(4, param_bytes=[1] * 4, activation_bytes=[10] * 4)
    assert stage_input_bytes(library, (0, 0, 1, 1), 0) == library.input_bytes
    assert stage_input_bytes(library, (0, 0, 1, 1), 1) == 10  # layer 1's output
    plain = toy_plan()
    # without: 4 in flight * (10 of inputs + 20 of outputs) * 2 samples on stage 1
    assert stage_memory_terms(plain, library, 1)["d1"]["activations"] == 240
    # recomputing stage 1 keeps 4 * (10 * 2) inputs and one micro-batch's outputs, 20 * 2: 80 + 40
    assert stage_memory_terms(toy_plan(recompute=(1,)), library, 1)["d1"]["activations"] == 120
    saved = stage_memory_bytes(plain, library, 1)["d1"] - stage_memory_bytes(toy_plan(recompute=(1,)), library, 1)["d1"]
    assert saved == 120
    assert stage_memory_bytes(toy_plan(recompute=(1,)), library, 0) == stage_memory_bytes(plain, library, 0)


def needs(plan: Plan, library: LayerLibrary) -> list[int]:
    return [need for s in range(plan.n_stages) for need in stage_memory_bytes(plan, library, s).values()]


def test_the_screen_counts_what_a_recomputing_stage_keeps() -> None:
    # inputs of 2 bytes a sample: the first stage is small
    library = dataclasses.replace(chain_library(4, param_bytes=[1] * 4, activation_bytes=[10] * 4), input_bytes=2)
    late = toy_plan(stage_of_layer=(0, 1, 1, 1))
    memory = max(needs(dataclasses.replace(late, recompute=(1,)), library))
    assert max(needs(late, library)) > memory and max(needs(toy_plan(), library)) > memory
    screen = MemoryScreen(CostContext(library, make_cluster([1, 1], memory=f"{memory}B")))
    assert not screen.fits(toy_plan())
    assert not screen.fits(toy_plan(recompute=(0,)))  # stage 1 does not fit
    assert not screen.fits(late)
    assert screen.fits(dataclasses.replace(late, recompute=(1,)))


def test_the_cost_model_charges_the_extra_forward() -> None:
    library = library_from_edges(4, [(0, 1), (1, 2), (2, 3)], forward_s=[1.0] * 4, backward_s=[2.0] * 4)
    context = CostContext(library, make_cluster([1]))
    one = Plan("toy", 8, 4, "gpipe", (0,) * 4, (("d0",),))
    plain, recomputing = estimate(one, context), estimate(dataclasses.replace(one, recompute=(0,)), context)
    assert recomputing.step_time_s == pytest.approx(plain.step_time_s + 4.0)  # the forward's 4 s again
    # 4 micro-batches in flight of the 3072-byte input and 400 bytes of outputs per sample, or of the input only and
    # the outputs of one: 400 * 2 * 3 bytes less
    assert plain.peak_memory_bytes["d0"] - recomputing.peak_memory_bytes["d0"] == 3 * 400 * 2


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 30 * 30, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


def test_a_recomputed_stage_gives_the_same_gradients_and_counts_its_statistics_once() -> None:
    torch.manual_seed(0)
    traced = torch.fx.symbolic_trace(_Normed())
    split, graph = split_stages(traced, (0,) * 5, 1)
    x = torch.randn(4, 3, 32, 32)
    results = []
    for recompute in (False, True):
        stage = Stage(0, split.get_submodule("submod_0"), graph, torch.device("cpu"), traced)
        stage.module.train()
        (out,) = stage.forward([x], recompute=recompute)
        stage.forward([x + 1], recompute=recompute)  # another micro-batch between the forward and its backward
        out.square().sum().backward()
        state = {k: v.detach().clone() for k, v in stage.module.state_dict().items()}
        grads = {k: p.grad.clone() for k, p in stage.module.named_parameters() if p.grad is not None}
        results.append((state, grads))
    (state, grads), (state_again, grads_again) = results
    assert set(grads) == set(grads_again) and grads
    for name in grads:
        torch.testing.assert_close(grads_again[name], grads[name])
    for name in state:
        torch.testing.assert_close(state_again[name], state[name])


# ---------------------------------------------------------------------------------------------------------------
# Real ranks


SYNC_CASES = [
    # id, model, schedule, cuts, stage devices, shares, recomputing stages
    ("mlp-gpipe-all", "mlp", "gpipe", (3,), (("d0",), ("d1",)), (), (0, 1)),
    ("branchy-1f1b-3-skip", "tiny_branchy", "1f1b", (3, 8), (("d0",), ("d1",), ("d2",)), (), (0, 1)),
    ("cnn-last-replicated", "tiny_cnn", "gpipe", (3,), (("d0",), ("d1", "d2")), (), (1,)),
    (
        "branchy-uneven-replicas",
        "tiny_branchy",
        "1f1b",
        (6,),
        (("d0", "d2"), ("d1",)),
        ((0.75, 0.25), (1.0,)),
        (0, 1),
    ),
    ("bsp-3-uneven", "tiny_cnn", "gpipe", (), (("d0", "d1", "d2"),), ((0.5, 0.3, 0.2),), (0,)),
]


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("model", "schedule", "cuts", "devices", "shares", "recompute"),
    [c[1:] for c in SYNC_CASES],
    ids=[str(c[0]) for c in SYNC_CASES],
)
def test_recomputing_stages_train_like_one_device(
    pool3: WorkerPool,
    model: str,
    schedule: str,
    cuts: tuple[int, ...],
    devices: tuple[tuple[str, ...], ...],
    shares: tuple[tuple[float, ...], ...],
    recompute: tuple[int, ...],
) -> None:
    plan = Plan(
        model, BATCH, MICRO_BATCHES, schedule, stages_by_cuts(model, cuts), devices,
        stage_shares=shares, recompute=recompute,
    )  # fmt: skip
    trains_like_one_device(pool3, plan)


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("staleness", [None, 1])
def test_recomputing_async_stages_use_the_weights_of_each_forward(pool3: WorkerPool, staleness: int | None) -> None:
    """The recomputed forward runs on the weights the first one ran on (the stashed, predicted ones)."""
    model, cuts, devices = "tiny_branchy", (3, 8), (("d0",), ("d1",), ("d2",))
    plan = Plan(
        model, BATCH, MICRO_BATCHES, "async", stages_by_cuts(model, cuts), devices,
        staleness=staleness, recompute=(0, 1),
    )  # fmt: skip
    measurement, parameters = pool3.run_steps(
        plan, steps=STEPS, warmup=1, seed=SEED, optimizer=OPTIMIZER, collect_parameters=True
    )
    assert measurement.ok, measurement.error
    ran, _, _ = run_length(plan.pipeline_schedule, plan.n_stages, MICRO_BATCHES, STEPS, 1)
    assert_same_parameters(parameters, async_reference(model, cuts, len(devices), staleness, ran), model)


# ---------------------------------------------------------------------------------------------------------------
# The searches


def test_the_least_recomputation_that_fits() -> None:
    # inputs of 2 bytes a sample: the first stage is small
    library = dataclasses.replace(chain_library(4, param_bytes=[1] * 4, activation_bytes=[10] * 4), input_bytes=2)
    plan = toy_plan(stage_of_layer=(0, 1, 1, 1))
    memory = max(needs(dataclasses.replace(plan, recompute=(1,)), library))
    context = CostContext(library, make_cluster([1, 1], memory=f"{memory}B"))
    assert recomputing_where_needed(plan, context).recompute == (1,)  # stage 0 fits as it is
    roomy = CostContext(library, make_cluster([1, 1], memory="1GiB"))
    assert recomputing_where_needed(plan, roomy) is plan


@pytest.mark.parametrize("name", ["autoddl", "tapp", "oracle"])
def test_a_search_recomputes_where_nothing_else_fits(name: str) -> None:
    """One device whose memory holds the weights' state and the inputs of every micro-batch in flight, but not
    their activations: only a recomputing plan fits, and the search finds it."""
    from tapp_core.cost.checks import validate
    from tapp_core.planners import get_planner
    from tests.test_planners_common import QUICK
    from tests.test_planners_common import chain_library as synthetic_chain

    library = synthetic_chain()
    whole = Plan(library.model, 64, 4, "gpipe", (0,) * len(library.layers), (("d0",),))
    keeping = stage_memory_bytes(whole, library, 0)["d0"]
    recomputing = stage_memory_bytes(dataclasses.replace(whole, recompute=(0,)), library, 0)["d0"]
    assert recomputing < keeping
    cluster = make_cluster([1.0], memory=f"{(keeping + recomputing) // 2}B")
    context = CostContext(library, cluster)
    options = {"schedule": "gpipe", "schedules": ("gpipe",), **QUICK[name]}
    plan = get_planner(name, micro_batches=(4,), **options).plan(context)
    validate(plan, context)
    assert plan.recompute, plan.describe(library)
