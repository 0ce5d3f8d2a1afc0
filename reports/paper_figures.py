"""The figures of the paper's evaluation beyond one step's time: test accuracy against training time, and the two
experiments of its section 5.2.2 (computing power, batch sizes). Drawn on ``matplotlib.figure.Figure`` with the Agg
renderer, as ``reports.figures`` draws.

Each takes a long frame (one row per point) and draws one panel per ``group`` and one line per ``method``, in the
frame's order, with the same colour for a method in every panel (the project's palette).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, PercentFormatter

from reports import schema
from reports.accuracy import ACCURACY_HIGH, ACCURACY_LOW
from reports.figures import _save_png, method_colour
from tapp_core.measure.stats import ACCURACY_CONFIDENCE

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")


def _panels(groups: list[str], width: float = 5.2, height: float = 3.8) -> tuple[Figure, list[Axes]]:
    columns = min(len(groups), 3)
    rows = math.ceil(len(groups) / columns)
    figure = Figure(figsize=(width * columns + 1.8, height * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel().tolist()
    for extra in axes[len(groups) :]:
        extra.set_visible(False)
    return figure, axes[: len(groups)]


def _styles(methods: list[str]) -> dict[str, tuple[str, str]]:
    """(colour, marker) per method (a name or its label), in the order given: the colour is the project's palette's
    (``reports.figures.method_colour``), as in every figure and in MLflow."""
    return {m: (method_colour(m), MARKERS[i % len(MARKERS)]) for i, m in enumerate(methods)}


def _legend(figure: Figure, axes: list[Axes]) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    for ax in axes[1:]:
        more_handles, more_labels = ax.get_legend_handles_labels()
        for label, handle in zip(more_labels, more_handles, strict=True):
            seen.setdefault(label, handle)
    figure.legend(list(seen.values()), list(seen), loc="outside right center", fontsize=8)


def accuracy_vs_time(curves: pd.DataFrame, path: str | Path, perplexity: bool = False) -> Path:
    """Test accuracy (``perplexity``: a language model's test perplexity, lower is better) against wall-clock
    training time, per method: ``curves`` has ``group``, ``method``, ``curve_train_time_s`` and
    ``curve_test_accuracy`` (``curve_test_perplexity``), one row per test evaluation. With no curve at all, the
    figure says so."""
    quality = "perplexity" if perplexity else "accuracy"
    column = schema.CURVE_PERPLEXITY if perplexity else schema.CURVE_ACCURACY
    groups = list(dict.fromkeys(curves["group"])) if not curves.empty else ["no training"]
    figure, axes = _panels(groups)
    styles = _styles(list(dict.fromkeys(curves["method"])) if not curves.empty else [])
    for ax, group in zip(axes, groups, strict=True):
        part = curves[curves["group"] == group] if not curves.empty else curves
        for method, points in part.groupby("method", sort=False) if not part.empty else []:
            ordered = points.sort_values("curve_train_time_s")
            colour, marker = styles[str(method)]
            values = ordered[column]
            errors = None if perplexity else _accuracy_errors(ordered)
            ax.errorbar(
                ordered["curve_train_time_s"], values, yerr=errors, label=str(method), color=colour,
                marker=marker, capsize=3,
            )  # fmt: skip
        if part.empty:
            ax.text(0.5, 0.5, "no plan was trained", ha="center", va="center", transform=ax.transAxes)
        elif "chance" in part and part["chance"].notna().any():
            chance = float(part["chance"].dropna().iloc[0])
            ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({chance:.0%})")
        if not perplexity:
            ax.set_ylim(0, 1)
        ax.set_title(group, fontsize=10)
        ax.set_xlabel("training time (s, wall clock)")
        ax.set_ylabel(f"test {quality}" + (" (lower is better)" if perplexity else ""))
        if not perplexity:
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    if not curves.empty:
        _legend(figure, axes)
    interval = "" if perplexity else f" ({ACCURACY_CONFIDENCE:.0%} Wilson interval)"
    # two lines: a one-panel figure (one model on one cluster, make run's) is narrower than the title on one
    figure.suptitle(f"Time to {quality}: test {quality}{interval}\nagainst training time, per method")
    return _save_png(figure, path)


def _accuracy_errors(points: pd.DataFrame) -> list[list[float]] | None:
    """Each accuracy's interval as error bars (below, above), where the curve has them."""
    if ACCURACY_LOW not in points or points[ACCURACY_LOW].isna().all():
        return None
    accuracy = points["curve_test_accuracy"]
    return [list(accuracy - points[ACCURACY_LOW]), list(points[ACCURACY_HIGH] - accuracy)]


def computing_power_figure(frame: pd.DataFrame, path: str | Path) -> Path:
    """Step time against computing power, per method: ``frame`` has ``group``, ``method``, ``power``, ``step_time_s``
    and (measured) ``low_s``, ``high_s``; the full power on the left."""
    groups = list(dict.fromkeys(frame["group"]))
    figure, axes = _panels(groups)
    styles = _styles(list(dict.fromkeys(frame["method"])))
    for ax, group in zip(axes, groups, strict=True):
        for method, points in frame[frame["group"] == group].groupby("method", sort=False):
            ordered = points.sort_values("power", ascending=False)
            colour, marker = styles[str(method)]
            ax.errorbar(
                ordered["power"], ordered["step_time_s"], yerr=_errors(ordered), capsize=3, label=str(method),
                color=colour, marker=marker,
            )  # fmt: skip
        _log_when_wide(ax, frame.loc[frame["group"] == group, "step_time_s"])
        ax.set_xscale("log", base=2)
        ax.invert_xaxis()
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
        ax.set_xticks(sorted(set(frame.loc[frame["group"] == group, "power"])))
        ax.set_title(group, fontsize=10)
        ax.set_xlabel("computing power of the slow devices")
        ax.set_ylabel("step time (s)")
        ax.grid(alpha=0.3)
    _legend(figure, axes)
    figure.suptitle("Step time under different computing power (section 5.2.2)")
    return _save_png(figure, path)


def batch_size_figure(frame: pd.DataFrame, path: str | Path) -> Path:
    """Throughput against batch size, per method: ``frame`` has ``group``, ``method``, ``batch_size``,
    ``images_per_s`` and (measured) ``low``, ``high`` (the throughput's interval)."""
    groups = list(dict.fromkeys(frame["group"]))
    figure, axes = _panels(groups)
    styles = _styles(list(dict.fromkeys(frame["method"])))
    for ax, group in zip(axes, groups, strict=True):
        for method, points in frame[frame["group"] == group].groupby("method", sort=False):
            ordered = points.sort_values("batch_size")
            errors = _errors(ordered.rename(columns={"images_per_s": "step_time_s", "low": "low_s", "high": "high_s"}))
            colour, marker = styles[str(method)]
            ax.errorbar(
                ordered["batch_size"], ordered["images_per_s"], yerr=errors, capsize=3, label=str(method),
                color=colour, marker=marker,
            )  # fmt: skip
        _log_when_wide(ax, frame.loc[frame["group"] == group, "images_per_s"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(frame.loc[frame["group"] == group, "batch_size"])))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_title(group, fontsize=10)
        ax.set_xlabel("batch size")
        ax.set_ylabel("throughput (images/s)")
        ax.grid(alpha=0.3)
    _legend(figure, axes)
    figure.suptitle("Throughput under different batch sizes (section 5.2.2)")
    return _save_png(figure, path)


def _log_when_wide(ax: Axes, values: pd.Series) -> None:
    """A log scale on the y axis when the values span more than a factor of 10 (one slow method would flatten
    the others)."""
    positive = values[values > 0]
    if len(positive) and positive.max() > 10 * positive.min():
        ax.set_yscale("log")


def _errors(points: pd.DataFrame) -> list[list[float]] | None:
    """Asymmetric error bars from ``low_s`` and ``high_s`` around ``step_time_s`` (none without them)."""
    if "low_s" not in points or "high_s" not in points or points["low_s"].isna().all():
        return None
    values, low, high = (points[c].to_numpy(dtype=float) for c in ("step_time_s", "low_s", "high_s"))
    below = [max(v - lo, 0.0) if lo == lo else 0.0 for v, lo in zip(values, low, strict=True)]
    above = [max(hi - v, 0.0) if hi == hi else 0.0 for v, hi in zip(values, high, strict=True)]
    return [below, above]
