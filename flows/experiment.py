"""``tapp_experiment``: profile -> TAPP search rounds -> runtime sampling -> final evaluation -> report.

Everything lands in one MLflow parent run with a nested run per stage (profile, search, sampling, report) and
per evaluated method; every stage is a Prefect task (the search one per round). Inputs are checked before any
run exists, so a typo costs no half-written run.

What a person sees first: the parent run's description (the verdict, the result table, TAPP's plan, links), the
evaluation as an MLflow table (``evaluation.json``, for ``mlflow.load_table``), and in Prefect the flow run's log
lines and its keyed artifacts (``tasks.prefect_ui``). The flow run is named ``MODEL-CLUSTER-bBATCH-MODE``, the
mode being ``measured`` or ``estimated``.

An interrupted experiment resumes: ``resume_from`` names its parent run, whose settings ``resume_parameters``
reads back; the new experiment run continues TAPP's search from the last checkpoint the old one logged (after every
round) and then evaluates and reports as usual (``tapp run --resume RUN_ID``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from reports import runs
from tapp_core.calibration import cluster_calibration
from tapp_core.cluster import Cluster, load_cluster
from tapp_core.costs import Calibration
from tapp_core.data import DATASET_NAMES, DataError, open_dataset
from tapp_core.errors import TappError
from tapp_core.library import LayerLibrary
from tapp_core.models import build_traced_model
from tapp_core.plan import Plan
from tapp_core.races import RaceResult
from tapp_core.runtime.folders import owned_folder, sweep_pool_folders
from tasks import prefect_ui, summary
from tasks.evaluate import Evaluation, check_methods, evaluate_method, methods_for, plan_method, race_methods
from tasks.measure import RuntimeSettings, close_pools
from tasks.profile import profile_stage
from tasks.progress import StageProgress
from tasks.report import ReportRun, report_experiment
from tasks.search import SearchBudget, fetch_checkpoint, sampling_stage, search_stage
from tasks.tracking import (
    DEFAULT_EXPERIMENT,
    ExperimentTags,
    TrackedRun,
    TrackingError,
    check_tracking,
    mlflow_ui_url,
    run_url,
    runs_view_url,
    tracked_run,
)
from tasks.train import TrainSettings, train_method

DEFAULT_METHODS: tuple[str, ...] = ("tapp", "single-cpu", "bsp", "pipetorch", "even", "pipedream", "autoddl", "oracle")
DEFAULT_OUT = Path("out") / "report"
DEFAULT_ROUNDS = SearchBudget.rounds + SearchBudget.measured_rounds
"""TAPP's search rounds in all, the measured ones included (as the TAPP planner counts them)."""
DEFAULT_STEPS = RuntimeSettings.steps - RuntimeSettings.warmup
"""Timed steps per plan and race round, after the warm-up (as ``tapp measure --steps`` counts them)."""
DEFAULT_WARMUP = RuntimeSettings.warmup

sampling_task = task(name="sampling", task_run_name="sampling", cache_policy=NO_CACHE)(sampling_stage)
"""The sampling stage as a Prefect task (its measured rounds are its nested ``search-round-N`` tasks)."""


SEARCH_FOLDER_PREFIX = "tapp-search-"
RESUMED_FROM_TAG = "resumed_from"
"""On an experiment run that continues another's search: that run's id."""
RESUMED_PARAMETERS = (
    "model", "cluster", "batch_size", "dataset", "data_dir", "methods", "search_rounds", "samples_per_round",
    "measured_rounds", "measured_per_round", "measure", "steps", "warmup", "train_epochs", "seed",
)  # fmt: skip
"""The experiment's parameters that a resumed experiment takes from the run it resumes."""


class ExperimentIncomplete(RuntimeError):
    """Some methods failed; the report holds the others and the parent run is marked FAILED."""


@dataclass
class ExperimentResult:
    experiment: str
    tracking_uri: str
    run_id: str
    report_dir: Path
    step_time_table: str
    """The step-time table as Markdown (the same text as ``report_dir/step_time.md``)."""
    evaluations: dict[str, Evaluation] = field(default_factory=dict)
    experiment_id: str = ""
    summary: str = ""
    """The parent run's description: verdict, result table, TAPP's plan, links (Markdown)."""


def check_inputs(
    model: str,
    cluster: str,
    batch_size: int,
    dataset: str,
    data_dir: str | None,
    methods: tuple[str, ...],
    tracking_uri: str | None,
) -> tuple[Cluster, str]:
    """Every input checked, cheapest first; the first bad one raises a ``TappError`` that names it."""
    if batch_size <= 0:
        raise TappError(f"batch size must be positive, got {batch_size}")
    check_methods(methods)
    target = load_cluster(cluster)
    if dataset not in DATASET_NAMES:
        raise DataError(f"unknown dataset {dataset!r}; known datasets: {', '.join(DATASET_NAMES)}")
    if dataset != "synthetic":
        open_dataset(dataset, data_dir, train=False)
    build_traced_model(model)
    return target, check_tracking(tracking_uri)


def resume_parameters(uri: str, run_id: str, experiment: str = DEFAULT_EXPERIMENT) -> tuple[str, str, dict[str, Any]]:
    """(run id, experiment name, ``tapp_experiment`` parameters) of experiment run ``run_id`` (``last``: the latest
    experiment run of ``experiment``), to resume it; a ``TrackingError`` when there is no such run, it is not an
    experiment's parent run, or it is not interrupted."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
    if run_id == "last":
        run_id = _last_experiment_run(client, experiment, uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise TrackingError(f"--resume: no run {run_id!r} in {uri}") from None
    if run.data.tags.get(runs.KIND) != runs.EXPERIMENT:
        raise TrackingError(f"--resume: run {run_id} is not an experiment's parent run (the one `tapp run` prints)")
    if run.info.status in ("FINISHED", "RUNNING"):
        state = "finished" if run.info.status == "FINISHED" else "still running"
        raise TrackingError(f"--resume: run {run_id} is {state}; only an interrupted or failed experiment resumes")
    saved = run.data.params
    missing = [name for name in RESUMED_PARAMETERS if name not in saved]
    if missing:
        raise TrackingError(f"--resume: run {run_id} lacks the parameter(s) {', '.join(missing)}")
    parameters: dict[str, Any] = {name: _parameter_value(saved[name]) for name in RESUMED_PARAMETERS}
    parameters["methods"] = tuple(str(parameters["methods"]).split(","))
    for name in ("model", "cluster", "dataset"):
        parameters[name] = str(parameters[name])
    return run_id, client.get_experiment(run.info.experiment_id).name, parameters


def _last_experiment_run(client: Any, experiment: str, uri: str) -> str:
    found = client.get_experiment_by_name(experiment)
    latest = (
        client.search_runs(
            [found.experiment_id],
            f"tags.{runs.KIND} = '{runs.EXPERIMENT}'",
            max_results=1,
            order_by=["start_time DESC"],
        )
        if found is not None
        else []
    )
    if not latest:
        raise TrackingError(f"--resume last: experiment {experiment!r} in {uri} has no experiment run")
    return str(latest[0].info.run_id)


def _parameter_value(text: str) -> Any:
    """A parameter as ``TrackedRun.log_params`` wrote it: strings as they are, anything else as JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def search_budget(
    search_rounds: int,
    samples_per_round: int,
    measured_rounds: int | None,
    measured_per_round: int,
    measure: bool,
) -> SearchBudget:
    """The search of ``search_rounds`` rounds in all, the last ``measured_rounds`` rewarded by measurements (None:
    the default when measuring, none otherwise), the rounds before them by the cost model."""
    measured = (SearchBudget.measured_rounds if measure else 0) if measured_rounds is None else measured_rounds
    if measured < 0:
        raise TappError(f"measured rounds must be 0 or more, got {measured}")
    if measured and not measure:
        raise TappError(f"{measured} measured round(s) need the runtime: measure, or ask for 0 measured rounds")
    if search_rounds <= measured:
        raise TappError(
            f"search rounds ({search_rounds}) must be more than the measured rounds ({measured}): the rounds "
            "before the measured ones are rewarded by the cost model"
        )
    return SearchBudget(search_rounds - measured, samples_per_round, measured, measured_per_round)


def runtime_settings(measure: bool, steps: int, warmup: int, seed: int) -> RuntimeSettings:
    """How the final evaluation measures: a race whose rounds run each plan for ``steps`` timed steps after
    ``warmup`` warm-up steps."""
    if steps < 1 or warmup < 0:
        raise TappError(f"a measurement needs at least 1 timed step and no negative warm-up (got {steps}, {warmup})")
    return RuntimeSettings(enabled=measure, steps=warmup + steps, warmup=warmup, seed=seed)


def _search_params(budget: SearchBudget, sampling: RuntimeSettings) -> dict[str, object]:
    """The run parameters that the search budget and the sampling stage's runtime settle."""
    return {
        "simulated_rounds": budget.rounds,
        "samples_per_round": budget.samples_per_round,
        "measured_rounds": budget.measured_rounds,
        "measured_per_round": budget.measured_per_round,
        "sampling_steps": sampling.steps - sampling.warmup,
        "sampling_warmup": sampling.warmup,
    }


def _plan_of_work(params: dict[str, object], budget: SearchBudget) -> str:
    """The experiment's plan of work in one line, for the flow run's log."""
    how = "measured" if params["measure"] else "estimated by the cost model"
    methods = str(params["methods"]).replace(",", ", ")
    return (
        f"batch {params['batch_size']}, {params['dataset']} data; {how}; TAPP search {params['search_rounds']} rounds "
        f"({budget.rounds} on the cost model, {budget.measured_rounds} measured); methods {methods}"
    )


def experiment_run_name() -> str:
    """The flow run's name, ``MODEL-CLUSTER-bBATCH-MODE``: measured and estimate-only runs differ at a glance."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    mode = "measured" if parameters.get("measure", True) else "estimated"
    return f"{parameters.get('model', 'alexnet')}-{parameters.get('cluster', 'local')}-b{parameters.get('batch_size', 64)}-{mode}"


@flow(name="tapp-experiment", flow_run_name=experiment_run_name)
def tapp_experiment(
    model: str = "alexnet",
    cluster: str = "local",
    batch_size: int = 64,
    dataset: str = "synthetic",
    data_dir: str | None = None,
    search_rounds: int = DEFAULT_ROUNDS,
    samples_per_round: int = SearchBudget.samples_per_round,
    measured_rounds: int | None = None,
    measured_per_round: int = SearchBudget.measured_per_round,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    measure: bool = True,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    train_epochs: int = 0,
    train_steps: int | None = None,
    seed: int = 0,
    experiment: str = DEFAULT_EXPERIMENT,
    out: str = str(DEFAULT_OUT),
    tracking_uri: str | None = None,
    sweep_run: str | None = None,
    resume_from: str | None = None,
) -> ExperimentResult:
    """Find TAPP's plan for ``model`` on ``cluster``, compare it with the baselines, and report, all in MLflow.

    ``search_rounds`` counts TAPP's policy-gradient rounds in all; the last ``measured_rounds`` of them (default:
    3 when measuring, else 0) are rewarded by measurements on the workers. ``measure=False`` skips the runtime
    (step times from the cost model, tagged ``estimated``); ``steps`` timed steps after ``warmup`` warm-up steps
    make each plan's round of the final evaluation's race; ``train_epochs`` > 0 also trains each method's plan on
    ``dataset`` for the accuracy table. ``resume_from`` (an earlier experiment run of the same settings) continues
    its search.
    """
    methods = tuple(methods)
    target, uri = check_inputs(model, cluster, batch_size, dataset, data_dir, methods, tracking_uri)
    calibration = cluster_calibration(cluster, target)  # measured by `tapp calibrate`, else the ideal one
    tags = ExperimentTags(model, target.name, batch_size, seed, dataset, target.emulated, sweep_run)
    budget = search_budget(search_rounds, samples_per_round, measured_rounds, measured_per_round, measure)
    runtime = runtime_settings(measure, steps, warmup, seed)
    sampling = budget.sampling_runtime(runtime)
    training = TrainSettings(train_epochs, train_steps, data_dir) if train_epochs > 0 else None
    chosen_methods = methods_for(target, methods)
    work = ExperimentWork(target, calibration, chosen_methods, budget, runtime, training, out, experiment, resume_from)
    params = {
        "model": model,
        "cluster": cluster,
        "batch_size": batch_size,
        "dataset": dataset,
        "data_dir": data_dir,
        "methods": ",".join(chosen_methods),
        "search_rounds": search_rounds,
        **_search_params(budget, sampling),
        "measure": measure,
        "steps": steps,
        "warmup": warmup,
        "train_epochs": train_epochs,
        "seed": seed,
    }
    prefect_ui.log(f"{model} on {target.name} ({len(target.devices)} devices), {_plan_of_work(params, budget)}")
    name = f"{model} on {target.name}, batch {batch_size}"
    try:
        run_tags = tags.as_tags(**{runs.KIND: runs.EXPERIMENT, RESUMED_FROM_TAG: resume_from})
        with tracked_run(name, run_tags, experiment=experiment, uri=uri) as parent:
            parent.set_tags({runs.EXPERIMENT_RUN: parent.run_id})
            parent.log_params(params)
            evaluations, reported, text = _run_stages(parent, tags, work)
    finally:
        close_pools()
    return ExperimentResult(
        experiment=experiment,
        tracking_uri=uri,
        run_id=parent.run_id,
        report_dir=reported.report.folder,
        step_time_table=reported.report.tables.step_time.to_markdown(),
        evaluations=evaluations,
        experiment_id=parent.ref.experiment_id,
        summary=text,
    )


@dataclass(frozen=True)
class ExperimentWork:
    """What an experiment does once its inputs are checked: the stages' settings."""

    target: Cluster
    calibration: Calibration
    methods: tuple[str, ...]
    budget: SearchBudget
    runtime: RuntimeSettings
    training: TrainSettings | None
    out: str
    experiment: str
    resume_from: str | None = None


def _run_stages(
    parent: TrackedRun, tags: ExperimentTags, work: ExperimentWork
) -> tuple[dict[str, Evaluation], ReportRun, str]:
    """Profile, search, sample, evaluate every method (and train each plan), report, summarise; all under
    ``parent``. The search's checkpoint lives in a ``tapp-search-*`` folder of the temporary directory, removed on
    every way out; the ``tapp-search-*`` and ``tapp-pool-*`` folders a killed process left are swept first."""
    target, calibration, budget, out = work.target, work.calibration, work.budget, work.out
    parent.log_dict(target.model_dump(mode="json"), "cluster.json")
    parent.log_dict(calibration.to_dict(), "calibration.json")
    library = profile_stage(parent.ref, tags, target)
    sweep_pool_folders()  # what a killed experiment left, whether or not this one measures
    with owned_folder(SEARCH_FOLDER_PREFIX) as workdir:
        if work.resume_from is not None:
            resumed = fetch_checkpoint(parent.ref.tracking_uri, work.resume_from, workdir)
            where = f"round {resumed}" if resumed is not None else "the start (it logged no checkpoint)"
            prefect_ui.log(f"resuming the search of run {work.resume_from} from {where}")
        sampling = budget.sampling_runtime(work.runtime)
        search = search_stage(parent.ref, tags, library, target, budget, sampling, calibration, workdir)
        tapp_plan = sampling_task(parent.ref, tags, search, library, target, sampling)
    prefect_ui.log(f"TAPP's chosen {summary.plan_line(tapp_plan)}")
    evaluations, failed, race = _evaluate(
        parent, tags, library, target, work.methods, tapp_plan, work.runtime, calibration
    )
    if work.training is not None:
        failed += _train(parent, tags, target, evaluations, work.training)
    reported = report_experiment(parent.ref, tags, out, work.experiment)
    text = _summarise(parent, tags, evaluations, reported, failed, race)
    if failed:
        raise ExperimentIncomplete(f"failed: {', '.join(failed)} (see their MLflow runs); report in {out}")
    return evaluations, reported, text


def _evaluate(
    parent: TrackedRun,
    tags: ExperimentTags,
    library: LayerLibrary,
    cluster: Cluster,
    methods: tuple[str, ...],
    tapp_plan: Plan,
    runtime: RuntimeSettings,
    calibration: Calibration,
) -> tuple[dict[str, Evaluation], list[str], RaceResult | None]:
    """Plan every method, race all their plans together, then record each method; a failed one is noted and the
    rest go on. Returns the evaluations, the failures, and the race (None when the runtime is off)."""
    planned = [
        plan_method(method, library, cluster, tags, tapp_plan if method == "tapp" else None, calibration)
        for method in methods
    ]
    race = None
    if runtime.enabled:
        planned, race = race_methods(planned, cluster, tags.model, runtime)
    evaluations: dict[str, Evaluation] = {}
    failed: list[str] = []
    first_with_plan: dict[str, str] = {}
    progress = StageProgress("evaluation", len(methods), "final evaluation")
    for done, method_plan in enumerate(planned, start=1):
        method, plan = method_plan.method, method_plan.plan
        shared = first_with_plan.setdefault(plan.id, method) if plan is not None and method_plan.ok else method
        source = shared if shared != method else None
        state = evaluate_method(method_plan, parent.ref, tags, race, source, return_state=True)
        if state.is_completed():
            result = evaluations[method] = state.result()
            how = "measured" if result.measured else "estimated"
            progress.update(
                done, f"{method} {summary.number(result.step_time_s)} s ({how})", summary.plan_line(result.plan)
            )
        else:
            failed.append(f"evaluation of {method}")
            progress.update(done, f"{method} FAILED: {_reason(state)}")
    return evaluations, failed, race


def _reason(state: Any) -> str:
    """Why a task's state is not completed, in one line."""
    try:
        state.result()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return str(state.name)


def _train(
    parent: TrackedRun,
    tags: ExperimentTags,
    cluster: Cluster,
    evaluations: dict[str, Evaluation],
    settings: TrainSettings,
) -> list[str]:
    failed = []
    progress = StageProgress("training", len(evaluations), f"training each plan for {settings.epochs} epoch(s)")
    for done, (method, evaluation) in enumerate(evaluations.items(), start=1):
        state = train_method(method, evaluation.plan, cluster, parent.ref, tags, settings, return_state=True)
        if state.is_completed():
            progress.update(done, f"{method} {state.result().test_accuracy:.1%}")
        else:
            failed.append(f"training of {method}")
            progress.update(done, f"{method} FAILED: {_reason(state)}")
    return failed


def _summarise(
    parent: TrackedRun,
    tags: ExperimentTags,
    evaluations: dict[str, Evaluation],
    reported: ReportRun,
    failed: list[str],
    race: RaceResult | None,
) -> str:
    """What a person reads first: headline metrics (the BSP/TAPP speedup with its interval, from the race's
    per-round ratios, and the race's conditions), the evaluation table and the result text on the parent run,
    every chosen plan under ``plans/``, and the same result in Prefect (log lines, keyed artifacts)."""
    _headline(parent, evaluations, race)
    for method, evaluation in evaluations.items():
        parent.log_dict(evaluation.plan.to_dict(), f"plans/{method}.json")
    frame = summary.result_frame(evaluations)
    if not frame.empty:  # as shown (rounded); also as evaluation.json, the table mlflow.load_table reads
        parent.log_table(summary.shown_frame(frame), "evaluation.csv")
    ref = parent.ref
    ui = mlflow_ui_url(ref.tracking_uri)
    links = summary.Links(
        report_folder=str(reported.report.folder.resolve()),
        report_run=run_url(ui, ref.experiment_id, reported.run_id, "report/step_time.md"),
        runs_view=runs_view_url(ui, ref.experiment_id),
        flow_run=prefect_ui.flow_run_url(prefect_ui.flow_run_id()),
    )
    title = f"{tags.model} on {tags.cluster}, batch {tags.batch_size}: step time per method"
    text = summary.result_markdown(title, evaluations, links, failed)
    parent.set_note(text)
    prefect_ui.log(text)
    prefect_ui.markdown_artifact(prefect_ui.RESULT_KEY, text, f"TAPP vs the baselines: {tags.model} on {tags.cluster}")
    prefect_ui.table_artifact(prefect_ui.EVALUATION_KEY, frame, "one row per method, fastest first")
    prefect_ui.link_artifact(
        prefect_ui.MLFLOW_RUN_KEY,
        run_url(ui, ref.experiment_id, ref.run_id),
        f"MLflow run {ref.run_id}",
        f"the experiment's parent run in the MLflow UI at {ui}",
    )
    return text


def _headline(parent: TrackedRun, evaluations: dict[str, Evaluation], race: RaceResult | None) -> None:
    """Each method's step time, the BSP/TAPP speedup (with its interval when both were raced), the race's
    conditions and its summary (``race.json``)."""
    headline: dict[str, float | None] = {
        f"{method}_step_time_s": evaluation.step_time_s for method, evaluation in evaluations.items()
    }
    if "tapp" in evaluations and "bsp" in evaluations:
        bsp, tapp = evaluations["bsp"], evaluations["tapp"]
        ratio = race.ratio(bsp.plan.id, tapp.plan.id) if race is not None and bsp.measured and tapp.measured else None
        if ratio is not None:
            headline[runs.SPEEDUP] = ratio.median
            headline[f"{runs.SPEEDUP}_low"], headline[f"{runs.SPEEDUP}_high"] = ratio.low, ratio.high
        else:
            headline[runs.SPEEDUP] = bsp.step_time_s / tapp.step_time_s
    if race is not None:
        headline.update(
            {
                "race_rounds": race.rounds,
                "race_plans": len(race.plans),
                runs.LOAD_BEFORE: race.load_before,
                runs.LOAD_AFTER: race.load_after,
                runs.HOST_OTHER_CPU: race.other_cpu_share,
            }
        )
        parent.set_tags({runs.RACE_STOP: race.stop, runs.HOST_OVERLOADED: str(race.overloaded).lower()})
        parent.log_dict(race.summary(), "race.json")
    parent.log_metrics(headline)
