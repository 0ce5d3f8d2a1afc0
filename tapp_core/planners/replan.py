"""Planning again in the middle of a training (``runtime.elastic``): on the devices that still answer, or with a
device's speed re-estimated from its measured steps, from the cost model alone, in seconds.

The new plan keeps what a checkpoint cannot change: the model, the mini-batch size (the data order counts
batches) and the schedule (synchronous or not, with its staleness bound). It is the fastest by the cost model of

- the running plan warm-started onto the cluster: its cuts kept, each stage's devices those of its group still in
  the cluster (with their shares scaled to sum to one); no candidate when a stage lost every device;
- the running plan's planner's kind of search from scratch: TAPP's, with its own warm start (each device alone,
  BSP, the even split, PipeDream, AutoDDL) and a short time limit (``REPLAN_TIME_LIMIT_S``).

A candidate that does not fit (memory, devices, shapes: ``cost.checks.validate``) is dropped; when none fits,
``PlannerError`` says so in one line.
"""

from __future__ import annotations

import dataclasses

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.errors import TappError
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import PlannerError, get_planner

REPLAN_TIME_LIMIT_S = 10.0
"""TAPP's search time when planning again: the warm start and a few dozen rounds of the cost model."""
REPLAN_ROUNDS = 40


def carried_over(running: Plan, devices: tuple[str, ...]) -> Plan | None:
    """``running`` with its stages' devices limited to ``devices`` (its cuts kept, each changed stage's shares
    scaled to sum to one); None when a stage keeps no device."""
    keep = set(devices)
    groups: list[tuple[str, ...]] = []
    shares: list[tuple[float, ...]] = []
    for index, group in enumerate(running.stage_devices):
        kept = tuple(d for d in group if d in keep)
        if not kept:
            return None
        groups.append(kept)
        if running.stage_shares:
            own = [s for d, s in zip(group, running.stage_shares[index], strict=True) if d in keep]
            shares.append(tuple(s / sum(own) for s in own))
    if tuple(groups) == running.stage_devices:
        return dataclasses.replace(running, notes={})
    return dataclasses.replace(
        running, stage_devices=tuple(groups), stage_shares=tuple(shares), planner="carried-over", notes={}
    )


def searched(running: Plan, context: CostContext, time_limit_s: float, seed: int) -> Plan | None:
    """TAPP's search on the context's cluster, for ``running``'s batch size and schedule; None if it finds none."""
    try:
        planner = get_planner(
            "tapp",
            batch_size=running.batch_size,
            schedules=(running.schedule,),
            schedule=running.schedule,
            staleness=running.staleness,
            rounds=REPLAN_ROUNDS,
            time_limit_s=time_limit_s,
            seed=seed,
        )
        return planner.plan(context)
    except TappError:
        return None


def replan(
    running: Plan, context: CostContext, time_limit_s: float = REPLAN_TIME_LIMIT_S, seed: int = 0
) -> tuple[Plan, float]:
    """The fastest plan that fits the context's cluster by the cost model (the module's doc) and its estimated step
    time; ``PlannerError`` when none fits."""
    candidates = [carried_over(running, context.cluster.device_names), searched(running, context, time_limit_s, seed)]
    timed: list[tuple[float, Plan]] = []
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            validate(candidate, context)
            timed.append((estimate(candidate, context).step_time_s, candidate))
        except TappError:
            continue
    if not timed:
        names = ", ".join(context.cluster.device_names)
        raise PlannerError(f"no plan of {running.model} (batch {running.batch_size}) fits on {names}")
    step_s, best = min(timed, key=lambda pair: pair[0])
    return best, step_s
