"""Commands that run a plan on MPI workers: ``measure`` and ``train``."""

from __future__ import annotations

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
    console,
    error_console,
    fail,
    library_for,
    load_plan,
)
from tapp_core.errors import TappError

if TYPE_CHECKING:
    from tapp_core.cluster import Cluster
    from tapp_core.plan import Plan


def _plan_to_run(model: str, plan_file: Path, cluster: str, library: Path | None) -> tuple[Plan, Cluster]:
    """The plan and cluster to run; the plan is validated against the library when one is given."""
    from tapp_core.plan import validate

    chosen, target = load_plan(model, plan_file, cluster)
    missing = sorted(set(chosen.devices) - set(target.device_names))
    if missing:
        raise TappError(f"plan {plan_file} uses device(s) {', '.join(missing)} that cluster {target.name!r} lacks")
    if library is not None:
        validate(chosen, library_for(model, chosen.batch_size, library), target)
    return chosen, target


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
) -> None:
    """Run a plan on MPI workers (one rank per device, launched with mpiexec) and print its Measurement as JSON."""
    from tapp_core.runtime import measure as run_measure

    chosen, target = _plan_to_run(model, plan_file, cluster, library)
    with error_console.status(f"measuring plan {chosen.id} on {target.name} ({len(target.devices)} MPI ranks)"):
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
) -> None:
    """Train a plan for real on MPI workers and report test accuracy."""
    from tapp_core.data import open_dataset
    from tapp_core.runtime import train as run_train

    chosen, target = _plan_to_run(model, plan_file, cluster, library)
    directory = str(data_dir) if data_dir is not None else None
    dataset = chosen_dataset(dataset, data_dir)
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
        raise fail(f"training plan {chosen.id} failed: {result.error}")
    for epoch, (loss, accuracy, seconds) in enumerate(
        zip(result.epoch_losses, result.epoch_test_accuracy, result.epoch_times_s, strict=False), start=1
    ):
        console.print(f"epoch {epoch}: train loss {loss:.4f}, test accuracy {accuracy:.2%}, {seconds:.1f} s")
    note = " (synthetic data: accuracy means nothing)" if getattr(test_set, "synthetic", False) else ""
    console.print(f"test accuracy {result.test_accuracy:.2%} on {result.test_samples} samples{note}")
