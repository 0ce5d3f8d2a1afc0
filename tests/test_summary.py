"""The experiment's result as people read it (tasks.summary): the verdict, the rounded table, the plan line."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

from tapp_core.metrics import Measurement
from tapp_core.plan import Plan, single_stage_plan
from tasks.evaluate import Evaluation
from tasks.summary import Links, markdown_table, result_frame, result_markdown, shown_frame, verdict
from tests.factories import chain_library

LIBRARY = chain_library(4)


def evaluation(
    method: str, step_time_s: float, devices: tuple[str, ...] = ("cpu0",), measured: bool = True
) -> Evaluation:
    plan = single_stage_plan(LIBRARY, list(devices), planner=method)
    estimate: Any = SimpleNamespace(step_time=step_time_s * 1.1, communication_share=0.25)
    measurement = Measurement(
        plan.id, step_time_s=step_time_s, step_time_spread_s=0.001234567, communication_share=0.125
    )
    return Evaluation(method, f"run-{method}", plan, estimate, measurement if measured else None)


def test_verdict_names_the_fastest_and_where_tapp_stands() -> None:
    evaluations = {e.method: e for e in (evaluation("tapp", 0.3), evaluation("bsp", 0.6), evaluation("even", 0.2))}
    frame = result_frame(evaluations)
    assert list(frame["method"]) == ["even", "tapp", "bsp"]
    assert (
        verdict(frame)
        == "**Fastest: even**, 0.2 s per step (measured median); TAPP 0.3 s, place 2 of 3; BSP/TAPP 2.00x."
    )
    assert verdict(frame, ["evaluation of oracle"]).endswith("Failed: evaluation of oracle (see their runs).")


def test_equal_times_share_the_first_place_and_tapp_leads_them() -> None:
    evaluations = {e.method: e for e in (evaluation("oracle", 0.5), evaluation("tapp", 0.5), evaluation("bsp", 0.7))}
    frame = result_frame(evaluations)
    assert list(frame["method"]) == ["tapp", "oracle", "bsp"]
    assert verdict(frame).startswith("**Fastest: tapp, oracle** (equal), 0.5 s per step")
    assert "place" not in verdict(frame)


def test_the_table_is_rounded_and_keeps_its_cells() -> None:
    evaluations = {
        "tapp": evaluation("tapp", 0.123456789, ("cpu0", "cpu1")),
        "bsp": evaluation("bsp", 0.3, measured=False),
    }
    frame = result_frame(evaluations)
    lines = markdown_table(frame).splitlines()
    assert lines[0].startswith("| method | step time (s) | spread (s) | source | vs TAPP |")
    assert lines[2] == "| tapp | 0.1235 | 0.001235 | measured | 1.00x | 12.5% | 1 | cpu0+cpu1 | 1 | gpipe |"
    assert lines[3].startswith("| bsp | 0.33 | – | estimated | 2.67x | 25.0% |")
    assert all(line.count("|") == 11 for line in lines)  # no cell splits the table
    assert shown_frame(frame).loc[0, "step_time_s"] == 0.1235 and frame.loc[0, "step_time_s"] == 0.123456789
    assert math.isnan(shown_frame(frame).loc[1, "step_time_spread_s"])


def test_the_text_has_the_verdict_first_then_the_table_plan_and_links() -> None:
    links = Links(report_folder="/out/report", report_run="http://ui/#/r", runs_view="http://ui/#/v", flow_run=None)
    text = result_markdown("m on c", {"tapp": evaluation("tapp", 0.2)}, links)
    lines = text.splitlines()
    assert lines[0] == "### m on c" and lines[2].startswith("**Fastest: tapp**")
    plan: Plan = single_stage_plan(LIBRARY, ["cpu0"])
    assert f"TAPP's plan `{plan.id}`: 1 stage(s) on cpu0, 1 micro-batches, gpipe schedule; estimated 0.22 s" in text
    assert "Report: [tables and figures](http://ui/#/r), also written to `/out/report`." in text
    assert "[runs view](http://ui/#/v)" in text and "Prefect" not in text


def raced(method: str, median: float, low: float, high: float, devices: tuple[str, ...] = ("cpu0",)) -> Evaluation:
    """An evaluation measured in a race of 5 rounds, with its interval."""
    plain = evaluation(method, median, devices)
    assert plain.measurement is not None
    measured = dataclasses.replace(plain.measurement, rounds=5, interval_low_s=low, interval_high_s=high, coverage=0.94)
    return dataclasses.replace(plain, measurement=measured)


def test_raced_methods_inside_the_noise_are_a_best_group_not_a_winner() -> None:
    evaluations = {
        e.method: e
        for e in (
            raced("single-cpu", 0.371, 0.36, 0.39),
            raced("tapp", 0.382, 0.378, 0.40),
            raced("bsp", 1.68, 1.6, 1.8),
        )
    }
    frame = result_frame(evaluations)
    assert list(frame["best_group"]) == [True, True, False]
    assert verdict(frame) == (
        "**Best group: single-cpu, tapp**, medians 0.371–0.382 s per step, within the noise of each other (raced); "
        "TAPP 0.382 s, in the best group; BSP/TAPP 4.40x."
    )
    lines = markdown_table(frame).splitlines()
    assert lines[2].startswith("| single-cpu | **0.371 ± 0.015** |") and lines[4].startswith("| bsp | 1.68 ± 0.1 |")
    alone = result_frame({"tapp": raced("tapp", 0.3, 0.29, 0.31), "bsp": raced("bsp", 0.6, 0.5, 0.7)})
    assert verdict(alone).startswith("**Fastest: tapp**, 0.3 s per step, its interval clear of every other's (raced)")
