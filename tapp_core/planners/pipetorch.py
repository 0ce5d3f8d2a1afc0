"""Pipe-Torch: dynamic programming over contiguous partitions, aware of device speed and link bandwidth.

For an ordered sequence of devices (one stage each), the DP finds the cut positions minimising the pipeline's
bottleneck per sample: the largest of every stage's compute time on its device and every cut's transfer time
over the link between consecutive devices (a stage's compute from its device's own kind's library,
``DeviceCosts``; a transfer's bytes staged through host memory where a GPU sends or receives them). Orders are enumerated as a prefix tree (every DP step extends the
one of its prefix), trying one device per class of interchangeable devices at every level, so every subset
and order of devices is covered exactly once. Layer times are costed at the micro-batch size, so the DP runs
once per micro-batch choice; the best partitions of each are built and the cost model picks the fastest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import PlannerBase, ProgressCallback
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.space import contiguous_plan
from tapp_core.planners.stage_costs import DeviceCosts, device_classes
from tapp_core.platform.cluster import Cluster


@dataclass(frozen=True)
class _Partition:
    bottleneck: float
    devices: tuple[str, ...]
    cuts: tuple[int, ...]


class _OrderTree:
    """Depth-first enumeration of device orders with one DP step per tree node."""

    def __init__(self, costs: DeviceCosts, samples: int, cluster: Cluster, planner: PipeTorchPlanner) -> None:
        self.costs = costs
        self.samples = samples
        self.cluster = cluster
        self.classes = device_classes(cluster)
        self.calibration = costs.context.calibration
        reference = costs.layer_costs(cluster.device_names[0], samples)
        n = reference.n_layers
        self.earlier = np.tril(np.ones((n + 1, n + 1), dtype=bool), k=-1)
        self.cut_bytes = reference.cut_bytes
        self.n = n
        self.columns = np.arange(n + 1)
        self.stage_work: dict[int, np.ndarray] = {}
        self.stage_times: dict[tuple[int, float], np.ndarray] = {}
        self.found: list[_Partition] = []

    def run(self) -> list[_Partition]:
        for first in self._candidates(()):
            self._extend((first,), self._stage_time(first)[:, 0], [])
        return self.found

    def _candidates(self, used: tuple[str, ...]) -> list[str]:
        """One unused device per class (the first unused one)."""
        return [next(d for d in group if d not in used) for group in self.classes if any(d not in used for d in group)]

    def _extend(self, order: tuple[str, ...], best: np.ndarray, choices: list[np.ndarray]) -> None:
        if np.isfinite(best[self.n]):
            self.found.append(_Partition(float(best[self.n]), order, self._cuts(choices)))
        if len(order) >= self.n:
            return
        previous = order[-1]
        for device in self._candidates(order):
            link = self.cluster.link(previous, device)
            transfer = self.cut_bytes / (link.bandwidth * self.calibration.bandwidth_scale)
            staging = self.costs.staging_per_byte(previous, device)
            if staging:
                transfer = transfer + self.cut_bytes * staging
            candidates = np.maximum(self._stage_time(device), np.maximum(best, transfer)[None, :])
            argmin = np.argmin(candidates, axis=1)
            self._extend((*order, device), candidates[self.columns, argmin], [*choices, argmin])

    def _stage_time(self, device: str) -> np.ndarray:
        library = id(self.costs.terms[device].library)
        key = (library, self.costs.factor(device))
        if key not in self.stage_times:
            if library not in self.stage_work:
                # stage_work[j, i]: work per sample of layers [i, j) in the device's library; inf where the stage
                # would be empty. Rows are the stage ends, so the DP's minimum over stage starts runs along
                # contiguous memory.
                work = self.costs.layer_costs(device, self.samples).work_prefix
                self.stage_work[library] = np.where(self.earlier, work[:, None] - work[None, :], np.inf)
            self.stage_times[key] = self.stage_work[library] * key[1]
        return self.stage_times[key]

    def _cuts(self, choices: list[np.ndarray]) -> tuple[int, ...]:
        cuts = []
        j = self.n
        for argmin in reversed(choices):
            j = int(argmin[j])
            cuts.append(j)
        return tuple(sorted(cuts))


@dataclass
class PipeTorchPlanner(PlannerBase):
    name = "pipetorch"

    candidates: int = 3
    """How many of the best DP partitions of each micro-batch choice are costed."""

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        evaluator = PlanEvaluator(context)
        costs = DeviceCosts(context)
        batch = self.resolved_batch_size(library)
        orders = 0
        # Layer times depend on the micro-batch size (fixed costs per call), so each choice gets its own DP.
        for m in self.micro_batch_choices(library):
            partitions = sorted(_OrderTree(costs, batch // m, cluster, self).run(), key=lambda p: p.bottleneck)
            orders = max(orders, len(partitions))
            for tried, partition in enumerate(partitions):
                if tried >= self.candidates and evaluator.best_plan is not None:
                    break
                devices = [[d] for d in partition.devices]
                evaluator.step_time(contiguous_plan(library, partition.cuts, devices, m, self.schedule_spec, batch))
        if evaluator.best_plan is None:
            raise evaluator.no_plan(
                f"Pipe-Torch found no partition of {library.model} that fits cluster {cluster.name!r}"
            )
        notes: dict[str, object] = {"evaluations": evaluator.evaluations, "orders": orders}
        return dataclasses.replace(evaluator.best_plan, notes=notes)
