"""Step times of candidate plans on the cost model, memoised by plan id, with the best plan kept.

Each plan is estimated once: the evaluator keeps the terms of every estimate it made (``StepTerms``: the step
time, and per device compute, communication and memory), which what reports a search's plans after it
(``tasks.search.sampled_plans``) reuses. It keeps no ``Estimate``: one holds its whole simulation until its timeline
is read, some 70 KiB for AlexNet on 4 devices, and a search makes thousands.

A plan the cost model or ``validate`` rejects (memory exceeded, a replica count that does not divide the
micro-batch...) costs ``inf``: searches treat it as the worst possible plan rather than crashing. Searches
estimate thousands of candidates, so the checks that can fail for a structurally sound candidate (memory,
replica counts) are screened in one vectorised pass, and the full ``validate`` runs on every plan that would
become the best, so the best plan is always fully validated. Every candidate is first put to the runtime's rule
(``tapp_core.plan.rule.check_runs``): a plan the runtime would refuse is never costed.
"""

from __future__ import annotations

import math

import numpy as np

from tapp_core.cost.checks import check_memory, validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.measure.step import StepTerms
from tapp_core.plan.plan import (
    DeviceFootprint,
    InputCounter,
    KeptOutputs,
    OutOfMemory,
    Plan,
    PlanError,
    device_memory_terms,
    model_trace_bytes,
)
from tapp_core.plan.rule import ModelFacts, check_runs
from tapp_core.plan.ties import tied_copy_bytes
from tapp_core.planners.base import DoesNotFit, PlannerError


class MemoryScreen:
    """``validate``'s group and memory checks (``check_groups``, ``check_memory``) as one yes or no, with the stage
    sums vectorised over layers."""

    def __init__(self, context: CostContext) -> None:
        self.context = context
        library = context.library
        self.params = np.array([layer.param_bytes for layer in library.layers], dtype=np.float64)
        self.frozen = np.array([layer.frozen_bytes for layer in library.layers], dtype=np.float64)
        self.kept = KeptOutputs.of(library)
        self.outputs = self.kept.held
        self.memory = context.plan_memory
        self.shared = library.shared
        self.inputs = InputCounter(library)
        self.optimizer_state = context.optimizer_state
        self.trace = model_trace_bytes(library)

    def fits(self, plan: Plan) -> bool:
        if plan.signatures:  # split weights: each device holds its share (the full count, layer by layer)
            if any(len(devices) > plan.micro_batch_size for devices in plan.stage_devices):
                return False
            try:
                check_memory(plan, self.context)
            except PlanError:
                return False
            return True
        stages = np.asarray(plan.stage_of_layer)
        params = np.bincount(stages, self.params, plan.n_stages)
        frozen = np.bincount(stages, self.frozen, plan.n_stages)
        if self.shared:
            params += tied_copy_bytes(plan.stage_of_layer, plan.n_stages, self.shared)
            frozen += tied_copy_bytes(plan.stage_of_layer, plan.n_stages, self.shared, trained=False)
        activations = np.bincount(stages, self.kept.per_layer(stages), plan.n_stages)
        largest, widest = np.zeros(plan.n_stages), np.zeros(plan.n_stages)
        np.maximum.at(largest, stages, self.params)
        np.maximum.at(widest, stages, self.outputs)
        inputs, (received_forward, received_backward) = self.inputs.counts(plan.stage_of_layer, plan.n_stages)
        for stage, devices in enumerate(plan.stage_devices):
            if len(devices) > plan.micro_batch_size:
                return False
            held = float(params[stage])
            footprint = DeviceFootprint(
                param_bytes=held,
                activation_bytes=float(activations[stage]),
                kept_bytes=float(inputs[stage]),
                largest_param_bytes=float(largest[stage]),
                reduced_bytes=held - float(frozen[stage]),
                largest_activation_bytes=float(widest[stage]),
                received_bytes=(float(received_forward[stage]), float(received_backward[stage])),
                frozen_bytes=float(frozen[stage]),
            )
            for device, (start, stop) in zip(devices, plan.rows(stage), strict=True):
                terms = device_memory_terms(plan, stage, stop - start, footprint, self.optimizer_state, self.trace)
                if sum(terms.values()) > self.memory.get(device, 0):
                    return False
        return True


class PlanEvaluator:
    def __init__(
        self,
        context: CostContext,
        budget: int | None = None,
        lazy_validation: bool = False,
    ) -> None:
        self.context = context
        self.budget = budget
        self.lazy_validation = lazy_validation
        """Check memory only for plans that would be the new best: for searches that use nothing but the best
        (the oracle); a slower plan's cached time may then belong to a plan that does not fit."""
        self.screen = MemoryScreen(context)
        self.model = ModelFacts.of_library(context.library)
        self.evaluations = 0
        """Distinct plans evaluated (cache hits are free)."""
        self.failures = 0
        self.memory_failures = 0
        """Of ``failures``, the plans over a device's memory (the screen's, or ``OutOfMemory``)."""
        self.best_plan: Plan | None = None
        self.best_time = math.inf
        self._cache: dict[str, float] = {}
        self._terms: dict[str, StepTerms] = {}

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
            check_runs(plan, self.model)
            if not self.lazy_validation and not self.screen.fits(plan):
                raise OutOfMemory("does not fit")
            value = self.terms(plan).step_time_s
            if value < self.best_time:
                validate(plan, self.context)
        except PlanError as exc:
            self.failures += 1
            self.memory_failures += isinstance(exc, OutOfMemory)
            value = math.inf
        self._cache[key] = value
        if value < self.best_time:
            self.best_time, self.best_plan = value, plan
        return value

    def no_plan(self, message: str) -> PlannerError:
        """The error of a search that kept no plan: ``DoesNotFit`` when every plan it tried was over a device's memory
        (the model and the cluster's fact, not the method's failure)."""
        if self.failures and self.memory_failures == self.failures:
            return DoesNotFit(f"{message}: every plan it tried is over a device's memory")
        return PlannerError(message)

    def terms(self, plan: Plan) -> StepTerms:
        """The terms of the cost model's estimate of ``plan`` (its ``PlanError`` if it has none), estimated once per
        plan."""
        found = self._terms.get(plan.id)
        if found is None:
            found = self._terms[plan.id] = estimate(plan, self.context).terms
        return found

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
