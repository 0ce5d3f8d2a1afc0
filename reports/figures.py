"""Figures for the paper and the MLflow artifacts, drawn with matplotlib's Agg renderer (no display needed).

Figures are built on ``matplotlib.figure.Figure`` directly, never through pyplot, so no global state is touched
and drawing works in worker threads and headless processes alike.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from reports import schema
from reports.numbers import seconds, seconds_interval
from tapp_core.cost.estimate import NO_MICRO_BATCH, OP_KINDS, MemoryCurve, TimelineOp

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
MEMORY_PANEL_HEIGHT = 2.0
"""Inches of the Gantt figure's memory panel, under the rows."""
MEMORY_SHARE_SHOWN = 0.25
"""The memory panel is drawn as a share of each device's memory for a plan when some device uses this much of it."""
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
    curves: Mapping[str, MemoryCurve] = getattr(estimate_or_timeline, "memory_over_time", {})
    height = 1.6 + 0.7 * len(devices)
    figure = Figure(figsize=(12, height + (MEMORY_PANEL_HEIGHT if curves else 0)), layout="constrained")
    FigureCanvasAgg(figure)
    if curves:
        axes, memory_axes = figure.subplots(2, 1, sharex=True, height_ratios=[height, MEMORY_PANEL_HEIGHT])
        _draw_memory(memory_axes, curves, devices, getattr(estimate_or_timeline, "plan_memory_bytes", {}))
    else:
        axes = figure.add_subplot()
    span = max(op.end for op in timeline) - min(op.start for op in timeline)
    several_iterations = any(op.iteration for op in timeline)
    _draw_bars(axes, timeline, devices, span, several_iterations)
    stage_of = {op.device: op.stage for op in reversed(timeline)}  # each device's first operation's stage
    axes.set_yticks(range(len(devices)), [f"{d}\nstage {stage_of[d]}" for d in devices])
    axes.set_ylim(len(devices) - 0.5, -0.6)
    (memory_axes if curves else axes).set_xlabel("time (s)")
    figure_of = "steady-state time per mini-batch" if several_iterations else "step time"  # metrics.step_kind
    axes.set_title("\n".join(textwrap.wrap(f"{title} — {figure_of} {step_time:.4g} s", 115)))
    kinds = [k for k in OP_KINDS if any(op.kind == k for op in timeline)]
    handles = [Patch(color=KIND_COLOURS[k], label=KIND_LABELS.get(k, k)) for k in kinds]
    # Below the axis label, outside the axes: the constrained layout makes room for it, so nothing overlaps.
    figure.legend(handles=handles, loc="outside lower center", ncol=len(kinds), frameon=False)
    axes.grid(axis="x", alpha=0.3)
    return _save_png(figure, path)


def _draw_memory(
    axes: Axes, curves: Mapping[str, MemoryCurve], devices: Sequence[str], plan_memory: Mapping[str, int]
) -> None:
    """Each device's memory in use over the timeline: as a share of the memory it has for a plan (the 100 % line is
    its limit) where that is known and some device comes within ``MEMORY_SHARE_SHOWN`` of it, else in MiB (a limit
    far above would flatten every curve), the least memory a device has for a plan then said above the panel."""
    known = all(plan_memory.get(d, 0) > 0 for d in curves)
    highest = max((b / plan_memory[d] for d in curves for _, b in curves[d]), default=0.0) if known else 0.0
    share = known and highest >= MEMORY_SHARE_SHOWN
    colours = colormaps["tab10"]
    for position, device in enumerate(d for d in devices if d in curves):
        times = [t for t, _ in curves[device]]
        held = [b / plan_memory[device] * 100 if share else b / 2**20 for _, b in curves[device]]
        axes.step(times, held, where="post", color=colours(position % colours.N), linewidth=1.2, label=device)
    if share:
        axes.axhline(100, color="#c44e52", linestyle="--", linewidth=1)
        axes.set_ylabel("memory in use\n(% of the device's\nfor a plan)")
        axes.set_ylim(0, max(105.0, axes.get_ylim()[1]))
    else:
        axes.set_ylabel("memory in use\n(MiB)")
        axes.set_ylim(bottom=0)
        if known:
            least = min(plan_memory[d] for d in curves) / 2**20
            note = f"each device has at least {least:,.0f} MiB for a plan ({highest:.0%} at most in use)"
            axes.set_title(note, loc="left", fontsize=8, color="#555555")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    axes.grid(alpha=0.3)


def _timeline_of(source: HasTimeline | Sequence[TimelineOp]) -> list[TimelineOp]:
    if isinstance(source, HasTimeline):
        return list(source.timeline)
    return list(source)


def _step_time_of(source: object, timeline: Sequence[TimelineOp]) -> float:
    """The source's own step time (an Estimate's or a Measurement's ``step_time_s``), else the timeline's span."""
    value = getattr(source, "step_time_s", None)
    if isinstance(value, int | float) and value == value:
        return float(value)
    return max(op.end for op in timeline) - min(op.start for op in timeline)


def _device_order(timeline: Sequence[TimelineOp]) -> list[str]:
    """Devices by stage, then in the order they first appear."""
    first: dict[str, tuple[int, int]] = {}
    for position, op in enumerate(timeline):
        first.setdefault(op.device, (op.stage, position))
    return sorted(first, key=first.__getitem__)


def _draw_bars(
    axes: Axes, timeline: Sequence[TimelineOp], devices: Sequence[str], span: float, several_iterations: bool
) -> None:
    """Every operation as a bar in its device's row (sends in the thin lane), one collection per row, lane and
    kind: a timeline has thousands of operations, and a collection each makes drawing slow."""
    row_of = {device: row for row, device in enumerate(devices)}
    bars: dict[tuple[int, bool, str], list[tuple[float, float]]] = {}
    for op in timeline:
        row = row_of[op.device]
        bars.setdefault((row, op.kind in SEND_LANE, op.kind), []).append((op.start, op.duration))
        if (
            op.kind in ("forward", "backward")
            and op.micro_batch != NO_MICRO_BATCH
            and op.duration >= MIN_LABEL_FRACTION * span
        ):
            label = f"{op.iteration}.{op.micro_batch}" if several_iterations else str(op.micro_batch)
            axes.text(op.start + op.duration / 2, row, label, ha="center", va="center", fontsize=7, color="white")
    for (row, send_lane, kind), ranges in bars.items():
        lane = (row + ROW_HEIGHT / 2, SEND_HEIGHT) if send_lane else (row - ROW_HEIGHT / 2, ROW_HEIGHT)
        colour = KIND_COLOURS.get(kind, "#999999")
        axes.broken_barh(ranges, lane, facecolor=colour, edgecolor="white", linewidth=0.3 if send_lane else 0.5)


# --- One palette for the project ----------------------------------------------------------------------------

METHOD_COLOURS: dict[str, str] = {
    "tapp": "#d62728",
    "single-cpu": "#7f7f7f",
    "single-gpu": "#bcbd22",
    "single": "#7f7f7f",
    "bsp": "#1f77b4",
    "pipetorch": "#ff7f0e",
    "even": "#8c564b",
    "pipedream": "#9467bd",
    "autoddl": "#17becf",
    "pipeline-cd": "#e377c2",
    "oracle": "#2ca02c",
}
"""One colour per method, distinct, the same in every figure of the report and in MLflow's charts (each method run
carries its colour as ``mlflow.runColor``). TAPP is red."""
SPARE_COLOURS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
"""For methods the palette does not name, in the order they are first asked for."""
_spare: dict[str, str] = {}


def method_colour(method: str) -> str:
    """The colour of ``method``: a method name (``tapp``, ``single-cpu``) or its report label (``TAPP``,
    ``SingleCPU``, ``tapp_core.planners.base.method_label``)."""
    from tapp_core.planners.base import method_label

    if method in METHOD_COLOURS:
        return METHOD_COLOURS[method]
    named = next((name for name in METHOD_COLOURS if method_label(name) == method), None)
    if named is not None:
        return METHOD_COLOURS[named]
    if method not in _spare:
        _spare[method] = SPARE_COLOURS[len(_spare) % len(SPARE_COLOURS)]
    return _spare[method]


SIMULATED_COLOUR = "#7f7f7f"
MEASURED_COLOUR = "#ff7f0e"
BEST_COLOUR = "#2ca02c"
WINNER_COLOUR = METHOD_COLOURS["tapp"]


# --- Search and comparison figures (read back from MLflow by reports.paper) ----------------------------------


def reward_curve(
    history: pd.DataFrame,
    path: str | Path,
    title: str = "TAPP search",
    samples: pd.DataFrame | None = None,
    final: Mapping[str, object] | None = None,
) -> Path:
    """Every search round, simulated and measured: the mean reward (left); the step times (right): each round's
    best estimate and the best so far on the cost model, each measured sample's median with its interval at the
    round it was measured in, and the final race's candidates with their intervals and its verdict.

    ``history`` has ``round``, ``phase`` (``simulated`` or ``measured``) and any of ``schema.ROUND_METRICS``; ``samples`` the measured plans (``measured_round``,
    ``measured_step_time_s`` and its ``_low_s``/``_high_s``); ``final`` the final race's summary.
    """
    figure = Figure(figsize=(12, 5.0), layout="constrained")
    FigureCanvasAgg(figure)
    rewards, times = figure.subplots(1, 2, width_ratios=(1, 1.5))
    measured_rounds = _shade_measured(history, (rewards, times))
    if "reward_mean" in history and history["reward_mean"].notna().any():
        rewards.plot(history["round"], history["reward_mean"], marker="o", markersize=3, color="#1f77b4")
    rewards.set_ylabel("mean reward of the round's samples")
    _simulated_times(times, history)
    _measured_samples(times, samples)
    verdict = _final_race(times, final, 1 + max(history["round"], default=0))
    times.set_ylabel("step time (s)")
    for axes in (rewards, times):
        axes.set_xlabel("search round")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    if verdict:  # the final race's column is named, not numbered
        last = int(max(history["round"], default=0)) + 1
        ticks = [t for t in times.get_xticks() if 1 <= t < last]
        times.set_xticks([*ticks, last], [str(int(t)) for t in ticks] + ["final\nrace"])
    handles, labels = times.get_legend_handles_labels()
    if handles:  # under the panels, clear of the data
        figure.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    subtitle = _rounds_text(history, measured_rounds)
    figure.suptitle(f"{title}\n{subtitle}" + (f"; {verdict}" if verdict else ""), fontsize=10)
    return _save_png(figure, path)


def _rounds_text(history: pd.DataFrame, measured: Sequence[int]) -> str:
    """``30 rounds on the cost model, then 1 measured on the workers (round 31)``: counts first, so that a round's
    number is never read as a count."""
    total = len(history["round"].unique()) if "round" in history else 0
    if not measured:
        return f"all {total} rounds on the cost model"
    which = f"round {measured[0]}" if len(measured) == 1 else f"rounds {min(measured)}–{max(measured)}"
    return f"{total - len(measured)} rounds on the cost model, then {len(measured)} measured on the workers ({which})"


def _shade_measured(history: pd.DataFrame, panels: Sequence[Axes]) -> list[int]:
    """Shade the measured rounds on both panels; returns their numbers, empty when none."""
    if "phase" not in history:
        return []
    rounds = sorted({int(r) for r in history.loc[history["phase"] == "measured", "round"]})
    for axes in panels if rounds else ():
        axes.axvspan(min(rounds) - 0.5, max(rounds) + 0.5, color=MEASURED_COLOUR, alpha=0.08, linewidth=0)
    return rounds


def _simulated_times(axes: Axes, history: pd.DataFrame) -> None:
    simulated = history[history["phase"] != "measured"] if "phase" in history else history
    if schema.ROUND_BEST_ESTIMATED in simulated and simulated[schema.ROUND_BEST_ESTIMATED].notna().any():
        axes.plot(
            simulated["round"], simulated[schema.ROUND_BEST_ESTIMATED], ".", color=SIMULATED_COLOUR,
            label="round's best estimate",
        )  # fmt: skip
    if schema.BEST_ESTIMATED_SO_FAR in simulated and simulated[schema.BEST_ESTIMATED_SO_FAR].notna().any():
        axes.step(
            simulated["round"], simulated[schema.BEST_ESTIMATED_SO_FAR], where="post", color=BEST_COLOUR,
            label="best estimate so far",
        )  # fmt: skip


def _measured_samples(axes: Axes, samples: pd.DataFrame | None) -> None:
    """Each measured sample at its round: its median and interval (a little apart when a round has several)."""
    if samples is None or samples.empty or "measured_round" not in samples:
        return
    measured = samples[samples["measured_round"].notna() & samples["measured_step_time_s"].notna()]
    if measured.empty:
        return
    offsets = measured.groupby("measured_round").cumcount()
    counts = measured.groupby("measured_round")["measured_round"].transform("size")
    x = measured["measured_round"] + 0.5 * (offsets - (counts - 1) / 2) / counts.clip(lower=1)
    median = measured["measured_step_time_s"]
    below = (median - measured["measured_step_time_low_s"]).clip(lower=0).fillna(0)
    above = (measured["measured_step_time_high_s"] - median).clip(lower=0).fillna(0)
    axes.errorbar(
        x, median, yerr=[below, above], fmt="o", markersize=4, color=MEASURED_COLOUR, capsize=2,
        label="measured sample: median [interval] (one round: none)",
    )  # fmt: skip


def _final_race(axes: Axes, final: Mapping[str, object] | None, x: int) -> str:
    """The final race's candidates at ``x``, the winner in TAPP's colour; returns the verdict as text."""
    plans = final.get("plans") if final else None
    if not isinstance(plans, list) or not final:
        return ""
    winner = final.get("winner")
    done = [p for p in plans if isinstance(p, dict) and isinstance(p.get("median_s"), int | float)]
    labelled = False
    for i, plan in enumerate(done):
        median, low, high = (float(plan.get(k) or plan["median_s"]) for k in ("median_s", "low_s", "high_s"))
        won = plan.get("plan_id") == winner
        position = x + 0.5 * (i - (len(done) - 1) / 2) / max(len(done), 1)
        label = "final race: the winner" if won else (None if labelled else "final race: other candidates")
        labelled = labelled or not won
        axes.errorbar(
            [position], [median], yerr=[[max(median - low, 0)], [max(high - median, 0)]],
            fmt="*" if won else "s", markersize=11 if won else 5, capsize=3,
            color=WINNER_COLOUR if won else "#555555", label=label, zorder=3 if won else 2,
        )  # fmt: skip
    axes.axvline(x - 0.5, color="#555555", linewidth=0.8, linestyle=":")
    won_plan = next((p for p in done if p.get("plan_id") == winner), None)
    if won_plan is None:
        return "final race: no plan finished"
    text = seconds_interval(
        float(won_plan["median_s"]), float(won_plan["low_s"] or "nan"), float(won_plan["high_s"] or "nan")
    )
    load = ", overloaded host" if final.get("overloaded") else ""
    return f"the search's final race: {len(plans)} candidates, {final.get('rounds')} rounds ({final.get('stop')}{load}); winner {text} s"


def step_time_bars(frame: pd.DataFrame, path: str | Path, title: str = "Step time by method", note: str = "") -> Path:
    """Grouped bars of ``step_time_s``: one group per ``group`` value, one bar per ``method`` value (first-seen order),
    each in its ``colour`` (a column; default: the project's palette by ``method``), named under it (and in the
    legend when there are several groups), its value written above it (4 significant digits).

    With ``low_s`` and ``high_s`` columns, each bar that has them carries its confidence interval as an error bar
    (asymmetric: the interval of a median need not be centred on it), and its label gives the interval too. ``note``
    is a second line under the title.
    """
    frame = frame.reset_index(drop=True)
    groups = list(dict.fromkeys(frame["group"]))
    methods = list(dict.fromkeys(frame["method"]))
    width = 0.8 / max(len(methods), 1)
    figure = Figure(figsize=(max(6.5, 0.6 * len(groups) * len(methods) + 3.0), 5.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    low = frame["low_s"] if "low_s" in frame else pd.Series(math.nan, index=frame.index)
    high = frame["high_s"] if "high_s" in frame else pd.Series(math.nan, index=frame.index)
    with_intervals = bool((low.notna() & high.notna()).any())
    ticks: list[tuple[float, str]] = []
    for i, method in enumerate(methods):
        for g, group in enumerate(groups):
            chosen = frame[(frame["method"] == method) & (frame["group"] == group)]
            if chosen.empty or not math.isfinite(float(chosen["step_time_s"].iloc[0])):
                continue
            row = chosen.index[0]
            height, lo, hi = (float(str(series.at[row])) for series in (frame["step_time_s"], low, high))
            position = g + (i - (len(methods) - 1) / 2) * width
            colour = str(frame.at[row, "colour"]) if "colour" in frame else method_colour(str(method))
            known = math.isfinite(lo) and math.isfinite(hi)
            errors = [[max(height - lo, 0.0)], [max(hi - height, 0.0)]] if known else None
            axes.bar(
                [position], [height], width=width * 0.9, color=colour, yerr=errors, capsize=3, ecolor="#333333",
                label=str(method) if g == 0 else None,
            )  # fmt: skip
            text = seconds_interval(height, lo, hi) if known else seconds(height)
            top = hi if known else height
            axes.annotate(
                text, (position, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                rotation=90, fontsize=7,
            )  # fmt: skip
            ticks.append((position, str(method)))
    _name_bars(axes, groups, ticks)
    axes.set_ylabel("step time (s)")
    if with_intervals:
        note = "; ".join(t for t in ("measured: median and its confidence interval", note) if t)
    titled = title if len(groups) > 1 else f"{title}: {groups[0]}".replace("\n", ", ") if groups else title
    axes.set_title("\n".join([titled, *textwrap.wrap(note, 72)]), fontsize=9)
    axes.set_ylim(0, axes.get_ylim()[1] * 1.8)  # room for the labels above the bars
    axes.grid(axis="y", alpha=0.3)
    return _save_png(figure, path)


def _name_bars(axes: Axes, groups: Sequence[str], ticks: Sequence[tuple[float, str]]) -> None:
    """One group: each bar named under it. Several: the groups under the axis, the methods in a legend."""
    if len(groups) == 1:
        axes.set_xticks([p for p, _ in ticks], [name for _, name in ticks], rotation=30, ha="right")
    else:
        axes.set_xticks(range(len(groups)), groups)
        axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _save_png(figure: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=120)
    return out
