"""Commands on tapp_core alone, with no workers, Prefect or MLflow: ``profile``, ``plan`` and ``simulate``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from flows.cli.common import (
    DEFAULT_BATCH,
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    DEFAULT_PLAN,
    METHODS,
    BatchOpt,
    ClusterOpt,
    LibraryOpt,
    ModelOpt,
    PlanFileOpt,
    SeedOpt,
    console,
    library_for,
    load_plan,
    progress_bars,
)

if TYPE_CHECKING:
    from rich.progress import TaskID

    from tapp_core.cluster import Cluster
    from tapp_core.costmodel import Estimate
    from tapp_core.library import LayerLibrary
    from tapp_core.plan import Plan
    from tapp_core.planners import SearchProgress

PlannerOpt = Annotated[str, typer.Option(help=" | ".join(METHODS) + " (the method names of tapp run --methods)")]


def profile(
    model: ModelOpt = DEFAULT_MODEL,
    batch_size: BatchOpt = DEFAULT_BATCH,
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
    seed: SeedOpt = 0,
) -> None:
    """Find a plan for a model on a cluster and write it as JSON."""
    from tapp_core.cluster import load_cluster
    from tapp_core.costmodel import estimate
    from tapp_core.plan import validate

    target = load_cluster(cluster)
    layers = library_for(model, batch_size, library)
    options = {"reward": reward, "seed": seed, "batch_size": batch_size, "rounds": rounds}
    found = _run_planner(planner, layers, target, budget, **{k: v for k, v in options.items() if v is not None})
    validate(found, layers, target)
    found.save(out)
    predicted = estimate(found, layers, target)
    console.print(
        f"{planner} plan {found.id}: {found.n_stages} stage(s) on {', '.join('+'.join(d) for d in found.stage_devices)}, "
        f"{found.micro_batches} micro-batches, {found.schedule}; estimated step time {predicted.step_time:.4f} s"
    )
    console.print(f"wrote {out}")


def _run_planner(name: str, library: LayerLibrary, cluster: Cluster, budget: int | None, **options: object) -> Plan:
    """Build planner ``name`` with the options it accepts and run it under a progress bar over search rounds."""
    from tapp_core.errors import TappError
    from tapp_core.planners import get_planner, planner_options

    accepted = planner_options(name)
    if "rounds" in options and "rounds" not in accepted:
        raise TappError(f"--rounds is for the tapp planner, not {name!r}")
    planner = get_planner(name, **{k: v for k, v in options.items() if k in accepted})
    with progress_bars() as progress:
        bars: list[TaskID] = []  # added on the first report, so constructive planners show no empty bar

        def report(update: SearchProgress) -> None:
            if not bars:
                bars.append(progress.add_task(f"{name} search rounds", total=update.total_rounds, status=""))
            status = f"best {update.best_step_time_s:.4f} s, {update.evaluations} evaluations"
            if update.reward is not None:
                status += f", reward {update.reward:.3f}, entropy {update.entropy:.2f} ({update.phase})"
            progress.update(bars[0], completed=update.round, total=update.total_rounds, status=status)

        return planner.plan(library, cluster, budget=budget, progress=report)


def simulate(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    plan_file: PlanFileOpt = DEFAULT_PLAN,
    library: LibraryOpt = None,
    gantt: Annotated[Path | None, typer.Option(help="draw the timeline of one step to this PNG")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the estimate as JSON")] = False,
) -> None:
    """Predict a plan's step time, per-device compute / communication / idle and peak memory."""
    from tapp_core.costmodel import estimate
    from tapp_core.plan import validate

    chosen, target = load_plan(model, plan_file, cluster)
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


def _print_estimate(chosen: Plan, predicted: Estimate) -> None:
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
