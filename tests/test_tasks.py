"""Tasks one by one (``.fn()``, no Prefect server), each checked by reading its MLflow run back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.server import free_port
from tapp_core import schema
from tapp_core.cluster import load_cluster, parse_cluster
from tapp_core.costs import DEFAULT_CALIBRATION
from tapp_core.library import LayerLibrary
from tapp_core.metrics import Measurement
from tapp_core.plan import Plan, PlanError, single_stage_plan
from tapp_core.planners import PlannerError
from tapp_core.planners.tapp import SearchOptions, TappPlanner
from tapp_core.profiler import profile_model
from tapp_core.races import run_race
from tasks.config import ExperimentConfig
from tasks.evaluate import MEASUREMENT_FROM, baseline_plan, evaluate_method, plan_method
from tasks.profile import record_library
from tasks.search import SearchBudget
from tasks.tracking import ExperimentTags, TrackingError, check_tracking, code_version, open_store, tracked_run
from tests.test_planners_common import chain_library, small_cluster


@pytest.fixture(scope="module")
def tiny_library() -> LayerLibrary:
    return profile_model("tiny_cnn", 16, threads=1, repeats=2)


def experiment_tags() -> ExperimentTags:
    return ExperimentTags(model="tiny_cnn", cluster="local", batch_size=16, seed=0, dataset="synthetic", emulated=True)


def tiny_config(**settings: object) -> ExperimentConfig:
    """tiny_cnn at batch 16 on the local cluster, estimated only."""
    return ExperimentConfig.model_validate(
        {"model": "tiny_cnn", "batch_size": 16, "dataset": "synthetic", "measure": False, **settings}
    )


def test_unreachable_tracking_server_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingError, match=rf"MLflow tracking server {uri} is unreachable"):
        check_tracking(uri, timeout_s=2)
    with pytest.raises(TrackingError, match="folder /no/such/folder does not exist"):
        check_tracking("sqlite:////no/such/folder/mlflow.db")


def test_a_file_that_is_not_a_store_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "mlflow.db"
    bad.write_text("not a database")
    with pytest.raises(TrackingError, match=r"mlflow\.db cannot be opened: file is not a database"):
        open_store(f"sqlite:///{bad}")


def test_a_run_that_raises_ends_failed_with_its_error(tracking_uri: str, experiment_name: str) -> None:
    with pytest.raises(ZeroDivisionError), tracked_run("doomed", {"k": "v"}, experiment=experiment_name) as run:
        run.log_metrics({"before": 1.0})
        _ = 1 / 0
    stored = MlflowClient().get_run(run.run_id)
    assert stored.info.status == "FAILED"
    assert stored.data.tags["error"] == "ZeroDivisionError: division by zero"
    assert stored.data.metrics == {"before": 1.0}


def test_tags_carry_the_comparison_keys(tracking_uri: str, experiment_name: str) -> None:
    tags = experiment_tags()
    with tracked_run("parent", tags.as_tags(run_kind="experiment"), experiment=experiment_name) as parent:
        child = tracked_run("child", tags.child(parent.ref, schema.EVALUATION, method="bsp"), parent=parent.ref)
        with child as child_run:
            pass
    stored = MlflowClient().get_run(child_run.run_id).data.tags
    assert {k: stored[k] for k in ("model", "method", "cluster", "batch_size", "seed", "emulated", "run_kind")} == {
        "model": "tiny_cnn",
        "method": "bsp",
        "cluster": "local",
        "batch_size": "16",
        "seed": "0",
        "emulated": "true",
        "run_kind": "evaluation",
    }
    assert stored["mlflow.parentRunId"] == parent.run_id == stored[schema.EXPERIMENT_RUN]
    assert stored["code_version"] == code_version() != "unknown"


def test_layer_library_is_logged_and_reads_back(
    tracking_uri: str, experiment_name: str, tiny_library: LayerLibrary, tmp_path: Path
) -> None:
    with tracked_run("profile", {}, experiment=experiment_name) as run:
        record_library(run, tiny_library)
    local = MlflowClient().download_artifacts(run.run_id, "layer_library", str(tmp_path))
    assert LayerLibrary.load(local).to_frame().equals(tiny_library.to_frame())
    assert MlflowClient().get_run(run.run_id).data.params["layers"] == str(len(tiny_library.layers))


def test_evaluation_logs_plan_and_estimate(tracking_uri: str, experiment_name: str, tiny_library: LayerLibrary) -> None:
    tags = experiment_tags()
    planned = plan_method.fn("pipetorch", tiny_library, tiny_config())
    with tracked_run("parent", tags.as_tags(), experiment=experiment_name) as parent:
        result = evaluate_method.fn(planned, parent.ref, tags)

    stored = MlflowClient().get_run(result.run_id)
    assert stored.info.status == "FINISHED"
    assert stored.data.tags[schema.STEP_TIME_SOURCE] == "estimated"
    assert stored.data.metrics[schema.STEP_TIME] == result.estimate.step_time == result.step_time_s
    assert stored.data.metrics[schema.ESTIMATED_STEP_TIME] == result.estimate.step_time
    assert stored.data.params["plan_id"] == result.plan.id
    plan_file = MlflowClient().download_artifacts(result.run_id, schema.PLAN_ARTIFACT)
    assert json.loads(Path(plan_file).read_text())["id"] == result.plan.id


def test_a_failing_evaluation_marks_its_run_failed_and_logs_no_step_time(
    tracking_uri: str, experiment_name: str, tiny_library: LayerLibrary
) -> None:
    tags = experiment_tags()
    bad = single_stage_plan(tiny_library, ["nowhere"], batch_size=16)  # a device the cluster does not have
    planned = plan_method.fn("tapp", tiny_library, tiny_config(), plan=bad)
    assert not planned.ok and isinstance(planned.failure, PlanError)
    with tracked_run("parent", tags.as_tags(), experiment=experiment_name) as parent, pytest.raises(PlanError):
        evaluate_method.fn(planned, parent.ref, tags)

    client = MlflowClient()
    (child,) = client.search_runs([parent.ref.experiment_id], f"tags.{schema.METHOD} = 'tapp'")
    assert child.info.status == "FAILED"
    assert "unknown device 'nowhere'" in child.data.tags["error"]
    assert schema.STEP_TIME not in child.data.metrics


def test_single_device_baselines_pick_by_kind(tiny_library: LayerLibrary) -> None:
    cluster = load_cluster("local")
    single_cpu = baseline_plan("single-cpu", tiny_library, cluster, 16, seed=0)
    assert single_cpu.stage_devices == (("cpu0",),) and single_cpu.planner == "single-cpu"
    with pytest.raises(PlannerError, match="no cuda device of cluster 'local'"):
        baseline_plan("single-gpu", tiny_library, cluster, 16, seed=0)
    assert tiny_config(methods=("tapp", "bsp")).evaluated_methods == ("tapp", "bsp")


def test_single_gpu_joins_the_paper_methods_when_the_cluster_has_a_gpu() -> None:
    cluster = parse_cluster(
        {
            "name": "mixed",
            "devices": [{"name": "c", "memory": "1GiB"}, {"name": "g", "kind": "cuda", "memory": "1GiB"}],
            "links": {"bandwidth": "1Gbit/s", "latency": 0},
        }
    )
    config = tiny_config(cluster=cluster, methods=("tapp", "single-cpu", "bsp", "pipetorch", "even"))
    assert config.evaluated_methods == ("tapp", "single-cpu", "bsp", "pipetorch", "single-gpu", "even")


def test_two_methods_with_one_plan_are_raced_once_and_share_its_figure(
    tracking_uri: str, experiment_name: str, tiny_library: LayerLibrary
) -> None:
    tags = experiment_tags()
    single = plan_method.fn("single-cpu", tiny_library, tiny_config())
    oracle = dataclasses.replace(single, method="oracle", plan=dataclasses.replace(single.plan, planner="oracle"))
    bsp = plan_method.fn("bsp", tiny_library, tiny_config())
    race = run_race(FixedRounds({single.plan.id: 0.25, bsp.plan.id: 0.5}), [single.plan, oracle.plan, bsp.plan])
    assert len(race.plans) == 2  # the oracle's plan is SingleCPU's: raced once
    with tracked_run("parent", tags.as_tags(), experiment=experiment_name) as parent:
        results = [
            evaluate_method.fn(single, parent.ref, tags, race),
            evaluate_method.fn(oracle, parent.ref, tags, race, measurement_from="single-cpu"),
        ]
    stored = [MlflowClient().get_run(r.run_id).data for r in results]
    assert MEASUREMENT_FROM not in stored[0].tags and stored[1].tags[MEASUREMENT_FROM] == "single-cpu"
    for data in stored:
        assert data.metrics[schema.STEP_TIME] == data.metrics[schema.MEASURED_STEP_TIME] == 0.25
        assert (data.metrics[schema.STEP_TIME_LOW], data.metrics[schema.STEP_TIME_HIGH]) == (0.25, 0.25)
        assert data.metrics[schema.RACE_ROUNDS] == race.rounds and data.tags[schema.RACE_ID] == race.id
        assert data.tags[schema.BEST_GROUP] == "true"  # 0.25 s against BSP's 0.5 s
    rounds = MlflowClient().get_metric_history(results[1].run_id, schema.ROUND_STEP_TIME)
    assert [m.step for m in rounds] == list(range(1, race.rounds + 1))


class FixedRounds:
    """Each plan's every round measures its given seconds."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    def __call__(self, plan: Plan) -> Measurement:
        return Measurement(plan_id=plan.id, step_time_s=self.seconds[plan.id], emulated=True)


def test_the_flow_s_search_budget_is_the_planner_s_options_with_named_ones_overridden() -> None:
    library, cluster = chain_library(), small_cluster()
    config = SearchBudget(rounds=5, samples_per_round=3).config(library, cluster, 64, 7, DEFAULT_CALIBRATION)
    planner_s = TappPlanner(batch_size=64, seed=7).config(library, cluster, None)
    rounds = 5 + SearchOptions.measured_rounds
    assert config == dataclasses.replace(planner_s, reward="hybrid", rounds=rounds, samples_per_round=3)
    simulated = SearchBudget(measured_rounds=0).config(library, cluster, 64, 7, DEFAULT_CALIBRATION)
    assert (simulated.reward, simulated.rounds) == ("simulated", SearchBudget.rounds)
    with pytest.raises(PlannerError, match=r"search rounds \(0\) must be at least 1"):
        SearchBudget(rounds=0)
    with pytest.raises(PlannerError, match="measured_per_round must be at least 1, got 0"):
        SearchBudget(measured_per_round=0)
