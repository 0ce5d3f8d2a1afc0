"""Orchestrated experiments, Prefect flows tracked in MLflow: ``run``, and ``report`` rebuilt from MLflow."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from flows.cli.common import (
    DEFAULT_BATCH,
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    BatchOpt,
    CheckpointDirOpt,
    CheckpointEveryOpt,
    ClusterOpt,
    DataDirOpt,
    DatasetOpt,
    ElasticOpt,
    ExperimentOpt,
    ModelOpt,
    NoCalibrateOpt,
    RaceSecondsOpt,
    ScheduleOpt,
    SchedulesOpt,
    SeedOpt,
    StalenessOpt,
    StepsOpt,
    TrackingUriOpt,
    WarmupOpt,
    comma_list,
    console,
    error_console,
    print_markdown,
    progress_bars,
)
from reports import schema
from tapp_core.errors import TappError
from tapp_core.planners.base import PLANNER_NAMES
from tasks.config import (
    DEFAULT_MEASURED_ROUNDS,
    ESTIMATED_UNLESS_ASKED,
    ExperimentConfig,
    ExperimentSettings,
    SweepConfig,
    default_methods,
)

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from flows.experiment import ExperimentResult

_FIELDS = ExperimentSettings.model_fields
DEFAULT_ROUNDS = _FIELDS["search_rounds"].default
"""TAPP's search rounds in all (the experiments' default, ``tasks.config``)."""

RoundsOpt = Annotated[
    int,
    typer.Option(
        "--rounds",
        min=1,
        help="TAPP's search rounds in all (as tapp plan --rounds counts them), measured ones included",
    ),
]
SamplesOpt = Annotated[int, typer.Option(min=1, help="plans sampled per search round")]
MeasuredRoundsOpt = Annotated[
    int | None,
    typer.Option(
        min=0,
        help=f"how many of the last rounds are rewarded by measurements on the workers (default: {DEFAULT_MEASURED_ROUNDS}; 0 with --estimate-only)",
    ),
]
MethodsOpt = Annotated[
    str | None,
    typer.Option(
        help="comma-separated methods, tapp among them: "
        + " | ".join(PLANNER_NAMES)
        + " (default: "
        + ", ".join(default_methods())
        + " raced, and "
        + ", ".join(ESTIMATED_UNLESS_ASKED)
        + " estimated unless one's plan is raced; even only when named; single-gpu only on a cluster with a GPU)"
    ),
]
EstimateOnlyOpt = Annotated[
    bool, typer.Option("--estimate-only", help="no MPI runtime: cost-model step times, and no training")
]
TrainSamplesOpt = Annotated[
    int,
    typer.Option(
        min=0,
        help="training images per method, the same for every method: the TAPP paper's methods' plans are trained on "
        "the real data, their test accuracy measured along the way (0: no training)",
    ),
]
TrainSecondsOpt = Annotated[
    float | None,
    typer.Option(
        min=0,
        help="a time budget per method instead of --train-samples (steps = seconds / the plan's step time: a faster "
        "plan trains more images; 0: no training)",
    ),
]
TrainOptimizerOpt = Annotated[
    str | None,
    typer.Option(
        help="the experiment's optimiser, which the races time and the training uses: adamw | sgd (default: the "
        "one the model's workload declares, else adamw)"
    ),
]
TrainLrOpt = Annotated[
    float | None, typer.Option(help="its learning rate (default: the declared optimiser's, else adamw 1e-3, sgd 0.01)")
]
TrainEpochsOpt = Annotated[int | None, typer.Option(min=1, help="train whole epochs instead of --train-seconds")]
TestSamplesOpt = Annotated[
    int, typer.Option(min=0, help="test images each accuracy is measured on (0: the whole test set)")
]
RunOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="folder for the report's tables and figures (default: out/EXPERIMENT/RUN_ID); one that holds another "
        "experiment's report is refused",
    ),
]
ReportOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="folder for the report's tables and figures (default: out/EXPERIMENT/report); one that holds another "
        "experiment's report is refused",
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's log lines")]
PowerOpt = Annotated[
    float,
    typer.Option(
        help="computing power: the factor on the speed of the cluster's slow devices (its slow half; 1: as written)",
    ),
]

ResumeOpt = Annotated[
    str | None,
    typer.Option(
        "--resume",
        metavar="RUN_ID",
        help="continue an interrupted experiment (its parent run's id, or `last`: the latest of --experiment) with "
        "its own configuration, from the last round its search logged; the other experiment options are not used",
    ),
]


def _settings(
    methods: MethodsOpt = None,
    schedule: ScheduleOpt = None,
    schedules: SchedulesOpt = None,
    staleness: StalenessOpt = None,
    rounds: RoundsOpt = DEFAULT_ROUNDS,
    samples_per_round: SamplesOpt = _FIELDS["samples_per_round"].default,
    measured_rounds: MeasuredRoundsOpt = None,
    estimate_only: EstimateOnlyOpt = False,
    no_calibrate: NoCalibrateOpt = False,
    steps: StepsOpt = DEFAULT_STEPS,
    warmup: WarmupOpt = DEFAULT_WARMUP,
    race_seconds: RaceSecondsOpt = _FIELDS["race_seconds"].default,
    data_dir: DataDirOpt = None,
    dataset: DatasetOpt = None,
    train_samples: TrainSamplesOpt = _FIELDS["train_samples"].default,
    train_seconds: TrainSecondsOpt = None,
    train_epochs: TrainEpochsOpt = None,
    train_optimizer: TrainOptimizerOpt = _FIELDS["train_optimizer"].default,
    train_lr: TrainLrOpt = None,
    test_samples: TestSamplesOpt = _FIELDS["test_samples"].default,
    seed: SeedOpt = 0,
    checkpoint_dir: CheckpointDirOpt = None,
    checkpoint_every: CheckpointEveryOpt = 0,
    elastic: ElasticOpt = False,
) -> dict[str, object]:
    """The experiment settings' options (``tasks.config.ExperimentSettings``), as the configuration's values."""
    values: dict[str, object] = {
        "methods": comma_list(methods),
        "schedule": schedule,
        "schedules": comma_list(schedules),
        "staleness": staleness,
        "search_rounds": rounds,
        "samples_per_round": samples_per_round,
        "measured_rounds": measured_rounds,
        "measure": not estimate_only,
        "calibrate": False if no_calibrate else None,
        "steps": steps,
        "warmup": warmup,
        "race_seconds": race_seconds,
        "dataset": dataset,
        "data_dir": str(data_dir) if data_dir is not None else None,
        "train_samples": train_samples,
        "train_seconds": train_seconds,
        "train_epochs": train_epochs,
        "train_optimizer": train_optimizer,
        "train_lr": train_lr,
        "test_samples": test_samples or None,
        "seed": seed,
        "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir is not None else None,
        "checkpoint_every": checkpoint_every or None,
        "elastic": elastic or None,
    }
    return {k: v for k, v in values.items() if v is not None}  # left out: the configuration's default


OPTION_NAMES = {
    "search_rounds": "--rounds",
    "measure": "--estimate-only",
    "calibrate": "--no-calibrate",
    "models": "--model",
    "model": "--model",
    "clusters": "--cluster",
    "cluster": "--cluster",
    "batch_sizes": "--batch-sizes",
    "powers": "--power",
}
"""The command line's name of a setting whose option is not ``--`` + its name (messages name the option)."""


def with_settings(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with the experiment settings' options (``_settings``) after its own; it receives them as
    ``settings``, one dictionary of configuration values. ``tapp run`` and ``tapp sweep`` share them this way, as
    their configurations share ``ExperimentSettings``."""
    own = inspect.signature(command, eval_str=True)
    extra = inspect.signature(_settings, eval_str=True)

    @functools.wraps(command)
    def wrapper(**options: Any) -> None:
        settings = _settings(**{name: options.pop(name) for name in extra.parameters})
        command(settings=settings, **options)

    parameters = [p for p in own.parameters.values() if p.name != "settings"] + list(extra.parameters.values())
    wrapper.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return wrapper


C = TypeVar("C", ExperimentConfig, SweepConfig)


def built(kind: type[C], values: dict[str, object], command: str) -> C:
    """The configuration ``kind`` of ``values``; a bad one is one line naming its option (exit 2)."""
    from tasks.config import ConfigError, build

    try:
        return build(kind, values, f"tapp {command}")
    except ConfigError as exc:
        text = str(exc)
        for field, option in OPTION_NAMES.items():
            text = text.replace(f" {field}: ", f" {option}: ").replace(f"; {field}: ", f"; {option}: ")
        for field in kind.model_fields:
            text = text.replace(f" {field}: ", f" --{field.replace('_', '-')}: ")
        raise ConfigError(text) from None


@with_settings
def run(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    batch_size: BatchOpt = DEFAULT_BATCH,
    power: PowerOpt = 1.0,
    experiment: ExperimentOpt = "tapp",
    out: RunOutOpt = None,
    tracking_uri: TrackingUriOpt = None,
    resume: ResumeOpt = None,
    verbose: VerboseOpt = False,
    *,
    settings: dict[str, object],
) -> None:
    """Run the whole experiment: profile, TAPP search, runtime sampling, TAPP vs the baselines, training of the
    paper's methods' plans for the accuracy table, report (Prefect + MLflow)."""
    _quiet_services()
    from flows.server import prefect_api, sigterm_exits
    from reports.report_folders import check_report_folder
    from tapp_core.paths import check_output_folder

    if out is not None:
        check_output_folder(out, "--out")
        check_report_folder(out, experiment)
    # SIGTERM ends the command as Ctrl-C does (runs KILLED, server and workers stopped, temporary folders removed).
    # The server starts first, so that its start overlaps the imports, the input checks and the MLflow store.
    with sigterm_exits(), prefect_api() as prefect_ready:
        if resume is not None:
            uri, resume, experiment, config = _resumed(resume, experiment, tracking_uri)
        else:
            values = {**settings, "model": model, "cluster": cluster, "batch_size": batch_size, "power": power}
            config = built(ExperimentConfig, values, "run")
            uri = _checked(config, tracking_uri)
        _announce(config, uri, experiment, resume)
        if out is not None:
            check_report_folder(out, experiment)  # a resumed experiment's name is known only now
        prefect_ready()
        with _stage_progress(verbose):
            state = _run_flow(config, experiment, out, uri, resume)
        flow_run = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
        failure = _failure(state)
        shown = _result_of(state)
        _print_result(shown)
        _print_links(uri, experiment, flow_run)  # in the block: a temporary Prefect server gets no link
        _print_report(shown, out)
    if failure:
        error_console.print(f"[bold red]the experiment failed:[/] {failure}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _quiet_services() -> None:
    # Prefect's local server would otherwise post anonymous usage data at start (and log an error when offline).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A fresh PREFECT_HOME migrates its database on the first start, which can pass Prefect's 20 s default here.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # MLflow draws a progress bar for every artifact it reads back (the report reads several): noise in the terminal.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def _checked(config: ExperimentConfig, tracking_uri: str | None) -> str:
    """The store (opened, its orphaned runs marked FAILED), every input checked first."""
    from flows.experiment import check_inputs

    uri = check_inputs(config, tracking_uri)  # the data and the store, before any run exists
    _open(uri)
    return uri


def _resumed(run_id: str, experiment: str, tracking_uri: str | None) -> tuple[str, str, str, ExperimentConfig]:
    """(store, run id, experiment name, configuration) of the interrupted experiment run ``run_id`` (``last``: the
    latest of ``experiment``)."""
    from flows.experiment import check_inputs, resume_config
    from tasks.tracking import check_tracking

    uri = check_tracking(tracking_uri)
    _open(uri)
    run_id, experiment, config = resume_config(uri, run_id, experiment)
    check_inputs(config, uri)
    return uri, run_id, experiment, config


def _open(uri: str) -> None:
    """Open the store (created and migrated if new) and mark FAILED the runs that dead processes left RUNNING."""
    from tasks.tracking import fail_orphaned_runs, open_store

    open_store(uri)
    orphaned = fail_orphaned_runs(uri)
    if orphaned:
        console.print(
            f"marked {len(orphaned)} run(s) FAILED that a killed process left RUNNING: {', '.join(orphaned)}",
            highlight=False,
            soft_wrap=True,
        )


def _announce(config: ExperimentConfig, uri: str, experiment: str, resume: str | None) -> None:
    from tapp_core.model.workload import check_workload

    workload = config.workload()
    check_workload(workload)  # a model whose inputs TAPP cannot infer: one line, exit 2
    if config.training:
        workload = dataclasses.replace(workload, data=config.dataset)  # the races' batches are synthetic, of its shape
    target = config.target
    resuming = f"; resuming run {resume}" if resume else ""
    trained = "each method's plan trained" if config.training else f"not trained: {config.training_skipped}"
    console.print(
        f"[bold]tapp_experiment[/]: workload {workload.describe()}; on {target.name} ({len(target.devices)} devices), batch "
        f"{config.batch_size}; {trained}; MLflow store {uri}, experiment {experiment!r}{resuming}",
        highlight=False,
        soft_wrap=True,
    )


def _run_flow(config: ExperimentConfig, experiment: str, out: Path | None, uri: str, resume: str | None) -> State[Any]:
    from flows.experiment import tapp_experiment

    folder = str(out) if out is not None else None
    state: State[Any] = tapp_experiment(
        config=config, experiment=experiment, out=folder, tracking_uri=uri, resume_from=resume, return_state=True
    )
    return state


def _result_of(state: State[Any]) -> ExperimentResult | None:
    """The flow's result: a complete experiment's, else what the methods that did not fail gave (None when the flow
    ended before it had one)."""
    from flows.experiment import ExperimentIncomplete

    try:
        result: ExperimentResult = state.result()
    except ExperimentIncomplete as incomplete:
        return incomplete.result
    except Exception:
        return None
    return result


def _failure(state: State[Any]) -> str | None:
    """Why the flow failed (None if it completed); a ``TappError`` (bad input) is raised as it is."""
    if state.is_completed():
        return None
    try:
        state.result()
    except TappError:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


ModelsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--model",
        "-m",
        help="the models, each a registry name, module:callable or file.py:callable: --model M1 M2 or --model M1 "
        "--model M2 (default: alexnet vgg16 inception_v3)",
    ),
]
ClustersOpt = Annotated[
    list[str] | None, typer.Option("--cluster", "-c", help="the clusters, by name or YAML file (default: local)")
]
BatchSizesOpt = Annotated[
    list[int] | None, typer.Option("--batch-sizes", "-b", min=1, help="the batch sizes (default: 64)")
]
PowersOpt = Annotated[
    list[float] | None,
    typer.Option(
        "--power",
        help="the computing powers: each cluster's family, its slow devices' speed times each (default: 1)",
    ),
]
SweepResumeOpt = Annotated[
    str | None,
    typer.Option(
        "--resume",
        metavar="RUN_ID",
        help="continue an interrupted sweep (its run's id, or `last`: the latest of --experiment) with its own "
        "configuration, at its first unfinished configuration; the other sweep options are not used",
    ),
]


@with_settings
def sweep(
    models: ModelsOpt = None,
    clusters: ClustersOpt = None,
    batch_sizes: BatchSizesOpt = None,
    powers: PowersOpt = None,
    experiment: ExperimentOpt = "tapp",
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for the sweep's report")] = Path("out/sweep"),
    tracking_uri: TrackingUriOpt = None,
    resume: SweepResumeOpt = None,
    verbose: VerboseOpt = False,
    *,
    settings: dict[str, object],
) -> None:
    """Run a sweep of experiments without a Prefect server: every combination of models, clusters, computing powers
    and batch sizes (the deployments' benchmark_sweep, with the same parameters), then its report; a bar per
    configuration."""
    _quiet_services()
    from flows.server import prefect_api, sigterm_exits
    from tapp_core.paths import check_output_folder

    check_output_folder(out, "--out")
    with sigterm_exits(), prefect_api() as prefect_ready:
        if resume is not None:
            uri, resume, chosen = _resumed_sweep(resume, experiment, tracking_uri)
        else:
            lists = {"models": models, "clusters": clusters, "batch_sizes": batch_sizes, "powers": powers}
            chosen = built(SweepConfig, {**settings, **{k: v for k, v in lists.items() if v}}, "sweep")
            uri = _checked_sweep(chosen, tracking_uri)
        configurations = chosen.configurations()
        how = "measured" if chosen.measure else "estimated"
        console.print(
            f"[bold]benchmark_sweep[/]: {len(configurations)} experiments ({how}); MLflow store {uri}, experiment "
            f"{experiment!r}" + (f"; resuming run {resume}" if resume else ""),
            highlight=False,
            soft_wrap=True,
        )
        prefect_ready()
        with _sweep_progress(verbose, configurations):
            state = _run_sweep(chosen if resume is None else None, experiment, out, uri, resume)
        failure = _failure(state)
        tables = ("step_time", "computing_power", "batch_size", "paper_comparison", "accuracy", "perplexity")
        for name in (f"{table}.md" for table in tables):
            if (out / name).is_file():
                print_markdown((out / name).read_text())
        console.print(f"Report:  {out}/ (tables as .md/.csv/.tex, figures as .png)", highlight=False)
    if failure:
        error_console.print(f"[bold red]the sweep failed:[/] {failure}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _checked_sweep(chosen: SweepConfig, tracking_uri: str | None) -> str:
    from flows.experiment import check_inputs

    uri = ""
    for config in chosen.configurations():
        uri = check_inputs(config, tracking_uri)
    _open(uri)
    return uri


def _resumed_sweep(run_id: str, experiment: str, tracking_uri: str | None) -> tuple[str, str, SweepConfig]:
    """(store, run id, configuration) of the interrupted sweep run ``run_id`` (``last``: the latest of
    ``experiment``)."""
    from flows.sweep import resume_sweep
    from tasks.tracking import check_tracking

    uri = check_tracking(tracking_uri)
    _open(uri)
    chosen, resumed = resume_sweep(uri, run_id, experiment)
    left = len(chosen.configurations()) - len(resumed.finished)
    console.print(
        f"resuming sweep {resumed.sweep_id}: {len(resumed.finished)} configurations finished, {left} to run",
        highlight=False,
        soft_wrap=True,
    )
    return uri, resumed.run_id, chosen


def _run_sweep(chosen: SweepConfig | None, experiment: str, out: Path, uri: str, resume: str | None) -> State[Any]:
    from flows.sweep import benchmark_sweep

    state: State[Any] = benchmark_sweep(
        sweep=chosen, experiment=experiment, out=str(out), tracking_uri=uri, resume_from=resume, return_state=True
    )
    return state


@contextlib.contextmanager
def _sweep_progress(verbose: bool, configurations: list[ExperimentConfig]) -> Iterator[None]:
    """A rich bar per configuration, in the sweep's order: its stages done, and the latest stage's status."""
    from flows.sweep import SWEEP_STAGE, configuration_label
    from tasks.progress import listening

    _quiet_prefect_logs(verbose)
    with progress_bars("[bold]{task.description}") as progress:
        bars = {
            configuration_label(c): progress.add_task(configuration_label(c), total=len(expected_stages(c)), status="")
            for c in configurations
        }
        stages_of = {configuration_label(c): expected_stages(c) for c in configurations}
        current: list[str] = []
        finished: dict[str, set[str]] = {}

        def show(stage: str, done: int, total: int, status: str) -> None:
            if stage == SWEEP_STAGE:
                state, _, label = status.partition(" ")
                if label in bars and state == "start":
                    current[:] = [label]
                elif label.split(" (")[0] in bars and state in ("done", "failed"):
                    name = label.split(" (")[0]
                    progress.update(bars[name], completed=len(stages_of[name]), status=f"{state}{label[len(name) :]}")
                return
            if not current:
                return
            finished.setdefault(current[0], set())
            if done >= total:
                finished[current[0]].add(stage)
            progress.update(bars[current[0]], completed=len(finished[current[0]]), status=f"{stage}: {status}")

        with listening(show):
            yield


def expected_stages(config: ExperimentConfig) -> list[str]:
    """The progress stages one experiment of this configuration goes through."""
    stages = ["profile", "search", "sampling"]
    stages += ["race"] if config.measure else []
    stages += ["evaluation"] + (["training"] if config.training else []) + ["report"]
    return stages


def report(
    experiment: ExperimentOpt = "tapp",
    out: ReportOutOpt = None,
    tracking_uri: TrackingUriOpt = None,
) -> None:
    """Rebuild the paper's tables (Markdown, CSV, LaTeX) and figures (PNG) from an MLflow experiment alone."""
    from reports.paper import write_report
    from reports.report_folders import check_report_folder, experiment_report_folder
    from tapp_core.paths import check_output_folder
    from tasks.tracking import check_tracking, open_store

    out = out if out is not None else experiment_report_folder(experiment)
    check_output_folder(out, "--out")
    check_report_folder(out, experiment)
    uri = check_tracking(tracking_uri, existing=True)  # reading a store must not create an empty one
    open_store(uri)
    with console.status(f"reading experiment {experiment!r} from {uri}"):
        written = write_report(experiment, out, uri)
    print_markdown(written.tables.step_time.to_markdown())
    console.print(f"wrote {len(written.table_files)} table files and {len(written.figure_files)} figures to {out}/")


@contextlib.contextmanager
def _stage_progress(verbose: bool) -> Iterator[None]:
    """One rich bar per flow stage, fed by the stages' progress reports; Prefect's log lines only with --verbose."""
    from tasks.progress import listening

    _quiet_prefect_logs(verbose)

    with progress_bars("[bold]{task.description:<10}") as progress:
        shown: dict[str, Any] = {}

        def show(stage: str, done: int, total: int, status: str) -> None:
            if stage not in shown:
                shown[stage] = progress.add_task(stage, total=total, status="")
            progress.update(shown[stage], completed=done, total=total, status=status)

        with listening(show):
            yield


def _quiet_prefect_logs(verbose: bool) -> None:
    """Prefect's log lines on the console only with --verbose (the bars say what happens)."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    if not verbose:
        for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(logging.WARNING)


def _print_result(result: ExperimentResult | None) -> None:
    """The experiment's result as the other views show it (``tasks.summary``): its plain sentences, the table of
    methods, what a step time means."""
    from tasks import summary

    if result is None or result.result is None:
        return
    shown = result.result
    console.print(shown.title, highlight=False, markup=False, style="bold", soft_wrap=True)
    for sentence in summary.sentences(shown):  # one line each: they paste and grep as they are
        console.print(sentence, highlight=False, markup=False, soft_wrap=True)
    print_markdown("\n" + summary.markdown_table(shown) + "\n")
    console.print(summary.STEP_TIME_MEANING, highlight=False, markup=False, style="dim", soft_wrap=True)


def _print_links(uri: str, experiment: str, flow_run: str | None) -> None:
    """Where to look: the MLflow UI (how to start it, the runs view, this experiment's run), and the Prefect flow
    run when a lasting Prefect server holds it."""
    from tasks.prefect_ui import flow_run_url
    from tasks.tracking import mlflow_ui_url, run_url, runs_view_url

    ui = mlflow_ui_url(uri)
    console.print(f"MLflow:  experiment {experiment!r} in {uri}", highlight=False, soft_wrap=True)
    if not uri.startswith(("http://", "https://")):
        console.print(f"  start its UI:         mlflow ui --backend-store-uri {uri}", highlight=False, soft_wrap=True)
    parent = _parent_run(uri, experiment, flow_run)
    if parent is not None:
        experiment_id, run_id = parent
        console.print(f"  methods by step time: {runs_view_url(ui, experiment_id)}", highlight=False, soft_wrap=True)
        console.print(f"  this experiment:      {run_url(ui, experiment_id, run_id)}", highlight=False, soft_wrap=True)
    prefect_page = flow_run_url(flow_run)
    if prefect_page:
        console.print(f"Prefect: {prefect_page}", highlight=False, soft_wrap=True)


def _print_report(result: ExperimentResult | None, out: Path | None) -> None:
    """The accuracy table (a language model's: the perplexity table) when plans were trained, then the report's folder and what it holds: the tables that have
    rows (a table with none, such as the accuracy of an experiment that trained nothing, is not listed) and the
    figures."""
    if result is not None:
        folder, files = result.report_dir, [Path(f) for f in result.report_files]
    elif out is not None and out.is_dir():
        folder, files = out, sorted(p for p in out.iterdir() if p.suffix in (".md", ".csv", ".tex", ".png"))
    else:
        return
    tables = sorted({f.stem for f in files if f.suffix == ".csv" and len(f.read_text().splitlines()) > 1})
    figures = [f.name for f in files if f.suffix == ".png"]
    for quality in ("accuracy", "perplexity"):
        if quality in tables and (folder / f"{quality}.md").is_file():
            print_markdown((folder / f"{quality}.md").read_text())
    console.print(
        f"Report:  {folder}/ (tables {', '.join(tables) or 'none'} as .md/.csv/.tex; figures {', '.join(figures) or 'none'})",
        highlight=False,
        soft_wrap=True,
    )


def _parent_run(uri: str, experiment: str, flow_run: str | None) -> tuple[str, str] | None:
    """(experiment id, run id) of the parent run the flow run ``flow_run`` made, if it made one."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.tracking import FLOW_RUN_TAG

    if flow_run is None:
        return None
    try:
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        query = f"tags.`{FLOW_RUN_TAG}` = '{flow_run}' and tags.{schema.KIND} = '{schema.EXPERIMENT}'"
        parents = client.search_runs([found.experiment_id], query, max_results=1)
    except MlflowException:
        return None
    return (found.experiment_id, parents[0].info.run_id) if parents else None
