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
    ScheduleOpt,
    SeedOpt,
    StepsOpt,
    WarmupOpt,
    chosen_dataset,
    cluster_library,
    console,
    error_console,
    fail,
    print_markdown,
    read_plan,
)
from tapp_core.errors import TappError

if TYPE_CHECKING:
    from tapp_core.cluster import Cluster
    from tapp_core.library import LayerLibrary
    from tapp_core.plan import Plan
    from tapp_core.races import RaceResult


AllowOversubscribeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-oversubscribe",
        help="start the plan's ranks even when this host has fewer cores or less memory than they need "
        "(also TAPP_ALLOW_OVERSUBSCRIBE=1)",
    ),
]


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
    from tapp_core.cluster import load_cluster
    from tapp_core.hosts import OVERSUBSCRIBE_VARIABLE
    from tapp_core.plan import validate
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
        validate(chosen, libraries[chosen.batch_size], target)
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
    model: ModelOpt = DEFAULT_MODEL,
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
    from tapp_core.races import RaceOptions, RoundSteps
    from tapp_core.runtime import WorkerPool
    from tapp_core.runtime.race import race

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
    """The race as Markdown: one row per plan, fastest first, the best group marked, then how the race went."""
    group = {p.id for p in result.best_group()}
    winner = result.winner()
    rows = [
        "| plan | devices | median s | ± | interval s | rounds | |",
        "| --- | --- | ---: | ---: | --- | ---: | --- |",
    ]
    order = sorted(
        zip(result.plans, result.measurements, strict=True), key=lambda pm: (not pm[1].ok, pm[1].step_time_s)
    )
    for plan, measured in order:
        devices = " \\| ".join("+".join(d) for d in plan.stage_devices)
        interval = measured.interval
        if interval is None:
            rows.append(f"| {names[plan.id]} | {devices} | – | – | failed: {measured.error} | {measured.rounds} | |")
            continue
        mark = "winner" if winner is not None and plan.id == winner.id else ("best group" if plan.id in group else "")
        rows.append(
            f"| {names[plan.id]} | {devices} | {interval.median:.4f} | {interval.half_width:.4f} | "
            f"[{interval.low:.4f}, {interval.high:.4f}] | {measured.rounds} | {mark} |"
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
    [chosen], target = _plans_to_run(model, [plan_file], cluster, library, allow_oversubscribe)
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
