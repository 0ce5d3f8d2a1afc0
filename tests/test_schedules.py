"""Schedule parity: the order in which the cost model runs each stage's operations is the runtime's order.

The runtime's engine runs ``schedule.actions(...)`` in list order. The cost model's order is read from what it
did, an ``estimate``'s timeline, not from the list it was given. Both are held against ``reference_order``, the
schedules as their docstrings state them, written here independently: a change to either side's order fails.
"""

from __future__ import annotations

import itertools

import pytest

from tapp_core.costmodel import Estimate, estimate
from tapp_core.plan import Plan
from tapp_core.schedules import SCHEDULES, Action, ActionKind, schedule_for
from tests.factories import library_from_edges, make_cluster

SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 4), (4, 2), (4, 8), (5, 3)]
"""(stages, micro-batches): fewer, as many and more micro-batches than stages."""


def reference_order(schedule: str, stage: int, n_stages: int, micro_batches: int, steps: int) -> list[Action]:
    """gpipe: every forward, then every backward from the last. 1f1b: ``min(S - s, M)`` forwards, then a
    backward and a forward in turn, then the remaining backwards. async: 1f1b over all steps' micro-batches with
    no flush, each step's update right after the backward of its last micro-batch."""
    m = micro_batches
    order: list[Action] = []
    if schedule == "async":
        total = m * steps
        warmup = min(n_stages - stage, total)
        plain: list[tuple[ActionKind, int]] = [("forward", j) for j in range(warmup)]
        for j in range(total - warmup):
            plain += [("backward", j), ("forward", warmup + j)]
        plain += [("backward", j) for j in range(total - warmup, total)]
        for kind, j in plain:
            order.append(Action(kind, j))
            if kind == "backward" and j % m == m - 1:
                order.append(Action("update", j // m))
        return order
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


def pipeline(schedule: str, n_stages: int, micro_batches: int, replicated: bool = False) -> tuple[Plan, Estimate]:
    """A chain of two layers per stage on devices of unequal speed, with a skip edge over the middle stages
    (timings that differ by stage, so an order that only holds for uniform timings would show)."""
    n_layers = 2 * n_stages
    edges = [(i, i + 1) for i in range(n_layers - 1)] + ([(0, n_layers - 1)] if n_layers > 2 else [])
    forward = [0.5 + 0.25 * (i % 3) for i in range(n_layers)]
    library = library_from_edges(n_layers, edges, forward_s=forward, batch_size=2 * micro_batches)
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
    )
    return plan, estimate(plan, library, cluster)


def simulated_order(result: Estimate, device: str, micro_batches: int) -> list[Action]:
    """The forwards, backwards and updates the cost model ran on ``device``, in the order it ran them."""
    ops = sorted((op for op in result.timeline if op.device == device), key=lambda op: (op.start, op.end))
    order = []
    for op in ops:
        if op.kind == "forward":
            order.append(Action("forward", op.iteration * micro_batches + op.micro_batch))
        elif op.kind == "backward":
            order.append(Action("backward", op.iteration * micro_batches + op.micro_batch))
        elif op.kind == "update":
            order.append(Action("update", op.iteration))
    return order


@pytest.mark.parametrize(("n_stages", "micro_batches"), SHAPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cost_model_runs_the_runtimes_order(schedule: str, n_stages: int, micro_batches: int) -> None:
    plan, result = pipeline(schedule, n_stages, micro_batches)
    runtime = schedule_for(schedule)
    for stage, (device,) in enumerate(plan.stage_devices):
        simulated = simulated_order(result, device, micro_batches)
        steps = 1 + max(a.index for a in simulated if a.kind == "update")
        assert steps == 1 or schedule == "async"
        expected = reference_order(schedule, stage, n_stages, micro_batches, steps)
        assert runtime.actions(stage, n_stages, micro_batches, steps) == expected, f"runtime, stage {stage}"
        assert simulated == expected, f"cost model, stage {stage}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_replica_of_a_stage_runs_the_stages_order(schedule: str) -> None:
    plan, result = pipeline(schedule, 3, 4, replicated=True)
    first, second = plan.stage_devices[0]
    assert simulated_order(result, first, 4) == simulated_order(result, second, 4)
    assert [op.kind for op in result.timeline if op.device == first].count("allreduce") >= 1


@pytest.mark.parametrize(("n_stages", "micro_batches"), SHAPES)
@pytest.mark.parametrize("name", SCHEDULES)
def test_memory_and_bound_terms_follow_from_the_order(name: str, n_stages: int, micro_batches: int) -> None:
    """``in_flight`` is the most forwards ahead of their backwards in the program (over enough steps for the
    asynchronous one to reach its steady state); ``round_trip_cover`` counts the backwards between the last
    micro-batch's forward and its backward: none in gpipe, the other cool-down backwards in 1f1b."""
    schedule = schedule_for(name)
    steps = 1 if schedule.synchronous else n_stages + 2
    for stage in range(n_stages):
        actions = schedule.actions(stage, n_stages, micro_batches, steps)
        ahead = itertools.accumulate({"forward": 1, "backward": -1, "update": 0}[a.kind] for a in actions)
        assert schedule.in_flight(stage, n_stages, micro_batches) == max(ahead)
        assert schedule.weight_versions(stage, n_stages, micro_batches) == (
            schedule.in_flight(stage, n_stages, micro_batches) if schedule.stashes_weights else 0
        )
        one_step = schedule.actions(stage, n_stages, micro_batches, 1)
        last = micro_batches - 1
        between = one_step[one_step.index(Action("forward", last)) + 1 : one_step.index(Action("backward", last))]
        assert schedule.round_trip_cover(stage, n_stages, micro_batches) == len(between)
        assert len(between) == (0 if name == "gpipe" else min(n_stages - stage, micro_batches) - 1)
