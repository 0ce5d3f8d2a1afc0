"""Step times of candidate plans on the cost model, memoised by plan id, with the best plan kept.

A plan the cost model or ``validate`` rejects (memory exceeded, a replica count that does not divide the
micro-batch...) costs ``inf``: searches treat it as the worst possible plan rather than crashing. Searches
estimate thousands of candidates, so the checks that can fail for a structurally sound candidate (memory,
replica counts) are screened in one vectorised pass, and the full ``validate`` runs on every plan that would
become the best, so the best plan is always fully validated.
"""

from __future__ import annotations

import math

import numpy as np

from tapp_core.cluster import Cluster
from tapp_core.costmodel import estimate
from tapp_core.costs import DEFAULT_CALIBRATION, Calibration
from tapp_core.library import LayerLibrary
from tapp_core.plan import Plan, PlanError, check_memory, device_memory_bytes, validate


class MemoryScreen:
    """``validate``'s group and memory checks (``check_groups``, ``check_memory``) as one yes or no, with the stage
    sums vectorised over layers."""

    def __init__(self, library: LayerLibrary, cluster: Cluster) -> None:
        self.library, self.cluster = library, cluster
        self.params = np.array([layer.param_bytes for layer in library.layers], dtype=np.float64)
        self.activations = np.array([layer.activation_bytes for layer in library.layers], dtype=np.float64)
        self.memory = {d.name: d.memory for d in cluster.devices}

    def fits(self, plan: Plan) -> bool:
        if plan.signatures:  # split weights: each device holds its share (the full count, layer by layer)
            if any(len(devices) > plan.micro_batch_size for devices in plan.stage_devices):
                return False
            try:
                check_memory(plan, self.library, self.cluster)
            except PlanError:
                return False
            return True
        stages = np.asarray(plan.stage_of_layer)
        params = np.bincount(stages, self.params, plan.n_stages)
        activations = np.bincount(stages, self.activations, plan.n_stages)
        for stage, devices in enumerate(plan.stage_devices):
            if len(devices) > plan.micro_batch_size:
                return False
            for device, (start, stop) in zip(devices, plan.rows(stage), strict=True):
                need = device_memory_bytes(plan, stage, stop - start, float(params[stage]), float(activations[stage]))
                if need > self.memory.get(device, 0):
                    return False
        return True


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
        self.screen = MemoryScreen(library, cluster)
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
            if not self.lazy_validation and not self.screen.fits(plan):
                raise PlanError("does not fit")
            value = estimate(plan, self.library, self.cluster, self.calibration).step_time
            if value < self.best_time:
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
