"""Commands that run a plan on MPI workers: ``measure`` and ``train``.

Everything that can be checked is checked before any MPI process starts: the options, the plan's structure and
schedule against the traced model, its memory against the layer library (given, cached or profiled now), and for
``train`` every file of the data. A bad one is one line and exit 2; only then does the pool start, with one rank
per device of the plan.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import (
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    DEFAULT_PLAN,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    ClusterOpt,
    DataDirOpt,
    DatasetOpt,
    EmulateOpt,
    LibraryOpt,
    ModelOpt,
    PlanFileOpt,
    SeedOpt,
    StepsOpt,
    WarmupOpt,
    chosen_dataset,
    cluster_library,
    console,
    error_console,
    fail,
    load_plan,
)
from tapp_core.errors import TappError

if TYPE_CHECKING:
    from tapp_core.cluster import Cluster
    from tapp_core.plan import Plan


AllowOversubscribeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-oversubscribe",
        help="start the plan's ranks even when this host has fewer cores or less memory than they need "
        "(also TAPP_ALLOW_OVERSUBSCRIBE=1)",
    ),
]


def _plan_to_run(
    model: str, plan_file: Path, cluster: str, library: Path | None, allow_oversubscribe: bool
) -> tuple[Plan, Cluster]:
    """The plan and cluster to run, checked as far as they can be before any MPI process starts: the plan's devices
    against the cluster, its structure and schedule against the traced model (``check_before_launch``), and its
    memory against the layer library (the given folder, else the profile cache's, profiled now if missing)."""
    from tapp_core.plan import validate
    from tapp_core.runtime import check_before_launch
    from tapp_core.runtime.placement import OVERSUBSCRIBE_VARIABLE

    chosen, target = load_plan(model, plan_file, cluster)
    missing = sorted(set(chosen.devices) - set(target.device_names))
    if missing:
        raise TappError(f"plan {plan_file} uses device(s) {', '.join(missing)} that cluster {target.name!r} lacks")
    check_before_launch(chosen, target, model)
    validate(chosen, cluster_library(model, chosen.batch_size, library, target), target)
    if allow_oversubscribe:
        os.environ[OVERSUBSCRIBE_VARIABLE] = "1"  # read by the pool this command starts
    return chosen, target


def _ranks(chosen: Plan) -> str:
    count = len(chosen.devices)
    return f"{count} MPI rank{'s' if count != 1 else ''}"


def measure(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    plan_file: PlanFileOpt = DEFAULT_PLAN,
    steps: StepsOpt = DEFAULT_STEPS,
    warmup: WarmupOpt = DEFAULT_WARMUP,
    library: LibraryOpt = None,
    seed: SeedOpt = 0,
    emulate: EmulateOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds before the plan is abandoned")] = 600.0,
    allow_oversubscribe: AllowOversubscribeOpt = False,
) -> None:
    """Run a plan on MPI workers (one rank per device of the plan, launched with mpiexec) and print its
    Measurement as JSON."""
    from tapp_core.runtime import measure as run_measure

    if not (math.isfinite(timeout) and timeout > 0):
        raise TappError(f"--timeout must be a positive number of seconds, got {timeout}")
    chosen, target = _plan_to_run(model, plan_file, cluster, library, allow_oversubscribe)
    with error_console.status(f"measuring plan {chosen.id} on {target.name} ({_ranks(chosen)})"):
        result = run_measure(
            chosen, target, model, steps=warmup + steps, warmup=warmup, seed=seed, emulate=emulate, timeout_s=timeout
        )
    typer.echo(result.to_json())
    if not result.ok:
        raise fail(f"plan {chosen.id} failed: {result.error}")


def train(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    plan_file: PlanFileOpt = DEFAULT_PLAN,
    data_dir: DataDirOpt = None,
    dataset: DatasetOpt = None,
    epochs: Annotated[int, typer.Option(min=1, help="passes over the training set")] = 1,
    steps_per_epoch: Annotated[int | None, typer.Option(min=1, help="cut each epoch short (smoke runs)")] = None,
    augment: Annotated[bool, typer.Option(help="random crop and flip")] = False,
    library: LibraryOpt = None,
    seed: SeedOpt = 0,
    emulate: EmulateOpt = None,
    allow_oversubscribe: AllowOversubscribeOpt = False,
) -> None:
    """Train a plan for real on MPI workers and report test accuracy."""
    from tapp_core.data import check_dataset
    from tapp_core.runtime import train as run_train

    directory = str(data_dir) if data_dir is not None else None
    dataset = chosen_dataset(dataset, data_dir)
    with error_console.status(f"checking the {dataset} data"):
        check_dataset(dataset, directory)  # every file, before any rank starts: bad data fails here, in one line
    chosen, target = _plan_to_run(model, plan_file, cluster, library, allow_oversubscribe)
    with error_console.status(f"training plan {chosen.id} on {target.name} for {epochs} epoch(s) ({_ranks(chosen)})"):
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
        raise fail(f"training plan {chosen.id} failed: {result.error}")
    for epoch, (loss, accuracy, seconds) in enumerate(
        zip(result.epoch_losses, result.epoch_test_accuracy, result.epoch_times_s, strict=False), start=1
    ):
        console.print(f"epoch {epoch}: train loss {loss:.4f}, test accuracy {accuracy:.2%}, {seconds:.1f} s")
    note = " (synthetic data: accuracy means nothing)" if dataset == "synthetic" else ""
    console.print(f"test accuracy {result.test_accuracy:.2%} on {result.test_samples} samples{note}")
