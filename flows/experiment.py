"""``tapp_experiment``: profile -> TAPP search rounds -> runtime sampling -> final evaluation -> training -> report.

The flow receives one ``ExperimentConfig`` (``tasks.config``), built by the command line or from a deployment's
parameters: its cluster was parsed when it was built, and nothing here parses it again; the model is traced only by
the profile (once per device kind, none from the profile cache), which runs before the first MLflow run, so a model
that cannot be traced costs no half-written run either. Everything lands in one MLflow parent run (its
configuration as ``config.json``) with a nested run per stage (profile, search, sampling, report), per evaluated
method and per trained plan; every stage is a Prefect task (the search one per round).

What a person sees first is one result (``tasks.summary.Result``: the verdict, every method's step time with its
interval, the BSP/TAPP speedup, what TAPP's search found), computed once at the end and shown everywhere
(``tasks.views``): the parent run's description, metrics and params, each method run's name and description, the
evaluation as an MLflow table (``evaluation.json``, for ``mlflow.load_table``), and in Prefect the flow run's log
lines and its keyed artifacts (``tasks.prefect_ui``); the command line prints it too. The flow run is named
``MODEL-CLUSTER-bBATCH-MODE``, the mode being ``measured`` or ``estimated``. The report goes to
``out/<experiment>/<parent run id>/`` unless ``out`` names a folder (one that holds no other experiment's report).

An interrupted experiment resumes: ``resume_from`` names its parent run, whose configuration ``resume_config``
reads back; the new experiment run continues TAPP's search from the last checkpoint the old one logged (after every
round) and then evaluates and reports as usual (``tapp run --resume RUN_ID``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from reports import schema
from reports.numbers import rounded, seconds
from reports.report_folders import check_report_folder, run_report_folder
from tapp_core.cost.calibration import Calibration
from tapp_core.cost.context import CostContext
from tapp_core.measure.races import RaceResult
from tapp_core.measure.stats import proportion_interval
from tapp_core.model.data import check_dataset_present
from tapp_core.model.workload import check_workload_data
from tapp_core.plan.plan import Plan
from tapp_core.planners import PAPER_METHODS
from tapp_core.planners.tapp import SearchOptions
from tapp_core.platform.cluster import scaled_name
from tapp_core.runtime.pool import WorkerPool
from tapp_core.runtime.pool_race import PoolRounds
from tapp_core.runtime.results import TrainResult
from tapp_core.runtime.temp_folders import owned_folder, sweep_pool_folders
from tasks import prefect_ui, summary, views
from tasks.calibration import experiment_calibration
from tasks.config import NO_DATA, ExperimentConfig
from tasks.evaluate import (
    Evaluation,
    Unfit,
    check_choices,
    evaluate_method,
    plan_method,
    race_methods,
    raced_plan,
)
from tasks.measure import RuntimeSettings
from tasks.profile import Profiled, profile_stage, record_profile
from tasks.progress import StageProgress
from tasks.report import ReportRun, report_experiment
from tasks.search import SearchBudget, SearchOutcome, fetch_checkpoint, sampling_stage, search_stage
from tasks.summary import Result
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
from tasks.train import SharedTraining, train_method, training_checkpoints

sampling_task = task(name="sampling", task_run_name="sampling", cache_policy=NO_CACHE)(sampling_stage)
"""The sampling stage as a Prefect task (its measured rounds are its nested ``search-round-N`` tasks)."""


SEARCH_FOLDER_PREFIX = "tapp-search-"


class ExperimentIncomplete(RuntimeError):
    """Some methods failed; the report holds the others and the parent run is marked FAILED. ``result`` is what the
    others gave (the command line shows it as for a complete experiment)."""

    def __init__(self, message: str, result: ExperimentResult | None = None) -> None:
        super().__init__(message)
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:  # a Prefect state pickles it
        return (ExperimentIncomplete, (str(self), self.result))


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
    result: Result | None = None
    """The result every view shows (``tasks.summary``)."""
    report_files: tuple[Path, ...] = ()


def check_inputs(
    config: ExperimentConfig, tracking_uri: str | None, experiment: str | None = None, out: str | None = None
) -> str:
    """What the configuration could not check itself, before any run exists: ``out`` (a report folder) holds no
    other experiment's report, its schedule options reach a planner, the named data is there (and every file can
    be read, when it is to be trained on), and the tracking store can be reached; returns the store's URI."""
    if out is not None and experiment is not None:
        check_report_folder(out, experiment)
    check_choices(config)
    if config.training and config.dataset not in ("synthetic", NO_DATA):
        workload = dataclasses.replace(config.workload(), data=config.dataset)
        check_workload_data(workload, config.data_dir)  # the data fit the workload's inputs, every file read
    elif config.dataset not in ("synthetic", NO_DATA):
        check_dataset_present(config.dataset, config.data_dir)
    return check_tracking(tracking_uri)


def resume_config(uri: str, run_id: str, experiment: str = DEFAULT_EXPERIMENT) -> tuple[str, str, ExperimentConfig]:
    """(run id, experiment name, configuration) of experiment run ``run_id`` (``last``: the latest experiment run
    of ``experiment``), read back from its ``config.json``, to resume it; a ``TrackingError`` when there is no such
    run, it is not an experiment's parent run, or it is not interrupted."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run, text = interrupted_run(
        client, uri, run_id, experiment, schema.EXPERIMENT, "an experiment's parent run (the one `tapp run` prints)"
    )
    run_id = run.info.run_id
    config = ExperimentConfig.from_json(text, f"--resume: run {run_id}'s {schema.CONFIG_ARTIFACT}")
    return run_id, client.get_experiment(run.info.experiment_id).name, config


def interrupted_run(client: Any, uri: str, run_id: str, experiment: str, kind: str, what: str) -> tuple[Any, str]:
    """The interrupted run ``run_id`` of ``kind`` (``last``: the latest of ``experiment``) and the text of its
    configuration artifact, to resume it; a ``TrackingError`` naming what is wrong (``what``: the kind in words)."""
    from mlflow.exceptions import MlflowException

    if run_id == "last":
        run_id = last_run(client, experiment, uri, kind)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise TrackingError(f"--resume: no run {run_id!r} in {uri}") from None
    if run.data.tags.get(schema.KIND) != kind:
        raise TrackingError(f"--resume: run {run_id} is not {what}")
    check_interrupted(run, run_id)
    return run, read_artifact_text(client, run_id, schema.CONFIG_ARTIFACT)


def check_interrupted(run: Any, run_id: str) -> None:
    if run.info.status in ("FINISHED", "RUNNING"):
        state = "finished" if run.info.status == "FINISHED" else "still running"
        raise TrackingError(f"--resume: run {run_id} is {state}; only an interrupted or failed run resumes")


def read_artifact_text(client: Any, run_id: str, name: str) -> str:
    """The text of artifact ``name`` of run ``run_id``; a ``TrackingError`` when it has none."""
    import tempfile

    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="tapp-config-") as folder:
        try:
            return Path(client.download_artifacts(run_id, name, folder)).read_text()
        except (MlflowException, OSError):
            raise TrackingError(f"--resume: run {run_id} has no {name} (made by an older TAPP?)") from None


def last_run(client: Any, experiment: str, uri: str, kind: str) -> str:
    """The latest run of ``kind`` (an experiment's or a sweep's parent run) in ``experiment``."""
    found = client.get_experiment_by_name(experiment)
    latest = (
        client.search_runs(
            [found.experiment_id], f"tags.{schema.KIND} = '{kind}'", max_results=1, order_by=["start_time DESC"]
        )
        if found is not None
        else []
    )
    if not latest:
        raise TrackingError(f"--resume last: experiment {experiment!r} in {uri} has no {kind} run")
    return str(latest[0].info.run_id)


def search_budget(config: ExperimentConfig) -> SearchBudget:
    """The search of ``search_rounds`` rounds in all, the last ``measured_rounds`` rewarded by measurements (a
    hybrid search; none: a simulated one), the rounds before them by the cost model (the configuration checked that
    there are some): the TAPP planner's options with these overridden by name."""
    measured = config.measured_rounds or 0
    named: dict[str, Any] = {
        "reward": "hybrid" if measured > 0 else "simulated",
        "rounds": config.search_rounds,
        "samples_per_round": config.samples_per_round,
        "measured_rounds": measured,
    }
    if config.measured_per_round is not None:
        named["measured_per_round"] = config.measured_per_round
    return SearchBudget(SearchOptions(**named))


def runtime_settings(config: ExperimentConfig) -> RuntimeSettings:
    """How the final evaluation measures: a race whose rounds run each plan for ``steps`` timed steps after
    ``warmup`` warm-up steps, and which starts no new round after ``race_seconds``."""
    runtime = RuntimeSettings(config.measure, config.warmup + config.steps, config.warmup, seed=config.seed)
    return runtime.with_race(budget_s=config.race_seconds)


def _search_params(budget: SearchBudget, sampling: RuntimeSettings) -> dict[str, object]:
    """The run parameters that the search budget and the sampling stage's runtime settle."""
    options = budget.options
    return {
        "simulated_rounds": options.simulated_rounds,
        "samples_per_round": options.samples_per_round,
        "measured_rounds": options.measured_rounds,
        "measured_per_round": options.measured_per_round,
        "sampling_steps": sampling.steps - sampling.warmup,
        "sampling_warmup": sampling.warmup,
    }


def _plan_of_work(config: ExperimentConfig, budget: SearchBudget) -> str:
    """The experiment's plan of work in one line, for the flow run's log."""
    how = "measured" if config.measure else "estimated by the cost model"
    trained = f"trained on {config.dataset}" if config.training else f"not trained ({config.training_skipped})"
    return (
        f"batch {config.batch_size}; {how}; TAPP search {config.search_rounds} rounds ({budget.options.simulated_rounds} "
        f"on the cost model, {budget.options.measured_rounds} measured); methods {', '.join(config.evaluated_methods)}; {trained}"
    )


def experiment_run_name() -> str:
    """The flow run's name, ``MODEL-CLUSTER-bBATCH-MODE``: measured and estimate-only runs differ at a glance. Read
    from the parameters as given (a configuration, or its JSON from a deployment), not by building one: that would
    parse the cluster file again."""
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config")
    values = config.model_dump(mode="json") if isinstance(config, ExperimentConfig) else dict(config or {})
    cluster = values.get("cluster") or "local"
    name = str(cluster.get("name", "cluster")) if isinstance(cluster, dict) else Path(str(cluster)).stem
    mode = "measured" if values.get("measure", True) else "estimated"
    model, batch = values.get("model", "alexnet"), values.get("batch_size", 64)
    return f"{model}-{scaled_name(name, float(values.get('power', 1.0)))}-b{batch}-{mode}"


@dataclass(frozen=True)
class ExperimentWork:
    """What an experiment does once its inputs are checked: its configuration and the stages' settings."""

    config: ExperimentConfig
    calibration: Calibration
    budget: SearchBudget
    runtime: RuntimeSettings
    out: str | None
    """The report's folder; None: ``out/<experiment>/<parent run id>``."""
    experiment: str
    pool: WorkerPool
    """The cluster's workers, which every measurement and training of the experiment runs on: started on first use,
    closed when the flow ends."""
    resume_from: str | None = None


@flow(name="tapp-experiment", flow_run_name=experiment_run_name)
def tapp_experiment(
    config: ExperimentConfig | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    out: str | None = None,
    tracking_uri: str | None = None,
    sweep_run: str | None = None,
    sweep_index: int | None = None,
    resume_from: str | None = None,
) -> ExperimentResult:
    """Find TAPP's plan for the configuration's model on its cluster, compare it with the baselines, train the
    paper's methods' plans, and report, all in MLflow (``config``: ``ExperimentConfig``; None: the defaults).

    ``resume_from`` (an earlier experiment run of the same configuration) continues its search; ``sweep_run`` and
    ``sweep_index`` place the experiment in a benchmark sweep. The report goes to ``out`` (default:
    ``out/<experiment>/<parent run id>``).
    """
    config = config or ExperimentConfig()
    prefect_ui.quiet_task_states()
    uri = check_inputs(config, tracking_uri, experiment, out)
    target = config.target
    extra = config.tags() | ({schema.SWEEP_INDEX: str(sweep_index)} if sweep_index is not None else {})
    tags = ExperimentTags(
        config.model, target.name, config.batch_size, config.seed, config.dataset, target.emulated, sweep_run,
        tuple(extra.items()),
    )  # fmt: skip
    budget = search_budget(config)
    runtime = runtime_settings(config)
    pool = WorkerPool(target)
    prefect_ui.log(f"{config.model} on {target.name} ({len(target.devices)} devices), {_plan_of_work(config, budget)}")
    profiled = profile_stage(config)  # before any run: a model that cannot be traced fails here
    calibration = experiment_calibration(config, profiled.library, prefect_ui.log)
    work = ExperimentWork(config, calibration, budget, runtime, out, experiment, pool, resume_from)
    try:
        run_tags = tags.as_tags(**{schema.KIND: schema.EXPERIMENT, schema.RESUMED_FROM: resume_from})
        name = schema.experiment_name(config.model, target.name, config.batch_size)
        with tracked_run(name, run_tags, experiment=experiment, uri=uri) as parent:
            parent.set_tags({schema.EXPERIMENT_RUN: parent.run_id})
            if not config.training:
                parent.set_tags({schema.TRAINING_SKIPPED: config.training_skipped})
            parent.log_params({**config.params(), **_search_params(budget, budget.sampling_runtime(runtime))})
            parent.log_text(config.to_json(), schema.CONFIG_ARTIFACT)
            evaluations, reported, result = _run_stages(parent, tags, work, profiled)
            done = ExperimentResult(
                experiment=experiment,
                tracking_uri=uri,
                run_id=parent.run_id,
                report_dir=reported.report.folder,
                step_time_table=reported.report.tables.step_time.to_markdown(),
                evaluations=evaluations,
                experiment_id=parent.ref.experiment_id,
                summary=summary.markdown(result),
                result=result,
                report_files=(*reported.report.table_files, *reported.report.figure_files),
            )
            if result.failed:  # the parent run ends FAILED
                failed = ", ".join(result.failed)
                raise ExperimentIncomplete(
                    f"failed: {failed} (see their MLflow runs); report in {done.report_dir}", done
                )
    finally:
        pool.close()
    return done


def _run_stages(
    parent: TrackedRun, tags: ExperimentTags, work: ExperimentWork, profiled: Profiled
) -> tuple[dict[str, Evaluation], ReportRun, summary.Result]:
    """Record the profile, search, sample, evaluate every method, train the paper's methods' plans, report,
    summarise; all under ``parent``. The search's checkpoint lives in a ``tapp-search-*`` folder of the temporary
    directory, removed on every way out; the ``tapp-search-*`` and ``tapp-pool-*`` folders a killed process left are
    swept first."""
    config, calibration, budget = work.config, work.calibration, work.budget
    out = work.out or str(run_report_folder(work.experiment, parent.run_id))
    parent.log_dict(config.target.model_dump(mode="json"), "cluster.json")
    parent.log_dict(calibration.to_dict(), "calibration.json")
    record_profile(parent.ref, tags, profiled)
    context = CostContext(profiled.library, config.target, calibration, config.optimizer)
    """Built once: the search, the sampling and every method's plan and estimate share it."""
    sweep_pool_folders()  # what a killed experiment left, whether or not this one measures
    with owned_folder(SEARCH_FOLDER_PREFIX) as workdir:
        if work.resume_from is not None:
            resumed = fetch_checkpoint(parent.ref.tracking_uri, work.resume_from, workdir)
            where = f"round {resumed}" if resumed is not None else "the start (it logged no checkpoint)"
            prefect_ui.log(f"resuming the search of run {work.resume_from} from {where}")
        sampling = budget.sampling_runtime(work.runtime)
        hybrid = budget.options.reward != "simulated"
        measurer = PoolRounds(work.pool, config.workload(), sampling.round_steps()) if hybrid else None
        session = search_stage(parent.ref, tags, context, config, budget, workdir, measurer)
        outcome: SearchOutcome = sampling_task(parent.ref, tags, session)
    tapp_plan = outcome.plan
    prefect_ui.log(f"TAPP's chosen {summary.plan_line(tapp_plan)}.")
    evaluations, failed, race, unfit = _evaluate(parent, tags, context, config, tapp_plan, work)
    accuracy: list[summary.Accuracy] = []
    if config.training:
        failed += _train(parent, tags, config, evaluations, work.pool, work.resume_from, accuracy, context)
    else:
        prefect_ui.log(f"No training: {config.training_skipped}.")
    title = f"{tags.model} on {tags.cluster}, batch {tags.batch_size}: step time per method"
    result = summary.build_result(title, evaluations, summary.Links(out), race, outcome.story, failed, accuracy, unfit)
    _race_conditions(parent, race)
    views.record_numbers(parent, result)  # before the report, which reads them back from MLflow
    reported = report_experiment(parent.ref, tags, out, work.experiment)
    result = _show(parent, tags, result, reported)
    return evaluations, reported, result


def _evaluate(
    parent: TrackedRun,
    tags: ExperimentTags,
    context: CostContext,
    config: ExperimentConfig,
    tapp_plan: Plan,
    work: ExperimentWork,
) -> tuple[dict[str, Evaluation], list[str], RaceResult | None, dict[str, str]]:
    """Plan every method, race all their plans together, then record each method; a failed one is noted and the
    rest go on. Returns the evaluations, the failures, the race (None when the runtime is off), and why each method
    with no plan that fits the memory has none (``Unfit``)."""
    methods, runtime = config.evaluated_methods, work.runtime
    planned = [plan_method(method, context, config, tapp_plan if method == "tapp" else None) for method in methods]
    race = None
    if runtime.enabled:
        planned, race = race_methods(planned, work.pool, config.workload(), runtime, config.estimated_only)
    evaluations: dict[str, Evaluation] = {}
    failed: list[str] = []
    unfit: dict[str, str] = {}
    first_with_plan: dict[str, str] = {}
    progress = StageProgress("evaluation", len(methods), "final evaluation")
    for done, method_plan in enumerate(planned, start=1):
        method, plan = method_plan.method, method_plan.plan
        key = plan.execution_id if plan is not None and method_plan.ok else method
        shared = first_with_plan.setdefault(key, method)  # plans that run the same share one measurement
        source = shared if shared != method else None
        unraced = method in config.estimated_only and (plan is None or raced_plan(race, plan) is None)
        state = evaluate_method(method_plan, parent.ref, tags, None if unraced else race, source, return_state=True)
        outcome = state.result() if state.is_completed() else None
        if isinstance(outcome, Unfit):
            unfit[method] = outcome.reason
            progress.update(done, f"{method}: no plan fits the memory")
        elif isinstance(outcome, Evaluation):
            result = evaluations[method] = outcome
            how = "measured" if result.measured else "estimated"
            text = f"{method} evaluated: {seconds(result.step_time_s)} s ({how})"
            if done < len(planned):
                progress.update(done, text)
            else:  # the bar's last words are not the last method's, which a reader would take for the winner
                progress.update(done, "every method evaluated", text)
        else:
            failed.append(f"evaluation of {method}")
            progress.update(done, f"{method} FAILED: {_reason(state)}")
    return evaluations, failed, race, unfit


def _reason(state: Any) -> str:
    """Why a task's state is not completed, in one line."""
    try:
        state.result()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return str(state.name)


TRAINED_METHODS: tuple[str, ...] = (*PAPER_METHODS, "single-gpu")
"""The methods whose plans an experiment trains: the TAPP paper's accuracy table's (and SingleGPU, where there is
one)."""


def _train(
    parent: TrackedRun,
    tags: ExperimentTags,
    config: ExperimentConfig,
    evaluations: dict[str, Evaluation],
    pool: WorkerPool,
    resume_from: str | None,
    accuracy: list[summary.Accuracy],
    context: CostContext | None = None,
) -> list[str]:
    """Train each of the paper's methods' plans, the same computation once (``training_key``: the second method
    records the first's result, ``tasks.train.SharedTraining``), adding each one's test accuracy to ``accuracy``;
    returns the failures. A resumed experiment (``resume_from``) resumes each training from its checkpoints, if the
    configuration writes them (``training_checkpoints``)."""
    chosen = [m for m in evaluations if m in TRAINED_METHODS]
    failed = []
    trained: dict[str, SharedTraining] = {}
    what = f"{config.train_epochs} epoch(s)" if config.train_epochs else _training_amount(config)
    progress = StageProgress("training", len(chosen), f"training each plan on {config.dataset}, {what}")
    for done, method in enumerate(chosen, start=1):
        evaluation = evaluations[method]
        key = training_key(evaluation.plan)
        checkpoints = training_checkpoints(config, resume_from or parent.run_id, method, resume_from is not None)
        state = train_method(
            method,
            evaluation.plan,
            evaluation.step_time_s,
            config,
            parent.ref,
            tags,
            pool,
            trained.get(key),
            checkpoints,
            context,
            return_state=True,
        )
        if state.is_completed():
            result = state.result()
            trained.setdefault(key, SharedTraining(method, result, evaluation.step_time_s))
            source = trained[key].method if trained[key].method != method else None
            accuracy.append(_accuracy(method, result, source, config, evaluation.step_time_s))
            progress.update(done, accuracy[-1].text)
        else:
            failed.append(f"training of {method}")
            progress.update(done, f"{method} FAILED: {_reason(state)}")
    return failed


def _accuracy(
    method: str, result: TrainResult, source: str | None, config: ExperimentConfig, step_time_s: float
) -> summary.Accuracy:
    """A trained method's accuracy, its interval over the test images, and the training images it took."""
    epochs, steps = config.train_plan(step_time_s)
    images = epochs * (steps or 0) * config.batch_size  # whole epochs (steps None) count no images here
    perplexity = result.test_perplexity if config.workload().language_model else None
    tested = proportion_interval(result.test_accuracy, result.test_samples)
    return summary.Accuracy(method, tested, images, source, perplexity)


def training_key(plan: Plan) -> str:
    """Plans whose training computes the same share a key: a plan whose every stage applies its gradients to the
    weights they were computed on (a synchronous schedule, or one stage) computes what one device computes (the
    runtime's correctness tests); a plan with stale stages only what its own execution does."""
    schedule = plan.pipeline_schedule
    delays = [schedule.delay(stage, plan.n_stages, plan.micro_batches) for stage in range(plan.n_stages)]
    return "synchronous" if not any(delays) else plan.execution_id


def _training_amount(config: ExperimentConfig) -> str:
    if config.train_seconds is not None:
        return f"{config.train_seconds:g} s each"
    return f"{config.train_samples:,} samples each"


def _show(parent: TrackedRun, tags: ExperimentTags, result: summary.Result, reported: ReportRun) -> summary.Result:
    """The result with its links (the report, the runs view, the Prefect flow run) as the parent run's description
    in MLflow and in Prefect (``tasks.views``)."""
    ref = parent.ref
    ui = mlflow_ui_url(ref.tracking_uri)
    links = summary.Links(
        report_folder=str(reported.report.folder.resolve()),
        report_run=run_url(ui, ref.experiment_id, reported.run_id, "report/step_time.md"),
        runs_view=runs_view_url(ui, ref.experiment_id),
        flow_run=prefect_ui.flow_run_url(prefect_ui.flow_run_id()),
    )
    result = dataclasses.replace(result, links=links)
    views.record_text(parent, result, reported.report.figure_files)
    views.show_result(result, ui, parent, f"TAPP vs the baselines: {tags.model} on {tags.cluster}")
    return result


def _race_conditions(parent: TrackedRun, race: RaceResult | None) -> None:
    """The evaluation race's conditions (rounds, plans, the host's load) and its summary (``race.json``)."""
    if race is None:
        return
    parent.log_metrics(
        {
            "race_rounds": race.rounds,
            "race_plans": len(race.plans),
            schema.LOAD_BEFORE: rounded(race.load_before),  # rounded for reading: MLflow shows metrics raw
            schema.LOAD_AFTER: rounded(race.load_after),
            schema.HOST_OTHER_CPU: rounded(race.other_cpu_share),
        }
    )
    parent.set_tags({schema.RACE_STOP: race.stop, schema.HOST_OVERLOADED: str(race.overloaded).lower()})
    parent.log_dict(race.summary(), "race.json")
