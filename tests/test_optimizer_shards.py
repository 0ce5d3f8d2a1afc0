"""Sharded optimiser state among a stage's devices (ZeRO stage 1, ``Plan.shard_optimizer``): the plan carries the
choice, the memory model counts each device's share of the optimiser state, the cost model charges the
reduce-scatter, the update of a share and the allgather, and the runtime trains exactly as without it (like one
device, with even and uneven shares, SGD and AdamW, several buckets, frozen and tied parameters)."""

from __future__ import annotations

import dataclasses

import pytest

from tapp_core.cost.calibration import DEFAULT_CALIBRATION
from tapp_core.cost.checks import check_memory, memory_choices_where_needed, validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.estimate import Estimate
from tapp_core.cost.simulation import estimate
from tapp_core.plan.plan import BUCKET_COPIES, SHARD_COPIES, Plan, PlanError, stage_memory_bytes, stage_memory_terms
from tapp_core.planners.moves import optimizer_shard_toggled
from tapp_core.runtime import OptimizerConfig, WorkerPool
from tests.factories import chain_library, make_cluster
from tests.test_runtime_correctness import BATCH, MICRO_BATCHES, stages_by_cuts, trains_like_one_device


def replicated(**overrides: object) -> Plan:
    plan = Plan("toy", 8, 1, "gpipe", (0, 0, 0, 1), (("d0", "d1"), ("d2",)), stage_shares=((0.75, 0.25), (1.0,)))
    return dataclasses.replace(plan, **overrides)  # type: ignore[arg-type]


def test_the_plan_carries_the_choice_and_old_plans_keep_their_id() -> None:
    plain, sharded = replicated(), replicated(shard_optimizer=(0,))
    assert "shard_optimizer" not in plain.canonical() and sharded.id != plain.id
    again = Plan.from_json(sharded.to_json())
    assert again == sharded and again.shards_optimizer(0) and not again.shards_optimizer(1)
    assert "sharded optimizer" in sharded.describe()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"shard_optimizer": (1,)}, "stage 1, which runs on one device"),
        ({"shard_optimizer": (2,)}, "stage 2, which is not a stage"),
        ({"shard_optimizer": (0,), "signatures": ((1, "col"),)}, "runs split signatures"),
        ({"shard_optimizer": (0,), "schedule": "async"}, "applies its gradients late"),
    ],
)
def test_a_stage_that_cannot_shard_is_named(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        replicated(**overrides)


def test_regrouping_keeps_the_choice_with_a_group_that_can_still_shard() -> None:
    sharded = replicated(shard_optimizer=(0,))
    assert sharded.regrouped(stage_of_layer=(0, 0, 1, 1)).shard_optimizer == (0,)
    assert sharded.regrouped(stage_devices=(("d0",), ("d1", "d2"))).shard_optimizer == ()


def test_each_device_holds_its_share_of_the_optimizer_state() -> None:
    library = chain_library(4, param_bytes=[0, 4000, 0, 1000])
    adamw = 2
    plain = stage_memory_terms(replicated(), library, 0, adamw)
    sharded = stage_memory_terms(replicated(shard_optimizer=(0,)), library, 0, adamw)
    for device, share in (("d0", 0.75), ("d1", 0.25)):
        saved = plain[device]["training state"] - sharded[device]["training state"]
        assert saved == pytest.approx(adamw * (1 - share) * 4000)
        # its share of the sum and MPI's working memory, not the flat buffer and the allreduce's
        assert sharded[device]["gradient buckets"] == pytest.approx(SHARD_COPIES * share * 4000)
        assert plain[device]["gradient buckets"] == pytest.approx(BUCKET_COPIES * 4000)


def _seconds(estimate: Estimate, device: str, kind: str) -> float:
    return sum(op.end - op.start for op in estimate.timeline if op.device == device and op.kind == kind)


def test_the_cost_model_charges_the_reduce_scatter_a_share_of_the_update_and_the_allgather() -> None:
    library = chain_library(4, param_bytes=[0, 40_000_000, 0, 1000])
    calibration = dataclasses.replace(DEFAULT_CALIBRATION, update_s_per_param_byte=1e-9)
    context = CostContext(library, make_cluster([1, 1, 1], bandwidth=1e9), calibration)
    plain, sharded = estimate(replicated(), context), estimate(replicated(shard_optimizer=(0,)), context)
    # a ring reduce-scatter moves (1 - smallest share) of the bucket, a ring allreduce 2 (k - 1) / k of it
    assert _seconds(sharded, "d0", "reduce") == pytest.approx(0.75 * _seconds(plain, "d0", "reduce"), rel=1e-3)
    for device, share in (("d0", 0.75), ("d1", 0.25)):  # each updates its share of the 40 MB
        assert _seconds(sharded, device, "update") == pytest.approx(share * _seconds(plain, device, "update"), rel=1e-3)
    last_update = max(op.end for op in sharded.timeline if op.kind == "update" and op.stage == 0)
    gathers = [op for op in sharded.timeline if op.kind == "allreduce" and op.stage == 0 and op.end > last_update]
    assert {op.device for op in gathers} == {"d0", "d1"}
    assert all(op.end == pytest.approx(gathers[0].end) for op in gathers)


SGD = OptimizerConfig(lr=0.05, momentum=0.9)
ADAMW = OptimizerConfig(name="AdamW", lr=0.01, weight_decay=0.1, options=(("eps", 1e-4),))
"""AdamW's step divides by the root of its second moment plus ``eps``: for a gradient near zero, torch's default eps
(1e-8) turns the last bits of a sum, which another order of the same additions changes (another split of the batch,
another CPU's kernels), into a step several ATOLs apart. A larger eps keeps the comparison about the shards."""
CASES = [
    # id, pool, model, schedule, cuts, stage devices, shares, bucket bytes, optimiser
    ("bsp-2-even", "pool2", "mlp", "gpipe", (), (("d0", "d1"),), (), None, SGD),
    ("bsp-3-uneven-small-buckets", "pool3", "tiny_cnn", "gpipe", (), (("d0", "d1", "d2"),), ((0.5, 0.3, 0.2),), 512, SGD),
    ("replicated-first-1f1b-uneven-adamw", "pool3", "tiny_branchy", "1f1b", (6,), (("d0", "d2"), ("d1",)),
     ((0.75, 0.25), (1.0,)), 2048, ADAMW),
    ("bsp-3-even-adamw", "pool3", "tiny_cnn", "1f1b", (), (("d0", "d1", "d2"),), (), None, ADAMW),
    ("frozen-backbone-bsp-2", "pool2", "tests.wild_models:finetune", "gpipe", (), (("d0", "d1"),), (), None, ADAMW),
    ("tied-replicated-holder-1f1b", "pool3", "tests.user_models:tied", "1f1b", (6,), (("d0", "d2"), ("d1",)),
     ((0.75, 0.25), (1.0,)), None, SGD),
]  # fmt: skip


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("pool_name", "model", "schedule", "cuts", "devices", "shares", "bucket_bytes", "optimizer"),
    [c[1:] for c in CASES],
    ids=[str(c[0]) for c in CASES],
)
def test_sharded_optimizer_state_trains_like_one_device(
    request: pytest.FixtureRequest,
    pool_name: str,
    model: str,
    schedule: str,
    cuts: tuple[int, ...],
    devices: tuple[tuple[str, ...], ...],
    shares: tuple[tuple[float, ...], ...],
    bucket_bytes: int | None,
    optimizer: OptimizerConfig,
) -> None:
    pool: WorkerPool = request.getfixturevalue(pool_name)
    plan = Plan(
        model, BATCH, MICRO_BATCHES, schedule, stages_by_cuts(model, cuts), devices,
        stage_shares=shares, bucket_bytes=bucket_bytes, shard_optimizer=(0,),
    )  # fmt: skip
    trains_like_one_device(pool, plan, optimizer=optimizer)


def test_a_toggle_move_turns_sharding_on_only_where_a_stage_may_shard() -> None:
    plan = replicated()
    toggled = list(optimizer_shard_toggled(plan))
    assert [p.shard_optimizer for p in toggled] == [(0,)]  # stage 1 runs on one device
    assert [p.shard_optimizer for p in optimizer_shard_toggled(toggled[0])] == [()]


def heavy_layer_context(devices: int = 4) -> tuple[CostContext, Plan]:
    """One layer holding nearly every weight (an embedding table), under AdamW, on devices that hold it only with its optimiser state
    sharded among three or more of them (the memory of one device, or of two, is short of it)."""
    param = 40 * 2**20
    chain = chain_library(4, param_bytes=[0, param, 0, 1000], activation_bytes=[64] * 4)
    # an embedding table: a layer no signature splits, so operator parallelism cannot hold it either
    layers = [dataclasses.replace(layer, op="Embedding") for layer in chain.layers]
    library = dataclasses.replace(chain, layers=layers)
    plan = Plan("toy", 8, 1, "gpipe", (0,) * 4, (tuple(f"d{i}" for i in range(devices)),))
    adamw = OptimizerConfig(name="AdamW")
    roomy = CostContext(library, make_cluster([1.0] * devices), optimizer=adamw)
    need = max(stage_memory_bytes(dataclasses.replace(plan, shard_optimizer=(0,)), library, 0, 2).values())
    assert need < 3.5 * param < 4 * param  # one device alone needs 4x its weights: weights, gradients, AdamW's two
    cluster = make_cluster([1.0] * devices, memory=f"{int(3.5 * param)}B")
    return dataclasses.replace(roomy, cluster=cluster), plan


def test_the_oracles_space_shards_a_stage_that_does_not_fit_otherwise() -> None:
    context, plan = heavy_layer_context()
    chosen = memory_choices_where_needed(plan, context)
    assert chosen.shard_optimizer == (0,) and not chosen.recompute
    check_memory(chosen, context)
    with pytest.raises(PlanError, match="out of memory"):
        check_memory(plan, context)


@pytest.mark.parametrize("name", ["autoddl", "tapp", "oracle"])
def test_a_search_shards_where_nothing_else_fits(name: str) -> None:
    from tapp_core.planners import get_planner
    from tests.test_planners_common import QUICK

    context, _ = heavy_layer_context()
    options = {"schedule": "gpipe", "schedules": ("gpipe",), **QUICK[name]}
    plan = get_planner(name, micro_batches=(1,), **options).plan(context)
    validate(plan, context)
    assert plan.shard_optimizer, plan.describe()
