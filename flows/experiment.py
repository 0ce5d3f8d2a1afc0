"""``tapp_experiment``: profile -> TAPP search rounds -> runtime sampling -> final evaluation -> report.

Everything lands in one MLflow parent run with a nested run per stage (profile, search, sampling, report) and
per evaluated method. Inputs are checked before any run exists, so a typo costs no half-written run.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow

from reports import runs
from reports.paper import Report
from tapp_core.cluster import Cluster, load_cluster
from tapp_core.costs import Calibration
from tapp_core.data import DATASET_NAMES, DataError, open_dataset
from tapp_core.errors import TappError
from tapp_core.library import LayerLibrary
from tapp_core.models import build_traced_model
from tapp_core.plan import Plan
from tapp_core.runtime.calibration import load_fitted_calibration
from tapp_core.runtime.race import RaceResult
from tasks.evaluate import Evaluation, check_methods, evaluate_method, methods_for, plan_method, race_methods
from tasks.measure import RuntimeSettings, close_pools
from tasks.profile import profile_stage
from tasks.progress import StageProgress
from tasks.report import report_experiment
from tasks.search import SearchBudget, sampling_stage, search_stage
from tasks.tracking import DEFAULT_EXPERIMENT, ExperimentTags, TrackedRun, check_tracking, tracked_run
from tasks.train import TrainSettings, train_method

DEFAULT_METHODS: tuple[str, ...] = ("tapp", "single-cpu", "bsp", "pipetorch", "even", "pipedream", "autoddl", "oracle")
DEFAULT_OUT = Path("out") / "report"


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


@flow(name="tapp-experiment", flow_run_name="{model}-{cluster}-b{batch_size}")
def tapp_experiment(
    model: str = "alexnet",
    cluster: str = "local",
    batch_size: int = 64,
    dataset: str = "synthetic",
    data_dir: str | None = None,
    search_rounds: int = SearchBudget.rounds,
    samples_per_round: int = SearchBudget.samples_per_round,
    measured_rounds: int = SearchBudget.measured_rounds,
    measured_per_round: int = SearchBudget.measured_per_round,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    measure: bool = True,
    steps: int = RuntimeSettings.steps,
    warmup: int = RuntimeSettings.warmup,
    train_epochs: int = 0,
    train_steps: int | None = None,
    seed: int = 0,
    experiment: str = DEFAULT_EXPERIMENT,
    out: str = str(DEFAULT_OUT),
    tracking_uri: str | None = None,
    sweep_run: str | None = None,
) -> ExperimentResult:
    """Find TAPP's plan for ``model`` on ``cluster``, compare it with the baselines, and report, all in MLflow.

    ``measure=False`` skips the runtime (step times from the cost model, tagged ``estimated``);
    ``train_epochs`` > 0 also trains each method's plan on ``dataset`` for the accuracy table.
    """
    methods = tuple(methods)
    target, uri = check_inputs(model, cluster, batch_size, dataset, data_dir, methods, tracking_uri)
    tags = ExperimentTags(model, target.name, batch_size, seed, dataset, target.emulated, sweep_run)
    budget = SearchBudget(search_rounds, samples_per_round, measured_rounds if measure else 0, measured_per_round)
    runtime = RuntimeSettings(enabled=measure, steps=steps, warmup=warmup, seed=seed)
    training = TrainSettings(train_epochs, train_steps, data_dir) if train_epochs > 0 else None
    chosen_methods = methods_for(target, methods)
    params = {
        "model": model,
        "cluster": cluster,
        "batch_size": batch_size,
        "dataset": dataset,
        "data_dir": data_dir,
        "methods": ",".join(chosen_methods),
        "search_rounds": search_rounds,
        "samples_per_round": samples_per_round,
        "measured_rounds": budget.measured_rounds,
        "measured_per_round": budget.measured_per_round,
        "measured_steps": budget.measured_steps,
        "measure": measure,
        "steps": steps,
        "warmup": warmup,
        "train_epochs": train_epochs,
        "seed": seed,
    }
    name = f"{model} on {target.name}, batch {batch_size}"
    try:
        with tracked_run(name, tags.as_tags(**{runs.KIND: runs.EXPERIMENT}), experiment=experiment, uri=uri) as parent:
            parent.set_tags({runs.EXPERIMENT_RUN: parent.run_id})
            parent.log_params(params)
            evaluations, report = _run_stages(
                parent, tags, target, chosen_methods, budget, runtime, training, out, experiment
            )
    finally:
        close_pools()
    return ExperimentResult(
        experiment=experiment,
        tracking_uri=uri,
        run_id=parent.run_id,
        report_dir=report.folder,
        step_time_table=report.tables.step_time.to_markdown(),
        evaluations=evaluations,
    )


def _run_stages(
    parent: TrackedRun,
    tags: ExperimentTags,
    target: Cluster,
    methods: tuple[str, ...],
    budget: SearchBudget,
    runtime: RuntimeSettings,
    training: TrainSettings | None,
    out: str,
    experiment: str,
) -> tuple[dict[str, Evaluation], Report]:
    """Profile, search, sample, evaluate every method (and train each plan), report; all under ``parent``."""
    parent.log_dict(target.model_dump(mode="json"), "cluster.json")
    calibration = load_fitted_calibration()
    parent.log_dict(calibration.to_dict(), "calibration.json")
    library = profile_stage(parent.ref, tags, target)
    with tempfile.TemporaryDirectory(prefix="tapp-search-") as workdir:
        sampling = budget.sampling_runtime(runtime)
        search = search_stage(parent.ref, tags, library, target, budget, sampling, calibration, Path(workdir))
        tapp_plan = sampling_stage(parent.ref, tags, search, library, target, sampling)
    evaluations, failed, race = _evaluate(parent, tags, library, target, methods, tapp_plan, runtime, calibration)
    if training is not None:
        failed += _train(parent, tags, target, evaluations, training)
    report = report_experiment(parent.ref, tags, out, experiment)
    _summarise(parent, evaluations, race)
    if failed:
        raise ExperimentIncomplete(f"failed: {', '.join(failed)} (see their MLflow runs); report in {out}")
    return evaluations, report


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
    progress = StageProgress("evaluation", len(methods), "final evaluation: methods")
    for done, method_plan in enumerate(planned, start=1):
        method, plan = method_plan.method, method_plan.plan
        shared = first_with_plan.setdefault(plan.id, method) if plan is not None and method_plan.ok else method
        source = shared if shared != method else None
        state = evaluate_method(method_plan, parent.ref, tags, race, source, return_state=True)
        if state.is_completed():
            result = evaluations[method] = state.result()
            progress.update(done, f"{method} {result.step_time_s:.4f} s")
        else:
            failed.append(f"evaluation of {method}")
            progress.update(done, f"{method} FAILED")
    return evaluations, failed, race


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
            progress.update(done, f"{method} FAILED")
    return failed


def _summarise(parent: TrackedRun, evaluations: dict[str, Evaluation], race: RaceResult | None) -> None:
    """Headline numbers on the parent run (the BSP/TAPP speedup with its interval, from the race's per-round
    ratios), the race's conditions, and every chosen plan under ``plans/``."""
    headline: dict[str, float | None] = {
        f"{method}_step_time_s": evaluation.step_time_s for method, evaluation in evaluations.items()
    }
    if "tapp" in evaluations and "bsp" in evaluations:
        bsp, tapp = evaluations["bsp"], evaluations["tapp"]
        ratio = race.ratio(bsp.plan.id, tapp.plan.id) if race is not None and bsp.measured and tapp.measured else None
        if ratio is not None:
            headline.update(
                {
                    runs.SPEEDUP: ratio.median,
                    f"{runs.SPEEDUP}_low": ratio.low,
                    f"{runs.SPEEDUP}_high": ratio.high,
                }
            )
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
    for method, evaluation in evaluations.items():
        parent.log_dict(evaluation.plan.to_dict(), f"plans/{method}.json")
