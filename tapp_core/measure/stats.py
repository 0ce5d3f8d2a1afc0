"""The statistics of a comparison: a median with its confidence interval, and who is in the best group.

Intervals come from **order statistics**, not from the bootstrap. For ``n`` independent samples of any continuous
distribution, the k-th smallest and k-th largest bracket the true median with probability
``1 - 2 P(Binomial(n, 1/2) <= k - 1)``, exactly and whatever the distribution's shape. That matters here: step
times on a shared host are skewed and bimodal (runs of ~0.30 s and runs of ~0.39 s), and a race has 5 to 20
rounds, where a bootstrap interval is too narrow (it never reaches past the observed extremes and under-covers
at such sizes) and depends on a resampling seed. The price is coarse coverage steps: with fewer than 5 samples
even the whole range covers less than 90 % (the interval's own ``coverage`` says how much).

The samples are a race's *rounds* (one value per round, the median of that round's steps), not its steps: steps
within a round share the same moment's load and are not independent; rounds interleaved with the other plans'
are closer to it.

The verdict: the best is the lowest median; the **best group** is every plan whose interval overlaps the best's
interval. No winner is declared inside it (a caller that must choose one takes the plan with fewest devices).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_CONFIDENCE = 0.9


@dataclass(frozen=True)
class Interval:
    """A median and its confidence interval ``[low, high]``, from ``samples`` values; ``coverage`` is the
    interval's exact probability of holding the true median (at least ``confidence`` once there are enough
    samples)."""

    median: float
    low: float
    high: float
    samples: int
    coverage: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def above(self, other: Interval) -> bool:
        """Wholly slower than ``other``: this interval starts after ``other``'s ends."""
        return self.low > other.high

    def to_dict(self) -> dict[str, float | int]:
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "samples": self.samples,
            "coverage": self.coverage,
        }


def _binomial_cdf_half(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)


def order_statistic_rank(n: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[int, float]:
    """The largest ``k`` (1-based) such that ``[x_(k), x_(n+1-k)]`` covers the median with at least ``confidence``,
    and that coverage; ``k = 1`` (the whole range) with its smaller coverage when no ``k`` reaches it."""
    if n < 1:
        raise ValueError("an interval needs at least one sample")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    best_k, best_coverage = 1, 1 - 2 * _binomial_cdf_half(n, 0)
    for k in range(2, (n + 1) // 2 + 1):
        coverage = 1 - 2 * _binomial_cdf_half(n, k - 1)
        if coverage < confidence:
            break
        best_k, best_coverage = k, coverage
    return best_k, best_coverage


def median_interval(samples: Sequence[float], confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    """The median of ``samples`` and its distribution-free confidence interval (order statistics)."""
    values = sorted(float(v) for v in samples)
    if not values:
        raise ValueError("an interval needs at least one sample")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"samples must be finite, got {values}")
    k, coverage = order_statistic_rank(len(values), confidence)
    return Interval(statistics.median(values), values[k - 1], values[-k], len(values), coverage)


def paired_ratio_interval(
    numerator: Mapping[int, float], denominator: Mapping[int, float], confidence: float = DEFAULT_CONFIDENCE
) -> Interval | None:
    """The median of per-round ratios ``numerator[r] / denominator[r]`` over the rounds both ran, with its interval;
    None when they share no round. Interleaving makes each round's pair one moment's comparison, so a load burst
    that slows both cancels in the ratio."""
    ratios = [numerator[r] / denominator[r] for r in sorted(set(numerator) & set(denominator)) if denominator[r] > 0]
    return median_interval(ratios, confidence) if ratios else None


def best_index(intervals: Sequence[Interval | None]) -> int | None:
    """The index of the lowest median (first on ties); None when nothing has an interval."""
    present = [(iv.median, i) for i, iv in enumerate(intervals) if iv is not None]
    return min(present)[1] if present else None


def best_group(intervals: Sequence[Interval | None]) -> list[int]:
    """Indices whose interval overlaps the best's (the best included), in index order; empty without intervals."""
    best = best_index(intervals)
    if best is None:
        return []
    leader = intervals[best]
    assert leader is not None
    return [i for i, iv in enumerate(intervals) if iv is not None and iv.overlaps(leader)]


def separated(intervals: Sequence[Interval | None]) -> bool:
    """Whether the best's interval lies wholly below every other interval (a race can stop)."""
    group = best_group(intervals)
    return len(group) == 1 and sum(iv is not None for iv in intervals) >= 2


ACCURACY_CONFIDENCE = 0.95
"""The confidence of an accuracy's interval (``proportion_interval``)."""


@dataclass(frozen=True)
class Proportion:
    """A measured proportion (an accuracy: ``successes`` right out of ``trials``) with its Wilson score interval
    ``[low, high]`` at ``confidence``."""

    value: float
    low: float
    high: float
    trials: int
    confidence: float

    def text(self, digits: int = 1) -> str:
        """``"63.2 % [60.1, 66.2]"``: percentages, the interval's bounds without their unit."""
        return f"{self.value:.{digits}%} [{100 * self.low:.{digits}f}, {100 * self.high:.{digits}f}]".replace(
            "%", " %", 1
        )


def proportion_interval(value: float, trials: int, confidence: float = ACCURACY_CONFIDENCE) -> Proportion:
    """The Wilson score interval of a proportion ``value`` measured over ``trials`` independent trials (an accuracy
    over test images): unlike value ± z·sqrt(p(1-p)/n), it stays inside [0, 1] and keeps its coverage near 0 and 1
    and at a few hundred trials (Brown, Cai & DasGupta 2001). No trials: the whole of [0, 1]."""
    if trials <= 0:
        return Proportion(value, 0.0, 1.0, 0, confidence)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    centre = (value + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(value * (1 - value) / trials + z * z / (4 * trials * trials))
    return Proportion(value, max(0.0, centre - half), min(1.0, centre + half), trials, confidence)
