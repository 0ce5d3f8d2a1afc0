"""Figures for the paper and the MLflow artifacts, drawn with matplotlib's Agg renderer (no display needed).

Figures are built on ``matplotlib.figure.Figure`` directly, never through pyplot, so no global state is touched
and drawing works in worker threads and headless processes alike.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from tapp_core.costmodel import NO_MICRO_BATCH, OP_KINDS, TimelineOp

if TYPE_CHECKING:
    import pandas as pd

KIND_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "send": "#55A868",
    "recv": "#C44E52",
    "collective": "#E377C2",
    "reduce": "#B07AA1",
    "allreduce": "#8172B3",
    "update": "#937860",
}
"""One colour per ``TimelineOp.kind``."""
KIND_LABELS = {
    "collective": "layout change (split layers)",
    "recv": "waiting on receive",
    "reduce": "gradient bucket reduced",
    "allreduce": "waiting on reduction",
}
SEND_LANE = ("send", "reduce")
"""Kinds drawn in a thin lane under the device's row: they overlap the device's compute."""
ROW_HEIGHT = 0.6
SEND_HEIGHT = 0.18
MIN_LABEL_FRACTION = 0.012
"""Bars narrower than this fraction of the time axis get no micro-batch number."""


@runtime_checkable
class HasTimeline(Protocol):
    """An Estimate, or a Measurement that recorded its operations."""

    @property
    def timeline(self) -> Sequence[TimelineOp]: ...


def gantt(
    estimate_or_timeline: HasTimeline | Sequence[TimelineOp], path: str | Path, title: str = "Pipeline timeline"
) -> Path:
    """Draw one row per device (named with its stage) with every operation of the timeline as a bar, sends in a thin
    lane under it, and the legend under the time axis; write a PNG to ``path``."""
    timeline = _timeline_of(estimate_or_timeline)
    if not timeline:
        raise ValueError("the timeline is empty: nothing to draw")
    step_time = _step_time_of(estimate_or_timeline, timeline)
    devices = _device_order(timeline)
    figure = Figure(figsize=(12, 1.6 + 0.7 * len(devices)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    span = max(op.end for op in timeline) - min(op.start for op in timeline)
    several_iterations = any(op.iteration for op in timeline)
    for op in timeline:
        row = devices.index(op.device)
        _draw_bar(axes, op, row, span, several_iterations)
    stage_of = {op.device: op.stage for op in reversed(timeline)}  # each device's first operation's stage
    axes.set_yticks(range(len(devices)), [f"{d}\nstage {stage_of[d]}" for d in devices])
    axes.set_ylim(len(devices) - 0.5, -0.6)
    axes.set_xlabel("time (s)")
    figure_of = "steady-state time per mini-batch" if several_iterations else "step time"  # metrics.step_kind
    axes.set_title("\n".join(textwrap.wrap(f"{title} — {figure_of} {step_time:.4g} s", 115)))
    kinds = [k for k in OP_KINDS if any(op.kind == k for op in timeline)]
    handles = [Patch(color=KIND_COLOURS[k], label=KIND_LABELS.get(k, k)) for k in kinds]
    # Below the axis label, outside the axes: the constrained layout makes room for it, so nothing overlaps.
    figure.legend(handles=handles, loc="outside lower center", ncol=len(kinds), frameon=False)
    axes.grid(axis="x", alpha=0.3)
    return _save_png(figure, path)


def _timeline_of(source: HasTimeline | Sequence[TimelineOp]) -> list[TimelineOp]:
    if isinstance(source, HasTimeline):
        return list(source.timeline)
    return list(source)


def _step_time_of(source: object, timeline: Sequence[TimelineOp]) -> float:
    """The source's own step time (Estimate.step_time, Measurement.step_time_s), else the timeline's span."""
    for name in ("step_time", "step_time_s"):
        value = getattr(source, name, None)
        if isinstance(value, int | float) and value == value:
            return float(value)
    return max(op.end for op in timeline) - min(op.start for op in timeline)


def _device_order(timeline: Sequence[TimelineOp]) -> list[str]:
    """Devices by stage, then in the order they first appear."""
    first: dict[str, tuple[int, int]] = {}
    for position, op in enumerate(timeline):
        first.setdefault(op.device, (op.stage, position))
    return sorted(first, key=first.__getitem__)


def _draw_bar(axes: Axes, op: TimelineOp, row: int, span: float, several_iterations: bool) -> None:
    colour = KIND_COLOURS.get(op.kind, "#999999")
    if op.kind in SEND_LANE:
        axes.broken_barh(
            [(op.start, op.duration)],
            (row + ROW_HEIGHT / 2, SEND_HEIGHT),
            facecolor=colour,
            edgecolor="white",
            linewidth=0.3,
        )
        return
    axes.broken_barh(
        [(op.start, op.duration)],
        (row - ROW_HEIGHT / 2, ROW_HEIGHT),
        facecolor=colour,
        edgecolor="white",
        linewidth=0.5,
    )
    if (
        op.kind in ("forward", "backward")
        and op.micro_batch != NO_MICRO_BATCH
        and op.duration >= MIN_LABEL_FRACTION * span
    ):
        label = f"{op.iteration}.{op.micro_batch}" if several_iterations else str(op.micro_batch)
        axes.text(op.start + op.duration / 2, row, label, ha="center", va="center", fontsize=7, color="white")


# --- Search and comparison figures (read back from MLflow by reports.paper) ----------------------------------


def reward_curve(history: pd.DataFrame, path: str | Path, title: str = "TAPP search") -> Path:
    """Per search round: the mean reward (left); the best step time so far and the round's best (right).

    ``history`` has a ``round`` column and any of ``reward_mean``, ``best_step_time_s``, ``round_best_step_time_s``.
    """
    figure = Figure(figsize=(10, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    rewards, times = figure.subplots(1, 2)
    if "reward_mean" in history and history["reward_mean"].notna().any():
        rewards.plot(history["round"], history["reward_mean"], marker="o", markersize=3)
    rewards.set_ylabel("mean reward of the round's samples")
    if "round_best_step_time_s" in history and history["round_best_step_time_s"].notna().any():
        times.plot(history["round"], history["round_best_step_time_s"], ".", color="tab:gray", label="round's best")
    if "best_step_time_s" in history and history["best_step_time_s"].notna().any():
        times.step(history["round"], history["best_step_time_s"], where="post", color="tab:green", label="best so far")
    times.set_ylabel("step time (s)")
    if times.lines:
        times.legend(loc="best")
    for axes in (rewards, times):
        axes.set_xlabel("search round")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    figure.suptitle(title)
    return _save_png(figure, path)


def step_time_bars(frame: pd.DataFrame, path: str | Path, title: str = "Step time by method") -> Path:
    """Grouped bars of ``step_time_s``: one group per ``group`` value, one bar per ``method`` value (first-seen order).

    With ``low_s`` and ``high_s`` columns, each bar that has them carries its confidence interval as an error bar
    (asymmetric: the interval of a median need not be centred on it).
    """
    groups = list(dict.fromkeys(frame["group"]))
    methods = list(dict.fromkeys(frame["method"]))
    width = 0.8 / max(len(methods), 1)
    figure = Figure(figsize=(max(6.0, 0.5 * len(groups) * len(methods) + 2.5), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    intervals = "low_s" in frame and "high_s" in frame
    for i, method in enumerate(methods):
        rows = frame[frame["method"] == method].set_index("group")
        heights = [float(rows["step_time_s"].get(g, float("nan"))) for g in groups]
        positions = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        errors = None
        if intervals:
            low = [float(rows["low_s"].get(g, float("nan"))) for g in groups]
            high = [float(rows["high_s"].get(g, float("nan"))) for g in groups]
            below = [max(h - lo, 0.0) if lo == lo else 0.0 for h, lo in zip(heights, low, strict=True)]
            above = [max(hi - h, 0.0) if hi == hi else 0.0 for h, hi in zip(heights, high, strict=True)]
            errors = [below, above]
        bars = axes.bar(positions, heights, width=width, label=method, yerr=errors, capsize=2, ecolor="#333333")
        if errors is None:
            axes.bar_label(bars, fmt="%.3f", fontsize=7, padding=2, rotation=90)
        else:  # inside the bar, clear of its error bar
            axes.bar_label(bars, fmt="%.3f", fontsize=7, label_type="center", rotation=90, color="white")
    axes.set_xticks(range(len(groups)), groups)
    axes.set_ylabel("step time (s)" + (", median and its confidence interval" if intervals else ""))
    axes.set_title(title)
    axes.margins(y=0.15)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save_png(figure, path)


def _save_png(figure: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=120)
    return out
