"""Commands on tapp_core alone, with no workers, Prefect or MLflow: ``profile``, ``plan`` and ``simulate``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from flows.cli.common import (
    DEFAULT_BATCH,
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    DEFAULT_PLAN,
    BatchOpt,
    ClusterOpt,
    LibraryOpt,
    ModelOpt,
    NoCalibrateOpt,
    PlanFileOpt,
    PlanModelOpt,
    ScheduleOpt,
    SchedulesOpt,
    SeedOpt,
    StalenessOpt,
    checked_workload,
    cluster_library,
    comma_list,
    console,
    error_console,
    load_plan,
    model_of_plan,
    print_workload,
    progress_bars,
)
from tapp_core.errors import TappError
from tapp_core.measure.metrics import step_kind
from tapp_core.planners.base import PLANNER_NAMES

if TYPE_CHECKING:
    from rich.progress import TaskID

    from tapp_core.cost.calibration import Calibration
    from tapp_core.cost.context import CostContext
    from tapp_core.cost.estimate import Estimate
    from tapp_core.plan.plan import Plan
    from tapp_core.planners import Planner, SearchProgress
    from tapp_core.platform.cluster import Cluster
    from tapp_core.profile.library import LayerLibrary

CHECKPOINT_FILE = "search.pt"
"""The file a TAPP search saves itself to in ``--checkpoint DIR``."""

PlannerOpt = Annotated[str, typer.Option(help=" | ".join(PLANNER_NAMES) + " (the method names of tapp run --methods)")]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(help="calibration JSON (tapp calibrate --out); default: the one beside the cluster file, if any"),
]


def profile(
    model: ModelOpt = DEFAULT_MODEL,
    batch_size: BatchOpt = DEFAULT_BATCH,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="folder for layers.csv and library.json (a folder per kind)")
    ] = Path("library"),
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    device: Annotated[str | None, typer.Option(help="profile this one kind: cpu or cuda")] = None,
    threads: Annotated[int | None, typer.Option(help="profile this one kind: torch threads")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="timed runs per layer; the median is kept")] = 5,
) -> None:
    """Trace a model and build its layer libraries: per-layer times, FLOPs, parameter and activation bytes. One
    library per device kind of the cluster that this host has (also stored in the profile cache, where `tapp plan`,
    `simulate` and `run` find them), or of the one kind --device / --threads name."""
    from tapp_core.paths import check_output_folder
    from tapp_core.profile.library import save_libraries

    check_output_folder(out, "--out")
    workload = checked_workload(model, run=False)  # the profile runs it: a failure there says what it was given
    if device is None and threads is None:
        library = _profile_cluster(model, batch_size, cluster, repeats)
    else:
        from tapp_core.profile.profiler import ProfileRequest, profile_model

        chosen = device or "cpu"
        with console.status(f"profiling {model} at batch {batch_size} on {chosen}"):
            library = profile_model(
                ProfileRequest(workload, batch_size, device=chosen, threads=threads, repeats=repeats)
            )
    print_workload(workload)
    for kind, lib in library.kind_libraries.items():
        ratio = lib.layer_time_sum_s / lib.whole_model_s
        console.print(
            f"{model} on {kind}: {len(lib.layers)} layers, whole model {lib.whole_model_s * 1e3:.1f} ms "
            f"(forward+backward, batch {batch_size}), sum of layers {lib.layer_time_sum_s * 1e3:.1f} ms"
        )
        console.print(f"sum-of-layers / whole-model ratio: {ratio:.3f}")
    save_libraries(library, out)
    console.print(f"wrote {out / 'layers.csv'} and {out / 'library.json'}" if not library.kinds else f"wrote {out}")


def _profile_cluster(model: str, batch_size: int, cluster: str, repeats: int) -> LayerLibrary:
    """Every kind of ``cluster`` that this host has, profiled afresh and stored in the profile cache."""
    from tapp_core.platform.cluster import load_cluster
    from tapp_core.platform.kinds import cluster_kinds
    from tapp_core.profile.cache import ProfileCache, local_kinds

    target = load_cluster(cluster)
    here = local_kinds(target)
    if not here:
        raise TappError(
            f"this host has none of the device kinds of cluster {target.name!r} ({', '.join(cluster_kinds(target))}): "
            "profile them on their hosts, or name one kind with --device / --threads"
        )
    with console.status(f"profiling {model} at batch {batch_size} on {', '.join(here)}"):
        return ProfileCache().cluster_libraries(model, batch_size, target, repeats=repeats, fresh=True)


def calibration_for(
    cluster: str, target: Cluster, library: LayerLibrary, path: Path | None, no_calibrate: bool
) -> Calibration:
    """The calibration at ``path``, else the one ``tapp calibrate`` wrote beside the cluster file or a first use
    kept, checked against this machine and ``library``; where there is none, measured now and kept
    (``calibration_on_first_use``, its lines on stderr), unless ``no_calibrate`` or ``TAPP_NO_CALIBRATE=1``: then
    the ideal one."""
    from tapp_core.cost.calibration import calibrate_by_default, cluster_calibration

    calibrate = calibrate_by_default() and not no_calibrate
    if path is None and calibrate:
        from tapp_core.runtime.calibrator import calibration_on_first_use

        found = calibration_on_first_use(cluster, target, library, lambda line: error_console.print(line))
    else:
        found = cluster_calibration(cluster, target, library, path, kept=calibrate)
    return found


def plan(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    planner: PlannerOpt = "even",
    batch_size: BatchOpt = DEFAULT_BATCH,
    out: Annotated[Path, typer.Option("--out", "-o", help="where to write the plan (JSON)")] = DEFAULT_PLAN,
    library: LibraryOpt = None,
    rounds: Annotated[
        int | None, typer.Option(min=1, help="tapp: policy-gradient rounds in all (default: the planner's)")
    ] = None,
    budget: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="tapp, autoddl, oracle: reward evaluations (distinct plans estimated or measured) after which the "
            "search stops; tapp ends the round that reaches them (default: no limit but the rounds)",
        ),
    ] = None,
    reward: Annotated[str, typer.Option(help="tapp reward source: simulated | measured | hybrid")] = "simulated",
    schedule: ScheduleOpt = None,
    schedules: SchedulesOpt = None,
    staleness: StalenessOpt = None,
    seed: SeedOpt = 0,
    calibration: CalibrationOpt = None,
    no_calibrate: NoCalibrateOpt = False,
    checkpoint: Annotated[
        Path | None,
        typer.Option(help=f"tapp: folder where the search saves itself after every round ({CHECKPOINT_FILE})"),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="tapp: continue the search saved in --checkpoint (its own options and seed; --rounds may extend it)",
        ),
    ] = False,
) -> None:
    """Find a plan for a model on a cluster and write it as JSON."""
    from tapp_core.cost.calibration import calibration_phrase
    from tapp_core.cost.checks import validate
    from tapp_core.cost.context import CostContext
    from tapp_core.cost.simulation import estimate
    from tapp_core.paths import check_output_file
    from tapp_core.platform.cluster import load_cluster

    check_output_file(out, "--out")
    options: dict[str, object] = {"reward": reward, "seed": seed, "batch_size": batch_size, "rounds": rounds}
    options |= schedule_options(planner, schedule, comma_list(schedules), staleness)
    options.update(_checkpoint_options(planner, checkpoint, resume, rounds))
    _built_planner(planner, **{k: v for k, v in options.items() if v is not None})
    target = load_cluster(cluster)
    layers = cluster_library(model, batch_size, library, target)
    context = CostContext(layers, target, calibration_for(cluster, target, layers, calibration, no_calibrate))
    with _measurer(planner, reward, target) as measurer:
        options["measurer"] = measurer
        found = _run_planner(planner, context, budget, **{k: v for k, v in options.items() if v is not None})
    validate(found, context)
    found.save(out)
    predicted = estimate(found, context)
    console.print(
        f"calibration: {calibration_phrase(context.calibration, not no_calibrate)}", highlight=False, soft_wrap=True
    )
    console.print(
        f"{planner} plan {found.id}: {found.describe(layers)}; estimated {step_kind(found.pipeline_schedule)} "
        f"{predicted.step_time_s:.4f} s"
    )
    console.print(f"wrote {out}")


@contextlib.contextmanager
def _measurer(planner: str, reward: str, cluster: Cluster) -> Iterator[object | None]:
    """The worker pool that measures TAPP's samples where its reward is measured or hybrid (none otherwise)."""
    if planner != "tapp" or reward == "simulated":
        yield None
        return
    from tapp_core.runtime.pool import WorkerPool
    from tapp_core.runtime.pool_race import PoolRounds

    with WorkerPool(cluster) as pool:
        yield PoolRounds(pool)


def _checkpoint_options(planner: str, checkpoint: Path | None, resume: bool, rounds: int | None) -> dict[str, object]:
    """The TAPP planner's ``checkpoint`` and ``resume`` options for ``--checkpoint DIR [--resume]``; a resumed search
    keeps its own number of rounds unless ``--rounds`` is given (so it ends where the uninterrupted one would)."""
    from tapp_core.errors import TappError
    from tapp_core.paths import check_output_folder
    from tapp_core.planners.tapp.search import read_checkpoint, saved_config

    if checkpoint is None:
        if resume:
            raise TappError("--resume needs --checkpoint DIR, the folder of the search to continue")
        return {}
    if planner != "tapp":
        raise TappError(f"--checkpoint is for the tapp planner, not {planner!r}")
    saved = checkpoint / CHECKPOINT_FILE
    if resume and not saved.is_file():
        raise TappError(
            f"--resume: {checkpoint} holds no saved search ({CHECKPOINT_FILE}); run without --resume to start one"
        )
    check_output_folder(checkpoint, "--checkpoint")
    if saved.is_file() and not resume:
        console.print(f"starting a new search: it replaces the one saved in {saved} (--resume continues that one)")
    options: dict[str, object] = {"checkpoint": saved, "resume": resume}
    if resume and rounds is None:
        options["rounds"] = saved_config(read_checkpoint(saved), saved).rounds
    return options


def schedule_options(
    planner: str, schedule: str | None, schedules: tuple[str, ...] | None, staleness: int | None
) -> dict[str, object]:
    """The planner options ``--schedule``, ``--schedules`` and ``--staleness`` give (those given; the planner's
    own defaults for the others), checked the way an experiment's configuration checks them."""
    from tasks.config import ExperimentSettings, build

    asked = {"schedule": schedule, "schedules": schedules, "staleness": staleness}
    given = {k: v for k, v in asked.items() if v is not None}
    checked = build(ExperimentSettings, {**given, "dataset": "none"}, f"tapp plan --planner {planner}")
    return {k: getattr(checked, k) for k in given}


def _built_planner(name: str, **options: object) -> Planner:
    """Planner ``name`` built with the options it accepts; an unknown planner or a bad option is a ``TappError``.
    Built once before any profiling or calibration, so that bad input costs nothing."""
    from tapp_core.errors import TappError
    from tapp_core.planners import get_planner, planner_options

    accepted = planner_options(name)
    for option in ("rounds", "schedules", "staleness"):
        if option in options and option not in accepted:
            raise TappError(f"--{option} is not an option of planner {name!r}")
    return get_planner(name, **{k: v for k, v in options.items() if k in accepted})


def _run_planner(name: str, context: CostContext, budget: int | None, **options: object) -> Plan:
    """Build planner ``name`` with the options it accepts and run it under a progress bar over search rounds."""
    planner = _built_planner(name, **options)
    with progress_bars() as progress:
        bars: list[TaskID] = []  # added on the first report, so constructive planners show no empty bar

        def report(update: SearchProgress) -> None:
            if not bars:
                bars.append(progress.add_task(f"{name} search rounds", total=update.total_rounds, status=""))
            status = f"best {update.best_step_time_s:.4f} s, {update.evaluations} evaluations"
            if update.reward is not None:
                status += f", reward {update.reward:.3f}, entropy {update.entropy:.2f} ({update.phase})"
            progress.update(bars[0], completed=update.round, total=update.total_rounds, status=status)

        return planner.plan(context, budget=budget, progress=report)


def simulate(
    model: PlanModelOpt = None,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    plan_file: PlanFileOpt = DEFAULT_PLAN,
    schedule: ScheduleOpt = None,
    library: LibraryOpt = None,
    gantt: Annotated[Path | None, typer.Option(help="draw the timeline of one step to this PNG")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the estimate as JSON")] = False,
    calibration: CalibrationOpt = None,
    no_calibrate: NoCalibrateOpt = False,
) -> None:
    """Predict a plan's step time, per-device compute / communication / idle and peak memory."""
    from tapp_core.cost.calibration import calibration_phrase
    from tapp_core.cost.checks import validate
    from tapp_core.cost.context import CostContext
    from tapp_core.cost.simulation import estimate
    from tapp_core.paths import check_output_file

    if gantt is not None:
        check_output_file(gantt, "--gantt")
    model = model_of_plan(model, plan_file)
    chosen, target = load_plan(model, plan_file, cluster, schedule)
    layers = cluster_library(model, chosen.batch_size, library, target)
    context = CostContext(layers, target, calibration_for(cluster, target, layers, calibration, no_calibrate))
    validate(chosen, context)
    predicted = estimate(chosen, context)
    if as_json:
        console.print_json(json.dumps(predicted.to_dict(include_timeline=False), default=float))
    else:
        console.print(
            f"calibration: {calibration_phrase(context.calibration, not no_calibrate)}", highlight=False, soft_wrap=True
        )
        _print_estimate(chosen, predicted, context)
    if gantt is not None:
        from reports.figures import gantt as draw_gantt

        draw_gantt(predicted, gantt, title=f"{model} on {target.name}: {chosen.describe(layers)}")
        console.print(f"wrote {gantt}")


def _print_estimate(chosen: Plan, predicted: Estimate, context: CostContext) -> None:
    """The plan's estimate, and a table of each device's times and estimated peak beside the memory a plan may use
    there (``CostContext.plan_memory``: the device's less what its rank holds before the plan, where calibrated)."""
    layers = context.library
    console.print(
        f"plan {chosen.id}: {chosen.describe(layers)}; estimated {step_kind(chosen.pipeline_schedule)} "
        f"[bold]{predicted.step_time_s:.4f} s[/], communication share {predicted.communication_share:.1%}"
    )
    table = Table(
        "device", "stage", "share", "compute s", "communication s", "idle s", "peak memory MiB", "for a plan MiB"
    )
    stage_of = {d: s for s, devices in enumerate(chosen.stage_devices) for d in devices}
    for device in predicted.compute_s:
        stage = stage_of[device]
        share = chosen.shares(stage)[chosen.stage_devices[stage].index(device)]
        table.add_row(
            device,
            str(stage),
            f"{share:.3g}",
            f"{predicted.compute_s[device]:.4f}",
            f"{predicted.communication_s[device]:.4f}",
            f"{predicted.idle_s[device]:.4f}",
            f"{predicted.peak_memory_bytes.get(device, 0) / 2**20:.1f}",
            f"{context.plan_memory[device] / 2**20:.0f}",
        )
    console.print(table)
