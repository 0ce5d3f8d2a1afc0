"""Single-device training on the fastest device whose memory holds the whole model: of one kind (``single-cpu``,
``single-gpu``, the methods the experiments compare), or of any kind, a GPU first (``single``, the old name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary
from tapp_core.plan import Plan, PlanError, single_stage_plan, validate
from tapp_core.planners.base import PlannerBase, PlannerError, ProgressCallback


@dataclass
class SinglePlanner(PlannerBase):
    name = "single"
    kind: ClassVar[str | None] = None
    """The device kind to choose from (``cpu``, ``cuda``); None: any, a GPU first."""

    def _plan(
        self, library: LayerLibrary, cluster: Cluster, budget: int | None, progress: ProgressCallback | None
    ) -> Plan:
        candidates = [d for d in cluster.devices if self.kind is None or d.kind == self.kind]
        ranked = sorted(candidates, key=lambda d: (d.kind != "cuda", -d.speed, -d.threads))
        problems = []
        for device in ranked:
            plan = single_stage_plan(library, [device.name], batch_size=self.resolved_batch_size(library))
            try:
                validate(plan, library, cluster)
            except PlanError as exc:
                problems.append(str(exc))
                continue
            return plan
        which = f"{self.kind} device" if self.kind else "device"
        reason = "; ".join(problems) or "it has none"
        raise PlannerError(f"no {which} of cluster {cluster.name!r} can train the whole model: {reason}")


@dataclass
class SingleCpuPlanner(SinglePlanner):
    name = "single-cpu"
    kind = "cpu"


@dataclass
class SingleGpuPlanner(SinglePlanner):
    name = "single-gpu"
    kind = "cuda"
