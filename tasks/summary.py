"""An experiment's result as people read it: a verdict first, the table of methods, TAPP's chosen plan, the links.

One text for every place that shows it: the parent run's description in MLflow, the ``tapp-result`` markdown
artifact and the log in Prefect. Numbers are rounded here, for reading (``tasks.prefect_ui.SIGNIFICANT_DIGITS``);
the MLflow metrics and the report's CSV files keep every digit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from tapp_core.plan import Plan
from tapp_core.stats import best_group
from tasks.evaluate import Evaluation
from tasks.prefect_ui import SIGNIFICANT_DIGITS, shown

COLUMNS = (
    "method",
    "step_time_s",
    "step_time_low_s",
    "step_time_high_s",
    "best_group",
    "step_time_spread_s",
    "step_time_source",
    "relative_to_tapp",
    "communication_share",
    "stages",
    "stage_devices",
    "micro_batches",
    "schedule",
    "plan_id",
    "run_id",
)


@dataclass(frozen=True)
class Links:
    """Where to look further: MLflow pages (``None`` when unknown) and the report's folder."""

    report_folder: str
    report_run: str | None = None
    """The report run's ``report/`` artifacts in the MLflow UI."""
    runs_view: str | None = None
    """The runs list in TAPP's saved view."""
    flow_run: str | None = None
    """The Prefect flow run's page."""


def result_frame(evaluations: Mapping[str, Evaluation]) -> pd.DataFrame:
    """One row per evaluated method, fastest first (TAPP first among equals): step time (measured median, else the
    estimate), its interval when raced and whether it is in the best group (``tapp_core.stats.best_group``), its
    spread and source, its ratio to TAPP's, communication share, and the plan's shape. Values unrounded."""
    tapp = evaluations.get("tapp")
    intervals = [e.ok_measurement.interval if e.ok_measurement is not None else None for e in evaluations.values()]
    group = {list(evaluations)[i] for i in best_group(intervals)}
    rows = []
    for (method, evaluation), interval in zip(evaluations.items(), intervals, strict=True):
        plan, measured = evaluation.plan, evaluation.ok_measurement
        rows.append(
            {
                "method": method,
                "step_time_s": evaluation.step_time_s,
                "step_time_low_s": interval.low if interval is not None else math.nan,
                "step_time_high_s": interval.high if interval is not None else math.nan,
                "best_group": method in group,
                "step_time_spread_s": measured.step_time_spread_s if measured is not None else math.nan,
                "step_time_source": "measured" if measured is not None else "estimated",
                "relative_to_tapp": evaluation.step_time_s / tapp.step_time_s if tapp is not None else math.nan,
                "communication_share": evaluation.communication_share,
                "stages": plan.n_stages,
                "stage_devices": plan_devices(plan),
                "micro_batches": plan.micro_batches,
                "schedule": plan.schedule,
                "plan_id": plan.id,
                "run_id": evaluation.run_id,
            }
        )
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame["_not_tapp"] = frame["method"] != "tapp"  # TAPP first among equal times
    ordered = frame.sort_values(["step_time_s", "_not_tapp", "method"], kind="stable")
    return ordered.drop(columns="_not_tapp").reset_index(drop=True)


def plan_devices(plan: Plan) -> str:
    """Stages in pipeline order, ``→`` between them, ``+`` between the replicas of one stage (no ``|``: it would
    split a Markdown table's cell)."""
    return " → ".join("+".join(devices) for devices in plan.stage_devices)


def number(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.{SIGNIFICANT_DIGITS}g}"


def ratio(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.2f}x"


def shown_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its floats rounded as they are shown (the MLflow metrics keep every digit)."""
    rounded = frame.copy()
    for column in rounded.columns:
        if rounded[column].dtype.kind == "f":
            rounded[column] = rounded[column].map(shown)
    return rounded


def verdict(frame: pd.DataFrame, failed: Sequence[str] = ()) -> str:
    """One line: when the methods were raced, the best group (every method whose interval overlaps the fastest's:
    no winner is declared among them) and whether TAPP is in it; else the method(s) with the shortest step time
    (methods whose times are equal share a place) and where TAPP stands. Then BSP/TAPP and what failed."""
    if frame.empty:
        return "No method finished." + (f" Failed: {', '.join(failed)}." if failed else "")
    times = dict(zip(frame["method"], frame["step_time_s"].astype(float), strict=True))
    text = _raced_verdict(frame, times) if frame["best_group"].any() else _fastest_verdict(frame, times)
    if "tapp" in times and "bsp" in times:
        text += f"; BSP/TAPP {ratio(times['bsp'] / times['tapp'])}"
    text += "."
    if failed:
        text += f" Failed: {', '.join(failed)} (see their runs)."
    return text


def _fastest_verdict(frame: pd.DataFrame, times: dict[str, float]) -> str:
    best = min(times.values())
    fastest = [method for method, time in times.items() if time == best]
    source = frame.loc[frame["method"] == fastest[0], "step_time_source"].iloc[0]
    how = "measured median" if source == "measured" else "estimated by the cost model"
    tied = " (equal)" if len(fastest) > 1 else ""
    text = f"**Fastest: {', '.join(fastest)}**{tied}, {number(best)} s per step ({how})"
    if "tapp" in times and "tapp" not in fastest:
        rank = 1 + sum(time < times["tapp"] for time in times.values())
        text += f"; TAPP {number(times['tapp'])} s, place {rank} of {len(times)}"
    return text


def _raced_verdict(frame: pd.DataFrame, times: dict[str, float]) -> str:
    group = [str(m) for m in frame.loc[frame["best_group"], "method"]]
    span = [times[m] for m in group]
    medians = number(span[0]) if len(group) == 1 else f"{number(min(span))}–{number(max(span))}"
    if len(group) == 1:
        text = f"**Fastest: {group[0]}**, {medians} s per step, its interval clear of every other's (raced)"
    else:
        text = (
            f"**Best group: {', '.join(group)}**, medians {medians} s per step, within the noise of each other (raced)"
        )
    if "tapp" in times:
        where = "in the best group" if "tapp" in group else "not in the best group"
        text += f"; TAPP {number(times['tapp'])} s, {where}"
    return text


def markdown_table(frame: pd.DataFrame) -> str:
    """The result table in Markdown, rounded: method, step time, spread, source, vs TAPP, communication, plan."""
    columns = [
        ("method", "---"),
        ("step time (s)", "---:"),
        ("spread (s)", "---:"),
        ("source", "---"),
        ("vs TAPP", "---:"),
        ("communication", "---:"),
        ("stages", "---:"),
        ("devices", "---"),
        ("micro-batches", "---:"),
        ("schedule", "---"),
    ]
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "| " + " | ".join(a for _, a in columns) + " |"]
    for row in frame.to_dict("records"):
        share = float(row["communication_share"])
        cells = [
            str(row["method"]),
            _time_cell(row),
            number(float(row["step_time_spread_s"])),
            str(row["step_time_source"]),
            ratio(float(row["relative_to_tapp"])),
            f"{100 * share:.1f}%" if math.isfinite(share) else "–",
            str(row["stages"]),
            str(row["stage_devices"]),
            str(row["micro_batches"]),
            str(row["schedule"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _time_cell(row: Mapping[Any, object]) -> str:
    """The step time, ``± half its interval`` when raced, bold in the best group."""
    text = number(float(str(row["step_time_s"])))
    low, high = float(str(row["step_time_low_s"])), float(str(row["step_time_high_s"]))
    if math.isfinite(low) and math.isfinite(high):
        text += f" ± {number((high - low) / 2)}"
    return f"**{text}**" if row["best_group"] is True else text


def plan_line(plan: Plan, estimated_step_time_s: float | None = None) -> str:
    """TAPP's chosen plan in one line."""
    text = (
        f"plan `{plan.id}`: {plan.n_stages} stage(s) on {plan_devices(plan)}, {plan.micro_batches} micro-batches, "
        f"{plan.schedule} schedule"
    )
    if estimated_step_time_s is not None:
        text += f"; estimated {number(estimated_step_time_s)} s per step"
    return text


def result_markdown(title: str, evaluations: Mapping[str, Evaluation], links: Links, failed: Sequence[str] = ()) -> str:
    """The whole text: title, verdict, table, TAPP's plan, links."""
    frame = result_frame(evaluations)
    parts = [f"### {title}", "", verdict(frame, failed), "", markdown_table(frame), ""]
    tapp = evaluations.get("tapp")
    if tapp is not None:
        parts += [f"TAPP's {plan_line(tapp.plan, tapp.estimate.step_time)}.", ""]
    parts.append(
        "Step time: one training step of the whole mini-batch; when measured, the median over the rounds of one race"
        " of every method's plan ± half its confidence interval, bold for the best group (intervals overlapping the"
        " fastest's); vs TAPP: step time / TAPP's."
    )
    report = f"[tables and figures]({links.report_run})" if links.report_run else "tables and figures"
    parts += ["", f"Report: {report}, also written to `{links.report_folder}`."]
    if links.runs_view:
        parts.append(f"All method runs by step time: [runs view]({links.runs_view}).")
    if links.flow_run:
        parts.append(f"Prefect flow run: [{links.flow_run}]({links.flow_run}).")
    return "\n".join(parts) + "\n"
