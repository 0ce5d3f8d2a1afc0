"""AutoDDL-style search: coordinate descent over the cost model (seed 002).

AutoDDL pairs an analytical performance model with a customised coordinate descent over parallelisation
schemes. Here the model is ``tapp_core.costmodel`` and the scheme is a contiguous pipeline plan, whose
coordinates are: every stage boundary (any position between its neighbours), the device group of every stage
(swap two stages' groups, or exchange one device for another), replication (add a left-over device to a
stage, or drop a replica), the number of stages (merge two neighbours, or split a stage onto a left-over
device), and the micro-batch count. Each coordinate in turn is set to its best value with the others held;
sweeps repeat until one changes nothing (or the budget runs out). The start is a split balanced to the
devices' relative speeds (``costs.relative_speeds``: their kinds' libraries and speeds), fastest device first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary
from tapp_core.plan import Plan
from tapp_core.planners.base import PlannerBase, PlannerError, ProgressCallback, SearchProgress
from tapp_core.planners.costs import relative_speeds
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


@dataclass(frozen=True)
class _Point:
    cuts: tuple[int, ...]
    groups: Groups
    micro_batches: int


class _Descent:
    def __init__(self, planner: AutoDdlPlanner, library: LayerLibrary, evaluator: PlanEvaluator, batch: int) -> None:
        self.library = library
        self.evaluator = evaluator
        self.schedule = planner.schedule_spec
        self.batch = batch
        self.choices = planner.micro_batch_choices(library)
        self.devices = evaluator.cluster.device_names
        self.n = len(library.layers)

    def plan(self, point: _Point) -> Plan:
        return contiguous_plan(self.library, point.cuts, point.groups, point.micro_batches, self.schedule, self.batch)

    def cost(self, point: _Point) -> float:
        return self.evaluator.step_time(self.plan(point))

    def best_of(self, current: _Point, candidates: Iterator[_Point]) -> _Point:
        best, best_cost = current, self.cost(current)
        for candidate in candidates:
            if self.evaluator.exhausted:
                break
            cost = self.cost(candidate)
            if cost < best_cost:
                best, best_cost = candidate, cost
        return best

    def coordinates(self, point: _Point) -> list[Iterator[_Point]]:
        """One generator of alternatives per coordinate (built lazily, so each sees the point it starts from)."""
        out = [self._micro_batches(point)]
        out += [self._boundary(point, j) for j in range(len(point.cuts))]
        out += [self._regroup(point), self._replicate(point), self._restage(point)]
        return out

    def _micro_batches(self, p: _Point) -> Iterator[_Point]:
        for m in self.choices:
            yield dataclasses.replace(p, micro_batches=m)

    def _boundary(self, p: _Point, j: int) -> Iterator[_Point]:
        for position in boundary_positions(p.cuts, j, self.n):
            yield dataclasses.replace(p, cuts=moved_cut(p.cuts, j, position))

    def _regroup(self, p: _Point) -> Iterator[_Point]:
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

    def _replicate(self, p: _Point) -> Iterator[_Point]:
        """A left-over device added to a stage; a replica dropped."""
        for d in unused_devices(p.groups, self.devices):
            for s in range(len(p.groups)):
                yield dataclasses.replace(p, groups=with_group(p.groups, s, (*p.groups[s], d)))
        for s, group in enumerate(p.groups):
            if len(group) > 1:
                for d in group:
                    yield dataclasses.replace(p, groups=with_group(p.groups, s, tuple(x for x in group if x != d)))

    def _restage(self, p: _Point) -> Iterator[_Point]:
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
class AutoDdlPlanner(PlannerBase):
    name = "autoddl"

    max_sweeps: int = 50

    def _plan(
        self, library: LayerLibrary, cluster: Cluster, budget: int | None, progress: ProgressCallback | None
    ) -> Plan:
        started = time.perf_counter()
        batch = self.resolved_batch_size(library)
        evaluator = PlanEvaluator(library, cluster, self.calibration, budget=budget)
        descent = _Descent(self, library, evaluator, batch)
        point = self._start(library, cluster, descent)
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
        if evaluator.best_plan is None:
            raise PlannerError(f"AutoDDL found no plan of {library.model} that fits cluster {cluster.name!r}")
        notes: dict[str, object] = {"evaluations": evaluator.evaluations, "sweeps": sweeps}
        return dataclasses.replace(evaluator.best_plan, notes=notes)

    def _start(self, library: LayerLibrary, cluster: Cluster, descent: _Descent) -> _Point:
        speeds = relative_speeds(library, cluster)
        ranked = sorted(cluster.device_names, key=lambda d: -speeds[d])[: len(library.layers)]
        weights = [layer.forward_s + layer.backward_s for layer in library.layers]
        cuts = tuple(balanced_cuts(weights, [speeds[d] for d in ranked]))
        start = _Point(cuts, tuple((d,) for d in ranked), descent.choices[0])
        return descent.best_of(start, descent._micro_batches(start))
