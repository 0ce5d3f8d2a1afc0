"""A model that fits no single device, planned, raced and trained: memory as a planned dimension (issue 33, part 5).

    .venv/bin/python bench/no_fit.py [--model vgg16] [--library bench/libraries/vgg16_b64] [--cluster homo4]
        [--memory 260MiB] [--optimizer AdamW] [--planners tapp pipedream even pipetorch bsp autoddl]
        [--rounds 5] [--steps 2] [--epochs 3] [--steps-per-epoch 8] [--testbed]

Every device of the cluster gets ``--memory``, less than the model's training state under ``--optimizer`` with one
batch's activations: the bench first prints, device by device, what the whole model needs there and that it is
over. Then every planner plans under that memory (TAPP's polish and AutoDDL may shard a replicated stage's optimiser
state or recompute a stage's activations; the notes say where); a method with no plan that fits says so. The plans
that fit are raced on the cluster's ranks (interleaved rounds, each plan's median step with its interval, the best
group); TAPP's plan trains ``--epochs`` epochs of ``--steps-per-epoch`` steps of synthetic data (augmented), each
epoch's training loss printed and whether it fell; then it runs again in a pool of its own, each device's own memory
(its peak less its baseline, as ``bench/memory.py`` measures) printed beside its estimate and the memory it has for
a plan, and the rank's whole peak beside the device's memory.

Without ``--testbed`` the cluster is emulated on this host's ranks, ``memory:`` is a number the planners read, and
the whole of it is the plan's (the ideal calibration). With ``--testbed`` (root) the cluster's testbed is brought
up with each host's kernel memory limit from its devices' ``memory:`` (``tapp testbed up``), and calibrated first
(``tapp calibrate``'s code): what a rank holds before a plan's first tensor (the interpreter, torch, MPI, its data
and model) is measured and left aside from a plan's memory (``CostContext.plan_memory``), and a plan over the limit
would be killed by the kernel ("out of memory on device D").
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.checks import check_memory, validate  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.errors import TappError  # noqa: E402
from tapp_core.measure.races import RaceOptions, RoundSteps  # noqa: E402
from tapp_core.model.workload import OptimizerConfig, Workload, as_workload  # noqa: E402
from tapp_core.plan.plan import (  # noqa: E402
    Plan,
    same_execution,
    single_stage_plan,
)
from tapp_core.planners import PlannerError, get_planner  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster, resolve_cluster_path  # noqa: E402
from tapp_core.platform.testbed import down, state_folder, up  # noqa: E402
from tapp_core.profile.library import LayerLibrary, load_libraries  # noqa: E402
from tapp_core.runtime import WorkerPool  # noqa: E402
from tapp_core.runtime.calibrator import calibrate  # noqa: E402
from tapp_core.runtime.pool_race import race  # noqa: E402
from tapp_core.units import parse_bytes  # noqa: E402

MiB = 2**20
NAME, SUBNET = "tappnf", "10.212.0.0/24"
PLANNERS = ("tapp", "pipedream", "even", "pipetorch", "bsp", "autoddl")
OPTIONS: dict[str, dict[str, object]] = {"tapp": {"rounds": 10}, "autoddl": {"max_sweeps": 3}}


def budgeted(cluster: Cluster, memory: int) -> Cluster:
    """``cluster`` with every device's memory ``memory`` bytes."""
    devices = tuple(d.model_copy(update={"memory": memory}) for d in cluster.devices)
    return cluster.model_copy(update={"devices": devices})


def single_devices_over(library: LayerLibrary, context: CostContext) -> bool:
    """Print what the whole model needs on each device; whether every one is over its memory."""
    over = True
    for device in context.cluster.devices:
        plan = single_stage_plan(library, [device.name], planner="single")
        try:
            check_memory(plan, context)
        except TappError as exc:
            print(f"  {device.name}: {exc}")
            continue
        over = False
        print(
            f"  {device.name}: the whole model fits ({max(estimate(plan, context).peak_memory_bytes.values()) / MiB:.0f} MiB)"
        )
    return over


def planned(context: CostContext, planners: list[str]) -> dict[str, Plan]:
    """Each planner's plan under the budget (printed with its estimate, or why there is none)."""
    plans: dict[str, Plan] = {}
    for name in planners:
        try:
            plan = get_planner(name, seed=0, **OPTIONS.get(name, {})).plan(context)
            validate(plan, context)
        except (PlannerError, TappError) as exc:
            print(f"  {name:10s} no plan that fits: {exc}")
            continue
        peak = max(estimate(plan, context).peak_memory_bytes.values())
        step = estimate(plan, context).step_time_s
        print(f"  {name:10s} {plan.describe(context.library)}  estimated {step:.3f} s, peak {peak / MiB:.0f} MiB")
        plans[name] = plan
    return plans


def measured_memory(context: CostContext, workload: Workload, plan: Plan, steps: int) -> bool:
    """Run ``plan`` in a pool of its own (no earlier plan's memory left behind, no emulated slowdown) and print each
    device's own memory (its peak less its baseline, as ``bench/memory.py``) by its estimate and the memory it has
    for a plan, and the rank's whole peak by the device's memory (a testbed host's kernel limit); whether every
    device kept within both."""
    with WorkerPool(context.cluster) as pool:
        pool.prepare(workload)
        measurement, _ = pool.run_steps(plan, workload, steps=steps, warmup=1, emulate=False, timeout_s=1800)
    if not measurement.ok:
        print(f"  failed: {measurement.error}")
        return False
    baseline = measurement.extra["baseline_memory_bytes"]
    assert isinstance(baseline, dict)
    estimated = estimate(plan, context).peak_memory_bytes
    within = True
    for device in plan.devices:
        peak, rank = measurement.peak_memory_bytes[device], int(baseline[device])
        own, budget, memory = peak - rank, context.plan_memory[device], context.cluster.device(device).memory
        within &= own <= budget and peak <= memory
        print(
            f"  {device}: measured {own / MiB:.0f} MiB, estimated {estimated[device] / MiB:.0f}, for a plan "
            f"{budget / MiB:.0f} ({'within' if own <= budget else 'OVER'}); the rank's peak {peak / MiB:.0f} MiB of "
            f"{memory / MiB:.0f} ({'within' if peak <= memory else 'OVER'}; before the plan {rank / MiB:.0f})"
        )
    return within


def on_testbed(cluster_name: str, memory: str, library: LayerLibrary, work: Path) -> CostContext:
    """Bring up the testbed of ``cluster_name`` with every device's memory ``memory`` (each host's kernel limit),
    and calibrate it: what a rank holds before a plan is measured and left aside from the plan's memory."""
    data = yaml.safe_load(resolve_cluster_path(cluster_name).read_text())
    for device in data["devices"]:
        device["memory"] = memory
    budgeted_file = work / "budgeted.yaml"
    budgeted_file.write_text(yaml.safe_dump(data))
    testbed = up(budgeted_file, work / "testbed.yaml", prefix=NAME, subnet=SUBNET, log=lambda x: print(f"  {x}"))
    calibration = calibrate(testbed, library, log=lambda line: print(f"  calibration: {line}"))
    return CostContext(library, testbed, calibration)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg16")
    parser.add_argument("--library", type=Path, default=ROOT / "bench" / "libraries" / "vgg16_b64")
    parser.add_argument("--cluster", default="homo4")
    parser.add_argument("--memory", default="260MiB", help="every device's memory")
    parser.add_argument("--optimizer", default="AdamW")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--planners", nargs="+", default=list(PLANNERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=8)
    parser.add_argument(
        "--testbed", action="store_true", help="on the cluster's testbed (root), --memory each host's kernel limit"
    )
    args = parser.parse_args()

    library = load_libraries(args.library)
    optimizer = OptimizerConfig(name=args.optimizer, lr=args.lr)
    workload: Workload = dataclasses.replace(as_workload(args.model), optimizer=optimizer)
    if not args.testbed:
        cluster = budgeted(load_cluster(args.cluster), parse_bytes(args.memory))
        return bench(CostContext(library, cluster, optimizer=optimizer), workload, args)
    with tempfile.TemporaryDirectory(prefix="tapp-bench-no-fit-") as work:
        try:
            context = on_testbed(args.cluster, args.memory, library, Path(work))
            return bench(dataclasses.replace(context, optimizer=optimizer), workload, args)
        finally:
            down(NAME, state_folder(NAME))


def bench(context: CostContext, workload: Workload, args: argparse.Namespace) -> int:
    """Plan, race and train ``args.model`` on the context's cluster (see the module's docstring); its exit code."""
    library, cluster, optimizer = context.library, context.cluster, context.optimizer
    print(
        f"{args.model} under {args.optimizer}, batch {library.batch_size}, on {cluster.name} at {args.memory} a device"
        + (" (the testbed: each host's kernel limit)" if args.testbed else "")
    )
    print("the whole model on one device:")
    if not single_devices_over(library, context):
        print("a device holds the whole model: lower --memory")
        return 2
    print("plans under the budget:")
    plans = planned(context, args.planners)
    if "tapp" not in plans:
        print("TAPP found no plan that fits")
        return 1
    distinct: list[Plan] = []
    for plan in plans.values():
        if not any(same_execution(plan, other) for other in distinct):
            distinct.append(plan)
    options = RaceOptions(min_rounds=args.rounds, max_rounds=args.rounds, eliminate=False, budget_s=3600)
    with WorkerPool(cluster) as pool:
        pool.prepare(workload)
        bounded = sum(info.bounded_memory for info in pool.ranks)
        print(
            f"\n{bounded} of {len(pool.ranks)} ranks give freed memory back at once (a memory limit within the device's)"
        )
        result = race(pool, distinct, workload, options, RoundSteps(steps=args.steps))
        print(f"\nraced ({result.rounds} interleaved rounds of {args.steps} steps after a warm-up):")
        best = {p.id for p in result.best_group()}
        for name, plan in plans.items():
            m = result.measurement(plan.id)
            interval = m.interval
            span = f"[{interval.low:.3f}, {interval.high:.3f}]" if interval is not None else ""
            text = f"{m.step_time_s:.3f} s {span}" if m.ok else f"failed: {m.error}"
            print(f"  {name:10s} {text}{'  (best group)' if plan.id in best else ''}")
        tapp = plans["tapp"]
        print(
            f"\nTAPP's plan trained {args.epochs} epochs of {args.steps_per_epoch} steps (synthetic data, augmented):"
        )
        trained = pool.train(
            tapp, workload, dataset="synthetic", epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
            augment=True, test_samples=64, optimizer=optimizer,
        )  # fmt: skip
    print("TAPP's plan, each device's own memory (peak less the rank's baseline):")
    within = measured_memory(context, workload, tapp, args.steps)
    if not trained.ok:
        print(f"  failed: {trained.error}")
        return 1
    losses = trained.epoch_losses
    print("  training loss by epoch: " + ", ".join(f"{x:.4f}" for x in losses))
    falling = all(b < a for a, b in itertools.pairwise(losses))
    print(f"  the loss {'fell every epoch' if falling else 'did not fall every epoch'}")
    in_best = tapp.id in best
    print(
        f"TAPP's measured step is {'in' if in_best else 'NOT in'} the best group of the {len(plans)} methods that fit"
    )
    print(f"{statistics.median(losses):.4f}")
    return 0 if falling and in_best and within else 1


if __name__ == "__main__":
    sys.exit(main())
