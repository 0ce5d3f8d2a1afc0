"""The constructive planners and the oracle against brute force on graphs small enough to enumerate."""

from __future__ import annotations

import dataclasses
import itertools
import math
import platform
import random
import time
from collections.abc import Callable

import numpy as np
import pytest

from tapp_core.cost.calibration import Calibration, KindCalibration
from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.model.workload import OptimizerConfig
from tapp_core.plan.plan import RUNTIME_BYTES, Plan, PlanError, single_stage_plan
from tapp_core.plan.schedules import SCHEDULES
from tapp_core.planners import get_planner
from tapp_core.planners.antichain import down_sets
from tapp_core.planners.base import PlannerBase
from tapp_core.planners.bounds import StepTimeBound
from tapp_core.planners.evaluation import MemoryScreen
from tapp_core.planners.even import min_max_partition
from tapp_core.planners.moves import (
    boundary_positions,
    collapsed,
    cuts_of,
    dropped_replicas,
    merged_neighbours,
    moved_cut,
    one_per_class,
    swapped_groups,
    unused_devices,
    with_group,
)
from tapp_core.planners.oracle import device_groupings
from tapp_core.planners.space import coarse_cut_positions, contiguous_plan
from tapp_core.planners.stage_costs import LayerCosts, device_classes
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.profile.library import LayerLibrary
from tests.test_planners_common import branchy_library, chain_library, small_cluster, with_fixed_parts


def test_min_max_partition_matches_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(30):
        weights = [rng.uniform(0.1, 5) for _ in range(rng.randint(3, 9))]
        parts = rng.randint(1, len(weights))
        cuts = min_max_partition(weights, parts)
        assert len(cuts) == parts - 1

        best = min(_largest_range(weights, c) for c in itertools.combinations(range(1, len(weights)), parts - 1))
        assert math.isclose(_largest_range(weights, tuple(cuts)), best)


def _largest_range(weights: list[float], cuts: tuple[int, ...]) -> float:
    bounds = [0, *cuts, len(weights)]
    return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))


def test_layer_costs_count_every_tensor_crossing_a_position() -> None:
    costs = LayerCosts.from_library(branchy_library())
    # After the stem (position 1) the stem's output crosses alone; inside the branches (after a1, position 2)
    # the stem's output (to b1 and to the add) and a1's output cross.
    assert costs.cut_tensors[1] == 1
    assert costs.cut_tensors[2] == 2
    assert 1 in costs.clean_cuts() and 2 not in costs.clean_cuts()


def test_down_sets_of_the_branchy_graph_are_exactly_the_closed_sets() -> None:
    library = branchy_library()
    states = down_sets(library)
    found = {tuple(np.flatnonzero(row)) for row in states.members}
    n = len(library.layers)
    closed = set()
    for mask in range(1 << n):
        members = {i for i in range(n) if mask >> i & 1}
        if all(p in members for i in members for p in library.layers[i].predecessors):
            closed.add(tuple(sorted(members)))
    # Chains inside the branchy block are contracted: a1 -> a2 is one unit, so {stem, a1} is not a state.
    assert found <= closed
    assert (0, 1) not in found and (0, 1, 2) in found and (0, 3) in found
    assert states.strict_subset[0, len(states) - 1]


def test_pipetorch_finds_the_bottleneck_optimum_of_its_model() -> None:
    library, cluster = chain_library([4, 1, 6, 2, 8, 1, 5]), small_cluster((1.0, 0.5, 0.25), slow_pair=False)
    plan = get_planner("pipetorch", micro_batches=(4,), candidates=1).plan(CostContext(library, cluster))
    costs = LayerCosts.from_library(library)
    n = len(library.layers)

    def bottleneck(cuts: tuple[int, ...], order: tuple[str, ...]) -> float:
        bounds = [0, *cuts, n]
        worst = max(
            costs.work(a, b) / cluster.device(d).speed
            for (a, b), d in zip(itertools.pairwise(bounds), order, strict=True)
        )
        links = [
            costs.cut_bytes[c] / cluster.link(x, y).bandwidth for c, x, y in zip(cuts, order, order[1:], strict=False)
        ]
        return max([worst, *links])

    best = min(
        bottleneck(cuts, order)
        for k in range(1, 4)
        for order in itertools.permutations(cluster.device_names, k)
        for cuts in itertools.combinations(range(1, n), k - 1)
    )
    cuts = tuple(plan.stage_of_layer.index(s) for s in range(1, plan.n_stages))
    assert math.isclose(bottleneck(cuts, tuple(d[0] for d in plan.stage_devices)), best)


def test_layer_costs_spread_fixed_parts_over_the_micro_batch() -> None:
    library = with_fixed_parts(chain_library(), 0.5)
    whole = LayerCosts.from_library(library)
    assert math.isclose(whole.work(0, 12) * 64, library.layer_time_sum_s)
    # At 8 samples a call still pays the whole fixed half: 8 samples cost half the batch's time plus 8/64 of the rest.
    eight = LayerCosts.from_library(library, 8)
    assert math.isclose(eight.work(0, 12) * 8, library.layer_time_sum_s * (0.5 + 0.5 * 8 / 64))


def test_pipetorch_takes_fewer_micro_batches_when_calls_cost_more_than_samples() -> None:
    cluster = small_cluster((1.0, 1.0), slow_pair=False)
    linear = get_planner("pipetorch", micro_batches=(1, 8)).plan(CostContext(chain_library(), cluster))
    fixed = get_planner("pipetorch", micro_batches=(1, 8)).plan(
        CostContext(with_fixed_parts(chain_library(), 0.9), cluster)
    )
    assert linear.micro_batches == 8  # more micro-batches only shrink the bubble when time scales with samples
    assert fixed.micro_batches == 1


def test_device_classes_and_groupings_skip_interchangeable_devices() -> None:
    twins = small_cluster((1.0, 1.0, 0.5), slow_pair=False)
    assert device_classes(twins) == [["d0", "d1"], ["d2"]]
    distinct = small_cluster((1.0, 0.5, 0.25))
    # Ordered sequences of disjoint non-empty groups of 3 distinct devices: 3 + 6 + 6 (k=1, one or more) ...
    all_groupings = list(device_groupings(distinct, 3))
    assert len(all_groupings) == len(set(all_groupings)) == 7 + 12 + 6
    assert len(list(device_groupings(twins, 3))) < len(all_groupings)


@pytest.mark.parametrize("fixed_share", [0.0, 0.6])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
def test_the_bound_never_exceeds_the_estimate(schedule: str, fixed_share: float) -> None:
    rng = random.Random(7)
    calibration = Calibration(
        per_message_s=1e-4, per_step_s=2e-3, per_micro_batch_s=3e-4, update_s_per_param_byte=1e-10
    )
    for library in (with_fixed_parts(chain_library(), fixed_share), with_fixed_parts(branchy_library(), fixed_share)):
        n = len(library.layers)
        for cluster in (small_cluster(), small_cluster((1.0, 1.0, 0.5, 0.5), slow_pair=False)):
            groupings = list(device_groupings(cluster, 2))
            for _ in range(60):
                grouping = rng.choice(groupings)
                m = rng.choice([1, 2, 4, 8])
                if len(grouping) > n or any((64 // m) % len(g) for g in grouping):
                    continue
                cuts = sorted(rng.sample(range(1, n), len(grouping) - 1))
                plan = contiguous_plan(library, cuts, grouping, m, schedule, 64)
                bound = StepTimeBound(CostContext(library, cluster, calibration), schedule, m)
                groups = [bound.group(g) for g in grouping]
                assert bound.bound(cuts, groups) <= estimate(
                    plan, CostContext(library, cluster, calibration)
                ).step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("fixed_share", [0.0, 0.6])
@pytest.mark.parametrize("make_library", [chain_library, branchy_library])
def test_the_oracle_is_the_minimum_over_every_contiguous_plan(make_library, fixed_share: float) -> None:
    library, cluster = with_fixed_parts(make_library(), fixed_share), small_cluster()
    choices = (1, 4)
    plan = get_planner("oracle", schedules=("1f1b",), micro_batches=choices).plan(CostContext(library, cluster))
    assert plan.notes["proved_optimal"] is True and plan.notes["coarsened"] is False
    n = len(library.layers)
    best = math.inf
    for grouping in device_groupings(cluster, 3):
        for m in choices:
            if any((64 // m) % len(g) for g in grouping):
                continue
            for cuts in itertools.combinations(range(1, n), len(grouping) - 1):
                candidate = contiguous_plan(library, cuts, grouping, m, "1f1b", 64)
                best = min(best, estimate(candidate, CostContext(library, cluster)).step_time_s)
    assert math.isclose(plan.notes["estimated_step_time_s"], best, rel_tol=1e-12)


def test_a_coarsened_oracle_says_so_and_cuts_only_where_allowed() -> None:
    library, cluster = chain_library(), small_cluster()
    plan = get_planner("oracle", schedules=("1f1b",), max_blocks=4, micro_batches=(2,)).plan(
        CostContext(library, cluster)
    )
    allowed = set(coarse_cut_positions(LayerCosts.from_library(library), 4))
    assert plan.notes["coarsened"] is True and plan.notes["cut_positions"] == len(allowed) == 3
    assert {plan.stage_of_layer.index(s) for s in range(1, plan.n_stages)} <= allowed


def test_groupings_come_fewest_stages_first() -> None:
    stages = [len(g) for g in device_groupings(small_cluster((1.0, 0.5, 0.25, 0.125)), 4)]
    assert stages == sorted(stages) and stages[0] == 1 and max(stages) == 4


def test_a_time_limited_oracle_that_finishes_says_it_proved_the_optimum() -> None:
    library, cluster = chain_library(), small_cluster()
    boxed = get_planner("oracle", schedules=("1f1b",), time_limit_s=60, micro_batches=(1, 4)).plan(
        CostContext(library, cluster)
    )
    plain = get_planner("oracle", schedules=("1f1b",), micro_batches=(1, 4)).plan(CostContext(library, cluster))
    assert boxed.notes["proved_optimal"] is True
    assert boxed.notes["groupings_cut"] is False and boxed.notes["incumbents_cut"] is False
    assert boxed.notes["estimated_step_time_s"] == plain.notes["estimated_step_time_s"]


def test_the_oracle_s_time_limit_covers_its_groupings_and_incumbents() -> None:
    library = chain_library([1.0] * 12)
    # 9 unlike devices: about 7.9 million device groupings, hours of incumbent estimates without the limit.
    cluster = small_cluster(tuple(1.0 - 0.08 * i for i in range(9)), slow_pair=False)
    started = time.perf_counter()
    plan = get_planner("oracle", time_limit_s=2).plan(CostContext(library, cluster))
    assert time.perf_counter() - started < 15
    assert plan.notes["proved_optimal"] is False
    assert plan.notes["groupings_cut"] or plan.notes["incumbents_cut"]
    single = get_planner("single").plan(CostContext(library, cluster))
    assert plan.notes["estimated_step_time_s"] <= single.notes["estimated_step_time_s"]


def test_the_oracle_s_time_limit_covers_every_schedule_s_search_together() -> None:
    oracle = get_planner("oracle", time_limit_s=2)
    assert oracle.schedules is not None and len(oracle.schedules) == 2  # 1f1b and async, each proved on its own
    one = oracle.for_schedule("async", len(oracle.schedules))
    assert (one.schedule, one.schedules, one.time_limit_s) == ("async", None, 1.0)  # type: ignore[attr-defined]
    assert get_planner("oracle").for_schedule("1f1b", 2).time_limit_s is None  # type: ignore[attr-defined]


@dataclasses.dataclass
class _ProvesOneSchedule(PlannerBase):
    """A planner whose search proves its optimum on 1f1b alone (as an oracle whose async proof hit its limit)."""

    name = "proves-one"

    def _plan(self, context: CostContext, budget: int | None, progress: object) -> Plan:
        plan = single_stage_plan(context.library, ["d0"])
        return dataclasses.replace(plan, schedule=self.schedule, notes={"proved_optimal": self.schedule == "1f1b"})


def test_a_search_is_proved_optimal_only_where_every_schedule_s_search_was_proved() -> None:
    context = CostContext(chain_library([1.0] * 4), small_cluster((1.0, 0.5)))
    assert _ProvesOneSchedule(schedules=("1f1b",)).plan(context).notes["proved_optimal"] is True
    assert _ProvesOneSchedule(schedules=("1f1b", "async")).plan(context).notes["proved_optimal"] is False


def test_pipedream_replicates_when_devices_are_many_and_equal() -> None:
    library = chain_library([6, 6, 6, 6, 6, 6])
    cluster = small_cluster((1.0, 1.0, 1.0, 1.0), slow_pair=False)
    plan = get_planner("pipedream", micro_batches=(1, 2, 4)).plan(CostContext(library, cluster))
    validate(plan, CostContext(library, cluster))
    assert len(plan.devices) >= 2


def test_autoddl_improves_on_its_start_and_respects_the_budget() -> None:
    library, cluster = chain_library(), small_cluster()
    full = get_planner("autoddl", micro_batches=(1, 2, 4)).plan(CostContext(library, cluster))
    capped = get_planner("autoddl", micro_batches=(1, 2, 4)).plan(CostContext(library, cluster), budget=5)
    evaluations, full_time, capped_time = (
        capped.notes["evaluations"],
        full.notes["estimated_step_time_s"],
        capped.notes["estimated_step_time_s"],
    )
    assert isinstance(evaluations, int) and isinstance(full_time, float) and isinstance(capped_time, float)
    assert evaluations <= 6 and full_time <= capped_time


@pytest.mark.parametrize(("optimizer", "frozen"), [("SGD", False), ("AdamW", False), ("AdamW", True)])
def test_the_memory_screen_agrees_with_validate(optimizer: str, frozen: bool) -> None:
    library = chain_library()
    if frozen:  # a fine-tuned model: the first half's parameters do not train
        half = len(library.layers) // 2
        library.layers = [
            dataclasses.replace(x, frozen_bytes=x.param_bytes, backward_s=0.0, backward_fixed_s=0.0)  # as profiled
            if x.index < half
            else x
            for x in library.layers
        ]
    cluster = parse_cluster(
        {
            "name": "tight",
            # 4, 8 and 16 MiB beyond what every stage's runtime takes (plan.RUNTIME_BYTES)
            "devices": [
                {"name": f"d{i}", "memory": f"{m + RUNTIME_BYTES // 2**20}MiB"} for i, m in enumerate((4, 8, 16))
            ],
            "links": {"bandwidth": "1Gbit/s", "latency": "50us"},
        }
    )
    context = CostContext(library, cluster, optimizer=OptimizerConfig(name=optimizer))
    screen = MemoryScreen(context)
    rng = random.Random(11)
    outcomes = set()
    for _ in range(300):
        devices = list(cluster.device_names)
        rng.shuffle(devices)
        k = rng.randint(1, 3)
        grouping = [devices[:1], *[[d] for d in devices[1:k]]]
        if rng.random() < 0.3 and k < 3:
            grouping[0].append(devices[k])
        cuts = sorted(rng.sample(range(1, len(library.layers)), len(grouping) - 1))
        plan = contiguous_plan(library, cuts, grouping, rng.choice([1, 2, 4, 8]), rng.choice(SCHEDULES), 64)
        try:
            validate(plan, context)
            valid = True
        except PlanError:
            valid = False
        assert screen.fits(plan) == valid
        outcomes.add(valid)
    assert outcomes == {True, False}


def test_the_shared_moves_keep_every_stage_and_device_once() -> None:
    cuts = (2, 5, 9)
    assert list(boundary_positions(cuts, 0, 12)) == [1, 2, 3, 4]
    assert list(boundary_positions(cuts, 1, 12)) == [3, 4, 5, 6, 7, 8]
    assert list(boundary_positions(cuts, 2, 12)) == [6, 7, 8, 9, 10, 11]
    assert moved_cut(cuts, 1, 7) == (2, 7, 9)
    groups = (("a",), ("b", "c"), ("d",))
    swaps = list(swapped_groups(groups))
    assert swaps[0] == (("b", "c"), ("a",), ("d",)) and len(swaps) == 3
    assert all(sorted(d for g in swapped for d in g) == ["a", "b", "c", "d"] for swapped in swaps)
    assert with_group(groups, 2, ("d", "e")) == (("a",), ("b", "c"), ("d", "e"))
    assert unused_devices(groups, ["f", "a", "e", "b"]) == ["f", "e"]
    library = chain_library()
    plan = contiguous_plan(library, (3, 7), groups, 2, "1f1b", 64)
    assert cuts_of(plan) == [3, 7]
    assert cuts_of(dataclasses.replace(plan, stage_of_layer=(0, 1, 0, *plan.stage_of_layer[3:]))) is None


# --- Several device kinds ---------------------------------------------------------------------------------------


def kind_library(library: LayerLibrary, threads: int, seed: int, gpu_model: str = "") -> LayerLibrary:
    """``library`` timed on another kind: every layer's time scaled by its own random factor (0.1x to 3x)."""
    rng = random.Random(seed)
    layers = []
    for layer in library.layers:
        f = rng.uniform(0.1, 3.0)
        layers.append(
            dataclasses.replace(
                layer,
                forward_s=layer.forward_s * f,
                backward_s=layer.backward_s * f,
                forward_fixed_s=layer.forward_fixed_s * f,
                backward_fixed_s=layer.backward_fixed_s * f,
            )
        )
    device = "cuda" if gpu_model else "cpu"
    return dataclasses.replace(library, layers=layers, threads=threads, device=device, gpu_model=gpu_model)


def kinds_case(make_library: Callable[[], LayerLibrary], fixed_share: float) -> tuple[LayerLibrary, Cluster]:
    """Three kinds, profiled here: a 1-thread CPU (the reference), a 2-thread CPU and a GPU, each with layer
    times of its own; a real cluster of two 1-thread devices, one 2-thread device and one GPU."""
    here = platform.node()
    base = dataclasses.replace(with_fixed_parts(make_library(), fixed_share), host=here)
    library = base.with_kinds([kind_library(base, 2, 1), kind_library(base, 4, 2, gpu_model="X")])
    cluster = parse_cluster(
        {
            "name": "kinds",
            "emulated": False,
            "devices": [
                {"name": "c1a", "threads": 1, "memory": "1GiB"},
                {"name": "c1b", "threads": 1, "memory": "1GiB"},
                {"name": "c2", "threads": 2, "memory": "1GiB"},
                {"name": "g", "kind": "cuda", "gpu_model": "X", "threads": 4, "memory": "1GiB"},
            ],
            "links": {
                "bandwidth": "1Gbit/s",
                "latency": "50us",
                "overrides": [{"between": ["c2", "g"], "bandwidth": "100Mbit/s", "latency": "50us"}],
            },
        }
    )
    return library, cluster


KIND_CALIBRATION = Calibration(
    per_message_s=1e-4,
    per_step_s=2e-3,
    per_micro_batch_s=3e-4,
    update_s_per_param_byte=1e-10,
    kinds={
        "cpu-t2": KindCalibration(compute_scale=1.3, per_micro_batch_s=1e-4, update_s_per_param_byte=5e-11),
        "cuda-X": KindCalibration(
            compute_scale=0.8,
            per_micro_batch_s=5e-5,
            update_s_per_param_byte=1e-12,
            d2h_s_per_byte=1e-9,
            h2d_s_per_byte=2e-9,
            staging_per_copy_s=2e-5,
        ),
    },
)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
def test_the_bound_never_exceeds_the_estimate_with_several_kinds(schedule: str) -> None:
    rng = random.Random(17)
    for make_library, fixed_share in ((chain_library, 0.0), (branchy_library, 0.6)):
        library, cluster = kinds_case(make_library, fixed_share)
        n = len(library.layers)
        groupings = list(device_groupings(cluster, 2))
        for _ in range(80):
            grouping = rng.choice(groupings)
            m = rng.choice([1, 2, 4, 8])
            if len(grouping) > n or any((64 // m) % len(g) for g in grouping):
                continue
            cuts = sorted(rng.sample(range(1, n), len(grouping) - 1))
            plan = contiguous_plan(library, cuts, grouping, m, schedule, 64)
            bound = StepTimeBound(CostContext(library, cluster, KIND_CALIBRATION), schedule, m)
            groups = [bound.group(g) for g in grouping]
            assert bound.bound(cuts, groups) <= estimate(
                plan, CostContext(library, cluster, KIND_CALIBRATION)
            ).step_time_s * (1 + 1e-9)


def test_the_oracle_is_the_minimum_with_several_kinds() -> None:
    library, cluster = kinds_case(chain_library, 0.3)
    library = dataclasses.replace(library, layers=library.layers[:7])  # small enough to enumerate
    library = library.with_kinds(
        [dataclasses.replace(other, layers=other.layers[:7]) for other in library.kinds.values()]
    )
    last = library.layers[-1]
    library.layers[-1] = dataclasses.replace(last, successors=())
    for other in library.kinds.values():
        other.layers[-1] = dataclasses.replace(other.layers[-1], successors=())
    choices = (1, 4)
    plan = get_planner("oracle", schedules=("1f1b",), micro_batches=choices).plan(
        CostContext(library, cluster, KIND_CALIBRATION)
    )
    assert plan.notes["proved_optimal"] is True
    best = math.inf
    for grouping in device_groupings(cluster, 4):
        for m in choices:
            if len(grouping) > 7 or any((64 // m) % len(g) for g in grouping):
                continue
            for cuts in itertools.combinations(range(1, 7), len(grouping) - 1):
                candidate = contiguous_plan(library, cuts, grouping, m, "1f1b", 64)
                best = min(best, estimate(candidate, CostContext(library, cluster, KIND_CALIBRATION)).step_time_s)
    assert math.isclose(plan.notes["estimated_step_time_s"], best, rel_tol=1e-12)


def test_the_dynamic_programs_put_each_layer_where_its_kind_is_fast() -> None:
    # Two kinds with opposite strengths: kind A runs layers 0-2 ten times faster than kind B, and B runs layers 3-5
    # ten times faster than A. One library scaled by a speed cannot see it; per-kind libraries can.
    here = platform.node()
    fast, slow = 1.0, 10.0
    a = dataclasses.replace(chain_library([fast] * 3 + [slow] * 3), host=here)
    opposite = chain_library([slow] * 3 + [fast] * 3).layers
    layers = [
        dataclasses.replace(mine, forward_s=theirs.forward_s, backward_s=theirs.backward_s)
        for mine, theirs in zip(a.layers, opposite, strict=True)
    ]
    b = dataclasses.replace(a, layers=layers, threads=2)
    library = a.with_kinds([b])
    cluster = parse_cluster(
        {
            "name": "opposites",
            "emulated": False,
            "devices": [{"name": "a", "threads": 1, "memory": "1GiB"}, {"name": "b", "threads": 2, "memory": "1GiB"}],
            "links": {"bandwidth": "10Gbit/s", "latency": "10us"},
        }
    )
    for name in ("pipetorch", "pipedream", "autoddl", "oracle"):
        plan = get_planner(name, micro_batches=(4,)).plan(CostContext(library, cluster))
        assert plan.stage_devices == (("a",), ("b",)), name
        assert plan.stage_of_layer == (0, 0, 0, 1, 1, 1), name


def test_shrinking_moves_give_valid_plans_with_fewer_devices_or_stages() -> None:
    library, cluster = chain_library(), small_cluster((1.0, 1.0, 0.5, 0.25), slow_pair=False)
    groups = (("d0", "d1"), ("d2",), ("d3",))
    plan = contiguous_plan(library, (4, 8), groups, 2, "1f1b", 64)
    class_of = {"d0": 0, "d1": 0, "d2": 1, "d3": 2}
    dropped = list(dropped_replicas(groups, class_of))
    assert dropped == [(("d0",), ("d2",), ("d3",))], "one replica per class: d0 and d1 are interchangeable"
    assert len(list(dropped_replicas(groups))) == 2
    merged = list(merged_neighbours(plan))
    assert len(merged) == 3 + 3, "d0+d1+d2 are 3 replicas of 11, 11 and 10 samples of the micro-batch of 32"
    for move in merged:
        validate(move, CostContext(library, cluster))
        assert move.n_stages == 2 and len(move.devices) <= len(plan.devices)
    assert merged[0].stage_devices == (("d0", "d1"), ("d3",)) and cuts_of(merged[0]) == [8]
    assert merged[1].stage_devices == (("d2",), ("d3",)) and merged[5].stage_devices == (("d0", "d1"), ("d2", "d3"))
    assert merged[2].rows(0) == ((0, 11), (11, 22), (22, 32))
    assert [
        p.stage_devices for p in merged_neighbours(dataclasses.replace(plan, stage_devices=(("d0",), ("d1",), ("d2",))))
    ][2] == (("d0", "d1"), ("d2",))
    single = list(collapsed(plan, ["d0", "d2"]))
    assert [p.stage_devices for p in single] == [(("d0",),), (("d2",),)]
    for move in single:
        validate(move, CostContext(library, cluster))
        assert move.n_stages == 1 and move.micro_batches == plan.micro_batches
    assert list(merged_neighbours(dataclasses.replace(plan, stage_of_layer=(0, 1, 0, *plan.stage_of_layer[3:])))) == []


def test_moves_skip_swaps_of_interchangeable_groups_and_keep_one_device_per_class() -> None:
    groups = (("a",), ("b",), ("c",))
    class_of = {"a": 0, "b": 0, "c": 1, "d": 1}
    assert list(swapped_groups(groups, class_of)) == [(("c",), ("b",), ("a",)), (("a",), ("c",), ("b",))]
    assert one_per_class(["a", "c", "b", "d"], class_of) == ["a", "c"]
    assert one_per_class(["a", "b"], None) == ["a", "b"]


def test_the_oracle_proves_both_pipelines_unless_told_one_schedule() -> None:
    library, cluster = chain_library(), small_cluster()
    both = get_planner("oracle", micro_batches=(1, 4)).plan(CostContext(library, cluster))
    each = {  # a schedule given, or one schedule asked for: that one alone
        s: get_planner("oracle", micro_batches=(1, 4), **options).plan(CostContext(library, cluster))  # type: ignore[arg-type]
        for s, options in (("1f1b", {"schedules": ("1f1b",)}), ("async", {"schedule": "async"}))
    }
    assert set(both.notes["schedule_estimates_s"]) == {"1f1b", "async"} and both.notes["proved_optimal"] is True
    assert both.notes["estimated_step_time_s"] == min(p.notes["estimated_step_time_s"] for p in each.values())
    assert {p.schedule.partition(":")[0] for p in each.values()} == {"1f1b", "async"}
    assert (
        get_planner("oracle", micro_batches=(1,), schedule="gpipe").plan(CostContext(library, cluster)).schedule
        == "gpipe"
    )
