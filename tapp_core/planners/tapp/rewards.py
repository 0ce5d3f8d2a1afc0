"""Where TAPP's reward comes from: the cost model (simulated) or the runtime's worker pool (measured).

A reward source turns plans into step times in seconds, ``inf`` for a plan that failed (it does not fit in
memory, the runtime raised, timed out or lost a rank): the search turns that into a penalty, never a crash.
Both sources remember what they have seen, so a plan sampled again costs nothing and a resumed search sees
the same values.

The measured source races (``tapp_core.measure.races``): the new plans of a call run one interleaved round; a plan
whose step time is near the best measured so far (or better) is raced against that best for more rounds before
the policy learns from it, so that one lucky run does not make a plan the search's best. The final choice of a
search (``TappSearch.finish``) is a race too (``MeasuredReward.race``); in the search's last round, which that race
follows, the new plans are only screened (``MeasuredReward.screen``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, runtime_checkable

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.measure.metrics import Measurement
from tapp_core.measure.races import RaceOptions, RaceResult, own_processes, pooled_rounds, run_race
from tapp_core.plan.plan import Plan, PlanError
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.platform.hosts import ranks_on_host

SCREEN = RaceOptions(min_rounds=1, max_rounds=1)
"""A new plan's first measurement: one round, interleaved with the call's other new plans."""
NEAR_BEST = 0.10
"""A new plan measured within this fraction of the best measured step time (or faster) is confirmed."""
CONFIRM = RaceOptions(min_rounds=3, max_rounds=3)
"""The confirmation: more rounds raced against the best measured plan; both plans' rounds are pooled."""
FINAL = RaceOptions(min_rounds=5, max_rounds=8, budget_s=30.0)
"""The final choice's race among the search's top candidates (no new round after 30 s: the chosen plan is raced
again against every method in an experiment's evaluation, and the tied are told apart by all their rounds)."""


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


class MeasuredState(TypedDict, total=False):
    measurements: dict[str, dict[str, object]]
    plans: dict[str, dict[str, object]]


@runtime_checkable
class Racing(Protocol):
    """A reward source that can race plans against each other (the measured one)."""

    def race(self, plans: Sequence[Plan], options: RaceOptions | None = None) -> RaceResult:
        """Race ``plans`` in interleaved rounds (``options``: the source's final-choice race by default)."""
        ...

    def screen(self, plans: Sequence[Plan]) -> list[float]:
        """``step_times`` without the confirmations: the new plans' one interleaved round, for a search whose final
        race follows (it races the near-best plans again, as a confirmation would)."""
        ...


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
    """Measures plans on a ``Measurer`` in races; a plan that cannot fit (``validate``) is failed without running
    it. Each ``measure`` call of the measurer is one round of one plan."""

    kind = "measured"

    def __init__(
        self,
        measurer: Measurer,
        context: CostContext,
        *,
        near_best: float = NEAR_BEST,
        confirm: RaceOptions = CONFIRM,
        final: RaceOptions = FINAL,
    ) -> None:
        library, cluster = context.library, context.cluster
        self.measurer = measurer
        self.context = context
        self.library = library
        self.cluster = cluster
        self.near_best = near_best
        self.confirm = confirm
        self.final = final
        self.measurements: dict[str, Measurement] = {}
        """Plan id -> its measurement, every round it ran in pooled (``pooled_rounds``)."""
        self.plans: dict[str, Plan] = {}
        self.confirmed: set[str] = set()
        """Plans that were raced against the best for more rounds."""

    @property
    def evaluations(self) -> int:
        return len(self.measurements)

    def step_times(self, plans: Sequence[Plan]) -> list[float]:
        for plan in sorted(self._screened(plans), key=self._step_time):
            self._confirm(plan)
        return [self._step_time(plan) for plan in plans]

    def screen(self, plans: Sequence[Plan]) -> list[float]:
        self._screened(plans)
        return [self._step_time(plan) for plan in plans]

    def _screened(self, plans: Sequence[Plan]) -> list[Plan]:
        """Measure the plans not seen before in one interleaved round (a plan that cannot fit is failed without
        running it); returns those that ran."""
        new: dict[str, Plan] = {}
        for plan in plans:
            if plan.id in self.measurements or plan.id in new:
                continue
            try:
                validate(plan, self.context)
            except PlanError as exc:
                self.measurements[plan.id] = Measurement.failed(plan.id, str(exc), self.cluster.emulated)
                continue
            new[plan.id] = plan
        if new:
            self.race(list(new.values()), SCREEN)
        return list(new.values())

    def race(self, plans: Sequence[Plan], options: RaceOptions | None = None) -> RaceResult:
        """Race ``plans`` (``options``: the final choice's by default); their rounds join what was measured before."""
        result = run_race(
            self.measurer.measure,
            plans,
            options or self.final,
            host_ranks=ranks_on_host(self.cluster.devices),
            own_pids=own_processes(self.measurer),
        )
        for plan, measured in zip(result.plans, result.measurements, strict=True):
            self.plans.setdefault(plan.id, plan)
            known = self.measurements.get(plan.id)
            self.measurements[plan.id] = pooled_rounds(known, measured) if known is not None else measured
        return result

    def _confirm(self, plan: Plan) -> None:
        """Race ``plan`` against the best other measured plan when it is near that best (or better), or when nothing
        else has been measured yet; one lucky round must not become the policy's best."""
        measured = self.measurements[plan.id]
        if not measured.ok:
            return
        rival = self._best(excluding=plan.id)
        if rival is not None and measured.step_time_s > (1 + self.near_best) * self._step_time(rival):
            return
        self.confirmed.add(plan.id)
        self.race([plan] if rival is None else [plan, rival], self.confirm)

    def _best(self, excluding: str) -> Plan | None:
        times = {key: self._step_time(p) for key, p in self.plans.items() if key != excluding}
        finite = [key for key, t in times.items() if math.isfinite(t)]
        return self.plans[min(finite, key=times.__getitem__)] if finite else None

    def _step_time(self, plan: Plan) -> float:
        known = self.measurements.get(plan.id)
        if known is None or not known.ok or not math.isfinite(known.step_time_s):
            return math.inf
        return known.step_time_s

    def state(self) -> MeasuredState:
        return {
            "measurements": {key: m.to_dict() for key, m in self.measurements.items()},
            "plans": {key: p.to_dict() for key, p in self.plans.items()},
        }

    def load_state(self, state: MeasuredState) -> None:
        self.measurements = {key: Measurement.from_dict(m) for key, m in state.get("measurements", {}).items()}
        self.plans = {key: Plan.from_dict(p) for key, p in state.get("plans", {}).items()}
