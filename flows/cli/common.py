"""What the ``tapp`` commands share: the consoles, the options several commands take, the error handling, and
the layer library and plan every planning or runtime command starts from."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperOption

from tapp_core.errors import TappError
from tapp_core.model.zoo.registry import MODEL_NAMES
from tapp_core.plan.schedules import SCHEDULES
from tasks.config import ExperimentSettings

if TYPE_CHECKING:
    from rich.progress import Progress

    from tapp_core.model.workload import Workload
    from tapp_core.plan.plan import Plan
    from tapp_core.platform.cluster import Cluster
    from tapp_core.profile.library import LayerLibrary

console = Console()
error_console = Console(stderr=True)

DEFAULT_MODEL = "alexnet"
DEFAULT_CLUSTER = "local"
DEFAULT_BATCH = 64
DEFAULT_PLAN = Path("plan.json")
DEFAULT_STEPS = ExperimentSettings.model_fields["steps"].default
"""Timed steps per plan and race round, after the warm-up (``tapp measure``, ``tapp run``): plans are measured in
races of interleaved rounds (``tapp_core.measure.races``); the experiments' default (``tasks.config``)."""
DEFAULT_WARMUP = ExperimentSettings.model_fields["warmup"].default

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help=" | ".join((*MODEL_NAMES, "module:callable", "file.py:callable")),
    ),
]
PlanModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="the plan's model: give it when the plan names a file elsewhere (default: the model the plan names)",
    ),
]


def model_of_plan(model: str | None, plan_file: Path) -> str:
    """``--model`` where given, else the model that the plan in ``plan_file`` names."""
    if model is not None:
        return model
    from tapp_core.plan.plan import Plan

    return Plan.load(plan_file).model


ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="cluster name (deployments/clusters) or YAML file")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="mini-batch size (samples per step)")]
LibraryOpt = Annotated[
    Path | None,
    typer.Option(
        "--library", help="a profiled layer library folder (tapp profile --out); profiled and cached if not given"
    ),
]
PlanFileOpt = Annotated[Path, typer.Option("--plan", "-p", help="plan JSON (tapp plan --out)")]
NoCalibrateOpt = Annotated[
    bool,
    typer.Option(
        "--no-calibrate",
        help="use the ideal cost model unless a calibration is given (--calibration, or tapp calibrate's beside the "
        "cluster file), rather than measuring the cluster's on first use (seconds, once: it is kept for later "
        "runs); TAPP_NO_CALIBRATE=1 does this for every command",
    ),
]
SeedOpt = Annotated[int, typer.Option(help="random seed: the planners' sampling, the weights and the data order")]
EmulateOpt = Annotated[
    bool | None,
    typer.Option(
        "--emulate/--no-emulate", help="slow devices and links down as the cluster says (default: its file's)"
    ),
]
ExperimentOpt = Annotated[str, typer.Option(help="MLflow experiment name")]
TrackingUriOpt = Annotated[
    str | None, typer.Option(help="MLflow store or server (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
]
StepsOpt = Annotated[int, typer.Option(min=1, help="timed training steps per plan and race round, after the warm-up")]
WarmupOpt = Annotated[int, typer.Option(min=0, help="warm-up steps per plan and race round, not counted")]
RaceSecondsOpt = Annotated[
    float,
    typer.Option(
        "--race-seconds",
        min=0.001,
        help="the evaluation race starts no new round after this many seconds (its verdict needs 5 rounds; fewer "
        "give each plan the range of its rounds)",
    ),
]
CheckpointDirOpt = Annotated[
    Path | None,
    typer.Option("--checkpoint-dir", help="write checkpoints here (and, at the end, the trained model.safetensors)"),
]
CheckpointEveryOpt = Annotated[
    int, typer.Option("--checkpoint-every", min=0, help="write a checkpoint every this many steps (0: at the end)")
]
ElasticOpt = Annotated[
    bool,
    typer.Option(
        "--elastic",
        help="re-plan on the devices left when one dies, and move to a new plan when one slows, through the "
        "checkpoints (needs --checkpoint-dir and --checkpoint-every)",
    ),
]
DataDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", help="CIFAR-10 folder (holding cifar-10-batches-py); default $TAPP_DATA_DIR, else none"),
]
DatasetOpt = Annotated[
    str | None,
    typer.Option(
        help="cifar10 | fashion-mnist | synthetic (default: CIFAR-10 in --data-dir when given, else Fashion-MNIST "
        "where Debian's dataset-fashion-mnist installs it; with neither, tapp run trains nothing and tapp train "
        "uses synthetic data)"
    ),
]


ScheduleOpt = Annotated[
    str | None,
    typer.Option(
        help=" | ".join(SCHEDULES) + ": the pipeline schedule (default: the planner's own, or the plan's)",
    ),
]
SchedulesOpt = Annotated[
    str | None,
    typer.Option(
        help="comma-separated schedules a planner may choose among (it plans with each and keeps the fastest), e.g. "
        "1f1b,async (default: --schedule alone)"
    ),
]
StalenessOpt = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="async schedule: how many weight versions a stage may lag behind (default: as deep as the pipeline; "
        "0: synchronous)",
    ),
]


def comma_list(text: str | None) -> tuple[str, ...] | None:
    """``a,b, c`` as ``("a", "b", "c")``; None for no text."""
    if text is None:
        return None
    return tuple(part.strip() for part in text.split(",") if part.strip())


def chosen_dataset(dataset: str | None, data_dir: Path | None) -> str:
    """``--dataset``, else the real data found (``tapp_core.model.data.find_dataset``: CIFAR-10 in ``--data-dir`` or
    ``$TAPP_DATA_DIR``, else the Debian package's Fashion-MNIST), else synthetic data."""
    if dataset:
        return dataset
    from tapp_core.model.data import find_dataset

    found = find_dataset(data_dir)
    return found[0] if found is not None else "synthetic"


P = ParamSpec("P")
R = TypeVar("R")


def reports_user_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Print a TappError's message and exit 2 instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except TappError as exc:
            error_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def fail(message: str) -> typer.Exit:
    """Print ``message`` as an error; the caller raises the returned exit (status 1: the work failed)."""
    error_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


class ManyValuesCommand(TyperCommand):
    """A command whose repeatable options also take several values after one flag: ``--power 1 0.5 0.25`` is read
    as ``--power 1 --power 0.5 --power 0.25``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        many = {name for p in self.params if isinstance(p, TyperOption) and p.multiple for name in p.opts}
        spread: list[str] = []
        current: str | None = None
        waiting = False
        for arg in args:
            if arg.startswith("-") and not _number(arg):
                current, waiting = (arg, True) if arg in many else (None, False)
            elif current is not None and not waiting:
                spread.append(current)
            else:
                waiting = False
            spread.append(arg)
        return super().parse_args(ctx, spread)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def progress_bars(description: str = "[bold]{task.description}") -> Progress:
    """Rich bars: description, bar, done/total, elapsed time, then the task's ``status`` field."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, TextColumn("{task.fields[status]}"), console=console)


def print_markdown(text: str) -> None:
    """Tables as their Markdown text: readable at any terminal width, and pastes as it is."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def cluster_library(model: str, batch_size: int, library: Path | None, cluster: Cluster) -> LayerLibrary:
    """The libraries to cost ``cluster`` with: the given folder (one library, or one per kind as ``tapp profile
    --cluster`` writes them), else the profile cache's library of each kind of the cluster this host has."""
    from tapp_core.profile.cache import ProfileCache
    from tapp_core.profile.library import load_libraries

    if library is not None:
        loaded = load_libraries(library)
        if loaded.model != model:
            raise TappError(f"layer library {library} is for model {loaded.model!r}, not {model!r}")
        return loaded
    with console.status(f"layer libraries of {model} at batch {batch_size} for cluster {cluster.name} (cached)"):
        return ProfileCache().cluster_libraries(model, batch_size, cluster)


def read_plan(model: str, plan_file: Path, schedule: str | None = None) -> Plan:
    """The plan in ``plan_file``, which must be for ``model``; with ``schedule`` (``--schedule``) in place of its
    own."""
    from tapp_core.plan.plan import Plan

    chosen = Plan.load(plan_file)
    if chosen.model != model:
        raise TappError(f"plan {plan_file} is for model {chosen.model!r}, not {model!r}")
    if schedule is not None and schedule != chosen.schedule:  # checked as a plan's schedule is; a new id
        from tapp_core.plan.schedules import BOUNDED

        data = {k: v for k, v in chosen.to_dict().items() if k != "id"}
        if schedule not in BOUNDED:
            data.pop("staleness", None)  # a bound only the asynchronous schedule takes
        chosen = Plan.from_dict({**data, "schedule": schedule}, f"{plan_file} with --schedule {schedule}")
    return chosen


def load_plan(model: str, plan_file: Path, cluster: str, schedule: str | None = None) -> tuple[Plan, Cluster]:
    """The plan in ``plan_file`` (which must be for ``model``; ``schedule`` in place of its own if given) and the
    cluster named ``cluster``."""
    from tapp_core.platform.cluster import load_cluster

    return read_plan(model, plan_file, schedule), load_cluster(cluster)


def checked_workload(model: str, run: bool = True) -> Workload:
    """The workload of ``model`` (``workload_of``: what its file declares, or the default), checked before any
    work: its inputs against the model's forward, and with ``run`` the model and loss on two samples. A model
    whose inputs TAPP cannot infer is a ``WorkloadError`` (one line, exit 2) saying what to give."""
    from tapp_core.model.workload import check_inputs, check_workload, workload_of

    workload = workload_of(model)
    (check_workload if run else check_inputs)(workload)
    return workload


def print_workload(workload: Workload) -> None:
    """The line that names the workload, first of a command's output."""
    console.print(f"workload {workload.describe()}", markup=False, highlight=False, soft_wrap=True)
