"""PipeDream / APapo: dynamic programming over the antichain DAG, with data-parallel replication of stages.

States are the graph's down-sets (``antichain.down_sets``). For a fixed order of devices, ``A[t][S]`` is the
smallest bottleneck (seconds per step) of a pipeline that covers down-set ``S`` with the first ``t`` devices;
the last stage is ``S - S'`` for some smaller down-set ``S'`` and runs on devices ``t'..t-1`` as replicas,
costing its compute on the slowest replica for its share of the batch (each replica's from its own kind's
library, ``DeviceCosts``) plus the allreduce of its gradients,
and the cut after ``S'`` costs its activation transfer over the link that feeds the stage (APapo's matching of
model tasks to computing resources). Device orders keep interchangeable devices together, so a replicated
stage takes devices of one kind; every order of the classes is tried. The best partitions are built with every
micro-batch choice and the cost model picks the fastest.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.context import CostContext
from tapp_core.cost.formulas import allreduce_s
from tapp_core.plan.plan import Plan
from tapp_core.plan.schedules import parse_schedule_spec
from tapp_core.planners.antichain import DownSets, down_sets
from tapp_core.planners.base import PlannerBase, ProgressCallback
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.stage_costs import DeviceCosts, device_classes
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class _Solution:
    bottleneck: float
    stages: tuple[tuple[int, tuple[str, ...]], ...]
    """(down-set ending the stage, its devices), in pipeline order."""


class _OrderDP:
    def __init__(
        self,
        states: DownSets,
        costs: DeviceCosts,
        order: tuple[str, ...],
        planner: PipeDreamPlanner,
        batch: int,
        replicas: set[int],
    ) -> None:
        self.states = states
        self.costs = costs
        self.cluster = costs.context.cluster
        self.order = order
        self.calibration = costs.context.calibration
        self.batch = batch
        self.replicas = replicas
        self._work: dict[int, np.ndarray] = {}

    def solve(self) -> list[_Solution]:
        n_states = len(self.states)
        d = len(self.order)
        best = np.full((d + 1, n_states), np.inf)
        best[0, 0] = 0.0
        previous_t = np.zeros((d + 1, n_states), dtype=np.int64)
        previous_s = np.zeros((d + 1, n_states), dtype=np.int64)
        stage_params = self.states.params[None, :] - self.states.params[:, None]
        not_subset = ~self.states.strict_subset
        for t in range(1, d + 1):
            for first in range(t):
                run = self.order[first:t]
                if len(run) not in self.replicas or not np.isfinite(best[first]).any():
                    continue
                stage = self._stage_compute(run)
                if len(run) > 1:
                    stage = stage + self._allreduce(run, stage_params)
                inbound = self._inbound(first)
                candidates = np.maximum(np.maximum(best[first], inbound)[:, None], stage)
                candidates[not_subset] = np.inf
                argmin = np.argmin(candidates, axis=0)
                values = candidates[argmin, np.arange(n_states)]
                better = values < best[t]
                best[t][better] = values[better]
                previous_t[t][better] = first
                previous_s[t][better] = argmin[better]
        solutions = []
        full = n_states - 1
        for t in range(1, d + 1):
            if np.isfinite(best[t, full]):
                solutions.append(_Solution(float(best[t, full]), self._backtrack(t, full, previous_t, previous_s)))
        return solutions

    def _stage_compute(self, run: tuple[str, ...]) -> np.ndarray:
        """``[S', S]``: the compute of stage ``S - S'`` (for any pair of down-sets; the caller masks those that are
        not nested) on the replicas ``run``: its slowest replica's, each costed from its own library."""
        parts = [
            self._stage_work(group[0]) * (self.batch / len(run) * max(self.costs.factor(name) for name in group))
            for group in self.costs.by_library(run).values()
        ]
        stage: np.ndarray = functools.reduce(np.maximum, parts)
        return stage

    def _stage_work(self, device: str) -> np.ndarray:
        library = id(self.costs.terms[device].library)
        found = self._work.get(library)
        if found is None:
            if self.costs.terms[device].library is self.costs.context.library:
                work = self.states.work
            else:
                work = self.states.work_in(self.costs.layer_costs(device))
            found = self._work[library] = work[None, :] - work[:, None]
        return found

    def _allreduce(self, run: tuple[str, ...], stage_params: np.ndarray) -> np.ndarray:
        fixed = allreduce_s(self.cluster, run, 0.0, self.calibration, self.costs.terms)
        per_byte = allreduce_s(self.cluster, run, 1.0, self.calibration, self.costs.terms) - fixed
        return fixed + per_byte * stage_params

    def _inbound(self, first: int) -> np.ndarray:
        """Per state: time to send the cut after it into the stage starting at device ``first``."""
        if first == 0:
            return np.zeros(len(self.states))
        sender, receiver = self.order[first - 1], self.order[first]
        bandwidth = self.cluster.link(sender, receiver).bandwidth * self.calibration.bandwidth_scale
        inbound: np.ndarray = self.states.out_bytes * self.batch / bandwidth
        staging = self.costs.staging_per_byte(sender, receiver)
        return inbound + self.states.out_bytes * self.batch * staging if staging else inbound

    def _backtrack(
        self, t: int, state: int, previous_t: np.ndarray, previous_s: np.ndarray
    ) -> tuple[tuple[int, tuple[str, ...]], ...]:
        stages = []
        while t > 0:
            first, before = int(previous_t[t, state]), int(previous_s[t, state])
            stages.append((state, self.order[first:t]))
            t, state = first, before
        return tuple(reversed(stages))


def class_orders(cluster: Cluster, limit: int = 120) -> list[tuple[str, ...]]:
    """Device orders that keep each class of interchangeable devices together, one per order of the classes."""
    classes = device_classes(cluster)
    orders = []
    for permutation in itertools.islice(itertools.permutations(classes), limit):
        orders.append(tuple(name for group in permutation for name in group))
    return orders


@dataclass
class PipeDreamPlanner(PlannerBase):
    name = "pipedream"

    schedule: str = "async"
    """PipeDream and APapo run their pipelines asynchronously, with weight stashing."""

    candidates: int = 3
    """How many of the best DP partitions are costed with every micro-batch choice."""
    max_down_sets_per_block: int = 512

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        states = down_sets(library, self.max_down_sets_per_block)
        batch = self.resolved_batch_size(library)
        choices = self.micro_batch_choices(library)
        replicas = {r for r in range(1, len(cluster.devices) + 1) if any((batch // m) % r == 0 for m in choices)}
        costs = DeviceCosts(context)
        solutions = []
        for order in class_orders(cluster):
            solutions += _OrderDP(states, costs, order, self, batch, replicas).solve()
        solutions.sort(key=lambda s: s.bottleneck)
        evaluator = PlanEvaluator(context)
        tried: set[tuple[tuple[int, tuple[str, ...]], ...]] = set()
        for solution in solutions:
            if len(tried) >= self.candidates and evaluator.best_plan is not None:
                break
            if solution.stages in tried:
                continue
            tried.add(solution.stages)
            for m in choices:
                evaluator.step_time(_plan_from(solution, states, library, batch, m, self.schedule_spec))
        if evaluator.best_plan is None:
            raise evaluator.no_plan(
                f"PipeDream found no partition of {library.model} that fits cluster {cluster.name!r}"
            )
        notes = {
            "evaluations": evaluator.evaluations,
            "down_sets": len(states),
            "whole_blocks": list(states.whole_blocks),
        }
        return dataclasses.replace(evaluator.best_plan, notes=notes)


def _plan_from(
    solution: _Solution, states: DownSets, library: LayerLibrary, batch: int, micro_batches: int, schedule: str
) -> Plan:
    stage_of_layer = np.zeros(len(library.layers), dtype=np.int64)
    for k, (state, _) in enumerate(solution.stages[:-1]):
        stage_of_layer[~states.members[state]] = k + 1
    name, staleness = parse_schedule_spec(schedule)
    return Plan(
        model=library.model,
        batch_size=batch,
        micro_batches=micro_batches,
        schedule=name,
        staleness=staleness,
        stage_of_layer=tuple(int(s) for s in stage_of_layer),
        stage_devices=tuple(devices for _, devices in solution.stages),
    )
