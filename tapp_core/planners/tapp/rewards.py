"""Where TAPP's reward comes from: the cost model (simulated) or the runtime's worker pool (measured).

A reward source turns plans into step times in seconds, ``inf`` for a plan that failed (it does not fit in
memory, the runtime raised, timed out or lost a rank): the search turns that into a penalty, never a crash.
Both sources remember what they have seen, so a plan sampled again costs nothing and a resumed search sees
the same values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, runtime_checkable

from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary
from tapp_core.metrics import Measurement
from tapp_core.plan import Plan, PlanError, validate
from tapp_core.planners.evaluation import PlanEvaluator


@dataclass(frozen=True)
class TimedPlan:
    """A plan with its step time in seconds under one reward source."""

    step_time_s: float
    plan: Plan


@runtime_checkable
class RewardSource(Protocol):
    kind: str
    """'simulated' or 'measured'."""

    @property
    def evaluations(self) -> int:
        """Distinct plans evaluated so far."""
        ...

    def step_times(self, plans: Sequence[Plan]) -> list[float]:
        """Step time of every plan in seconds; ``inf`` for a plan that failed."""
        ...

    def state(self) -> Mapping[str, object]:
        """What a checkpoint keeps (plain data: ``torch.save`` writes it, ``load_state`` reads it back)."""
        ...

    def load_state(self, state: Any) -> None:
        """Continue from ``state()``'s value, as read back from a checkpoint."""
        ...


@runtime_checkable
class Measurer(Protocol):
    """Anything that runs a plan and measures it, such as ``tapp_core.runtime.pool.WorkerPool``."""

    def measure(self, plan: Plan) -> Measurement: ...


class SimulatedState(TypedDict):
    cache: dict[str, float]
    evaluations: int
    failures: int
    best_plan: dict[str, object] | None


class MeasuredState(TypedDict):
    measurements: dict[str, dict[str, object]]


class SimulatedReward:
    kind = "simulated"

    def __init__(self, evaluator: PlanEvaluator) -> None:
        self.evaluator = evaluator

    @property
    def evaluations(self) -> int:
        return self.evaluator.evaluations

    def step_times(self, plans: Sequence[Plan]) -> list[float]:
        return [self.evaluator.step_time(plan) for plan in plans]

    def state(self) -> SimulatedState:
        best = self.evaluator.best_plan
        return {
            "cache": self.evaluator.export_cache(),
            "evaluations": self.evaluator.evaluations,
            "failures": self.evaluator.failures,
            "best_plan": best.to_dict() if best is not None else None,
        }

    def load_state(self, state: SimulatedState) -> None:
        best = state["best_plan"]
        self.evaluator.restore(
            state["cache"],
            int(state["evaluations"]),
            int(state["failures"]),
            Plan.from_dict(best) if best is not None else None,
        )


class MeasuredReward:
    """Measures plans on a ``Measurer``; a plan that cannot fit (``validate``) is failed without running it."""

    kind = "measured"

    def __init__(self, measurer: Measurer, library: LayerLibrary, cluster: Cluster) -> None:
        self.measurer = measurer
        self.library = library
        self.cluster = cluster
        self.measurements: dict[str, Measurement] = {}

    @property
    def evaluations(self) -> int:
        return len(self.measurements)

    def step_times(self, plans: Sequence[Plan]) -> list[float]:
        return [self._step_time(plan) for plan in plans]

    def _step_time(self, plan: Plan) -> float:
        known = self.measurements.get(plan.id)
        if known is None:
            try:
                validate(plan, self.library, self.cluster)
            except PlanError as exc:
                known = Measurement.failed(plan.id, str(exc), self.cluster.emulated)
            else:
                known = self.measurer.measure(plan)
            self.measurements[plan.id] = known
        if not known.ok or not math.isfinite(known.step_time_s):
            return math.inf
        return known.step_time_s

    def state(self) -> MeasuredState:
        return {"measurements": {key: m.to_dict() for key, m in self.measurements.items()}}

    def load_state(self, state: MeasuredState) -> None:
        self.measurements = {key: Measurement.from_dict(m) for key, m in state["measurements"].items()}
