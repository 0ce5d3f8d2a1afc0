"""Commands that run plans on MPI workers: ``measure`` (a race of one plan or several) and ``train``.

Everything that can be checked is checked before any MPI process starts: the options, each plan's structure and
schedule against the traced model, its memory against the layer library (given, cached or profiled now), and for
``train`` every file of the data. A bad one is one line and exit 2; only then does the pool start, with one rank
per device of the plans.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import (
    DEFAULT_CLUSTER,
    DEFAULT_PLAN,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    CheckpointDirOpt,
    CheckpointEveryOpt,
    ClusterOpt,
    DataDirOpt,
    DatasetOpt,
    ElasticOpt,
    EmulateOpt,
    LibraryOpt,
    PlanFileOpt,
    PlanModelOpt,
    ScheduleOpt,
    SeedOpt,
    StepsOpt,
    WarmupOpt,
    checked_workload,
    chosen_dataset,
    cluster_library,
    console,
    error_console,
    fail,
    model_of_plan,
    print_markdown,
    read_plan,
)
from tapp_core.errors import TappError

if TYPE_CHECKING:
    from tapp_core.measure.races import RaceResult
    from tapp_core.model.checkpoint_options import CheckpointOptions
    from tapp_core.model.workload import RunSpec, Workload
    from tapp_core.plan.plan import Plan
    from tapp_core.platform.cluster import Cluster
    from tapp_core.profile.library import LayerLibrary
    from tapp_core.runtime.results import TrainResult


AllowOversubscribeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-oversubscribe",
        help="start the plan's ranks even when this host has fewer cores or less memory than they need "
        "(also TAPP_ALLOW_OVERSUBSCRIBE=1)",
    ),
]

ResumeTrainingOpt = Annotated[
    Path | None,
    typer.Option(
        "--resume",
        help="go on from this checkpoint (or a folder of them: its newest complete one), under this plan; "
        "its seed orders the data",
    ),
]


def print_training(result: TrainResult, workload: Workload, dataset: str) -> None:
    """Per epoch the training loss and the test's quality (a language model's test loss and perplexity, else the
    test accuracy), then the last."""
    from tapp_core.model.workload import perplexity

    first = result.epochs - len(result.epoch_losses) + 1  # a resumed training starts at its checkpoint's epoch
    epochs = zip(
        result.epoch_losses, result.epoch_test_accuracy, result.epoch_test_loss, result.epoch_times_s, strict=False
    )
    for epoch, (loss, accuracy, test_loss, seconds) in enumerate(epochs, start=first):
        tested = (
            f"test loss {test_loss:.4f}, test perplexity {perplexity(test_loss):.2f}"
            if workload.language_model
            else f"test accuracy {accuracy:.2%}"
        )
        console.print(f"epoch {epoch}: train loss {loss:.4f}, {tested}, {seconds:.1f} s")
    if workload.language_model:
        console.print(
            f"test perplexity {result.test_perplexity:.2f} (test loss {result.test_loss:.4f} nats per token) "
            f"on {result.test_samples} predicted tokens of {dataset}"
        )
        return
    # Synthetic images are noise around class patterns; a workload's own synthetic targets may follow a rule.
    note = " (synthetic data: accuracy means nothing)" if dataset == "synthetic" and workload.targets == "drawn" else ""
    counted = "samples" if not workload.target.shape and workload.targets == "drawn" else "predicted positions"
    console.print(f"test accuracy {result.test_accuracy:.2%} on {result.test_samples} {counted}{note}")


def _plans_to_run(
    model: str,
    plan_files: list[Path],
    cluster: str,
    library: Path | None,
    allow_oversubscribe: bool,
    schedule: str | None = None,
) -> tuple[list[Plan], Cluster]:
    """The plans and cluster to run, checked as far as they can be before any MPI process starts: each plan's
    devices against the cluster, its structure and schedule against the traced model (``check_before_launch``), and
    its memory against the layer library (the given folder, else the profile cache's, profiled now if missing;
    loaded once per batch size)."""
    from tapp_core.cost.checks import validate
    from tapp_core.cost.context import CostContext
    from tapp_core.platform.cluster import load_cluster
    from tapp_core.platform.hosts import OVERSUBSCRIBE_VARIABLE
    from tapp_core.runtime import check_before_launch

    target = load_cluster(cluster)
    libraries: dict[int, LayerLibrary] = {}
    plans = []
    for plan_file in plan_files:
        chosen = read_plan(model, plan_file, schedule)
        missing = sorted(set(chosen.devices) - set(target.device_names))
        if missing:
            raise TappError(f"plan {plan_file} uses device(s) {', '.join(missing)} that cluster {target.name!r} lacks")
        check_before_launch(chosen, target, model)
        if chosen.batch_size not in libraries:
            libraries[chosen.batch_size] = cluster_library(model, chosen.batch_size, library, target)
        validate(chosen, CostContext(libraries[chosen.batch_size], target))
        plans.append(chosen)
    if allow_oversubscribe:
        os.environ[OVERSUBSCRIBE_VARIABLE] = "1"  # read by the pool this command starts
    return plans, target


def _ranks(chosen: Plan) -> str:
    count = len(chosen.devices)
    return f"{count} MPI rank{'s' if count != 1 else ''}"


PlanFilesOpt = Annotated[
    list[Path] | None,
    typer.Option("--plan", "-p", help="plan JSON (tapp plan --out); give --plan several times to race the plans"),
]


def measure(
    model: PlanModelOpt = None,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    plan_files: PlanFilesOpt = None,
    schedule: ScheduleOpt = None,
    steps: StepsOpt = DEFAULT_STEPS,
    warmup: WarmupOpt = DEFAULT_WARMUP,
    min_rounds: Annotated[int, typer.Option(min=1, help="rounds before any verdict (5: a 90 % interval)")] = 5,
    max_rounds: Annotated[int, typer.Option(min=1, help="most rounds")] = 15,
    budget: Annotated[float, typer.Option(min=1.0, help="seconds after which no new round starts")] = 600.0,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="several plans: also write the race as JSON here")
    ] = None,
    library: LibraryOpt = None,
    seed: SeedOpt = 0,
    emulate: EmulateOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds before a plan's round is abandoned")] = 600.0,
    allow_oversubscribe: AllowOversubscribeOpt = False,
) -> None:
    """Measure plans on MPI workers (one rank per device of the plans, launched with mpiexec) in a race of
    interleaved rounds: one plan prints its Measurement as JSON (the median over its rounds, with its interval);
    several print each one's median and interval, the best group and the winner."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise TappError(f"--timeout must be a positive number of seconds, got {timeout}")
    choice = RaceChoice(steps, warmup, min_rounds, max_rounds, budget, timeout)
    files = plan_files or [DEFAULT_PLAN]
    model = model_of_plan(model, files[0])
    if len(files) > 1:
        _race(model, cluster, files, library, seed, emulate, choice, json_out, allow_oversubscribe, schedule)
        return
    [chosen], target = _plans_to_run(model, files, cluster, library, allow_oversubscribe, schedule)
    with error_console.status(f"measuring plan {chosen.id} on {target.name} ({_ranks(chosen)})"):
        result = _run_race(target, [chosen], model, seed, emulate, choice)
    measured = result.measurements[0]
    typer.echo(measured.to_json())
    if not measured.ok:
        raise fail(f"plan {chosen.id} failed: {measured.error}")


@dataclass(frozen=True)
class RaceChoice:
    """The race the command line asked for."""

    steps: int
    warmup: int
    min_rounds: int
    max_rounds: int
    budget_s: float
    timeout_s: float


def _run_race(
    target: Cluster,
    plans: list[Plan],
    model: str,
    seed: int,
    emulate: bool | None,
    choice: RaceChoice,
    on_round: Callable[[int, RaceResult], None] | None = None,
) -> RaceResult:
    """Race ``plans`` (checked by ``_plans_to_run``) on a pool of the devices they use."""
    from tapp_core.measure.races import RaceOptions, RoundSteps
    from tapp_core.runtime import WorkerPool
    from tapp_core.runtime.pool_race import race

    options = RaceOptions(choice.min_rounds, choice.max_rounds, choice.budget_s, seed=seed)  # RaceError: exit 2
    steps = RoundSteps(choice.steps, choice.warmup, choice.timeout_s, seed)
    devices = sorted({d for plan in plans for d in plan.devices})
    with WorkerPool(target, devices=devices) as pool:
        return race(pool, plans, model, options, steps, emulate=emulate, on_round=on_round)


def _race(
    model: str,
    cluster: str,
    files: list[Path],
    library: Path | None,
    seed: int,
    emulate: bool | None,
    choice: RaceChoice,
    json_out: Path | None,
    allow_oversubscribe: bool,
    schedule: str | None = None,
) -> None:
    """Race the plans of ``files`` (each with ``schedule`` in place of its own, if given) on one pool and print the
    verdict as a Markdown table."""
    from tapp_core.paths import check_output_file

    if json_out is not None:
        check_output_file(json_out, "--json")
    plans, target = _plans_to_run(model, files, cluster, library, allow_oversubscribe, schedule)
    names: dict[str, list[str]] = {}
    for path, plan in zip(files, plans, strict=True):
        names.setdefault(plan.id, []).append(path.name)
    racing = f"racing {len(names)} plans on {target.name}"
    with error_console.status(racing) as status:
        result = _run_race(
            target, plans, model, seed, emulate, choice, lambda number, _: status.update(f"{racing}: round {number}")
        )
    print_markdown(race_table(result, {key: " = ".join(v) for key, v in names.items()}))
    if json_out is not None:
        summary = {**result.summary(), "measurements": [m.to_dict() for m in result.measurements]}
        json_out.write_text(json.dumps(summary, indent=2, default=float) + "\n")
    failed = [m for m in result.measurements if not m.ok]
    if failed:
        raise fail("; ".join(f"plan {m.plan_id} {m.error}" for m in failed))


def race_table(result: RaceResult, names: dict[str, str]) -> str:
    """The race as Markdown: one row per plan, fastest first, its median and interval as every view shows them
    (``reports.numbers``: ``[low, high]``, never a symmetric ``±``), the best group marked, then how the race went."""
    from reports.numbers import bracket, seconds

    group = {p.id for p in result.best_group()}
    winner = result.winner()
    rows = [
        "| plan | devices | median s | interval s | rounds | |",
        "| --- | --- | ---: | --- | ---: | --- |",
    ]
    order = sorted(
        zip(result.plans, result.measurements, strict=True), key=lambda pm: (not pm[1].ok, pm[1].step_time_s)
    )
    for plan, measured in order:
        devices = " \\| ".join("+".join(d) for d in plan.stage_devices)
        interval = measured.interval
        if interval is None:
            rows.append(f"| {names[plan.id]} | {devices} | – | failed: {measured.error} | {measured.rounds} | |")
            continue
        mark = "winner" if winner is not None and plan.id == winner.id else ("best group" if plan.id in group else "")
        rows.append(
            f"| {names[plan.id]} | {devices} | {seconds(interval.median)} | {bracket(interval.low, interval.high)} | "
            f"{measured.rounds} | {mark} |"
        )
    notes = [
        f"{result.rounds} rounds ({result.stop}), {result.elapsed_s:.0f} s; intervals: order statistics over the rounds, "
        f"at least {result.options.confidence:.0%} where there are enough rounds. Best group: every plan whose "
        "interval overlaps the fastest's; the winner is its plan with fewest devices.",
        f"host load average {result.load_before:.2f} before, {result.load_after:.2f} after, on {result.host_cpus} cores",
    ]
    if result.overloaded:
        notes.append("WARNING: the host was overloaded during the race; its intervals are wider than on a quiet host")
    return "\n".join([*rows, "", *notes]) + "\n"


def train(
    model: PlanModelOpt = None,
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
    checkpoint_dir: CheckpointDirOpt = None,
    checkpoint_every: CheckpointEveryOpt = 0,
    resume: ResumeTrainingOpt = None,
    elastic: ElasticOpt = False,
) -> None:
    """Train a plan for real on MPI workers and report test accuracy; with --checkpoint-dir, write checkpoints and,
    at the end, the whole trained model (model.safetensors) there. With --elastic, a device that dies or slows
    makes TAPP plan again and go on from the last checkpoint."""
    import dataclasses

    from tapp_core.model.workload import RunSpec, check_workload_data

    model = model_of_plan(model, plan_file)
    workload = checked_workload(model)
    if elastic and (checkpoint_dir is None or checkpoint_every <= 0):
        raise TappError("--elastic needs checkpoints: give --checkpoint-dir and --checkpoint-every (steps)")
    checkpoints = checkpoint_options(checkpoint_dir, checkpoint_every, resume)
    if checkpoints is not None:  # a checkpoint that cannot be resumed fails here, before the data and plan checks
        from tapp_core.runtime.checkpoint import prepare_checkpoints

        checkpoints, _ = prepare_checkpoints(checkpoints, workload, read_plan(model, plan_file).batch_size)
    directory = str(data_dir) if data_dir is not None else None
    dataset = chosen_dataset(dataset, data_dir) if workload.images else dataset or workload.data
    with error_console.status(f"checking the {dataset} data"):
        # every file, before any rank starts: bad data fails here, in one line
        check_workload_data(dataclasses.replace(workload, data=dataset), directory)
    spec = RunSpec(
        workload=dataclasses.replace(workload, data=dataset),
        seed=seed,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        data_dir=directory,
        augment=augment,
        checkpoints=checkpoints,
    )
    [chosen], target = _plans_to_run(model, [plan_file], cluster, library, allow_oversubscribe)
    with error_console.status(f"training plan {chosen.id} on {target.name} for {epochs} epoch(s) ({_ranks(chosen)})"):
        result = _train_plan(chosen, target, spec, emulate, elastic, library)
    if not result.ok:
        raise fail(f"training plan {chosen.id} failed: {result.error}")
    print_training(result, workload, dataset)
    if checkpoints is not None and checkpoints.folder is not None:
        from tapp_core.runtime.checkpoint import MODEL_FILE

        console.print(
            f"checkpoints in {checkpoints.folder}; the trained model: {Path(checkpoints.folder) / MODEL_FILE}"
        )


def _train_plan(
    chosen: Plan, target: Cluster, spec: RunSpec, emulate: bool | None, elastic: bool, library: Path | None
) -> TrainResult:
    """Train ``chosen`` as ``spec`` says; ``elastic``: re-planned (costed from ``library``, as ``--library`` gives
    it) when a device dies or slows, each event printed."""
    from tapp_core.runtime import train as run_train

    if not elastic:
        return run_train(chosen, target, spec, emulate=emulate)
    from tapp_core.cost.calibration import cluster_calibration
    from tapp_core.cost.context import CostContext
    from tapp_core.runtime.elastic import ElasticOptions
    from tasks.elastic import train_elastically

    layers = cluster_library(chosen.model, chosen.batch_size, library, target)
    context = CostContext(layers, target, cluster_calibration(target, target, layers), spec.workload.optimizer)
    done = train_elastically(chosen, spec, context, None, options=ElasticOptions(emulate=emulate))
    for event in done.events:
        console.print(f"elastic: {event.message}", highlight=False)
    lost = sum(event.steps_lost for event in done.events)
    console.print(f"elastic: {done.steps_done} of {done.total_steps} steps on {len(done.spans)} plan(s), {lost} lost")
    return done.result


def checkpoint_options(folder: Path | None, every: int, resume: Path | None) -> CheckpointOptions | None:
    """The training's checkpoint options (None: neither written nor resumed); a resumed training writes its
    checkpoints beside the one it resumes unless given a folder."""
    if folder is None and resume is None:
        if every:
            raise TappError("--checkpoint-every needs --checkpoint-dir")
        return None
    from tapp_core.model.checkpoint_options import CheckpointOptions

    return CheckpointOptions(
        str(folder) if folder is not None else None, every, str(resume) if resume is not None else None
    )


def export(
    checkpoint: Annotated[Path, typer.Option(help="a checkpoint (step-* folder) or a folder of them (its newest)")],
    out: Annotated[Path, typer.Option(help="the safetensors file to write")],
) -> None:
    """Write a training checkpoint's whole model, under the model's own parameter names, as one safetensors file."""
    from tapp_core.paths import check_output_file
    from tapp_core.runtime.checkpoint import Checkpoint, export_model

    check_output_file(out, "--out")
    opened = Checkpoint.open(checkpoint)
    path = export_model(opened, out)
    step = opened.position()[0]
    console.print(f"model {opened.model} after step {step} ({opened.folder}) written to {path}")
