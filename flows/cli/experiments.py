"""Orchestrated experiments, Prefect flows tracked in MLflow: ``run``, and ``report`` rebuilt from MLflow."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import (
    BatchOpt,
    ClusterOpt,
    ExperimentOpt,
    ModelOpt,
    SeedOpt,
    console,
    error_console,
    print_markdown,
    progress_bars,
)
from tapp_core.errors import TappError

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

DataDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", help="CIFAR-10 folder (holding cifar-10-batches-py); default: synthetic data"),
]
DatasetOpt = Annotated[
    str | None,
    typer.Option(help="synthetic | cifar10 | fashion-mnist (default: cifar10 with --data-dir, else synthetic)"),
]
RoundsOpt = Annotated[int | None, typer.Option("--rounds", min=1, help="TAPP search rounds (default: small budget)")]
SamplesOpt = Annotated[int | None, typer.Option(min=1, help="plans sampled per search round")]
MeasuredRoundsOpt = Annotated[
    int | None, typer.Option(min=0, help="final search rounds rewarded by measurements on the workers")
]
MethodsOpt = Annotated[str | None, typer.Option(help="comma-separated methods (default: tapp and every baseline)")]
EstimateOnlyOpt = Annotated[bool, typer.Option("--estimate-only", help="no MPI runtime: cost-model step times")]
StepsOpt = Annotated[int | None, typer.Option(min=2, help="training steps per measurement (warm-up included)")]
TrainEpochsOpt = Annotated[int, typer.Option(min=0, help="also train each plan for the accuracy table")]
ReportOutOpt = Annotated[Path, typer.Option("--out", "-o", help="report folder")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's log lines")]


def run(
    model: ModelOpt = "alexnet",
    cluster: ClusterOpt = "local",
    batch_size: BatchOpt = 64,
    data_dir: DataDirOpt = None,
    dataset: DatasetOpt = None,
    rounds: RoundsOpt = None,
    samples_per_round: SamplesOpt = None,
    measured_rounds: MeasuredRoundsOpt = None,
    methods: MethodsOpt = None,
    estimate_only: EstimateOnlyOpt = False,
    steps: StepsOpt = None,
    train_epochs: TrainEpochsOpt = 0,
    seed: SeedOpt = 0,
    experiment: ExperimentOpt = "tapp",
    out: ReportOutOpt = Path("out/report"),
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
        from flows.experiment import DEFAULT_METHODS, check_inputs, tapp_experiment
        from tasks.tracking import open_store

        chosen_dataset = dataset or ("cifar10" if data_dir else "synthetic")
        chosen_methods = tuple(m.strip() for m in methods.split(",") if m.strip()) if methods else DEFAULT_METHODS
        data = str(data_dir) if data_dir else None
        # Checked before the flow too, so that a typo fails at once, before any run exists.
        target, uri = check_inputs(model, cluster, batch_size, chosen_dataset, data, chosen_methods, None)
        console.print(
            f"[bold]tapp_experiment[/]: {model} on {target.name} ({len(target.devices)} devices), batch {batch_size}, "
            f"{chosen_dataset} data; MLflow store {uri}, experiment {experiment!r}"
        )
        open_store(uri)
        budget = {"search_rounds": rounds, "samples_per_round": samples_per_round, "measured_rounds": measured_rounds}
        given = {k: v for k, v in {**budget, "steps": steps}.items() if v is not None}  # else the flow's defaults
        prefect_ready()
        with _stage_progress(verbose):
            state = tapp_experiment(
                model=model,
                cluster=cluster,
                batch_size=batch_size,
                dataset=chosen_dataset,
                data_dir=data,
                methods=chosen_methods,
                measure=not estimate_only,
                train_epochs=train_epochs,
                seed=seed,
                experiment=experiment,
                out=str(out),
                **given,
                return_state=True,
            )
    failure = _failure(state)
    _print_report(out, uri, experiment)
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
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for the tables and figures")] = Path("out/paper"),
    tracking_uri: Annotated[
        str | None, typer.Option(help="MLflow store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    ] = None,
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


def _print_report(out: Path, uri: str, experiment: str) -> None:
    for name in ("step_time.md", "communication_share.md"):
        if (out / name).is_file():
            print_markdown((out / name).read_text())
    ui = f"mlflow ui --backend-store-uri {uri}" if not uri.startswith("http") else f"open {uri}"
    console.print(
        f"MLflow:  [bold]{ui}[/]  (experiment {experiment!r}; one parent run, nested runs per stage and method)"
    )
    console.print(f"Report:  {out}/ (step_time, communication_share, accuracy as .md/.csv/.tex; figures .png)")
