"""One step of a plan in one vocabulary, estimated or measured, so that the two compare term by term.

The cost model's ``Estimate`` (``tapp_core.cost.estimate``) and the runtime's ``Measurement``
(``tapp_core.measure.metrics``) both give their ``StepTerms``: the step time, and per device its compute (forward,
backward and update), its communication (the waits on transfers and collectives that did not overlap its
compute) and its peak memory. Times are seconds per step (``_s``), memory is bytes (``_bytes``). ``compare`` lines
the two up term by term.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

TIMED_STEPS = 3
"""Timed steps per plan in one race round, by default (``RoundSteps``, ``tapp run --steps``, the calibration)."""
WARMUP_STEPS = 1
"""Warm-up steps before them, not counted: a round builds the plan's stages afresh, and its first step pays for
the optimiser state and first-touch allocations."""

TERMS: tuple[str, ...] = ("step_time_s", "compute_s", "communication_s", "peak_memory_bytes")
"""The terms of a step, in the order ``compare`` lists them."""


def communication_share(wait_s: Mapping[str, float], step_time_s: float) -> float:
    """Mean over devices of (non-overlapped communication wait per step) / step time."""
    if not wait_s or step_time_s <= 0:
        return 0.0
    return sum(min(w, step_time_s) for w in wait_s.values()) / (len(wait_s) * step_time_s)


@dataclass(frozen=True)
class StepTerms:
    """One step of a plan: its time, and per device its compute, communication and peak memory."""

    step_time_s: float
    compute_s: Mapping[str, float]
    """Per device: forward, backward and update seconds per step."""
    communication_s: Mapping[str, float]
    """Per device: seconds per step waiting on communication that did not overlap compute."""
    peak_memory_bytes: Mapping[str, int]
    """Per device: the most bytes its stage held."""

    @property
    def communication_share(self) -> float:
        return communication_share(self.communication_s, self.step_time_s)


@dataclass(frozen=True)
class TermDifference:
    """One term of a step, estimated and measured; ``device`` is empty for the step time."""

    term: str
    device: str
    estimated: float
    measured: float

    @property
    def relative_error(self) -> float:
        """(estimated - measured) / measured; NaN where nothing was measured."""
        if not self.measured or math.isnan(self.measured):
            return math.nan
        return (self.estimated - self.measured) / self.measured


def compare(estimated: StepTerms, measured: StepTerms) -> list[TermDifference]:
    """Every term of ``estimated`` beside the same term of ``measured``: the step time first, then each per-device
    term for the devices both name (a measurement may lack a term its runtime did not record)."""
    out = [TermDifference("step_time_s", "", estimated.step_time_s, measured.step_time_s)]
    for term in TERMS[1:]:
        ours: Mapping[str, float] = getattr(estimated, term)
        theirs: Mapping[str, float] = getattr(measured, term)
        out += [TermDifference(term, d, float(ours[d]), float(theirs[d])) for d in ours if d in theirs]
    return out
