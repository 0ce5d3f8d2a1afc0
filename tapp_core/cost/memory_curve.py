"""Each device's estimated memory over the simulated step: the memory model's terms (``plan.device_memory_terms``)
laid on the cost model's timeline, for the Gantt figure's memory panel (``Estimate.memory_over_time``).

A device holds its training state, stashed weights, gradient buckets, posted receives and the runtime's own all
along; each micro-batch's activations (the activations term over the schedule's micro-batches in flight) from the
end of its forward to the end of its backward; and the backward's working memory and gradient transient while a
backward runs. The model trace, a transient before the stage is built, is not in the step: the curve's highest point
is the peak less it, at most the estimated peak.
"""

from __future__ import annotations

from collections.abc import Iterable

from tapp_core.cost.estimate import MemoryCurve, TimelineOp
from tapp_core.plan.plan import Plan, StageShares, stage_memory_terms
from tapp_core.profile.library import LayerLibrary

PER_MICRO_BATCH = "activations"
DURING_BACKWARD = ("backward working memory", "gradient transient")
OUTSIDE_THE_STEP = ("model trace",)


def memory_curves(
    plan: Plan, library: LayerLibrary, optimizer_state: int, timeline: Iterable[TimelineOp]
) -> dict[str, MemoryCurve]:
    """Per device of ``plan``: (time, bytes in use) at the start and after every change, in time order."""
    shared = StageShares.of(plan, library)
    held: dict[str, float] = {}
    per_micro_batch: dict[str, float] = {}
    working: dict[str, float] = {}
    for stage in range(plan.n_stages):
        in_flight = max(1, plan.pipeline_schedule.in_flight(stage, plan.n_stages, plan.micro_batches))
        for device, terms in stage_memory_terms(plan, library, stage, optimizer_state, shared).items():
            per_micro_batch[device] = terms[PER_MICRO_BATCH] / in_flight
            working[device] = sum(terms[name] for name in DURING_BACKWARD)
            apart = (PER_MICRO_BATCH, *DURING_BACKWARD, *OUTSIDE_THE_STEP)
            held[device] = sum(value for name, value in terms.items() if name not in apart)
    changes: dict[str, list[tuple[float, float]]] = {device: [] for device in held}
    for op in timeline:
        if op.device not in changes:
            continue
        if op.kind == "forward":
            changes[op.device].append((op.end, per_micro_batch[op.device]))
        elif op.kind == "backward":
            changes[op.device].append((op.start, working[op.device]))
            changes[op.device].append((op.end, -working[op.device] - per_micro_batch[op.device]))
    return {device: _curve(held[device], steps) for device, steps in changes.items()}


def _curve(start: float, changes: list[tuple[float, float]]) -> MemoryCurve:
    """The running total from ``start`` after each time's changes (a backward's release before a forward's take at
    the same time)."""
    points = [(0.0, start)]
    total = start
    for time, change in sorted(changes, key=lambda c: (c[0], c[1])):
        total += change
        if points[-1][0] == time:
            points[-1] = (time, total)
        else:
            points.append((time, total))
    return tuple(points)
