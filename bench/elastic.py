"""Elastic training on real hosts: a host killed, a host slowed, and nothing done (``tapp_core.runtime.elastic``).

    sudo .venv/bin/python bench/elastic.py [--cluster hetero4] [--model tiny_cnn] [--batch-size 256]
        [--steps 100] [--every 10] [--at 30] [--kill cpu1] [--slow cpu0] [--no-calibrate]

The bench makes the cluster's testbed (``tapp testbed up``'s code: hosts as namespaces with their own sshd, CPU
quotas, shaped links; name ``tappel``, subnet ``10.218.0.0/24``), profiles the model (the profile cache), calibrates
the testbed (``tapp calibrate``'s code, in memory), plans with TAPP, and trains the plan elastically for ``steps``
steps with a checkpoint every ``every`` steps, three times:

3. nothing done: the reference wall time and step time (and no move: the slow-device rule must not fire);
2. at step ``at``, the CPU quota of the host of device ``slow`` is cut to a third (its control group's ``cpu.max``):
   bar, TAPP re-plans within 20 steps; then the median step time after the move against the new plan's estimate
   (bar: within 15 %);
1. at step ``at`` (as the segment from there starts), every process of the host of device ``kill`` is killed (its sshd and its
   ranks: the host is gone): the training completes on the others; the steps lost (bar: at most ``every``) and the
   wall time against case 3's.

Case 1 runs last: its host stays dead. The testbed is taken down at the end, whatever happened. Each case runs
once: on a shared machine its times are one sample, not a median. Needs root, network namespaces, a cpu cgroup
controller and sshd.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.calibration import Calibration  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.model.checkpoint_options import CheckpointOptions  # noqa: E402
from tapp_core.model.data import find_dataset  # noqa: E402
from tapp_core.model.workload import RunSpec  # noqa: E402
from tapp_core.plan.plan import Plan  # noqa: E402
from tapp_core.planners import get_planner  # noqa: E402
from tapp_core.planners.replan import replan  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.platform.testbed import down, plan_testbed, state_folder, system, up  # noqa: E402
from tapp_core.platform.testbed.cgroups import Cgroups  # noqa: E402
from tapp_core.profile.cache import ProfileCache  # noqa: E402
from tapp_core.runtime.calibrator import calibrate  # noqa: E402
from tapp_core.runtime.elastic import LOST, MIGRATED, SLOW, ElasticEvent, ElasticResult, ElasticTraining  # noqa: E402
from tapp_core.runtime.pool import WorkerPool  # noqa: E402

NAME = "tappel"
SUBNET = "10.218.0.0/24"
REPLAN_BAR_STEPS = 20
ESTIMATE_BAR = 0.15

Fault = Callable[[int, WorkerPool], None]


def no_fault(step: int, pool: WorkerPool) -> None:
    return None


def once_at(step_wanted: int, action: Callable[[], None]) -> Fault:
    """A ``before_segment`` that runs ``action`` before the segment that starts at ``step_wanted``."""
    done: list[int] = []

    def fault(step: int, pool: WorkerPool) -> None:
        print(f"    segment from step {step} (pool of {', '.join(pool.devices)})", flush=True)
        if step == step_wanted and not done:
            done.append(step)
            action()

    return fault


def cut_quota(cgroups: Cgroups, group: str, fraction: float) -> str:
    """The group's CPU quota cut to ``fraction`` of what it is; returns what was done."""
    if cgroups.version == 2:
        path = cgroups.cpu / group / "cpu.max"
        quota, period = path.read_text().split()
        new = max(1000, int(int(quota) * fraction))
        path.write_text(f"{new} {period}")
    else:
        path = cgroups.cpu / group / "cpu.cfs_quota_us"
        quota = path.read_text().strip()
        new = max(1000, int(int(quota) * fraction))
        path.write_text(str(new))
    return f"quota of {group}: {quota} -> {new} us per period"


def kill_host(namespace: str) -> str:
    """SIGKILL every process of the host's namespace (its sshd, Hydra's proxy, its ranks)."""
    pids = sorted(system.namespace_pids(namespace))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return f"killed {len(pids)} process(es) of {namespace}"


def run_case(
    title: str, plan_context: tuple[Plan, CostContext], spec: RunSpec, folder: Path, fault: Fault
) -> tuple[ElasticResult, list[ElasticEvent]]:
    plan, context = plan_context
    events: list[ElasticEvent] = []

    def show(event: ElasticEvent) -> None:
        events.append(event)
        print(f"  [{title}] {event.kind} at step {event.step}: {event.message}", flush=True)

    assert spec.checkpoints is not None
    spec = spec.with_options(checkpoints=CheckpointOptions(str(folder), spec.checkpoints.every))
    done = ElasticTraining(
        plan,
        spec,
        context,
        lambda running, left: replan(running, left, seed=spec.seed),
        on_event=show,
        before_segment=fault,
    ).run()
    return done, events


def steady_step_s(done: ElasticResult, every: int, start: int) -> float:
    """The median step time from step ``start`` on, each segment's first step (its stage build) left out."""
    times = [t for k, t in enumerate(done.result.step_times_s) if k >= start and k % every != 0]
    return statistics.median(times) if times else float("nan")


def felt_cut(done: ElasticResult, device: str, every: int, at: int) -> str:
    """How much slower ``device``'s compute was in the segment after step ``at`` than in the one before (each
    segment's first step left out): on loaded shared cores a quota cut slows a rank only as far as the quota, not the
    contention, held it back."""
    compute = done.result.device_compute_s.get(device, [])
    before = [t for k, t in enumerate(compute[at - every : at]) if k > 0]
    after = [t for k, t in enumerate(compute[at : at + every]) if k > 0]
    if not before or not after:
        return "not measured"
    ratio = statistics.median(after) / statistics.median(before)
    return f"{statistics.median(before) * 1e3:.1f} -> {statistics.median(after) * 1e3:.1f} ms ({ratio:.2f}x)"


def describe(done: ElasticResult) -> str:
    spans = "; ".join(
        f"from step {s.start}: {' | '.join('+'.join(g) for g in s.plan.stage_devices)} (est. {s.estimated_step_s:.3f} s)"
        for s in done.spans
    )
    state = "ok" if done.result.ok else f"FAILED: {done.result.error}"
    return f"{done.steps_done}/{done.total_steps} steps, {done.wall_s:.1f} s wall, {state}; plans: {spans}"


def bench(args: argparse.Namespace, work: Path) -> None:
    emulated = load_cluster(args.cluster)
    testbed: Cluster = up(
        args.cluster, work / "testbed.yaml", prefix=NAME, subnet=SUBNET, log=lambda line: print(f"  {line}")
    )
    layout = plan_testbed(emulated, sorted(os.sched_getaffinity(0)), SUBNET, NAME)
    cgroups = Cgroups.find()
    assert cgroups is not None
    library = ProfileCache().cluster_libraries(args.model, args.batch_size, emulated)
    calibration = (
        Calibration()
        if args.no_calibrate
        else calibrate(testbed, library, log=lambda line: print(f"  calibration: {line}"))
    )
    context = CostContext(library, testbed, calibration)
    started = time.perf_counter()
    plan = get_planner("tapp", batch_size=args.batch_size, schedules=("1f1b",), rounds=60, time_limit_s=30.0).plan(
        context
    )
    print(
        f"TAPP's plan ({time.perf_counter() - started:.0f} s): {plan.stage_devices}, est. {plan.notes['estimated_step_time_s']:.3f} s"
    )
    dataset, data_dir = find_dataset() or ("synthetic", None)
    spec = RunSpec.of(
        args.model,
        dataset=dataset,
        data_dir=data_dir,
        epochs=1,
        steps_per_epoch=args.steps,
        test_samples=256,
        checkpoints=CheckpointOptions(str(work), args.every),
    )
    print(
        f"{args.steps} steps of {args.model} at batch {args.batch_size} on {dataset}, a checkpoint every {args.every}"
    )
    print(f"load average at the start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    quiet, quiet_events = run_case("3 nothing", (plan, context), spec, work / "case3", no_fault)
    print(f"case 3 (nothing done): {describe(quiet)}")
    print(
        f"  median step {steady_step_s(quiet, args.every, 0):.3f} s; moves: {sum(e.kind == MIGRATED for e in quiet_events)}"
    )

    slow_host = layout.host_of(args.slow)
    slowed, slow_events = run_case(
        "2 slow",
        (plan, context),
        spec,
        work / "case2",
        once_at(args.at, lambda: print(f"  [2 slow] step {args.at}: {cut_quota(cgroups, slow_host.cgroup, 1 / 3)}")),
    )
    cut_quota(cgroups, slow_host.cgroup, 3.0)  # back as it was, for case 1
    print(f"case 2 (host of {args.slow} cut to a third at step {args.at}): {describe(slowed)}")
    print(
        f"  {args.slow}'s compute per step, the segment before the cut and after: {felt_cut(slowed, args.slow, args.every, args.at)}"
    )
    seen = [e for e in slow_events if e.kind == SLOW and e.step >= args.at]
    if seen:  # the plan is made again when the device is seen slow; the move follows only when it pays
        print(
            f"  seen slow and re-planned at step {seen[0].step}: {seen[0].step - args.at} steps after the cut "
            f"(bar <= {REPLAN_BAR_STEPS}: {seen[0].step - args.at <= REPLAN_BAR_STEPS})"
        )
    else:
        print(f"  not seen slow (bar: re-planned within {REPLAN_BAR_STEPS} steps: False)")
    moves = [e for e in slow_events if e.kind == MIGRATED]
    if moves:
        moved = moves[0]
        after = steady_step_s(slowed, args.every, moved.step)
        estimated = moved.values["new_step_s"]
        error = after / estimated - 1
        print(
            f"  moved at step {moved.step}; step after the move {after:.3f} s against the new plan's estimate "
            f"{estimated:.3f} s: {error:+.1%} (bar within {ESTIMATE_BAR:.0%}: {abs(error) <= ESTIMATE_BAR})"
        )
    else:
        print("  no move (the estimated gain did not pay for a move, or nothing was seen)")
    print(
        f"  median step {steady_step_s(slowed, args.every, 0):.3f} s over the run (case 3: "
        f"{steady_step_s(quiet, args.every, 0):.3f} s)"
    )

    kill_host_of = layout.host_of(args.kill)

    def kill_now() -> None:
        print(f"  [1 kill] step {args.at}: {kill_host(kill_host_of.namespace)}", flush=True)

    killed, kill_events = run_case("1 kill", (plan, context), spec, work / "case1", once_at(args.at, kill_now))
    print(f"case 1 (host of {args.kill} killed at step {args.at}, as its segment starts): {describe(killed)}")
    lost = [e for e in kill_events if e.kind == LOST]
    steps_lost = sum(e.steps_lost for e in lost)
    print(
        f"  steps lost {steps_lost} (bar <= {args.every}: {bool(lost) and steps_lost <= args.every}); "
        f"completed: {killed.result.ok and killed.steps_done == killed.total_steps}"
    )
    print(
        f"  wall {killed.wall_s:.1f} s against {quiet.wall_s:.1f} s uninterrupted ({killed.wall_s / quiet.wall_s:.2f}x)"
    )
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="hetero4")
    parser.add_argument("--model", default="tiny_cnn")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--at", type=int, default=30)
    parser.add_argument("--kill", default="cpu1", help="the device whose host is killed (case 1)")
    parser.add_argument("--slow", default="cpu0", help="the device whose host is slowed (case 2)")
    parser.add_argument("--no-calibrate", action="store_true", help="cost with the ideal calibration")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tapp-bench-elastic-") as work:
        try:
            bench(args, Path(work))
        finally:
            down(NAME, state_folder(NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
