"""One fact, one number, everywhere a user looks: two real ``tapp run`` commands (one estimate-only, one measured on
MPI workers, small models), and the same verdict, speedup, step times, best group and search best found in the
terminal's output, the parent run's description, the MLflow metrics, Prefect's artifacts and log, and the report's
CSV. Also: reports of two experiments do not overwrite one another.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.sorting import LogSort
from typer.testing import CliRunner

from flows.cli import app
from flows.server import send_pending_logs_and_events
from reports import runs, schema
from reports.report_folders import MARKER
from tasks.tracking import NOTE_TAG

METHODS = ("tapp", "single-cpu", "bsp", "pipetorch")
LABELS = {"tapp": "TAPP", "single-cpu": "SingleCPU", "bsp": "BSP", "pipetorch": "Pipe-Torch"}
SPEEDUP = re.compile(
    r"BSP/TAPP: (\S+)x(?: \[(\S+), (\S+)\])? \((median of per-round ratios|ratio of step times)[^)]*\)\."
)


@dataclass
class Seen:
    """What one ``tapp run`` left, view by view."""

    terminal: str
    note: str
    parent: Any  # mlflow Run
    methods: dict[str, Any]  # method -> its evaluation run
    sampling: Any
    artifacts: dict[str, Any]  # Prefect artifact key -> artifact
    logs: list[str]
    report: Path

    @property
    def verdict(self) -> str:
        lines = self.terminal.splitlines()
        return next(line for line in lines if line.startswith(("Fastest: ", "Best group: ")))


def tapp_run(uri: str, experiment: str, *args: str) -> Seen:
    """``tapp run`` through the command line, then everything it left, read back from MLflow and Prefect."""
    command = ["run", "--methods", ",".join(METHODS), "--experiment", experiment, "--tracking-uri", uri, *args]
    done = CliRunner().invoke(app, command, terminal_width=400)
    assert done.exit_code == 0, done.output
    client = MlflowClient(uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    (parent,) = client.search_runs([experiment_id], f"tags.{schema.KIND} = '{schema.EXPERIMENT}'")
    nested = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    methods = {r.data.tags[schema.METHOD]: r for r in nested if r.data.tags.get(schema.KIND) == schema.EVALUATION}
    sampling = next(r for r in nested if r.data.tags.get(schema.STAGE) == "sampling")
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    send_pending_logs_and_events()
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        logs = prefect.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC
        )
    report = Path.cwd() / "out" / experiment / parent.info.run_id  # the default: out/EXPERIMENT/RUN_ID
    return Seen(
        terminal=done.output,
        note=parent.data.tags[NOTE_TAG],
        parent=parent,
        methods=methods,
        sampling=sampling,
        artifacts={a.key: a for a in artifacts if a.key},
        logs=[log.message for log in logs],
        report=report,
    )


@pytest.fixture(scope="module")
def seen(
    prefect_harness: None, mlflow_store: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Seen]]:
    """One estimate-only run (an MLP) and one measured run (a tiny CNN on real MPI workers, one measured search
    round), in one working folder."""
    folder = tmp_path_factory.mktemp("views")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("TAPP_CACHE_DIR", str(folder / ".tapp"))
        quick = ("--rounds", "3", "--samples-per-round", "4", "--train-seconds", "0")  # training: tests/test_flows.py
        estimated = tapp_run(
            mlflow_store, "views-estimated", "--model", "mlp", "--batch-size", "8", "--estimate-only", *quick
        )
        measured = tapp_run(
            mlflow_store,
            "views-measured",
            "--model",
            "tiny_cnn",
            "--batch-size",
            "16",
            "--measured-rounds",
            "1",
            "--race-seconds",
            "8",  # a short race: its figure is the same in every view whatever its rounds (tests/test_flows.py: 5+)
            *quick,
        )
        yield {"estimated": estimated, "measured": measured}


def shown_float(text: str) -> float:
    return float(text.rstrip("x"))


@pytest.mark.parametrize("mode", ["estimated", "measured"])
def test_every_view_shows_the_same_verdict_speedup_and_step_times(seen: dict[str, Seen], mode: str) -> None:
    views = seen[mode]
    verdict = views.verdict
    assert f"**{verdict}**" in views.note  # the parent's description
    assert views.artifacts["tapp-result"].data == views.note  # Prefect's Markdown artifact
    assert verdict in views.logs  # Prefect's log, a plain sentence
    assert not any(m.startswith(("|", "###")) or "**" in m for m in views.logs)  # no Markdown in the log
    for run in views.methods.values():
        assert verdict in run.data.tags[NOTE_TAG]  # each method run's description

    # The speedup, to the digits shown: the verdict, the parent's metrics, the report's CSV, Prefect's table.
    median, low, high, kind = SPEEDUP.search(verdict).groups()  # type: ignore[union-attr]
    metrics = views.parent.data.metrics
    speedup = schema.SPEEDUP_PAIRED if mode == "measured" else schema.SPEEDUP_OF_STEP_TIMES
    assert kind == (schema.RATIO_PAIRED if mode == "measured" else schema.RATIO_OF_STEP_TIMES)
    assert metrics[speedup] == shown_float(median)
    csv = pd.read_csv(views.report / "step_time.csv")
    assert csv.loc[0, "speedup BSP/TAPP"] == shown_float(median)
    table = json.loads(views.artifacts["tapp-evaluation"].data)
    assert next(r for r in table if r["method"] == "bsp")["vs_tapp"] == shown_float(median)
    if mode == "measured":
        assert (metrics[f"{speedup}_low"], metrics[f"{speedup}_high"]) == (float(low), float(high))
        assert (csv.loc[0, "speedup BSP/TAPP low"], csv.loc[0, "speedup BSP/TAPP high"]) == (float(low), float(high))
    else:
        assert low is None and schema.SPEEDUP_PAIRED not in metrics

    # Each method's step time (and interval): the terminal's table, the description's, Prefect's table, the
    # method run's metrics and name, the parent's metrics, the report's CSV.
    for method in METHODS:
        row = next(r for r in table if r["method"] == method)
        shown = str(row["step time (s)"])
        cells = [line for line in views.terminal.splitlines() if line.startswith(f"| {method} |")]
        assert len(cells) == 1 and f"| {shown} |" in cells[0].replace("**", "")
        assert f"| {method} | **{shown}** |" in views.note or f"| {method} | {shown} |" in views.note
        run = views.methods[method]
        median_text, *interval = shown.replace("[", "").replace("]", "").replace(",", "").split()
        assert run.data.metrics[schema.STEP_TIME] == float(median_text) == row["step_time_s"]
        assert metrics[f"{method}_{row['source']}_step_time_s"] == float(median_text) == csv.loc[0, LABELS[method]]
        assert run.info.run_name.startswith(f"{method} {shown} s")
        assert run.data.tags[schema.BEST_GROUP] == str(row["best_group"]).lower()
        if mode == "measured":
            assert [run.data.metrics[schema.STEP_TIME_LOW], run.data.metrics[schema.STEP_TIME_HIGH]] == [
                float(v) for v in interval
            ]
            assert [csv.loc[0, f"{LABELS[method]} low"], csv.loc[0, f"{LABELS[method]} high"]] == [
                float(v) for v in interval
            ]
            assert bool(csv.loc[0, f"{LABELS[method]} best"]) is row["best_group"]
        else:
            assert interval == [] and math.isnan(float(row["step_time_low_s"] or "nan"))
    best = [r["method"] for r in table if r["best_group"]]
    assert best and all(m in verdict for m in best)  # the verdict names the best group, estimate-only included


@pytest.mark.parametrize("mode", ["estimated", "measured"])
def test_every_view_tells_the_search_the_same(seen: dict[str, Seen], mode: str) -> None:
    views = seen[mode]
    said = [
        line
        for line in views.terminal.splitlines()
        if line.startswith(("TAPP's search took", "Its best plan", "TAPP's answer"))
    ]
    assert said and said[0].startswith("TAPP's search took") and said[-1].startswith("TAPP's answer: ")
    for sentence in said:
        assert sentence in views.note and sentence in views.logs
    by_model = next(s for s in said if s.startswith("Its best plan by the cost model"))
    estimate = re.search(r", (\S+) s estimated\.$", by_model).group(1)  # type: ignore[union-attr]
    assert views.parent.data.metrics["search_best_estimated_step_time_s"] == float(estimate)
    assert views.sampling.data.metrics["best_estimated_step_time_s"] == float(estimate)
    planning = views.methods["tapp"].data.metrics["planning_wall_s"]
    assert planning == pytest.approx(views.parent.data.metrics["tapp_search_s"], rel=1e-3) and planning > 0.05
    if mode == "measured":
        by_runtime = next(s for s in said if s.startswith("Its best plan measured while sampling"))
        median, low, high = re.search(r", (\S+) \[(\S+), (\S+)\] s measured over", by_runtime).groups()  # type: ignore[union-attr]
        for metrics, prefix in ((views.parent.data.metrics, "search_sampling_"), (views.sampling.data.metrics, "")):
            assert metrics[f"{prefix}best_measured_step_time_s"] == float(median)
            assert metrics[f"{prefix}best_measured_step_time_low_s"] == float(low)
            assert metrics[f"{prefix}best_measured_step_time_high_s"] == float(high)
        final = "The search's final race of "  # the search's own race, not the evaluation race of the headline
        assert final in views.note and any(s.startswith(final) for s in views.logs)


def test_tapp_has_one_step_time_in_every_view_each_named_by_its_source(
    seen: dict[str, Seen], mlflow_store: str
) -> None:
    """The measured run: TAPP's headline step time is the evaluation race's, the same in the terminal, the parent's
    description and metrics, its evaluation run, Prefect's table, the stored result and the report; every step-time
    metric's name says whether it was measured or estimated, and the search's own figures are named as the
    search's."""
    views = seen["measured"]
    table = json.loads(views.artifacts["tapp-evaluation"].data)
    tapp = next(r for r in table if r["method"] == "tapp")
    shown, median = str(tapp["step time (s)"]), float(tapp["step_time_s"])
    assert tapp["source"] == "measured"
    run, parent = views.methods["tapp"], views.parent.data.metrics
    figures = {
        "terminal": next(line for line in views.terminal.splitlines() if line.startswith("| tapp |")),
        "description": next(line for line in views.note.splitlines() if line.startswith("| tapp |")),
        "report": next(
            line for line in (views.report / "step_time.md").read_text().splitlines() if line.startswith("| tiny_cnn |")
        ),
    }
    for view, line in figures.items():
        assert shown in line.replace("**", ""), view
    assert run.data.metrics[schema.STEP_TIME] == parent["tapp_measured_step_time_s"] == median
    assert run.data.tags[schema.STEP_TIME_SOURCE] == "measured" and run.info.run_name.startswith(f"tapp {shown} s")
    assert pd.read_csv(views.report / "step_time.csv").loc[0, "TAPP"] == median
    result = runs.stored_result(MlflowClient(mlflow_store), views.parent.info.run_id)
    assert result is not None
    stored = next(r for r in result["methods"] if r["method"] == "tapp")
    assert stored["step_time_s"] == median and stored["step time (s)"] == shown
    assert parent["evaluation_race_rounds"] >= tapp_rounds(run) >= 1
    assert views.parent.data.params["race_seconds"] == "8.0"  # --race-seconds reached the run
    for metrics in (parent, views.sampling.data.metrics):
        for name in (n for n in metrics if "step_time" in n and not n.startswith("speedup_")):  # a step time
            assert "measured" in name or "estimated" in name, name
    assert not any(n.startswith("best_") and "step_time" in n for n in parent)  # the search's start with search_
    places = {method: int(r.data.metrics[schema.PLACE]) for method, r in views.methods.items()}
    assert sorted(places, key=places.__getitem__) == [r["method"] for r in table]  # the runs view's order
    # Prefect's log: TAPP's lines, without a "Finished in state Completed()" per task (the flow run's own stays).
    assert sum(m.startswith("Finished in state Completed") for m in views.logs) <= 1


def tapp_rounds(run: Any) -> int:
    return int(run.data.metrics[schema.RACE_ROUNDS])


def test_two_experiments_keep_their_reports(seen: dict[str, Seen], mlflow_store: str, tmp_path: Path) -> None:
    """Each run wrote its own folder (out/EXPERIMENT/RUN_ID), marked with its experiment; a report of another
    experiment into either folder is refused in one line, before any run exists, and the folder is left intact."""
    folders = {mode: views.report for mode, views in seen.items()}
    for mode, folder in folders.items():
        assert folder.parent.name == f"views-{mode}" and (folder / "step_time.csv").is_file()
        assert json.loads((folder / MARKER).read_text())["experiment"] == f"views-{mode}"
    before = {p.name: p.read_bytes() for p in folders["estimated"].iterdir()}
    refused = CliRunner().invoke(app, ["report", "--experiment", "views-measured", "--out", str(folders["estimated"])])
    assert refused.exit_code == 2
    assert refused.output.strip().count("\n") == 0 and "holds experiment 'views-estimated'" in refused.output
    assert {p.name: p.read_bytes() for p in folders["estimated"].iterdir()} == before
    again = CliRunner().invoke(
        app,
        [
            "run",
            "--estimate-only",
            "--experiment",
            "views-other",
            "--tracking-uri",
            mlflow_store,
            "--out",
            str(folders["measured"]),
        ],
    )
    assert again.exit_code == 2 and "holds experiment 'views-measured'" in again.output
    assert MlflowClient(mlflow_store).get_experiment_by_name("views-other") is None
