"""The ``tapp`` command line.

Every command turns a ``TappError`` (bad model, cluster, plan, data or library) into one red line on stderr and
exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from tapp_core.errors import TappError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
console = Console()
error_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="alexnet | vgg16 | inception_v3 | mlp | tiny_cnn | tiny_branchy | module:callable | file.py:callable",
    ),
]
ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="cluster name (deployments/clusters) or YAML file")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="mini-batch size")]
LibraryOpt = Annotated[
    Path | None,
    typer.Option(
        "--library", help="a profiled layer library folder (tapp profile --out); profiled and cached if not given"
    ),
]


def reports_user_errors(command: F) -> F:
    """Print a TappError's message and exit 2 instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except TappError as exc:
            error_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def cache_dir() -> Path:
    return Path(os.environ.get("TAPP_CACHE_DIR", ".tapp"))


def library_for(model: str, batch_size: int, library: Path | None, device: str = "cpu") -> Any:
    """The layer library to plan with: the given folder, else a cached profile of (model, batch, device)."""
    from tapp_core.library import LayerLibrary

    if library is not None:
        loaded = LayerLibrary.load(library)
        if loaded.model != model:
            raise TappError(f"layer library {library} is for model {loaded.model!r}, not {model!r}")
        return loaded
    from tapp_core.profiler import PROFILE_VERSION, profile_model

    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model}_b{batch_size}_{device}_v{PROFILE_VERSION}")
    cached = cache_dir() / "libraries" / key
    if (cached / "library.json").is_file():
        return LayerLibrary.load(cached)

    with console.status(f"profiling {model} at batch {batch_size} on {device} (cached in {cached})"):
        profiled = profile_model(model, batch_size, device=device)
    profiled.save(cached)
    return profiled


@app.command()
@reports_user_errors
def profile(
    model: ModelOpt = "vgg16",
    batch_size: BatchOpt = 64,
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for layers.csv and library.json")] = Path("library"),
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's)")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="timed runs per layer; the median is kept")] = 5,
) -> None:
    """Trace a model and build its layer library: per-layer times, FLOPs, parameter and activation bytes."""
    from tapp_core.profiler import profile_model

    with console.status(f"profiling {model} at batch {batch_size} on {device}"):
        library = profile_model(model, batch_size, device=device, threads=threads, repeats=repeats)
    library.save(out)
    ratio = library.layer_time_sum_s / library.whole_model_s
    console.print(
        f"{model}: {len(library.layers)} layers, whole model {library.whole_model_s * 1e3:.1f} ms "
        f"(forward+backward, batch {batch_size}), sum of layers {library.layer_time_sum_s * 1e3:.1f} ms"
    )
    console.print(f"sum-of-layers / whole-model ratio: {ratio:.3f}")
    console.print(f"wrote {out / 'layers.csv'} and {out / 'library.json'}")


@app.command()
@reports_user_errors
def plan(
    model: ModelOpt = "alexnet",
    cluster: ClusterOpt = "local",
    planner: Annotated[
        str, typer.Option(help="tapp | single | bsp | even | pipetorch | pipedream | autoddl | oracle")
    ] = "even",
    batch_size: BatchOpt = 64,
    out: Annotated[Path, typer.Option("--out", "-o")] = Path("plan.json"),
    library: LibraryOpt = None,
    budget: Annotated[int, typer.Option(help="search budget (rounds for tapp; planner-specific)")] = 0,
    reward: Annotated[str, typer.Option(help="tapp reward source: simulated | measured | hybrid")] = "simulated",
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Find a plan for a model on a cluster and write it as JSON."""
    from tapp_core.cluster import load_cluster
    from tapp_core.costmodel import estimate
    from tapp_core.plan import validate

    target = load_cluster(cluster)
    layers = library_for(model, batch_size, library)
    found = _run_planner(planner, layers, target, budget=budget, reward=reward, seed=seed, batch_size=batch_size)
    validate(found, layers, target)
    found.save(out)
    predicted = estimate(found, layers, target)
    console.print(
        f"{planner} plan {found.id}: {found.n_stages} stage(s) on {', '.join('+'.join(d) for d in found.stage_devices)}, "
        f"{found.micro_batches} micro-batches, {found.schedule}; estimated step time {predicted.step_time:.4f} s"
    )
    console.print(f"wrote {out}")


def _run_planner(name: str, library: Any, cluster: Any, budget: int, **options: Any) -> Any:
    """Build planner ``name`` with the options it accepts and run it under a progress bar over search rounds."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tapp_core.planners import get_planner, planner_options

    accepted = planner_options(name)
    planner = get_planner(name, **{k: v for k, v in options.items() if k in accepted})
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        bars: list[Any] = []  # added on the first report, so constructive planners show no empty bar

        def report(update: Any) -> None:
            if not bars:
                bars.append(progress.add_task(f"{name} search rounds", total=update.total_rounds, status=""))
            status = f"best {update.best_step_time_s:.4f} s, {update.evaluations} evaluations"
            if update.reward is not None:
                status += f", reward {update.reward:.3f}, entropy {update.entropy:.2f} ({update.phase})"
            progress.update(bars[0], completed=update.round, total=update.total_rounds, status=status)

        return planner.plan(library, cluster, budget=budget or None, progress=report)


@app.command()
@reports_user_errors
def simulate(
    model: ModelOpt = "alexnet",
    cluster: ClusterOpt = "local",
    plan_file: Annotated[Path, typer.Option("--plan", "-p", help="plan JSON (tapp plan --out)")] = Path("plan.json"),
    library: LibraryOpt = None,
    gantt: Annotated[Path | None, typer.Option(help="draw the timeline of one step to this PNG")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the estimate as JSON")] = False,
) -> None:
    """Predict a plan's step time, per-device compute / communication / idle and peak memory."""
    from tapp_core.cluster import load_cluster
    from tapp_core.costmodel import estimate
    from tapp_core.plan import Plan, validate

    chosen = Plan.load(plan_file)
    if chosen.model != model:
        raise TappError(f"plan {plan_file} is for model {chosen.model!r}, not {model!r}")
    target = load_cluster(cluster)
    layers = library_for(model, chosen.batch_size, library)
    validate(chosen, layers, target)
    predicted = estimate(chosen, layers, target)
    if as_json:
        console.print_json(json.dumps(predicted.to_dict(include_timeline=False), default=float))
    else:
        _print_estimate(chosen, predicted)
    if gantt is not None:
        from reports.figures import gantt as draw_gantt

        draw_gantt(predicted, gantt, title=f"{model} on {target.name}: plan {chosen.id} ({chosen.schedule})")
        console.print(f"wrote {gantt}")


def _print_estimate(chosen: Any, predicted: Any) -> None:
    console.print(
        f"plan {chosen.id}: {chosen.n_stages} stage(s), {chosen.micro_batches} micro-batches, {chosen.schedule}; "
        f"estimated step time [bold]{predicted.step_time:.4f} s[/], communication share {predicted.communication_share:.1%}"
    )
    table = Table("device", "stage", "compute s", "communication s", "idle s", "peak memory MiB")
    stage_of = {d: s for s, devices in enumerate(chosen.stage_devices) for d in devices}
    for device in predicted.compute:
        table.add_row(
            device,
            str(stage_of.get(device, "")),
            f"{predicted.compute[device]:.4f}",
            f"{predicted.communication[device]:.4f}",
            f"{predicted.idle[device]:.4f}",
            f"{predicted.peak_memory.get(device, 0) / 2**20:.1f}",
        )
    console.print(table)


# --- Orchestrated experiments: Prefect flows tracked in MLflow ----------------------------------------------


def _load_plan_for(model: str, plan_file: Path, cluster: str, library: Path | None) -> tuple[Any, Any]:
    """The plan and cluster to run; the plan is validated against the library when one is given."""
    from tapp_core.cluster import load_cluster
    from tapp_core.plan import Plan, validate

    chosen = Plan.load(plan_file)
    if chosen.model != model:
        raise TappError(f"plan {plan_file} is for model {chosen.model!r}, not {model!r}")
    target = load_cluster(cluster)
    missing = sorted(set(chosen.devices) - set(target.device_names))
    if missing:
        raise TappError(f"plan {plan_file} uses device(s) {', '.join(missing)} that cluster {target.name!r} lacks")
    if library is not None:
        validate(chosen, library_for(model, chosen.batch_size, library), target)
    return chosen, target


@app.command()
@reports_user_errors
def measure(
    model: ModelOpt = "alexnet",
    cluster: ClusterOpt = "local",
    plan_file: Annotated[Path, typer.Option("--plan", "-p", help="plan JSON (tapp plan --out)")] = Path("plan.json"),
    steps: Annotated[int, typer.Option(min=1, help="timed steps after the warm-up")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="warm-up steps, not counted")] = 2,
    library: LibraryOpt = None,
    seed: Annotated[int, typer.Option()] = 0,
    emulate: Annotated[bool | None, typer.Option("--emulate/--no-emulate", help="default: the cluster file's")] = None,
    timeout: Annotated[float, typer.Option(help="seconds before the plan is abandoned")] = 600.0,
) -> None:
    """Run a plan on MPI workers (one rank per device, launched with mpiexec) and print its Measurement as JSON."""
    from tapp_core.runtime import measure as run_measure

    chosen, target = _load_plan_for(model, plan_file, cluster, library)
    with error_console.status(f"measuring plan {chosen.id} on {target.name} ({len(target.devices)} MPI ranks)"):
        result = run_measure(
            chosen, target, model, steps=warmup + steps, warmup=warmup, seed=seed, emulate=emulate, timeout_s=timeout
        )
    typer.echo(result.to_json())
    if not result.ok:
        error_console.print(f"[bold red]error:[/] plan {chosen.id} failed: {result.error}", highlight=False)
        raise typer.Exit(1)


@app.command()
@reports_user_errors
def train(
    model: ModelOpt = "alexnet",
    cluster: ClusterOpt = "local",
    plan_file: Annotated[Path, typer.Option("--plan", "-p", help="plan JSON (tapp plan --out)")] = Path("plan.json"),
    data_dir: Annotated[
        Path | None, typer.Option(help="CIFAR-10 folder (cifar-10-batches-py); default $TAPP_DATA_DIR")
    ] = None,
    dataset: Annotated[str, typer.Option(help="cifar10 | fashion-mnist | synthetic")] = "cifar10",
    epochs: Annotated[int, typer.Option(min=1)] = 1,
    steps_per_epoch: Annotated[int | None, typer.Option(min=1, help="cut each epoch short (smoke runs)")] = None,
    augment: Annotated[bool, typer.Option(help="random crop and flip")] = False,
    library: LibraryOpt = None,
    seed: Annotated[int, typer.Option()] = 0,
    emulate: Annotated[bool | None, typer.Option("--emulate/--no-emulate", help="default: the cluster file's")] = None,
) -> None:
    """Train a plan for real on MPI workers and report test accuracy."""
    from tapp_core.data import open_dataset
    from tapp_core.runtime import train as run_train

    chosen, target = _load_plan_for(model, plan_file, cluster, library)
    directory = str(data_dir) if data_dir is not None else None
    test_set = open_dataset(dataset, directory, train=False)  # fails here, before any rank starts, if data is missing
    with error_console.status(f"training plan {chosen.id} on {target.name} for {epochs} epoch(s)"):
        result = run_train(
            chosen,
            target,
            model,
            dataset=dataset,
            data_dir=directory,
            epochs=epochs,
            seed=seed,
            emulate=emulate,
            steps_per_epoch=steps_per_epoch,
            augment=augment,
        )
    if not result.ok:
        error_console.print(f"[bold red]error:[/] training plan {chosen.id} failed: {result.error}", highlight=False)
        raise typer.Exit(1)
    for epoch, (loss, accuracy, seconds) in enumerate(
        zip(result.epoch_losses, result.epoch_test_accuracy, result.epoch_times_s, strict=False), start=1
    ):
        console.print(f"epoch {epoch}: train loss {loss:.4f}, test accuracy {accuracy:.2%}, {seconds:.1f} s")
    note = " (synthetic data: accuracy means nothing)" if getattr(test_set, "synthetic", False) else ""
    console.print(f"test accuracy {result.test_accuracy:.2%} on {result.test_samples} samples{note}")


@app.command()
@reports_user_errors
def run(
    model: ModelOpt = "alexnet",
    cluster: ClusterOpt = "local",
    batch_size: BatchOpt = 64,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help="CIFAR-10 folder (holding cifar-10-batches-py); default: synthetic data"),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help="synthetic | cifar10 | fashion-mnist (default: cifar10 with --data-dir, else synthetic)"),
    ] = None,
    rounds: Annotated[
        int | None, typer.Option("--rounds", min=1, help="TAPP search rounds (default: small budget)")
    ] = None,
    samples_per_round: Annotated[int | None, typer.Option(min=1, help="plans sampled per search round")] = None,
    measured_rounds: Annotated[
        int | None, typer.Option(min=0, help="final search rounds rewarded by measurements on the workers")
    ] = None,
    methods: Annotated[
        str | None, typer.Option(help="comma-separated methods (default: tapp and every baseline)")
    ] = None,
    estimate_only: Annotated[
        bool, typer.Option("--estimate-only", help="no MPI runtime: cost-model step times")
    ] = False,
    steps: Annotated[int | None, typer.Option(min=2, help="training steps per measurement (warm-up included)")] = None,
    train_epochs: Annotated[int, typer.Option(min=0, help="also train each plan for the accuracy table")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    experiment: Annotated[str, typer.Option(help="MLflow experiment name")] = "tapp",
    out: Annotated[Path, typer.Option("--out", "-o", help="report folder")] = Path("out/report"),
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's log lines")] = False,
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
        options = {
            "search_rounds": rounds,
            "samples_per_round": samples_per_round,
            "measured_rounds": measured_rounds,
            "steps": steps,
        }
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
                **{k: v for k, v in options.items() if v is not None},
                return_state=True,
            )
    failure = None
    if not state.is_completed():
        try:
            state.result()
        except TappError:
            raise
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
    _print_report(out, uri, experiment)
    if failure:
        error_console.print(f"[bold red]the experiment failed:[/] {failure}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command()
@reports_user_errors
def report(
    experiment: Annotated[str, typer.Option(help="MLflow experiment name")] = "tapp",
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
    _print_markdown(written.tables.step_time.to_markdown())
    console.print(f"wrote {len(written.table_files)} table files and {len(written.figure_files)} figures to {out}/")


def _stage_progress(verbose: bool) -> Any:
    """One rich bar per flow stage, fed by the stages' progress reports; Prefect's log lines only with --verbose."""
    import contextlib
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tasks.progress import listening

    if not verbose:
        for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(logging.WARNING)

    @contextlib.contextmanager
    def bars() -> Any:
        columns = (TextColumn("[bold]{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, TextColumn("{task.fields[status]}"), console=console) as progress:
            shown: dict[str, Any] = {}

            def show(stage: str, done: int, total: int, status: str) -> None:
                if stage not in shown:
                    shown[stage] = progress.add_task(stage, total=total, status="")
                progress.update(shown[stage], completed=done, total=total, status=status)

            with listening(show):
                yield

    return bars()


def _print_markdown(text: str) -> None:
    """Tables as their Markdown text: readable at any terminal width, and pastes as it is."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _print_report(out: Path, uri: str, experiment: str) -> None:
    for name in ("step_time.md", "communication_share.md"):
        if (out / name).is_file():
            _print_markdown((out / name).read_text())
    ui = f"mlflow ui --backend-store-uri {uri}" if not uri.startswith("http") else f"open {uri}"
    console.print(
        f"MLflow:  [bold]{ui}[/]  (experiment {experiment!r}; one parent run, nested runs per stage and method)"
    )
    console.print(f"Report:  {out}/ (step_time, communication_share, accuracy as .md/.csv/.tex; figures .png)")


if __name__ == "__main__":
    app()
