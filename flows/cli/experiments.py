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
    DEFAULT_REPORT,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    METHODS,
    BatchOpt,
    ClusterOpt,
    DataDirOpt,
    DatasetOpt,
    ExperimentOpt,
    ModelOpt,
    ReportOutOpt,
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

DEFAULT_ROUNDS = 33
"""TAPP's search rounds in all (``flows.experiment.DEFAULT_ROUNDS``; here so that ``--help`` imports no flow)."""
DEFAULT_MEASURED_ROUNDS = 3

RoundsOpt = Annotated[
    int,
    typer.Option(
        "--rounds", min=1, help="TAPP's search rounds in all (as tapp plan --rounds counts them), measured ones included"
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
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's log lines")]


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
    seed: SeedOpt = 0,
    experiment: ExperimentOpt = "tapp",
    out: ReportOutOpt = DEFAULT_REPORT,
    tracking_uri: TrackingUriOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Run the whole experiment: profile, TAPP search, runtime sampling, TAPP vs the baselines, report (Prefect + MLflow)."""
    # Prefect's local server would otherwise post anonymous usage data at start (and log an error when offline).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A fresh PREFECT_HOME migrates its database on the first start, which can pass Prefect's 20 s default here.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.server import prefect_api

    # The server starts first, so that its start overlaps the imports, the input checks and the MLflow store.
    with prefect_api() as prefect_ready:
        from flows.experiment import DEFAULT_METHODS, check_inputs, runtime_settings, search_budget, tapp_experiment
        from tasks.search import SearchBudget
        from tasks.tracking import open_store

        chosen = chosen_dataset(dataset, data_dir)
        chosen_methods = tuple(m.strip() for m in methods.split(",") if m.strip()) if methods else DEFAULT_METHODS
        data = str(data_dir) if data_dir else None
        # Checked before the flow too, so that a typo fails at once, before any run exists.
        target, uri = check_inputs(model, cluster, batch_size, chosen, data, chosen_methods, tracking_uri)
        budget = {"search_rounds": rounds, "samples_per_round": samples_per_round, "measured_rounds": measured_rounds}
        given: dict[str, Any] = {k: v for k, v in budget.items() if v is not None}  # else the flow's defaults
        samples = samples_per_round or SearchBudget.samples_per_round
        resolved = search_budget(rounds, samples, measured_rounds, SearchBudget.measured_per_round, not estimate_only)
        given["measured_rounds"] = resolved.measured_rounds  # so that Prefect's parameters say what MLflow records
        runtime_settings(not estimate_only, steps, warmup, seed)
        console.print(
            f"[bold]tapp_experiment[/]: {model} on {target.name} ({len(target.devices)} devices), batch {batch_size}, "
            f"{chosen} data; MLflow store {uri}, experiment {experiment!r}"
        )
        open_store(uri)
        prefect_ready()
        with _stage_progress(verbose):
            state = tapp_experiment(
                model=model,
                cluster=cluster,
                batch_size=batch_size,
                dataset=chosen,
                data_dir=data,
                methods=chosen_methods,
                measure=not estimate_only,
                steps=steps,
                warmup=warmup,
                train_epochs=train_epochs,
                seed=seed,
                experiment=experiment,
                out=str(out),
                tracking_uri=uri,
                **given,
                return_state=True,
            )
        flow_run = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
        failure = _failure(state)
        _print_report(out, uri, experiment, flow_run)  # in the block: a temporary Prefect server gets no link
    if failure:
        error_console.print(f"[bold red]the experiment failed:[/] {failure}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


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
    out: ReportOutOpt = DEFAULT_REPORT,
    tracking_uri: TrackingUriOpt = None,
) -> None:
    """Rebuild the paper's tables (Markdown, CSV, LaTeX) and figures (PNG) from an MLflow experiment alone."""
    from reports.paper import write_report
    from tasks.tracking import check_tracking

    uri = check_tracking(tracking_uri)
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


def _print_report(out: Path, uri: str, experiment: str, flow_run: str | None) -> None:
    """The tables, then where to look: the MLflow UI (how to start it, the runs view, this experiment's run), the
    Prefect flow run when a lasting Prefect server holds it, and the report folder."""
    from tasks.prefect_ui import flow_run_url
    from tasks.tracking import mlflow_ui_url, run_url, runs_view_url

    for name in ("step_time.md", "communication_share.md"):
        if (out / name).is_file():
            print_markdown((out / name).read_text())
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
    console.print(f"Report:  {out}/ (step_time, communication_share, accuracy as .md/.csv/.tex; figures .png)")


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
