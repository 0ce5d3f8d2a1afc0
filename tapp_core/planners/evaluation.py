"""Step times of candidate plans on the cost model, memoised by plan id, with the best plan kept.

A plan the cost model or ``validate`` rejects (memory exceeded, a replica count that does not divide the
micro-batch...) costs ``inf``: searches treat it as the worst possible plan rather than crashing.
"""

from __future__ import annotations

import math

from tapp_core.cluster import Cluster
from tapp_core.costmodel import DEFAULT_CALIBRATION, Calibration, estimate
from tapp_core.library import LayerLibrary
from tapp_core.plan import Plan, PlanError, validate


class PlanEvaluator:
    def __init__(
        self,
        library: LayerLibrary,
        cluster: Cluster,
        calibration: Calibration = DEFAULT_CALIBRATION,
        budget: int | None = None,
        lazy_validation: bool = False,
    ) -> None:
        self.library = library
        self.cluster = cluster
        self.calibration = calibration
        self.budget = budget
        self.lazy_validation = lazy_validation
        """Check memory only for plans that would be the new best: for searches that use nothing but the best
        (the oracle); a slower plan's cached time may then belong to a plan that does not fit."""
        self.evaluations = 0
        """Distinct plans evaluated (cache hits are free)."""
        self.failures = 0
        self.best_plan: Plan | None = None
        self.best_time = math.inf
        self._cache: dict[str, float] = {}

    @property
    def exhausted(self) -> bool:
        return self.budget is not None and self.evaluations >= self.budget

    def seen(self, plan: Plan) -> bool:
        return plan.id in self._cache

    def step_time(self, plan: Plan) -> float:
        key = plan.id
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        self.evaluations += 1
        try:
            if not self.lazy_validation:
                validate(plan, self.library, self.cluster)
            value = estimate(plan, self.library, self.cluster, self.calibration).step_time
            if self.lazy_validation and value < self.best_time:
                validate(plan, self.library, self.cluster)
        except PlanError:
            self.failures += 1
            value = math.inf
        self._cache[key] = value
        if value < self.best_time:
            self.best_time, self.best_plan = value, plan
        return value

    def export_cache(self) -> dict[str, float]:
        return dict(self._cache)

    def restore(self, cache: dict[str, float], evaluations: int, failures: int, best_plan: Plan | None) -> None:
        """Continue from a saved state (``export_cache`` and the counters), as a resumed search does."""
        self._cache = dict(cache)
        self.evaluations, self.failures = evaluations, failures
        self.best_plan = best_plan
        self.best_time = self._cache[best_plan.id] if best_plan is not None else math.inf

    def best(self, plans: list[Plan]) -> tuple[Plan, float]:
        """The fastest of ``plans`` (the first on ties)."""
        times = [self.step_time(p) for p in plans]
        i = min(range(len(plans)), key=times.__getitem__)
        return plans[i], times[i]
