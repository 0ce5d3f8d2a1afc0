"""Single-device training on the fastest device whose memory holds the whole model: of one kind (``single-cpu``,
``single-gpu``, the methods the experiments compare), or of any kind, a GPU first (``single``, the old name).

Fastest: a GPU before a CPU, then by relative speed (``stage_costs.relative_speeds``: the device's kind's library and
its speed), then by threads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import Plan, PlanError, single_stage_plan
from tapp_core.planners.base import PlannerBase, ProgressCallback, no_plan_fits
from tapp_core.planners.stage_costs import relative_speeds


@dataclass
class SinglePlanner(PlannerBase):
    name = "single"
    kind: ClassVar[str | None] = None
    """The device kind to choose from (``cpu``, ``cuda``); None: any, a GPU first."""

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        speeds = relative_speeds(context)
        candidates = [d for d in cluster.devices if self.kind is None or d.kind == self.kind]
        ranked = sorted(candidates, key=lambda d: (d.kind != "cuda", -speeds[d.name], -d.threads))
        problems: list[PlanError] = []
        for device in ranked:
            plan = single_stage_plan(library, [device.name], batch_size=self.resolved_batch_size(library))
            try:
                validate(plan, context)
            except PlanError as exc:
                problems.append(exc)
                continue
            return plan
        which = f"{self.kind} device" if self.kind else "device"
        raise no_plan_fits(problems, f"no {which} of cluster {cluster.name!r} can train the whole model")


@dataclass
class SingleCpuPlanner(SinglePlanner):
    name = "single-cpu"
    kind = "cpu"


@dataclass
class SingleGpuPlanner(SinglePlanner):
    name = "single-gpu"
    kind = "cuda"
