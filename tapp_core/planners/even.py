"""Even split (GPipe / torchgpipe ``balance_by_time``): one stage per device, layers balanced by time or count.

The split is unaware of device speed, kind and links: stage ``s`` goes to the ``s``-th device in cluster order
and the layers are cut into contiguous ranges minimising the largest range's weight (the optimal linear
partition that torchgpipe's ``blockpartition`` solves), their times taken from the library it is given (its own
kind, as torchgpipe's ``balance_by_time`` times one device). The micro-batch count is the cost model's pick
among the choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.errors import TappError
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import PlannerBase, PlannerError, ProgressCallback
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.space import contiguous_plan


def min_max_partition(weights: Sequence[float], parts: int) -> list[int]:
    """Cut positions splitting ``weights`` into ``parts`` non-empty contiguous ranges with the smallest maximum sum."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} non-empty ranges")
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    # best[k][j]: smallest max range sum splitting the first j layers into k ranges; choice[k][j]: last cut.
    best = np.full((parts + 1, n + 1), np.inf)
    choice = np.zeros((parts + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            starts = np.arange(k - 1, j)
            candidates = np.maximum(best[k - 1][starts], prefix[j] - prefix[starts])
            i = int(np.argmin(candidates))
            best[k][j], choice[k][j] = candidates[i], starts[i]
    cuts = []
    j = n
    for k in range(parts, 1, -1):
        j = int(choice[k][j])
        cuts.append(j)
    return sorted(cuts)


@dataclass
class EvenPlanner(PlannerBase):
    name = "even"

    by: str = "time"
    """'time' (forward + backward time per layer) or 'layers' (layer count)."""
    stages: int | None = None
    """Number of stages (the first devices in cluster order); None: one per device."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.by not in ("time", "layers"):
            raise PlannerError(f"even planner: by must be 'time' or 'layers', got {self.by!r}")
        if self.stages is not None and self.stages <= 0:
            raise PlannerError(f"even planner: stages must be positive, got {self.stages}")

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        n_stages = min(self.stages or len(cluster.devices), len(cluster.devices), len(library.layers))
        if self.by == "time":
            weights = [layer.forward_s + layer.backward_s for layer in library.layers]
        else:
            weights = [1.0] * len(library.layers)
        cuts = min_max_partition(weights, n_stages)
        devices = [[d] for d in cluster.device_names[:n_stages]]
        evaluator = PlanEvaluator(context)
        candidates = [
            contiguous_plan(library, cuts, devices, m, self.schedule_spec, self.resolved_batch_size(library))
            for m in self.micro_batch_choices(library)
        ]
        plan, step_time = evaluator.best(candidates)
        if step_time == float("inf"):
            raise PlannerError(
                f"the even split of {library.model} over {n_stages} devices of {cluster.name!r} cannot run: "
                f"{_refusal(candidates[0], context)}"
            )
        return dataclasses.replace(plan, notes={"evaluations": evaluator.evaluations, "by": self.by})


def _refusal(plan: Plan, context: CostContext) -> str:
    """Why ``plan`` cannot run (``validate``'s reason: the runtime's rule, the devices or the memory)."""
    try:
        validate(plan, context)
    except TappError as exc:
        return str(exc)
    return "no micro-batch count fits"
