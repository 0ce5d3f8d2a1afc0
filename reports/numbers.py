"""How TAPP shows a number, everywhere a person reads one: the terminal, MLflow (descriptions, run names, the
metrics its runs list shows raw), Prefect (logs, artifacts) and the report's tables.

One rule each, so that the same fact reads the same in every view:

- a step time has ``SIGNIFICANT_DIGITS`` significant digits (``0.1948``); a ratio ``RATIO_DIGITS`` (``5.48x``);
- a median with a confidence interval reads ``0.1948 [0.1946, 0.1994]``: the interval's ends, never a symmetric
  ``±`` (the interval of a median is seldom centred on it);
- a value that MLflow shows raw (a metric in its runs list) is logged already rounded to those digits
  (``rounded``), so that the runs list, the CSV built from the metrics and the text all carry the same number.
"""

from __future__ import annotations

import math

SIGNIFICANT_DIGITS = 4
"""Step times (seconds) and shares where shown or logged for reading."""
RATIO_DIGITS = 3
"""Ratios (speedups, ``vs TAPP``)."""
MISSING = "–"


def rounded(value: float, digits: int = SIGNIFICANT_DIGITS) -> float:
    """``value`` rounded to ``digits`` significant digits (NaN and infinity as they are)."""
    value = float(value)
    return float(f"{value:.{digits}g}") if math.isfinite(value) else value


def significant(value: float, digits: int = SIGNIFICANT_DIGITS) -> str:
    """``value`` with ``digits`` significant digits, trailing zeros kept (``0.2000``, ``5.30``)."""
    if not math.isfinite(value):
        return MISSING
    text = f"{float(value):#.{digits}g}"
    return text.rstrip(".") if "e" not in text else text


def seconds(value: float) -> str:
    """A time in seconds, ``SIGNIFICANT_DIGITS`` significant digits, no unit: ``0.1948``."""
    return significant(value)


def ratio(value: float) -> str:
    """A ratio: ``5.48x``."""
    return MISSING if not math.isfinite(value) else f"{significant(value, RATIO_DIGITS)}x"


def percent(value: float) -> str:
    """A share as a percentage with one decimal: ``12.5%``."""
    return MISSING if not math.isfinite(value) else f"{100 * float(value):.1f}%"


def perplexity(value: float) -> str:
    """A language model's perplexity, with two decimals: ``12.34``."""
    return MISSING if not math.isfinite(value) else f"{float(value):.2f}"


def bracket(low: float, high: float, digits: int = SIGNIFICANT_DIGITS) -> str:
    """An interval alone: ``[0.1946, 0.1994]``; empty when either end is unknown."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return ""
    return f"[{significant(low, digits)}, {significant(high, digits)}]"


def percent_bracket(low: float, high: float) -> str:
    """A proportion's interval in percentage points, as ``percent`` shows its value: ``[60.2, 66.1]``."""
    return f"[{100 * low:.1f}, {100 * high:.1f}]"


def with_interval(text: str, low: float, high: float, digits: int = SIGNIFICANT_DIGITS) -> str:
    """``text`` (a formatted median) followed by its interval when it has one: ``0.1948 [0.1946, 0.1994]``."""
    interval = bracket(low, high, digits)
    return f"{text} {interval}" if interval else text


def seconds_interval(median: float, low: float = math.nan, high: float = math.nan) -> str:
    """A step time and its interval: ``0.1948 [0.1946, 0.1994]`` (just ``0.1948`` without one)."""
    return with_interval(seconds(median), low, high)


def ratio_interval(median: float, low: float = math.nan, high: float = math.nan) -> str:
    """A ratio and its interval: ``5.48x [5.30, 5.67]``."""
    return with_interval(ratio(median), low, high, RATIO_DIGITS)
