"""Schedule parity: the cost model simulates each device's program, communication included, as the runtime runs it.

The runtime's engine runs ``DeviceProgram.actions()`` in list order. The cost model's order is read from what it
did, an ``estimate``'s timeline, not from the program it was given. Both are held against ``reference_order``, the
schedules as their docstrings state them, written here independently: a change to either side's order fails. The
sends and gradient reductions the cost model simulated are the program's, one for one.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest

from tapp_core.cost.context import CostContext
from tapp_core.cost.estimate import Estimate
from tapp_core.cost.simulation import estimate, simulated_programs
from tapp_core.plan.plan import Plan
from tapp_core.plan.program import BUCKET_BYTES, Route, ScheduleError, check_programs, plan_programs
from tapp_core.plan.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    posted_receives,
    receive_lookahead,
    schedule_for,
)
from tests.factories import library_from_edges, make_cluster

SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 4), (4, 2), (4, 8), (5, 3)]
"""(stages, micro-batches): fewer, as many and more micro-batches than stages."""
SCHEDULE_CASES = [(name, None) for name in SCHEDULES] + [("async", 0), ("async", 1), ("async", 2)]


def reference_order(
    schedule: str, stage: int, n_stages: int, micro_batches: int, steps: int, staleness: int | None = None
) -> list[Action]:
    """gpipe: every forward, then every backward from the last. 1f1b: ``min(S - s, M)`` forwards, then a
    backward and a forward in turn, then the remaining backwards. async: 1f1b over all steps' micro-batches with
    no flush, each step's update right after the backward of its last micro-batch; with staleness K, the forward
    of step t waits for the update of step t - K - 1 (K = 0 is 1f1b)."""
    m = micro_batches
    if schedule == "async" and staleness is None:
        return _unbounded_async(stage, n_stages, m, steps)
    if schedule == "async" and staleness is not None:
        return _bounded_async(stage, n_stages, m, steps, staleness)
    order: list[Action] = []
    for step in range(steps):
        base = step * m
        if schedule == "gpipe":
            order += [Action("forward", base + j) for j in range(m)]
            order += [Action("backward", base + j) for j in reversed(range(m))]
        else:
            warmup = min(n_stages - stage, m)
            order += [Action("forward", base + j) for j in range(warmup)]
            for j in range(m - warmup):
                order += [Action("backward", base + j), Action("forward", base + warmup + j)]
            order += [Action("backward", base + j) for j in range(m - warmup, m)]
        order.append(Action("update", step))
    return order


def _unbounded_async(stage: int, n_stages: int, m: int, steps: int) -> list[Action]:
    total = m * steps
    warmup = min(n_stages - stage, total)
    plain: list[tuple[ActionKind, int]] = [("forward", j) for j in range(warmup)]
    for j in range(total - warmup):
        plain += [("backward", j), ("forward", warmup + j)]
    plain += [("backward", j) for j in range(total - warmup, total)]
    order = []
    for kind, j in plain:
        order.append(Action(kind, j))
        if kind == "backward" and j % m == m - 1:
            order.append(Action("update", j // m))
    return order


def _bounded_async(stage: int, n_stages: int, m: int, steps: int, staleness: int) -> list[Action]:
    """Event by event: a backward as soon as one is owed and the in-flight cap is reached or the next forward
    must wait for an update; otherwise a forward."""
    order: list[Action] = []
    done_forward, done_backward, updates = 0, 0, 0
    while done_backward < m * steps:
        may_forward = (
            done_forward < m * steps
            and done_forward - done_backward < n_stages - stage
            and updates >= done_forward // m - staleness
        )
        if may_forward:
            order.append(Action("forward", done_forward))
            done_forward += 1
        else:
            order.append(Action("backward", done_backward))
            done_backward += 1
            if done_backward % m == 0:
                order.append(Action("update", done_backward // m - 1))
                updates += 1
    return order


def pipeline(
    schedule: str, n_stages: int, micro_batches: int, replicated: bool = False, staleness: int | None = None
) -> tuple[Plan, Estimate]:
    """A chain of two layers per stage on devices of unequal speed, with a skip edge over the middle stages
    (timings that differ by stage, so an order that only holds for uniform timings would show)."""
    n_layers = 2 * n_stages
    edges = [(i, i + 1) for i in range(n_layers - 1)] + ([(0, n_layers - 1)] if n_layers > 2 else [])
    forward = [0.5 + 0.25 * (i % 3) for i in range(n_layers)]
    library = library_from_edges(
        n_layers, edges, forward_s=forward, batch_size=2 * micro_batches, param_bytes=[10**6] * n_layers
    )
    speeds = [1.0, 0.5, 2.0, 1.5, 0.75, 1.0][: n_stages + 1]
    cluster = make_cluster(speeds, bandwidth=5000.0, latency=0.01)
    devices = [(f"d{s}",) for s in range(n_stages)]
    if replicated:
        devices[0] = ("d0", f"d{n_stages}")
    plan = Plan(
        model="toy",
        batch_size=2 * micro_batches,
        micro_batches=micro_batches,
        schedule=schedule,
        stage_of_layer=tuple(i // 2 for i in range(n_layers)),
        stage_devices=tuple(devices),
        staleness=staleness,
    )
    return plan, estimate(plan, CostContext(library, cluster))


def simulated_order(result: Estimate, device: str, micro_batches: int) -> list[Action]:
    """The forwards, backwards and updates the cost model ran on ``device``, in the order it ran them."""
    ops = sorted((op for op in result.timeline if op.device == device), key=lambda op: (op.start, op.end))
    order = []
    for op in ops:
        if op.kind in ("forward", "backward"):
            order.append(Action(op.kind, op.iteration * micro_batches + op.micro_batch))
        elif op.kind == "update":
            order.append(Action("update", op.iteration))
    return order


@pytest.mark.parametrize(("n_stages", "micro_batches"), SHAPES)
@pytest.mark.parametrize(("schedule", "staleness"), SCHEDULE_CASES)
def test_cost_model_runs_the_programs_order(
    schedule: str, staleness: int | None, n_stages: int, micro_batches: int
) -> None:
    plan, result = pipeline(schedule, n_stages, micro_batches, staleness=staleness)
    runtime = schedule_for(schedule, staleness)
    for stage, (device,) in enumerate(plan.stage_devices):
        simulated = simulated_order(result, device, micro_batches)
        steps = 1 + max(a.index for a in simulated if a.kind == "update")
        assert steps == 1 or not runtime.synchronous
        expected = reference_order(schedule, stage, n_stages, micro_batches, steps, staleness)
        assert list(runtime.compute_order(stage, n_stages, micro_batches, steps)) == expected, (
            f"schedule, stage {stage}"
        )
        assert simulated == expected, f"cost model, stage {stage}"


@pytest.mark.parametrize(("schedule", "staleness"), SCHEDULE_CASES)
def test_cost_model_sends_and_reduces_what_the_programs_say(schedule: str, staleness: int | None) -> None:
    plan, result = pipeline(schedule, 3, 4, replicated=True, staleness=staleness)
    library = library_from_edges(6, [(i, i + 1) for i in range(5)] + [(0, 5)], batch_size=8, param_bytes=[10**6] * 6)
    programs = simulated_programs(plan, library)
    check_programs(programs)
    device_of = [p.device for p in programs]
    expected: dict[str, Counter[tuple[object, ...]]] = {d: Counter() for d in plan.devices}
    for program in programs:
        for action in program.actions():
            if action.kind.startswith("send"):
                expected[program.device][("send", action.index, device_of[action.peer])] += 1
            elif action.kind == "reduce":
                expected[program.device][("reduce", action.index, action.bucket)] += 1
    simulated: dict[str, Counter[tuple[object, ...]]] = {d: Counter() for d in plan.devices}
    for op in result.timeline:
        if op.kind == "send":
            simulated[op.device][("send", op.iteration * plan.micro_batches + op.micro_batch, op.peer)] += 1
        elif op.kind == "reduce":
            simulated[op.device][("reduce", op.iteration, op.bucket)] += 1
    assert simulated == expected
    assert sum(c[k] for c in simulated.values() for k in c if k[0] == "reduce") > 0


@pytest.mark.parametrize(("schedule", "staleness"), SCHEDULE_CASES)
def test_every_replica_of_a_stage_runs_the_stages_order(schedule: str, staleness: int | None) -> None:
    plan, result = pipeline(schedule, 3, 4, replicated=True, staleness=staleness)
    first, second = plan.stage_devices[0]
    assert simulated_order(result, first, 4) == simulated_order(result, second, 4)


@pytest.mark.parametrize(("n_stages", "micro_batches"), SHAPES)
@pytest.mark.parametrize(("name", "staleness"), SCHEDULE_CASES)
def test_memory_and_bound_terms_follow_from_the_order(
    name: str, staleness: int | None, n_stages: int, micro_batches: int
) -> None:
    """``in_flight`` is the most forwards ahead of their backwards in the order (over enough steps for the
    asynchronous one to reach its steady state); ``round_trip_cover`` counts the backwards between the last
    micro-batch's forward and its backward: none in gpipe, the other cool-down backwards in 1f1b."""
    schedule = schedule_for(name, staleness)
    steps = 1 if schedule.synchronous else n_stages + 4
    for stage in range(n_stages):
        actions = schedule.compute_order(stage, n_stages, micro_batches, steps)
        ahead = itertools.accumulate({"forward": 1, "backward": -1, "update": 0}[a.kind] for a in actions)
        assert schedule.in_flight(stage, n_stages, micro_batches) == max(ahead)
        if schedule.synchronous:
            assert schedule.weight_versions(stage, n_stages, micro_batches) == 0
        one_step = schedule.compute_order(stage, n_stages, micro_batches, 1)
        last = micro_batches - 1
        between = one_step[one_step.index(Action("forward", last)) + 1 : one_step.index(Action("backward", last))]
        assert schedule.round_trip_cover(stage, n_stages, micro_batches) == len(between)
        assert len(between) == (0 if name == "gpipe" else min(n_stages - stage, micro_batches) - 1)


@pytest.mark.parametrize("staleness", [0, 1, 2, None])
def test_staleness_bounds_the_age_of_the_weights_each_gradient_meets(staleness: int | None) -> None:
    """Replaying the order: a micro-batch's gradient is applied at its step's update; the weights its forward ran on
    were current that many updates before. The bound holds, and is reached where the pipeline is deep enough."""
    schedule = schedule_for("async", staleness)
    n_stages, m, steps = 4, 1, 12
    worst = 0
    for stage in range(n_stages):
        version, ran_on = 0, {}
        for action in schedule.compute_order(stage, n_stages, m, steps):
            if action.kind == "forward":
                ran_on[action.index] = version
            elif action.kind == "update":
                worst = max(worst, version - ran_on[action.index * m + m - 1])
                version += 1
    assert worst == (n_stages - 1 if staleness is None else min(staleness, n_stages - 1))


def test_the_check_rejects_a_missing_receive() -> None:
    plan, _ = pipeline("1f1b", 2, 2)
    library = library_from_edges(4, [(0, 1), (1, 2), (2, 3)], batch_size=4)
    programs = plan_programs(plan, library.edges(), [0] * 4, steps=1)
    check_programs(programs)
    second = programs[1]
    no_receive = dataclasses.replace(second, receives={**second.receives, "forward": ()})
    with pytest.raises(
        ScheduleError, match=r"stage 0 \(d0\): send forward of micro-batch 0 to device #1 .* has no matching receive"
    ):
        check_programs((programs[0], no_receive))


def test_a_cyclic_wait_is_named() -> None:
    """Two stages that each receive before they send to the other: every message is paired, and none can go."""
    plan, _ = pipeline("gpipe", 2, 1)
    library = library_from_edges(4, [(0, 1), (1, 2), (2, 3)], batch_size=2)
    first, second = plan_programs(plan, library.edges(), [0] * 4, steps=1)
    # Stage 0 now also waits, before its forward, for a message stage 1 sends only after its own forward.
    loop = Route(1, (3,), (0, 2))
    first = dataclasses.replace(first, receives={**first.receives, "forward": (loop,)})
    second = dataclasses.replace(second, sends={**second.sends, "forward": (Route(0, (3,), (0, 2)),)})
    with pytest.raises(
        ScheduleError,
        match=r"the schedule deadlocks: stage 0 \(d0\) waits forever at recv forward of micro-batch 0 from device #1",
    ):
        check_programs((first, second))


def test_buckets_follow_the_backward_and_hold_whole_layers() -> None:
    from tapp_core.plan.program import gradient_buckets

    sizes = [0, 10 * 2**20, 30 * 2**20, 5 * 2**20, 5 * 2**20]
    buckets = gradient_buckets([0, 1, 2, 3, 4], sizes)
    assert [b.layers for b in buckets] == [(4, 3), (2,), (1,)]
    assert [b.nbytes for b in buckets] == [10 * 2**20, 30 * 2**20, 10 * 2**20]
    assert max(b.nbytes for b in buckets if len(b.layers) > 1) <= BUCKET_BYTES


@pytest.mark.parametrize(("n_stages", "micro_batches"), SHAPES)
@pytest.mark.parametrize(("schedule", "staleness"), SCHEDULE_CASES)
def test_posted_receives_count_the_programs_receives(
    schedule: str, staleness: int | None, n_stages: int, micro_batches: int
) -> None:
    """The memory model's receives posted and not yet taken (``posted_receives``) are the program's: over every
    window of ``receive_lookahead`` actions past the current one, the most activations and gradients received, for
    any sizes of the two."""
    plan = Plan(
        model="toy",
        batch_size=micro_batches,
        micro_batches=micro_batches,
        schedule=schedule,
        stage_of_layer=tuple(range(n_stages)),
        stage_devices=tuple((f"d{s}",) for s in range(n_stages)),
        staleness=staleness,
    )
    runtime = schedule_for(schedule, staleness)
    steps = sum(runtime.window(n_stages, micro_batches)) + 1
    programs = plan_programs(plan, [(i, i + 1) for i in range(n_stages - 1)], [0] * n_stages, steps)
    window = receive_lookahead(micro_batches, n_stages) + 1
    for program in programs:
        actions = list(program.actions())
        seen = {
            (
                sum(a.kind == "recv_forward" for a in actions[i : i + window]),
                sum(a.kind == "recv_backward" for a in actions[i : i + window]),
            )
            for i in range(len(actions))
        }
        counted = posted_receives(
            runtime, program.stage, n_stages, micro_batches, program.stage > 0, program.stage < n_stages - 1
        )
        for forward, backward in ((1, 0), (0, 1), (1, 1), (3, 1), (1, 3)):
            assert max(f * forward + b * backward for f, b in counted) == max(
                f * forward + b * backward for f, b in seen
            ), f"stage {program.stage}, sizes {forward}:{backward}"
