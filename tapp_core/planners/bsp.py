"""BSP: synchronous data parallelism, one stage holding the whole model replicated on every device.

Every replica takes an equal share of the batch, so the slowest device sets the pace. When the device count
does not divide the batch, the slowest devices (by ``stage_costs.relative_speeds``) are left out until it does (the
plan's notes say which).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import Plan, PlanError, single_stage_plan
from tapp_core.planners.base import PlannerBase, ProgressCallback, no_plan_fits
from tapp_core.planners.stage_costs import relative_speeds


@dataclass
class BspPlanner(PlannerBase):
    name = "bsp"

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        batch = self.resolved_batch_size(library)
        speeds = relative_speeds(context)
        ranked = sorted(cluster.device_names, key=lambda d: -speeds[d])
        problems: list[PlanError] = []
        for k in range(len(ranked), 0, -1):
            if batch % k:
                continue
            plan = single_stage_plan(library, ranked[:k], batch_size=batch)
            try:
                validate(plan, context)
            except PlanError as exc:
                problems.append(exc)
                continue
            left_out = ranked[k:]
            return dataclasses.replace(plan, notes={"left_out": left_out}) if left_out else plan
        raise no_plan_fits(problems, f"no data-parallel plan fits cluster {cluster.name!r}")
