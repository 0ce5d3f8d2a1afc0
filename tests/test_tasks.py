"""Tasks one by one (``.fn()``, no Prefect server), each checked by reading its MLflow run back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from mlflow import MlflowClient

from flows.server import free_port
from reports import schema
from reports.numbers import rounded
from tapp_core.cost.context import CostContext
from tapp_core.measure.metrics import Measurement
from tapp_core.measure.races import run_race
from tapp_core.plan.plan import Plan, PlanError, same_execution, single_stage_plan
from tapp_core.planners import PlannerError
from tapp_core.planners.base import DoesNotFit
from tapp_core.planners.tapp import SearchOptions, TappPlanner
from tapp_core.platform.cluster import load_cluster, parse_cluster
from tapp_core.profile.library import LayerLibrary
from tapp_core.profile.profiler import ProfileRequest, profile_model
from tapp_core.runtime import WorkerPool
from tasks.config import ExperimentConfig
from tasks.evaluate import MEASUREMENT_FROM, Unfit, baseline_plan, evaluate_method, plan_method, race_methods
from tasks.measure import RuntimeSettings
from tasks.profile import record_library
from tasks.search import SearchBudget, shown_plans
from tasks.tracking import ExperimentTags, TrackingError, check_tracking, code_version, open_store, tracked_run
from tests.test_planners_common import chain_library, small_cluster


@pytest.fixture(scope="module")
def tiny_library() -> LayerLibrary:
    return profile_model(ProfileRequest("tiny_cnn", 16, threads=1, repeats=2))


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
    planned = plan_method.fn("pipetorch", CostContext(tiny_library, tiny_config().target), tiny_config())
    with tracked_run("parent", tags.as_tags(), experiment=experiment_name) as parent:
        result = evaluate_method.fn(planned, parent.ref, tags)

    stored = MlflowClient().get_run(result.run_id)
    assert stored.info.status == "FINISHED"
    assert stored.data.tags[schema.STEP_TIME_SOURCE] == "estimated"
    assert result.estimate.step_time_s == result.step_time_s
    assert stored.data.metrics[schema.STEP_TIME] == rounded(result.step_time_s)  # as every view shows it
    assert stored.data.metrics[schema.STEP_TIME_MS] == rounded(1000 * rounded(result.step_time_s))
    assert stored.data.metrics[schema.ESTIMATED_STEP_TIME] == result.estimate.step_time_s  # every digit
    assert stored.data.params["plan_id"] == result.plan.id
    plan_file = MlflowClient().download_artifacts(result.run_id, schema.PLAN_ARTIFACT)
    assert json.loads(Path(plan_file).read_text())["id"] == result.plan.id


def test_a_failing_evaluation_marks_its_run_failed_and_logs_no_step_time(
    tracking_uri: str, experiment_name: str, tiny_library: LayerLibrary
) -> None:
    tags = experiment_tags()
    bad = single_stage_plan(tiny_library, ["nowhere"], batch_size=16)  # a device the cluster does not have
    planned = plan_method.fn("tapp", CostContext(tiny_library, tiny_config().target), tiny_config(), plan=bad)
    assert not planned.ok and isinstance(planned.failure, PlanError)
    with tracked_run("parent", tags.as_tags(), experiment=experiment_name) as parent, pytest.raises(PlanError):
        evaluate_method.fn(planned, parent.ref, tags)

    client = MlflowClient()
    (child,) = client.search_runs([parent.ref.experiment_id], f"tags.{schema.METHOD} = 'tapp'")
    assert child.info.status == "FAILED"
    assert "unknown device 'nowhere'" in child.data.tags["error"]
    assert schema.STEP_TIME not in child.data.metrics


def test_a_method_with_no_plan_that_fits_the_memory_is_unfit_not_failed(
    tracking_uri: str, experiment_name: str, tiny_library: LayerLibrary
) -> None:
    """SingleCPU on devices none of which holds the whole model: its row says so; the task ends well, its run
    (no step time) FAILED with the reason."""
    tags = experiment_tags()
    cluster = load_cluster("local")
    small = cluster.model_copy(
        update={"devices": tuple(d.model_copy(update={"memory": 1024}) for d in cluster.devices)}
    )
    planned = plan_method.fn("single-cpu", CostContext(tiny_library, small), tiny_config())
    assert isinstance(planned.failure, DoesNotFit)
    with tracked_run("parent", tags.as_tags(), experiment=experiment_name) as parent:
        outcome = evaluate_method.fn(planned, parent.ref, tags)
    assert isinstance(outcome, Unfit) and "out of memory on device 'cpu0'" in outcome.reason
    run = MlflowClient().get_run(outcome.run_id)
    assert run.info.status == "FAILED" and "out of memory" in run.data.tags[schema.DOES_NOT_FIT]
    assert schema.STEP_TIME not in run.data.metrics


def test_single_device_baselines_pick_by_kind(tiny_library: LayerLibrary) -> None:
    cluster = load_cluster("local")
    single_cpu = baseline_plan("single-cpu", CostContext(tiny_library, cluster), 16, seed=0)
    assert single_cpu.stage_devices == (("cpu0",),) and single_cpu.planner == "single-cpu"
    with pytest.raises(PlannerError, match="no cuda device of cluster 'local'"):
        baseline_plan("single-gpu", CostContext(tiny_library, cluster), 16, seed=0)
    # tapp-rl, TAPP's RL alone, is planned and estimated beside the default methods (raced only where methods names
    # it); an experiment given its own methods evaluates those
    assert tiny_config(methods=("tapp", "bsp")).evaluated_methods == ("tapp", "bsp")
    assert tiny_config().evaluated_methods[-1] == "tapp-rl"


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


def test_methods_whose_plans_run_the_same_are_raced_once_and_share_its_figure(
    tracking_uri: str, experiment_name: str, tiny_library: LayerLibrary
) -> None:
    """The oracle's plan is SingleCPU's; TAPP's is SingleCPU's under another schedule label (one stage, one
    micro-batch: it runs the same). ``race_methods`` races one of them."""
    tags = experiment_tags()
    single = plan_method.fn("single-cpu", CostContext(tiny_library, tiny_config().target), tiny_config())
    oracle = dataclasses.replace(single, method="oracle", plan=dataclasses.replace(single.plan, planner="oracle"))
    relabelled = dataclasses.replace(single.plan, planner="tapp", schedule="1f1b")
    tapp = dataclasses.replace(single, method="tapp", plan=relabelled)
    assert relabelled.id != single.plan.id and same_execution(relabelled, single.plan)
    bsp = plan_method.fn("bsp", CostContext(tiny_library, tiny_config().target), tiny_config())
    raced: list[list[str]] = []

    def race_plans(plans: list[Plan], *args: object, **kwargs: object) -> object:
        raced.append([p.id for p in plans])
        seconds = {single.plan.id: 0.25, bsp.plan.id: 0.5}
        return SimpleNamespace(is_completed=lambda: True, result=lambda: run_race(FixedRounds(seconds), plans))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tasks.evaluate.race_plans", race_plans)
        unstarted = WorkerPool(tiny_config().target)  # the race is the stand-in's: no worker starts
        _, race = race_methods([single, oracle, tapp, bsp], unstarted, "tiny_cnn", RuntimeSettings())
        race_methods([bsp, single], unstarted, "tiny_cnn", RuntimeSettings(), estimated_only=("bsp",))
    assert race is not None
    assert raced == [[single.plan.id, bsp.plan.id], [single.plan.id]]  # a method estimated only is not raced
    with tracked_run("parent", tags.as_tags(), experiment=experiment_name) as parent:
        results = [
            evaluate_method.fn(single, parent.ref, tags, race),
            evaluate_method.fn(oracle, parent.ref, tags, race, measurement_from="single-cpu"),
            evaluate_method.fn(tapp, parent.ref, tags, race, measurement_from="single-cpu"),
        ]
    stored = [MlflowClient().get_run(r.run_id).data for r in results]
    assert MEASUREMENT_FROM not in stored[0].tags and stored[1].tags[MEASUREMENT_FROM] == "single-cpu"
    assert stored[2].tags[MEASUREMENT_FROM] == "single-cpu"
    for data in stored:
        assert data.metrics[schema.STEP_TIME] == data.metrics[schema.MEASURED_STEP_TIME] == 0.25
        assert (data.metrics[schema.STEP_TIME_LOW], data.metrics[schema.STEP_TIME_HIGH]) == (0.25, 0.25)
        assert data.metrics[schema.RACE_ROUNDS] == race.rounds and data.tags[schema.RACE_ID] == race.id
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
    budget = SearchBudget(SearchOptions(reward="hybrid", rounds=6, samples_per_round=3))
    config = budget.planner(64, 7).config(CostContext(library, cluster), None)
    planner_s = TappPlanner(batch_size=64, seed=7).config(CostContext(library, cluster), None)
    assert config == dataclasses.replace(planner_s, reward="hybrid", rounds=6, samples_per_round=3)
    assert budget.options.simulated_rounds == 6 - SearchOptions.measured_rounds
    simulated = SearchBudget(SearchOptions(rounds=5)).planner(64, 7).config(CostContext(library, cluster), None)
    assert (simulated.reward, simulated.rounds) == ("simulated", 5)
    with pytest.raises(PlannerError, match=r"the search's rounds on the cost model \(0\) must be at least 1"):
        SearchBudget(SearchOptions(reward="hybrid", rounds=1, measured_rounds=1))
    with pytest.raises(PlannerError, match="measured_per_round must be at least 1, got 0"):
        SearchBudget(SearchOptions(measured_per_round=0))


def test_the_race_says_how_many_rounds_each_plan_ran() -> None:
    """Plans that leave a race early ran fewer rounds than the race: the line says "up to", never one count for all."""
    from types import SimpleNamespace

    from tasks.measure import rounds_text

    def race(*rounds: int) -> SimpleNamespace:
        measured = [SimpleNamespace(rounds=n, ok=True) for n in rounds]
        return SimpleNamespace(measurements=measured, rounds=max(rounds))

    assert rounds_text(race(7, 7)) == "7 rounds each"  # type: ignore[arg-type]
    assert rounds_text(race(5, 7, 5)) == "up to 7 rounds per plan (5–7)"  # type: ignore[arg-type]


def test_the_prefect_artifact_of_sampled_plans_keeps_the_chosen_the_measured_and_the_fastest() -> None:
    table = pd.DataFrame(
        {
            "plan_id": [f"p{i}" for i in range(6)],
            "estimated_step_time_s": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
            "chosen": [False, False, False, False, True, False],
            "measured": [False, False, True, False, False, False],
        }
    )
    assert list(shown_plans(table, most=2)["plan_id"]) == ["p0", "p1", "p2", "p4"]  # in the order of the estimates
    assert len(shown_plans(table, most=10)) == len(table)
