"""Orchestrated experiments, Prefect flows tracked in MLflow: ``run``, and ``report`` rebuilt from MLflow."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import (
    DEFAULT_BATCH,
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    METHODS,
    BatchOpt,
    ClusterOpt,
    DataDirOpt,
    DatasetOpt,
    ExperimentOpt,
    ModelOpt,
    SeedOpt,
    StepsOpt,
    TrackingUriOpt,
    WarmupOpt,
    chosen_dataset,
    console,
    error_console,
    print_markdown,
    progress_bars,
)
from tapp_core.errors import TappError

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from flows.experiment import ExperimentResult

DEFAULT_ROUNDS = 33
"""TAPP's search rounds in all (``flows.experiment.DEFAULT_ROUNDS``; here so that ``--help`` imports no flow)."""
DEFAULT_MEASURED_ROUNDS = 3

RoundsOpt = Annotated[
    int,
    typer.Option(
        "--rounds",
        min=1,
        help="TAPP's search rounds in all (as tapp plan --rounds counts them), measured ones included",
    ),
]
SamplesOpt = Annotated[int | None, typer.Option(min=1, help="plans sampled per search round (default: 16)")]
MeasuredRoundsOpt = Annotated[
    int | None,
    typer.Option(
        min=0,
        help=f"how many of the last rounds are rewarded by measurements on the workers (default: "
        f"{DEFAULT_MEASURED_ROUNDS}; 0 with --estimate-only)",
    ),
]
MethodsOpt = Annotated[
    str | None,
    typer.Option(
        help="comma-separated methods, tapp among them: " + " | ".join(METHODS) + " (default: all; single-gpu "
        "only on a cluster with a GPU)"
    ),
]
EstimateOnlyOpt = Annotated[bool, typer.Option("--estimate-only", help="no MPI runtime: cost-model step times")]
TrainEpochsOpt = Annotated[int, typer.Option(min=0, help="also train each plan for the accuracy table")]
TrainStepsOpt = Annotated[
    int | None, typer.Option(min=1, help="with --train-epochs: at most this many steps per epoch (a quick check)")
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


ResumeOpt = Annotated[
    str | None,
    typer.Option(
        "--resume",
        metavar="RUN_ID",
        help="continue an interrupted experiment (its parent run's id, or `last`: the latest of --experiment) with "
        "its own settings, from the last round its search logged; the other experiment options are not used",
    ),
]


def run(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    batch_size: BatchOpt = DEFAULT_BATCH,
    data_dir: DataDirOpt = None,
    dataset: DatasetOpt = None,
    rounds: RoundsOpt = DEFAULT_ROUNDS,
    samples_per_round: SamplesOpt = None,
    measured_rounds: MeasuredRoundsOpt = None,
    methods: MethodsOpt = None,
    estimate_only: EstimateOnlyOpt = False,
    steps: StepsOpt = DEFAULT_STEPS,
    warmup: WarmupOpt = DEFAULT_WARMUP,
    train_epochs: TrainEpochsOpt = 0,
    train_steps: TrainStepsOpt = None,
    seed: SeedOpt = 0,
    experiment: ExperimentOpt = "tapp",
    out: RunOutOpt = None,
    tracking_uri: TrackingUriOpt = None,
    resume: ResumeOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Run the whole experiment: profile, TAPP search, runtime sampling, TAPP vs the baselines, report (Prefect + MLflow)."""
    # Prefect's local server would otherwise post anonymous usage data at start (and log an error when offline).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A fresh PREFECT_HOME migrates its database on the first start, which can pass Prefect's 20 s default here.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.server import prefect_api, sigterm_exits
    from reports.folders import check_report_folder
    from tapp_core.paths import check_output_folder

    if out is not None:
        check_output_folder(out, "--out")
        check_report_folder(out, experiment)
    # SIGTERM ends the command as Ctrl-C does (runs KILLED, server and workers stopped, temporary folders removed).
    # The server starts first, so that its start overlaps the imports, the input checks and the MLflow store.
    with sigterm_exits(), prefect_api() as prefect_ready:
        if resume is not None:
            uri, resume, experiment, parameters = _resumed(resume, experiment, tracking_uri)
        else:
            uri, parameters = _checked_parameters(
                model, cluster, batch_size, data_dir, dataset, rounds, samples_per_round, measured_rounds,
                methods, estimate_only, steps, warmup, train_epochs, seed, tracking_uri,
            )  # fmt: skip
            parameters["train_steps"] = train_steps
        if out is not None:
            check_report_folder(out, experiment)  # a resumed experiment's name is known only now
        _announce(parameters, uri, experiment, resume)
        prefect_ready()
        with _stage_progress(verbose):
            state = _run_flow(parameters, experiment, out, uri, resume)
        flow_run = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
        failure = _failure(state)
        shown = _result_of(state)
        _print_result(shown)
        _print_links(uri, experiment, flow_run)  # in the block: a temporary Prefect server gets no link
        _print_report(shown, out)
    if failure:
        error_console.print(f"[bold red]the experiment failed:[/] {failure}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _checked_parameters(
    model: str,
    cluster: str,
    batch_size: int,
    data_dir: Path | None,
    dataset: str | None,
    rounds: int,
    samples_per_round: int | None,
    measured_rounds: int | None,
    methods: str | None,
    estimate_only: bool,
    steps: int,
    warmup: int,
    train_epochs: int,
    seed: int,
    tracking_uri: str | None,
) -> tuple[str, dict[str, Any]]:
    """The store (opened, its orphaned runs marked FAILED) and the flow's parameters, every input checked first."""
    from flows.experiment import DEFAULT_METHODS, check_inputs, runtime_settings, search_budget
    from tasks.search import SearchBudget

    chosen = chosen_dataset(dataset, data_dir)
    chosen_methods = tuple(m.strip() for m in methods.split(",") if m.strip()) if methods else DEFAULT_METHODS
    data = str(data_dir) if data_dir else None
    # Checked before the flow too, so that a typo fails at once, before any run exists.
    _, uri = check_inputs(model, cluster, batch_size, chosen, data, chosen_methods, tracking_uri)
    budget = {"search_rounds": rounds, "samples_per_round": samples_per_round, "measured_rounds": measured_rounds}
    given: dict[str, Any] = {k: v for k, v in budget.items() if v is not None}  # else the flow's defaults
    samples = samples_per_round or SearchBudget.samples_per_round
    resolved = search_budget(rounds, samples, measured_rounds, SearchBudget.measured_per_round, not estimate_only)
    given["measured_rounds"] = resolved.measured_rounds  # so that Prefect's parameters say what MLflow records
    runtime_settings(not estimate_only, steps, warmup, seed)
    _open(uri)
    parameters = {"model": model, "cluster": cluster, "batch_size": batch_size, "dataset": chosen, "data_dir": data}
    parameters |= {"methods": chosen_methods, "measure": not estimate_only, "steps": steps, "warmup": warmup}
    return uri, parameters | {"train_epochs": train_epochs, "seed": seed, **given}


def _resumed(run_id: str, experiment: str, tracking_uri: str | None) -> tuple[str, str, str, dict[str, Any]]:
    """(store, run id, experiment name, the flow's parameters) of the interrupted experiment run ``run_id``
    (``last``: the latest of ``experiment``)."""
    from flows.experiment import check_inputs, resume_parameters
    from tasks.tracking import check_tracking

    uri = check_tracking(tracking_uri)
    _open(uri)
    run_id, experiment, parameters = resume_parameters(uri, run_id, experiment)
    p = parameters
    check_inputs(p["model"], p["cluster"], p["batch_size"], p["dataset"], p["data_dir"], p["methods"], uri)
    return uri, run_id, experiment, parameters


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


def _announce(parameters: dict[str, Any], uri: str, experiment: str, resume: str | None) -> None:
    from tapp_core.cluster import load_cluster

    target = load_cluster(parameters["cluster"])
    resuming = f"; resuming run {resume}" if resume else ""
    console.print(
        f"[bold]tapp_experiment[/]: {parameters['model']} on {target.name} ({len(target.devices)} devices), batch "
        f"{parameters['batch_size']}, {parameters['dataset']} data; MLflow store {uri}, experiment {experiment!r}"
        f"{resuming}"
    )


def _run_flow(
    parameters: dict[str, Any], experiment: str, out: Path | None, uri: str, resume: str | None
) -> State[Any]:
    from flows.experiment import tapp_experiment

    folder = str(out) if out is not None else None
    state: State[Any] = tapp_experiment(
        **parameters, experiment=experiment, out=folder, tracking_uri=uri, resume_from=resume, return_state=True
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


def report(
    experiment: ExperimentOpt = "tapp",
    out: ReportOutOpt = None,
    tracking_uri: TrackingUriOpt = None,
) -> None:
    """Rebuild the paper's tables (Markdown, CSV, LaTeX) and figures (PNG) from an MLflow experiment alone."""
    from reports.folders import check_report_folder, experiment_report_folder
    from reports.paper import write_report
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
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    from tasks.progress import listening

    if not verbose:
        for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(logging.WARNING)

    with progress_bars("[bold]{task.description:<10}") as progress:
        shown: dict[str, Any] = {}

        def show(stage: str, done: int, total: int, status: str) -> None:
            if stage not in shown:
                shown[stage] = progress.add_task(stage, total=total, status="")
            progress.update(shown[stage], completed=done, total=total, status=status)

        with listening(show):
            yield


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
    """The report's folder and what it holds: the tables that have rows (a table with none, such as the accuracy of
    an experiment that trained nothing, is not listed) and the figures."""
    if result is not None:
        folder, files = result.report_dir, [Path(f) for f in result.report_files]
    elif out is not None and out.is_dir():
        folder, files = out, sorted(p for p in out.iterdir() if p.suffix in (".md", ".csv", ".tex", ".png"))
    else:
        return
    tables = sorted({f.stem for f in files if f.suffix == ".csv" and len(f.read_text().splitlines()) > 1})
    figures = [f.name for f in files if f.suffix == ".png"]
    console.print(
        f"Report:  {folder}/ (tables {', '.join(tables) or 'none'} as .md/.csv/.tex; figures {', '.join(figures) or 'none'})",
        highlight=False,
        soft_wrap=True,
    )


def _parent_run(uri: str, experiment: str, flow_run: str | None) -> tuple[str, str] | None:
    """(experiment id, run id) of the parent run the flow run ``flow_run`` made, if it made one."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from reports import runs
    from tasks.tracking import FLOW_RUN_TAG

    if flow_run is None:
        return None
    try:
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        query = f"tags.`{FLOW_RUN_TAG}` = '{flow_run}' and tags.{runs.KIND} = '{runs.EXPERIMENT}'"
        parents = client.search_runs([found.experiment_id], query, max_results=1)
    except MlflowException:
        return None
    return (found.experiment_id, parents[0].info.run_id) if parents else None
