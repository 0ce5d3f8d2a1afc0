"""Pipeline coordinate descent ("Pipeline CD"): AutoDDL's search (seed 002) restricted to pipelines of data-parallel
stages.

AutoDDL pairs an analytical performance model with a customised coordinate descent over parallelisation
schemes. Here the model is ``tapp_core.cost.simulation`` and the scheme is a contiguous pipeline plan of data-parallel
stages (``tapp_core.planners.autoddl`` adds operator parallelism: split layers), whose coordinates are: every stage boundary (any position between its neighbours), the device group of every stage
(swap two stages' groups, or exchange one device for another), replication (add a left-over device to a
stage, or drop a replica), the number of stages (merge two neighbours, or split a stage onto a left-over
device), and the micro-batch count. Each coordinate in turn is set to its best value with the others held;
sweeps repeat until one changes nothing (or the budget runs out). The start is a split balanced to the
devices' relative speeds (``stage_costs.relative_speeds``: their kinds' libraries and speeds), fastest device first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import PlannerBase, ProgressCallback, SearchProgress
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.moves import (
    Groups,
    boundary_positions,
    moved_cut,
    swapped_groups,
    unused_devices,
    with_group,
)
from tapp_core.planners.space import balanced_cuts, contiguous_plan
from tapp_core.planners.stage_costs import relative_speeds
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class Point:
    cuts: tuple[int, ...]
    groups: Groups
    micro_batches: int


class Descent:
    """The coordinate descent over contiguous pipeline plans (``Point``s) on one evaluator."""

    def __init__(self, planner: PlannerBase, library: LayerLibrary, evaluator: PlanEvaluator, batch: int) -> None:
        self.library = library
        self.evaluator = evaluator
        self.schedule = planner.schedule_spec
        self.batch = batch
        self.choices = planner.micro_batch_choices(library)
        self.devices = evaluator.context.cluster.device_names
        self.n = len(library.layers)

    def point(self, cuts: tuple[int, ...], groups: Groups, micro_batches: int) -> Point:
        return Point(cuts, groups, micro_batches)

    def plan(self, point: Point) -> Plan:
        return contiguous_plan(self.library, point.cuts, point.groups, point.micro_batches, self.schedule, self.batch)

    def cost(self, point: Point) -> float:
        return self.evaluator.step_time(self.plan(point))

    def best_of(self, current: Point, candidates: Iterator[Point]) -> Point:
        best, best_cost = current, self.cost(current)
        for candidate in candidates:
            if self.evaluator.exhausted:
                break
            cost = self.cost(candidate)
            if cost < best_cost:
                best, best_cost = candidate, cost
        return best

    def coordinates(self, point: Point) -> list[Iterator[Point]]:
        """One generator of alternatives per coordinate (built lazily, so each sees the point it starts from)."""
        out = [self._micro_batches(point)]
        out += [self._boundary(point, j) for j in range(len(point.cuts))]
        out += [self._regroup(point), self._replicate(point), self._restage(point)]
        return out

    def _micro_batches(self, p: Point) -> Iterator[Point]:
        for m in self.choices:
            yield dataclasses.replace(p, micro_batches=m)

    def _boundary(self, p: Point, j: int) -> Iterator[Point]:
        for position in boundary_positions(p.cuts, j, self.n):
            yield dataclasses.replace(p, cuts=moved_cut(p.cuts, j, position))

    def _regroup(self, p: Point) -> Iterator[Point]:
        """Two stages' groups swapped; one device of a group exchanged for another (with the stage that has it)."""
        for swapped in swapped_groups(p.groups):
            yield dataclasses.replace(p, groups=swapped)
        groups = p.groups
        used = {d for g in groups for d in g}
        for s, group in enumerate(groups):
            for i, old in enumerate(group):
                for new in self.devices:
                    if new in group:
                        continue
                    changed = [list(g) for g in groups]
                    changed[s][i] = new
                    if new in used:  # exchange with the stage that has it
                        t = next(k for k, g in enumerate(groups) if new in g)
                        changed[t][groups[t].index(new)] = old
                    yield dataclasses.replace(p, groups=tuple(tuple(g) for g in changed))

    def _replicate(self, p: Point) -> Iterator[Point]:
        """A left-over device added to a stage; a replica dropped."""
        for d in unused_devices(p.groups, self.devices):
            for s in range(len(p.groups)):
                yield dataclasses.replace(p, groups=with_group(p.groups, s, (*p.groups[s], d)))
        for s, group in enumerate(p.groups):
            if len(group) > 1:
                for d in group:
                    yield dataclasses.replace(p, groups=with_group(p.groups, s, tuple(x for x in group if x != d)))

    def _restage(self, p: Point) -> Iterator[Point]:
        bounds = [0, *p.cuts, self.n]
        for j in range(len(p.cuts)):  # merge stages j and j + 1, keeping either group
            cuts = p.cuts[:j] + p.cuts[j + 1 :]
            for keep in (p.groups[j], p.groups[j + 1]):
                yield dataclasses.replace(p, cuts=cuts, groups=(*p.groups[:j], keep, *p.groups[j + 2 :]))
        spare = unused_devices(p.groups, self.devices)
        weights = [layer.forward_s + layer.backward_s for layer in self.library.layers]
        for s in range(len(p.groups)):  # split stage s at its work midpoint onto a left-over device
            start, stop = bounds[s], bounds[s + 1]
            if stop - start < 2:
                continue
            middle = start + balanced_cuts(weights[start:stop], [1.0, 1.0])[0]
            for d in spare:
                cuts = (*p.cuts[:s], middle, *p.cuts[s:])
                groups = (*p.groups[: s + 1], (d,), *p.groups[s + 1 :])
                yield dataclasses.replace(p, cuts=cuts, groups=groups)


@dataclass
class PipelineCdPlanner(PlannerBase):
    name = "pipeline-cd"

    max_sweeps: int = 50

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library = context.library
        evaluator = PlanEvaluator(context, budget=budget)
        descent = Descent(self, library, evaluator, self.resolved_batch_size(library))
        _, sweeps = self.descend(descent, self._start(context, descent), progress)
        return self.found(evaluator, {"sweeps": sweeps})

    def descend(self, descent: Descent, point: Point, progress: ProgressCallback | None) -> tuple[Point, int]:
        """Sweep every coordinate in turn from ``point`` until a sweep changes nothing (or ``max_sweeps``, or the
        budget); the point reached and the sweeps made."""
        started = time.perf_counter()
        evaluator = descent.evaluator
        sweeps = 0
        for sweeps in range(1, self.max_sweeps + 1):
            before = point
            for coordinate in range(len(descent.coordinates(point))):
                options = descent.coordinates(point)
                if coordinate < len(options):
                    point = descent.best_of(point, options[coordinate])
            if progress:
                elapsed = time.perf_counter() - started
                progress(SearchProgress(self.name, sweeps, None, evaluator.evaluations, evaluator.best_time, elapsed))
            if point == before or evaluator.exhausted:
                break
        return point, sweeps

    def found(self, evaluator: PlanEvaluator, notes: dict[str, object]) -> Plan:
        """The best plan the search estimated, with its notes."""
        if evaluator.best_plan is None:
            context = evaluator.context
            raise evaluator.no_plan(
                f"{self.name} found no plan of {context.library.model} that fits cluster {context.cluster.name!r}"
            )
        return dataclasses.replace(evaluator.best_plan, notes={"evaluations": evaluator.evaluations, **notes})

    def _start(self, context: CostContext, descent: Descent) -> Point:
        library, cluster = context.library, context.cluster
        speeds = relative_speeds(context)
        ranked = sorted(cluster.device_names, key=lambda d: -speeds[d])[: len(library.layers)]
        weights = [layer.forward_s + layer.backward_s for layer in library.layers]
        cuts = tuple(balanced_cuts(weights, [speeds[d] for d in ranked]))
        start = descent.point(cuts, tuple((d,) for d in ranked), descent.choices[0])
        return descent.best_of(start, descent._micro_batches(start))
