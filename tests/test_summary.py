"""The experiment's result (tasks.summary): each fact computed once, every view showing the same numbers."""

from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace
from typing import Any

from reports.numbers import ratio, ratio_interval, rounded, seconds, seconds_interval
from tapp_core.measure.metrics import Measurement
from tapp_core.measure.races import RaceOptions, run_race
from tapp_core.measure.stats import proportion_interval
from tapp_core.plan.plan import Plan, single_stage_plan
from tasks.evaluate import Evaluation
from tasks.summary import (
    Accuracy,
    FinalRace,
    Links,
    PlanTime,
    Result,
    SearchStory,
    accuracy_sentence,
    build_result,
    markdown,
    markdown_table,
    method_view,
    parent_metrics,
    result_record,
    search_sentences,
    sentences,
    table_records,
)
from tests.factories import chain_library

LIBRARY = chain_library(4)
LINKS = Links(report_folder="/out/tapp/RUN", report_run="http://ui/#/r", runs_view="http://ui/#/v", flow_run=None)


def evaluation(
    method: str,
    step_time_s: float,
    devices: tuple[str, ...] = ("cpu0",),
    measured: bool = True,
    schedule: str = "gpipe",
) -> Evaluation:
    plan = dataclasses.replace(single_stage_plan(LIBRARY, list(devices), planner=method), schedule=schedule)
    estimate: Any = SimpleNamespace(
        step_time_s=step_time_s if not measured else step_time_s * 1.1, communication_share=0.25
    )
    measurement = Measurement(plan.id, step_time_s=step_time_s, communication_share=0.125)
    return Evaluation(method, f"run-{method}", plan, estimate, measurement if measured else None, 0.5)


def estimated(*pairs: tuple[str, float]) -> dict[str, Evaluation]:
    return {m: evaluation(m, t, measured=False) for m, t in pairs}


def test_the_fastest_estimate_and_where_tapp_stands() -> None:
    evaluations = {
        "tapp": evaluation("tapp", 0.3, ("cpu0", "cpu1"), measured=False),
        "bsp": evaluation("bsp", 0.6, ("cpu0", "cpu2"), measured=False),
        "even": evaluation("even", 0.2, ("cpu1",), measured=False),
    }
    result = build_result("m on c", evaluations, LINKS, failed=["evaluation of oracle"])
    assert [m.method for m in result.methods] == ["even", "tapp", "bsp"]
    assert result.verdict == (
        "Fastest: even, 0.2000 s per step (estimated by the cost model). TAPP: 0.3000 s, place 2 of 3. "
        "BSP/TAPP: 2.00x (ratio of step times). Failed: evaluation of oracle (see their runs)."
    )
    assert result.best_group == ["even"]  # an estimate-only run has a best group too: the fastest estimate(s)


def test_a_method_with_no_plan_that_fits_has_a_row_that_says_so() -> None:
    evaluations = {"tapp": evaluation("tapp", 0.3, ("cpu0", "cpu1")), "bsp": evaluation("bsp", 0.6, ("cpu0", "cpu1"))}
    reason = "no cpu device of cluster 'c' can train the whole model: out of memory on device 'cpu0'"
    result = build_result("m on c", evaluations, LINKS, unfit={"single-cpu": reason})
    assert [m.method for m in result.methods] == ["tapp", "bsp"] and not result.failed
    assert result.verdict.endswith("No plan fits the memory: single-cpu.")
    row = markdown_table(result).splitlines()[-1]
    assert row.startswith("| single-cpu | does not fit |") and "out of memory on device 'cpu0'" in row
    assert table_records(result)[-1] == {
        "method": "single-cpu", "step time (s)": "does not fit", "source": "", "best_group": False, "plan": reason,
    }  # fmt: skip


def test_equal_estimates_share_the_first_place_and_tapp_leads_them() -> None:
    evaluations = {
        "oracle": evaluation("oracle", 0.5, ("cpu1",), measured=False),
        "tapp": evaluation("tapp", 0.5, measured=False),
        "bsp": evaluation("bsp", 0.7, ("cpu0", "cpu1"), measured=False),
    }
    result = build_result("m", evaluations, LINKS)
    assert [m.method for m in result.methods] == ["tapp", "oracle", "bsp"]
    assert result.verdict.startswith("Fastest: tapp and oracle (equal estimates), 0.5000 s per step")
    assert "place" not in result.verdict and result.best_group == ["tapp", "oracle"]
    records = table_records(result)
    assert [r["best_group"] for r in records] == [True, True, False]
    assert all(math.isnan(float(str(r["step_time_low_s"]))) for r in records)  # an estimate has no interval
    assert records[0]["step time (s)"] == "0.5000" and records[0]["source"] == "estimated"


def test_plans_that_run_the_same_are_said_to_be_one() -> None:
    """SingleCPU's gpipe plan and TAPP's 1f1b plan of the one device run the same; the oracle's is SingleCPU's."""
    evaluations = {
        "single-cpu": evaluation("single-cpu", 0.19, measured=False),
        "tapp": evaluation("tapp", 0.19, measured=False, schedule="1f1b"),
        "oracle": evaluation("oracle", 0.19, measured=False),
    }
    result = build_result("m", evaluations, LINKS)
    assert {m.method: m.same_as for m in result.methods} == {
        "tapp": "single-cpu",
        "single-cpu": None,
        "oracle": "single-cpu",
    }
    said = sentences(result)
    assert (
        "tapp chose a plan that runs the same as single-cpu (cpu0, m=1, 1f1b: one stage, one micro-batch, "
        in "\n".join(said)
    )
    assert "oracle chose the same plan as single-cpu: both show its estimate." in said


def raced_result() -> tuple[Result, SearchStory]:
    """Four plans raced for real (``run_race``) on made-up rounds; TAPP's plan runs the same as SingleCPU's."""
    rounds = {"cpu0": [0.195, 0.194, 0.199, 0.1946, 0.1948, 0.21], "bsp": [1.06, 1.07, 1.1, 1.05, 1.068, 1.2]}
    rounds["pipe"] = [0.199, 0.2, 0.198, 0.21, 0.196, 0.19]
    plans = {
        "single-cpu": single_stage_plan(LIBRARY, ["cpu0"], planner="single-cpu"),
        "bsp": single_stage_plan(LIBRARY, ["cpu0", "cpu1"], planner="bsp"),
        "pipetorch": Plan("toy", 8, 2, "1f1b", (0, 0, 1, 1), (("cpu0",), ("cpu1",)), planner="pipetorch"),
    }
    plans["tapp"] = dataclasses.replace(plans["single-cpu"], schedule="1f1b", planner="tapp")
    which = {plans["single-cpu"].id: "cpu0", plans["bsp"].id: "bsp", plans["pipetorch"].id: "pipe"}
    count: dict[str, int] = {}

    def run_round(plan: Plan) -> Measurement:
        n = count[plan.id] = count.get(plan.id, 0) + 1
        return Measurement(plan.id, step_time_s=rounds[which[plan.id]][n - 1], communication_share=0.1, emulated=True)

    race = run_race(run_round, [plans["single-cpu"], plans["bsp"], plans["pipetorch"]], RaceOptions(max_rounds=6))
    evaluations = {}
    for method in ("tapp", "single-cpu", "bsp", "pipetorch"):
        raced = next(p for p in race.plans if p.execution_id == plans[method].execution_id)
        estimate: Any = SimpleNamespace(step_time_s=0.18, communication_share=0.0)
        evaluations[method] = Evaluation(
            method, f"run-{method}", plans[method], estimate, race.measurement(raced.id), 1.5
        )
    story = SearchStory(
        rounds=33,
        measured_rounds=3,
        search_s=33.14,
        chosen=PlanTime.of(plans["tapp"], 0.1816),
        chosen_by="race of 4 candidates",
        best_simulated=PlanTime.of(plans["tapp"], 0.1816),
        best_measured=PlanTime("p1", "2 stages on cpu0 → cpu1, 4 micro-batches, 1f1b", 2, 0.3052, 0.2013, 0.3481, 4),
        sampling_overloaded=True,
        final_race=None,
        best_pipeline=PlanTime("p2", "2 stages on cpu0 → cpu1, 2 micro-batches, 1f1b", 2, 0.2474),
        best_single=PlanTime.of(plans["single-cpu"], 0.1816),
    )
    return build_result("toy on c, batch 8", evaluations, LINKS, race, story), story


def test_the_views_of_one_result_carry_the_same_numbers() -> None:
    """Markdown (MLflow's description, Prefect's tapp-result), plain sentences (terminal, Prefect's log), the table
    records (Prefect's tapp-evaluation, MLflow's evaluation.json), the parent's metrics and each method run's name
    and description: the same verdict, step times, intervals, speedup and search best in all."""
    result, story = raced_result()
    assert result.speedup is not None and result.speedup.paired
    text, plain, records, metrics = markdown(result), sentences(result), table_records(result), parent_metrics(result)
    terminal = "\n".join(plain) + "\n" + markdown_table(result)

    assert plain[0] == result.verdict and f"**{result.verdict}**" in text
    speedup = ratio_interval(result.speedup.median, result.speedup.low, result.speedup.high)
    of_medians = ratio(result.speedup.of_step_times)
    assert f"BSP/TAPP: {speedup} (median of per-round ratios; ratio of the medians {of_medians})." in result.verdict
    paired = "speedup_bsp_over_tapp_median_of_round_ratios"
    assert metrics[paired] == float(speedup.split("x")[0])
    assert metrics["speedup_bsp_over_tapp_ratio_of_step_times"] == float(of_medians.rstrip("x"))
    low, high = re.findall(r"\[(\S+), (\S+)\]", speedup)[0]
    assert (metrics[f"{paired}_low"], metrics[f"{paired}_high"]) == (float(low), float(high))
    bsp_row = next(r for r in records if r["method"] == "bsp")
    assert bsp_row["vs_tapp"] == metrics[paired]  # "vs TAPP" is the paired speedup too, and says so
    assert bsp_row["vs_tapp_is"] == "median of per-round ratios"
    assert (bsp_row["vs_tapp_low"], bsp_row["vs_tapp_high"]) == (float(low), float(high))
    assert f"| {speedup.split(' ')[0]} |" in markdown_table(result)
    assert "| vs TAPP (median of per-round ratios) |" in markdown_table(result)

    for method in result.methods:
        shown = seconds_interval(method.step_time_s, method.low_s, method.high_s)
        assert shown in text and shown in terminal
        row = next(r for r in records if r["method"] == method.method)
        assert row["step time (s)"] == shown and row["step_time_s"] == rounded(method.step_time_s)
        assert metrics[f"{method.method}_measured_step_time_s"] == float(shown.split(" ")[0])
        name, note = method_view(result, method)
        assert name == f"{method.method} {shown} s" and result.verdict in note

    best = story.best_measured
    assert best is not None
    best_text = f"{seconds_interval(best.step_time_s, best.low_s, best.high_s)} s measured over 4 rounds"
    for view in (text, terminal):
        assert best_text in view and "on an overloaded host" in view
        assert f"{seconds(story.best_simulated.step_time_s)} s estimated" in view  # type: ignore[union-attr]
        assert "TAPP's search took 33.1 s: 33 rounds, 30 on the cost model and 3 measured" in view
        assert "TAPP's answer: do not split" in view and "estimated at 0.2474 s" in view
    assert metrics["search_sampling_best_measured_step_time_s"] == 0.3052 and metrics["tapp_search_s"] == 33.14
    assert metrics["search_sampling_best_measured_rounds"] == 4 and metrics["search_measured_rounds"] == 3
    assert (
        metrics["search_sampling_best_measured_step_time_low_s"],
        metrics["search_sampling_best_measured_step_time_high_s"],
    ) == (0.2013, 0.3481)
    assert not any(
        name.endswith("_step_time_s") and "measured" not in name and "estimated" not in name for name in metrics
    )


def test_raced_methods_inside_the_noise_are_a_best_group_not_a_winner() -> None:
    result, _ = raced_result()
    group = result.best_group
    assert group == ["tapp", "single-cpu", "pipetorch"]
    assert result.verdict.startswith("Best group: tapp = single-cpu and pipetorch, medians 0.1949–0.1985 s per step")
    assert "within the noise of each other (raced): no winner among them." in result.verdict
    lines = markdown_table(result).splitlines()
    assert lines[0].startswith(
        "| method | step time (s) | source | best group | vs TAPP (median of per-round ratios) |"
    )
    assert all(line.replace("\\|", "").count("|") == 9 for line in lines)  # no cell splits the table
    single = result.method("single-cpu")
    assert single is not None and single.same_as == "tapp" and single.measured  # TAPP's came first
    assert "±" not in markdown(result)  # intervals are [low, high], never a symmetric ±


def test_the_search_in_sentences() -> None:
    _, story = raced_result()
    said = search_sentences(story)
    assert said[0] == "TAPP's search took 33.1 s: 33 rounds, 30 on the cost model and 3 measured on the workers."
    assert said[-1] == (
        "TAPP's answer: do not split (cpu0, m=1, 1f1b). The best plan over several devices it found was estimated at "
        "0.2474 s (2 stages on cpu0 → cpu1, 2 micro-batches, 1f1b), the best single device at 0.1816 s (cpu0, m=1, "
        "gpipe)."
    )
    race = FinalRace(5, 12, "max rounds", False, story.chosen, 3)
    rated_faster = dataclasses.replace(
        story, best_pipeline=PlanTime("p3", "2 stages on cpu0 → cpu2", 2, 0.17), final_race=race
    )
    assert search_sentences(rated_faster)[-1].endswith(
        "the best single device at 0.1816 s (cpu0, m=1, gpipe). The cost model rated the split faster; measured, the "
        "single device was as fast or faster (the final race's winner)."
    )
    split = dataclasses.replace(story, chosen=PlanTime("p2", "2 stages on cpu0 → cpu1", 2, 0.15))
    assert search_sentences(split)[-1].startswith("TAPP's answer: split, 2 stages on cpu0 → cpu1, estimated 0.1500 s")


def test_the_accuracy_is_in_the_description_the_metrics_and_the_sentences() -> None:
    accuracy = [
        Accuracy("tapp", proportion_interval(0.49, 1000), 6400),
        Accuracy("single-cpu", proportion_interval(0.653, 1000), 6400),
        Accuracy("bsp", proportion_interval(0.653, 1000), 6400, trained_as="single-cpu"),
    ]
    result = build_result("m", estimated(("tapp", 0.2), ("single-cpu", 0.3), ("bsp", 0.25)), LINKS, accuracy=accuracy)
    sentence = accuracy_sentence(result)
    assert sentence.startswith("Test accuracy after 6,400 training images each (95% Wilson interval over 1,000")
    assert "tapp 49.0 % [45.9, 52.1]" in sentence and "bsp 65.3 % [62.3, 68.2] (single-cpu's training)" in sentence
    assert sentence in markdown(result) and sentence in sentences(result)
    metrics = parent_metrics(result)
    assert metrics["tapp_test_accuracy"] == 0.49 and abs(metrics["tapp_test_accuracy_low"] - 0.459) < 1e-3
    assert metrics["bsp_test_accuracy_high"] > 0.65
    untrained = build_result("m", estimated(("tapp", 0.2)), LINKS)
    assert accuracy_sentence(untrained) == "" and not any("accuracy" in k for k in parent_metrics(untrained))
    assert result_record(untrained)["accuracy"] == []
    stored = result_record(result)["accuracy"]
    assert isinstance(stored, list) and stored[2] == {
        "method": "bsp",
        "test_accuracy": 0.653,
        "low": rounded(accuracy[2].accuracy.low),
        "high": rounded(accuracy[2].accuracy.high),
        "interval": "Wilson 95%",
        "test_samples": 1000,
        "train_samples": 6400,
        "trained_as": "single-cpu",
    }


def test_the_stored_result_is_plain_json_with_the_numbers_every_view_shows() -> None:
    """``result.json`` (what the report reads) holds the table's rows and the speedup as shown, each ratio saying
    which it is, and reads back as strict JSON (no NaN)."""
    import json

    result, _ = raced_result()
    record = json.loads(json.dumps(result_record(result), allow_nan=False))
    assert record["verdict"] == result.verdict and record["vs_tapp_is"] == "median of per-round ratios"
    assert [r["method"] for r in record["methods"]] == [m.method for m in result.methods]
    shown = {r["method"]: r for r in table_records(result)}
    for row in record["methods"]:
        assert row["step time (s)"] == shown[row["method"]]["step time (s)"]
        assert row["vs_tapp"] == shown[row["method"]]["vs_tapp"]
    speedup = record["speedup_bsp_over_tapp"]
    assert speedup["median"] == parent_metrics(result)["speedup_bsp_over_tapp_median_of_round_ratios"]
    assert speedup["is"] == "median of per-round ratios"
