"""Real flows under the session's Prefect test server, read back from a real MLflow store.

One measured experiment (tiny CNN on the local 3-device cluster, real MPI workers) is run once for the module and
inspected by several tests; the others run cost-model-only experiments, which take seconds.
"""

from __future__ import annotations

import filecmp
import io
import json
import math
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from typer.testing import CliRunner

from flows.cli import app
from flows.experiment import ExperimentIncomplete, ExperimentResult, tapp_experiment, training_key
from flows.paper_table import paper_table
from flows.sweep import benchmark_sweep
from reports import schema
from reports.numbers import rounded, seconds_interval
from tapp_core.errors import TappError
from tapp_core.model.zoo import ModelError
from tapp_core.planners.tapp.search import FINAL_BY_ESTIMATE
from tapp_core.platform.cluster import ClusterError, load_cluster
from tapp_core.profile.library import LayerLibrary
from tasks.config import ExperimentConfig, SweepConfig, build
from tasks.profile import profile_cluster_layers
from tasks.tracking import NOTE_TAG, RUNS_VIEW, TrackingError

PAPER_METHODS = ("tapp", "single-cpu", "bsp", "pipetorch")
QUICK = {"search_rounds": 3, "samples_per_round": 8, "methods": PAPER_METHODS}


@pytest.fixture(scope="module")
def measured(
    prefect_harness: None, mlflow_store: str, fashion_mnist: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ExperimentResult, object, Path]]:
    """One measured experiment: (result, Prefect state, working folder)."""
    folder = tmp_path_factory.mktemp("measured")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
        patch.chdir(folder)
        config = ExperimentConfig(
            model="tiny_cnn",
            batch_size=16,
            dataset="fashion-mnist",  # real data: Debian's dataset-fashion-mnist
            train_seconds=1.0,  # per method, in two parts each tested on 200 test images: the plumbing is tested
            test_samples=200,
            accuracy_points=2,
            measured_rounds=1,
            measured_per_round=1,
            **{**QUICK, "search_rounds": 4},  # the last of them measured
        )
        state = tapp_experiment(
            config=config, experiment="flows-measured", out=str(folder / "report"), return_state=True
        )
        yield state.result(), state, folder


def children(client: MlflowClient, parent_id: str) -> dict[str, object]:
    """The parent's runs by name; a method's evaluation run by its method (its name carries its step time)."""
    experiment = client.get_run(parent_id).info.experiment_id
    found = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return {
        r.data.tags[schema.METHOD] if r.data.tags.get(schema.KIND) == schema.EVALUATION else r.info.run_name: r
        for r in found
    }


def test_experiment_records_every_stage_and_method(measured: tuple[ExperimentResult, object, Path]) -> None:
    result, _, _ = measured
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.run_id)
    assert parent.info.status == "FINISHED"
    for key, value in {"model": "tiny_cnn", "cluster": "local", "batch_size": "16", "emulated": "true"}.items():
        assert parent.data.tags[key] == value
    assert parent.data.params["search_rounds"] == "4"

    nested = children(client, result.run_id)
    trained = {f"train {m}" for m in PAPER_METHODS}
    assert set(nested) == {"profile", "search", "sampling", "report", *PAPER_METHODS, *trained}
    assert all(run.info.status == "FINISHED" for run in nested.values())
    for method in PAPER_METHODS:
        run = nested[method]
        assert run.data.tags[schema.METHOD] == method
        assert run.data.tags[schema.STEP_TIME_SOURCE] == "measured"
        assert run.data.metrics[schema.STEP_TIME] == rounded(result.evaluations[method].step_time_s)  # as shown
        assert run.data.metrics[schema.STEP_TIME] == rounded(run.data.metrics[schema.MEASURED_STEP_TIME])
        assert schema.ESTIMATED_STEP_TIME in run.data.metrics
        assert run.data.metrics[schema.STEP_TIME_LOW] <= run.data.metrics[schema.STEP_TIME]
        assert run.data.metrics[schema.STEP_TIME] <= run.data.metrics[schema.STEP_TIME_HIGH]
        assert run.data.metrics[schema.RACE_ROUNDS] >= 5
        assert run.data.tags[schema.RACE_ID] == nested["tapp"].data.tags[schema.RACE_ID]  # one race for every method
    speedup = parent.data.metrics[schema.SPEEDUP_PAIRED]  # the median of per-round BSP/TAPP ratios, with its interval
    assert parent.data.metrics[f"{schema.SPEEDUP_PAIRED}_low"] <= speedup
    assert speedup <= parent.data.metrics[f"{schema.SPEEDUP_PAIRED}_high"]
    assert schema.LOAD_BEFORE in parent.data.metrics and schema.HOST_OVERLOADED in parent.data.tags


def test_search_rounds_are_metrics_and_every_sampled_plan_is_a_table(
    measured: tuple[ExperimentResult, object, Path], tmp_path: Path
) -> None:
    result, _, _ = measured
    client = MlflowClient(result.tracking_uri)
    nested = children(client, result.run_id)
    for name in ("reward_mean", "entropy", schema.BEST_ESTIMATED_SO_FAR):
        assert [m.step for m in client.get_metric_history(nested["search"].info.run_id, name)] == [1, 2, 3]
    for name in ("reward_mean", schema.BEST_MEASURED_SO_FAR):  # a measured round's step times say so
        assert [m.step for m in client.get_metric_history(nested["sampling"].info.run_id, name)] == [4]
    assert not client.get_metric_history(nested["sampling"].info.run_id, schema.BEST_ESTIMATED_SO_FAR)

    sampling = nested["sampling"].info.run_id
    table = pd.read_csv(client.download_artifacts(sampling, "search/sampled_plans.csv", str(tmp_path)))
    assert len(table) == table["plan_id"].nunique() == nested["sampling"].data.metrics["sampled_plans"] > 2
    population = int(nested["search"].data.params["search_population"])  # one measured best sample per policy
    # + the final race's unmeasured ones: the best by estimate, of each schedule (TAPP's two), the warm start's
    final_unmeasured = FINAL_BY_ESTIMATE + 2 * 2 + 1
    assert 1 <= table["measured"].sum() <= population + final_unmeasured
    assert (table.loc[table["measured"], "measured_rounds"] >= 1).all()
    assert nested["sampling"].data.tags["chosen_by"].startswith("race of")
    final = json.loads(Path(client.download_artifacts(sampling, "search/final_race.json", str(tmp_path))).read_text())
    assert final["winner"] == result.evaluations["tapp"].plan.id
    assert table.loc[table["measured"], "measured_step_time_s"].notna().all()
    assert table["estimated_step_time_s"].notna().all()
    assert table["chosen"].sum() == 1
    assert table.loc[table["chosen"], "plan_id"].item() == result.evaluations["tapp"].plan.id
    # One cost model (the fitted calibration, logged on the parent) for the search and the final evaluation.
    assert table.loc[table["chosen"], "estimated_step_time_s"].item() == pytest.approx(
        nested["tapp"].data.metrics[schema.ESTIMATED_STEP_TIME]
    )
    calibration = json.loads(
        Path(client.download_artifacts(result.run_id, "calibration.json", str(tmp_path))).read_text()
    )
    for method in PAPER_METHODS:
        logged = client.download_artifacts(nested[method].info.run_id, schema.ESTIMATE_ARTIFACT, str(tmp_path / method))
        assert json.loads(Path(logged).read_text())["calibration"] == calibration

    artifacts = {
        "profile": "layer_library",
        "search": "policy",
        "report": "report",
    }
    for stage, folder in artifacts.items():
        assert client.list_artifacts(nested[stage].info.run_id, folder), f"{stage} has no {folder}/"
    names = {f.path for f in client.list_artifacts(nested["report"].info.run_id, "report")}
    assert {"report/step_time.md", "report/step_time.png", "report/gantt_tapp_tiny_cnn_local_b16.png"} <= names
    assert {f.path for f in client.list_artifacts(result.run_id, "plans")} == {f"plans/{m}.json" for m in PAPER_METHODS}


def test_report_numbers_equal_the_mlflow_metrics(measured: tuple[ExperimentResult, object, Path]) -> None:
    result, _, _ = measured
    table = pd.read_csv(result.report_dir / "step_time.csv")
    client = MlflowClient(result.tracking_uri)
    nested = children(client, result.run_id)
    labels = {"tapp": "TAPP", "single-cpu": "SingleCPU", "bsp": "BSP", "pipetorch": "Pipe-Torch"}
    for method, column in labels.items():
        assert table.loc[0, column] == nested[method].data.metrics[schema.STEP_TIME]
    assert result.step_time_table == (result.report_dir / "step_time.md").read_text()


def test_accuracy_table_holds_the_trained_plans_accuracy(measured: tuple[ExperimentResult, object, Path]) -> None:
    result, _, _ = measured
    client = MlflowClient(result.tracking_uri)
    nested = children(client, result.run_id)
    table = pd.read_csv(result.report_dir / "accuracy.csv")
    assert list(table["dataset"]) == ["Fashion-MNIST"]
    markdown = (result.report_dir / "accuracy.md").read_text()
    assert markdown.startswith("**Test accuracy after 1 s of training per method**")
    assert "accuracy on the first 200 test images" in markdown
    labels = {"tapp": "TAPP", "single-cpu": "SingleCPU", "bsp": "BSP", "pipetorch": "Pipe-Torch"}
    for method, column in labels.items():
        run = nested[f"train {method}"]
        assert run.data.tags[schema.KIND] == schema.TRAIN
        assert 0.0 <= run.data.metrics[schema.TEST_ACCURACY] <= 1.0
        assert table.loc[0, column] == run.data.metrics[schema.TEST_ACCURACY]
        steps = int(run.data.metrics[schema.TRAIN_STEPS])
        assert f"{column} {steps} steps in " in markdown  # the caption says how long each plan trained
        curve = client.get_metric_history(run.info.run_id, schema.CURVE_ACCURACY)
        assert [m.step for m in curve] == [1, 2] and curve[-1].value == run.data.metrics[schema.TEST_ACCURACY]
        # The budget is in the plan's own steps: its measured step time times its steps is about one second.
        step_time = nested[method].data.metrics[schema.STEP_TIME]
        # Within one step a part: the step time the budget was cut with and the one logged have differed by 0.6 %
        # (172 steps where 1 / 0.005747 s gives 174), which moves a boundary of the floor.
        assert abs(steps - 2 * max(1, int(1.0 / step_time) // 2)) <= 2
        # The same computation (``training_key``: every synchronous plan computes what one device does) is trained
        # once, by the first method in the training's order; the others record its result.
        key = training_key(result.evaluations[method].plan)
        first = next(m for m in labels if training_key(result.evaluations[m].plan) == key)
        assert run.data.tags.get(schema.TRAINED_AS) == (first if first != method else None)
    assert (result.report_dir / "accuracy_vs_time.png").stat().st_size > 0


def test_search_progress_is_a_prefect_artifact(measured: tuple[ExperimentResult, object, Path]) -> None:
    _, state, _ = measured
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    progress = {a.key: a.data for a in artifacts if a.type == "progress"}
    assert progress["tapp-search-progress"] == 100.0
    assert progress["tapp-sampling-progress"] == 100.0
    assert progress["tapp-evaluation-progress"] == 100.0


def test_the_parent_run_opens_on_the_result(measured: tuple[ExperimentResult, object, Path]) -> None:
    """Its description: the verdict, then the result table (rounded), TAPP's plan and a link to the report run."""
    result, _, _ = measured
    client = MlflowClient(result.tracking_uri)
    note = client.get_run(result.run_id).data.tags[NOTE_TAG]
    assert note == result.summary
    lines = note.splitlines()
    assert lines[0].startswith("### tiny_cnn on local, batch 16")
    assert lines[2].startswith(("**Fastest: ", "**Best group: ")) and "(raced)" in lines[2]
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"method", *PAPER_METHODS}
    nested = children(client, result.run_id)
    for method in PAPER_METHODS:
        step_time = nested[method].data.metrics[schema.STEP_TIME]
        cell = rows[method].split("|")[2].strip().strip("*")  # bold in the best group
        low, high = (nested[method].data.metrics[m] for m in (schema.STEP_TIME_LOW, schema.STEP_TIME_HIGH))
        assert cell == seconds_interval(step_time, low, high)  # raced: the median [low, high], as logged
    assert f"TAPP's plan {result.evaluations['tapp'].plan.id}: " in note
    report_run = nested["report"].info.run_id
    assert f"/runs/{report_run}/artifacts/report/step_time.md?workflowType=machine_learning" in note

    table = client.load_table(result.experiment_id, "evaluation.json", run_ids=[result.run_id])
    assert sorted(table["method"]) == sorted(PAPER_METHODS)
    for row in table.itertuples(index=False):
        assert row.step_time_s == pytest.approx(nested[row.method].data.metrics[schema.STEP_TIME], rel=1e-3)


def test_the_mlflow_ui_is_told_what_to_show(measured: tuple[ExperimentResult, object, Path]) -> None:
    """The saved runs view, Source and Created by, the flow run's tags, step_time_s first, the planner filled."""
    result, state, _ = measured
    client = MlflowClient(result.tracking_uri)
    view = json.loads(client.get_experiment(result.experiment_id).tags[f"mlflow.sharedViewState.{RUNS_VIEW}"])
    shown = json.loads(view["state"])
    assert shown["orderByKey"] == "metrics.`place_in_experiment`" and shown["orderByAsc"] is True
    assert shown["selectedColumns"][:6] == [
        "tags.`method`", "tags.`model`", "tags.`cluster`", "metrics.`step_time_s`", "metrics.`step_time_low_s`",
        "metrics.`step_time_high_s`",
    ]  # fmt: skip

    flow_run_id = str(state.state_details.flow_run_id)
    nested = children(client, result.run_id)
    for run in [client.get_run(result.run_id), *nested.values()]:
        tags = run.data.tags
        assert tags["mlflow.source.name"] == "prefect flow tapp-experiment", run.info.run_name
        assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"]
        assert tags["prefect.flow_run_id"] == flow_run_id
        assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run_id}")  # the harness is a server
    for method in PAPER_METHODS:
        assert next(iter(nested[method].data.metrics)) == schema.STEP_TIME  # the compare page plots it
        assert nested[method].data.params["planner"] == method
    parent = client.get_run(result.run_id).data.params
    assert parent["search_rounds"] == nested["search"].data.params["search_rounds"] == "4"
    assert (parent["simulated_rounds"], parent["measured_rounds"]) == ("3", "1")


def _flow_run_record(flow_run_id: object) -> tuple[object, list[object], list[object], list[object]]:
    """(flow run, its artifacts, its log lines, its task runs), read back from Prefect's API."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    from flows.server import send_pending_logs_and_events

    send_pending_logs_and_events()  # log lines are sent in the background
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC
        )
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return flow_run, artifacts, logs, tasks


def test_prefect_shows_tapps_work(measured: tuple[ExperimentResult, object, Path]) -> None:
    """Keyed artifacts (the result, the tables, the link to MLflow), TAPP's own log lines, stable task names."""
    result, state, _ = measured
    flow_run, artifacts, logs, tasks = _flow_run_record(state.state_details.flow_run_id)
    assert flow_run.name == "tiny_cnn-local-b16-measured"
    assert flow_run.parameters["config"]["measured_rounds"] == 1  # as MLflow records it
    keyed = {a.key: a for a in artifacts if a.key}
    assert keyed["tapp-result"].type == "markdown" and keyed["tapp-result"].data == result.summary
    evaluation = json.loads(keyed["tapp-evaluation"].data)
    assert keyed["tapp-evaluation"].type == "table" and {row["method"] for row in evaluation} == set(PAPER_METHODS)
    tapp_row = next(row for row in evaluation if row["method"] == "tapp")
    assert tapp_row["step_time_s"] == float(f"{result.evaluations['tapp'].step_time_s:.4g}")
    client = MlflowClient(result.tracking_uri)
    sampled = json.loads(keyed["tapp-sampled-plans"].data)
    assert len(sampled) == children(client, result.run_id)["sampling"].data.metrics["sampled_plans"]
    assert f"/runs/{result.run_id}?workflowType=machine_learning" in keyed["tapp-mlflow-run"].data  # a link

    messages = [log.message for log in logs]
    assert any(m.startswith("profiling tiny_cnn at batch 16 1/1: 7 layers") for m in messages)
    assert any(m.startswith("TAPP search rounds 3/3: round 3: its fastest sample ") for m in messages)
    assert any(m.startswith("TAPP's chosen plan ") for m in messages)
    assert any(m.startswith("final evaluation 4/4: every method evaluated") for m in messages)
    assert result.result is not None and result.result.verdict in messages  # plain sentences, no Markdown

    names = {t.name for t in tasks}
    expected = {"profile", "sampling", "report", "race", *(f"search-round-{n}" for n in range(1, 5))}
    expected |= {f"plan-{m}" for m in PAPER_METHODS} | {f"evaluate-{m}" for m in PAPER_METHODS}
    expected |= {f"train-{m}" for m in PAPER_METHODS}
    assert names == expected


def test_tapp_run_prints_the_links_and_records_what_it_ran(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path
) -> None:
    """``tapp run`` against a Prefect server: the flow run's page, the runs view; the same counts in both UIs."""
    args = ["run", "--model", "mlp", "--batch-size", "8", "--estimate-only", "--rounds", "2", "--samples-per-round"]
    args += ["4", "--methods", "tapp,bsp", "--experiment", experiment_name, "--tracking-uri", tracking_uri]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    client = MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment_name).experiment_id
    (parent,) = client.search_runs([experiment_id], f"tags.{schema.KIND} = 'experiment'")
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    assert f"#/experiments/{experiment_id}/runs?viewStateShareKey=tapp&workflowType=machine_learning" in done.output
    assert f"#/experiments/{experiment_id}/runs/{parent.info.run_id}?workflowType" in done.output
    assert f"Prefect: {parent.data.tags['prefect.flow_run_url']}" in done.output
    flow_run, _, _, tasks = _flow_run_record(flow_run_id)
    assert flow_run.name == "mlp-local-b8-estimated"
    for key in ("search_rounds", "measured_rounds", "steps", "warmup"):
        assert str(flow_run.parameters["config"][key]) == parent.data.params[key], key
    assert parent.data.params["measured_rounds"] == "0"
    assert {t.name for t in tasks} >= {"profile", "search-round-1", "search-round-2", "sampling", "report"}


def test_report_command_and_paper_table_flow_write_identical_tables(
    measured: tuple[ExperimentResult, object, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, _, _ = measured
    monkeypatch.setenv("MLFLOW_TRACKING_URI", result.tracking_uri)
    by_flow = paper_table(experiment=result.experiment, out=str(tmp_path / "flow"))
    cli = CliRunner().invoke(app, ["report", "--experiment", result.experiment, "--out", str(tmp_path / "cli")])
    assert cli.exit_code == 0, cli.output

    names = sorted(p.name for p in by_flow.table_files)
    assert len(names) == 18  # six tables, three formats
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "flow", tmp_path / "cli", names, shallow=False)
    assert (mismatch, errors) == ([], [])
    assert "TAPP" in cli.output


def test_profiling_is_cached_by_its_inputs(prefect_harness: None, work_dir: Path) -> None:
    """The profile task reads the profile cache: the same inputs give the stored library, others a new profile."""

    cluster = load_cluster("local")

    @flow
    def profile_twice() -> list[LayerLibrary]:
        return [profile_cluster_layers("mlp", batch, cluster, repeats=1) for batch in (8, 8, 4)]

    first, again, other_batch = profile_twice()
    assert again.to_frame().equals(first.to_frame()) and again.metadata() == first.metadata()
    assert other_batch.batch_size == 4
    assert len(list((work_dir / ".tapp" / "libraries").iterdir())) == 2


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"model": "resnet9000"}, ModelError, "unknown model 'resnet9000'"),
        ({"cluster": "BAD_CLUSTER"}, ClusterError, r"devices\.1\.memory"),
        (
            {"tracking_uri": "http://127.0.0.1:9"},
            TrackingError,
            "MLflow tracking server http://127.0.0.1:9 is unreachable",
        ),
        ({"methods": ("tapp", "magic")}, TappError, "methods: unknown method"),
        ({"search_rounds": 0}, TappError, "search_rounds: Input should be greater than or equal to 1"),
        ({"schedule": "zigzag"}, TappError, "schedule: unknown schedule 'zigzag'"),
    ],
)
def test_bad_input_fails_before_any_run(
    prefect_harness: None,
    tracking_uri: str,
    experiment_name: str,
    work_dir: Path,
    change: dict[str, object],
    error: type[Exception],
    message: str,
) -> None:
    if change.get("cluster") == "BAD_CLUSTER":
        bad = work_dir / "bad.yaml"
        bad.write_text(
            textwrap.dedent(
                """\
                devices:
                  - {name: a, memory: 1GiB}
                  - {name: b, memory: lots}
                links: {bandwidth: 1Gbit/s, latency: 10us}
                """
            )
        )
        change = {"cluster": str(bad)}
    uri = change.pop("tracking_uri", None)
    with pytest.raises(error, match=message):
        config = build(ExperimentConfig, {"model": "mlp", "batch_size": 8, "measure": False, **change})
        tapp_experiment(config=config, experiment=experiment_name, tracking_uri=uri)
    assert MlflowClient().get_experiment_by_name(experiment_name) is None


TWO_BIG_LAYERS = """
from torch import nn

def model():
    return nn.Sequential(nn.Flatten(), nn.Linear(3072, 256), nn.ReLU(), nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 10))
"""
SMALL_DEVICES = """
name: small
devices:
  - {name: d0, memory: 25MiB}
  - {name: d1, memory: 25MiB, slowdown: 2}
  - {name: d2, memory: 25MiB, slowdown: 3}
links: {bandwidth: 1Gbit/s, latency: 100us}
"""


def test_methods_with_no_plan_that_fits_say_so_and_the_others_are_reported(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path
) -> None:
    """The whole model (~20 MiB of training state under the experiment's AdamW: weights, gradients and two moments,
    and the runtime's own 7 MiB) fits no single 25 MiB device, so SingleCPU and BSP have no plan; split, it fits.
    That is not a failure of the experiment: their rows say "does not fit", their runs (no step time) end FAILED
    with the reason."""
    (work_dir / "big.py").write_text(TWO_BIG_LAYERS)
    (work_dir / "small.yaml").write_text(SMALL_DEVICES)
    config = ExperimentConfig(
        model=f"{work_dir / 'big.py'}:model", cluster=str(work_dir / "small.yaml"), batch_size=8, measure=False, **QUICK
    )
    state = tapp_experiment(config=config, experiment=experiment_name, out="report", return_state=True)
    assert state.is_completed()
    result = state.result().result
    assert not result.failed and [m for m, _ in result.unfit] == ["single-cpu", "bsp"]
    assert "No plan fits the memory: single-cpu, bsp." in result.verdict

    client = MlflowClient()
    (parent,) = client.search_runs(
        [client.get_experiment_by_name(experiment_name).experiment_id], f"tags.{schema.KIND} = 'experiment'"
    )
    assert parent.info.status == "FINISHED"
    assert "| single-cpu | does not fit |" in parent.data.tags["mlflow.note.content"]
    nested = children(client, parent.info.run_id)
    for method in ("single-cpu", "bsp"):
        assert nested[method].info.status == "FAILED"
        assert "out of memory" in nested[method].data.tags[schema.DOES_NOT_FIT]
        assert schema.STEP_TIME not in nested[method].data.metrics
    for method in ("tapp", "pipetorch"):
        assert nested[method].info.status == "FINISHED"
        assert nested[method].data.tags[schema.STEP_TIME_SOURCE] == "estimated"

    table = pd.read_csv(io.StringIO((work_dir / "report" / "step_time.csv").read_text()))
    assert math.isnan(table.loc[0, "SingleCPU"]) and math.isnan(table.loc[0, "BSP"])
    assert table.loc[0, "TAPP"] == nested["tapp"].data.metrics[schema.STEP_TIME]
    assert "| – |" in (work_dir / "report" / "step_time.md").read_text()


def test_a_method_that_fails_fails_its_run_and_the_experiment_and_the_others_are_reported(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path
) -> None:
    """SingleGPU on a cluster with no GPU: not a question of memory but a method that cannot run here."""
    config = ExperimentConfig(model="mlp", batch_size=8, measure=False, **{**QUICK, "methods": ("tapp", "single-gpu")})
    state = tapp_experiment(config=config, experiment=experiment_name, out="report", return_state=True)
    assert state.is_failed()
    with pytest.raises(ExperimentIncomplete, match="evaluation of single-gpu"):
        state.result()
    client = MlflowClient()
    (parent,) = client.search_runs(
        [client.get_experiment_by_name(experiment_name).experiment_id], f"tags.{schema.KIND} = 'experiment'"
    )
    assert parent.info.status == "FAILED"
    nested = children(client, parent.info.run_id)
    assert nested["single-gpu"].info.status == "FAILED" and schema.DOES_NOT_FIT not in nested["single-gpu"].data.tags
    assert "no cuda device" in nested["single-gpu"].data.tags["error"]
    assert nested["tapp"].info.status == "FINISHED"


def test_sweep_runs_experiments_as_subflows_and_reports_them_together(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path
) -> None:
    sweep = SweepConfig(
        models=("mlp", "tiny_cnn"),
        batch_sizes=(8,),
        clusters=("local",),
        search_rounds=2,
        samples_per_round=4,
        methods=("tapp", "bsp"),
        measure=False,
    )
    result = benchmark_sweep(sweep=sweep, experiment=experiment_name, out="sweep")
    client = MlflowClient()
    experiment_id = client.get_experiment_by_name(experiment_name).experiment_id
    experiments = client.search_runs([experiment_id], f"tags.{schema.KIND} = 'experiment'")
    assert sorted(r.data.tags["model"] for r in experiments) == ["mlp", "tiny_cnn"]
    assert {r.data.tags[schema.SWEEP_RUN] for r in experiments} == {result.run_id}
    assert all(r.info.status == "FINISHED" for r in experiments)

    table = pd.read_csv(work_dir / "sweep" / "step_time.csv")
    assert list(table["model"]) == ["mlp", "tiny_cnn"]
    assert table["TAPP"].notna().all() and table["BSP"].notna().all()
    assert client.list_artifacts(result.run_id, "report")
