"""The cost model on a real heterogeneous cluster: the testbed (``tapp testbed up``) against the emulation.

    sudo .venv/bin/python bench/testbed.py --cluster local [--model alexnet] [--batch-size 64]
        [--rounds 5] [--steps 3] [--tapp-rounds 30] [--repeats 7] [--own-profile]

For the cluster file given (emulated), the bench

1. makes its testbed (hosts as namespaces with their own sshd, CPU quotas, shaped links; name ``tappbn``, subnet
   ``10.214.0.0/24``) and measures its links with ``tapp cluster detect --cluster``'s ping-pong: each pair's
   detected bandwidth against the file's (bar: within 15 %);
2. profiles the model once on this machine (the profile cache; one library per kind), and calibrates both
   clusters with ``tapp calibrate``'s code (kept in memory, nothing is written beside the cluster files);
3. plans with every planner on the testbed's cluster file (and each device alone), then races the distinct plans
   on the testbed (emulation off: ``rounds`` interleaved rounds of a warm-up and ``steps`` timed steps) and the same
   plans on the emulated cluster (the emulation on);
4. prints every plan's measured median, the cost model's estimate and its error on both, the median and worst
   absolute error of the planners' plans on each (bars on the testbed: median <= 15 %, worst <= 35 %), and each
   quota-limited device's step alone against its speed ratio (bar: within 15 %);
5. with ``--own-profile``, profiles the model again inside every quota-limited host (under its quota) and prints
   that library's whole-model time beside the one-thread library scaled by the device's speed and the measured
   step alone: the figures behind costing a quota-limited CPU from the one-thread library;
6. takes the testbed down, whatever happened. The last line is the testbed's median error in %.

Needs root, network namespaces, a cpu cgroup controller and sshd (``tapp testbed up`` says what is missing).
Run it on a quiet machine (under the project's lock on a shared one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.calibration import Calibration  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.measure.races import RaceOptions, RoundSteps  # noqa: E402
from tapp_core.plan.plan import Plan, single_stage_plan  # noqa: E402
from tapp_core.planners import PlannerError, get_planner  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.platform.testbed import down, state_folder, up  # noqa: E402
from tapp_core.profile.cache import ProfileCache  # noqa: E402
from tapp_core.profile.library import LayerLibrary  # noqa: E402
from tapp_core.runtime import WorkerPool  # noqa: E402
from tapp_core.runtime.calibrator import calibrate  # noqa: E402
from tapp_core.runtime.detect import measure_cluster_links  # noqa: E402
from tapp_core.runtime.pool_race import race  # noqa: E402

PLANNERS = ("single", "bsp", "even", "pipetorch", "pipedream", "autoddl", "tapp")
ALONE = "alone on "
NAME = "tappbn"
SUBNET = "10.214.0.0/24"
BANDWIDTH_BAR = 0.15
QUOTA_BAR = 0.15
MEDIAN_BAR = 0.15
WORST_BAR = 0.35


def plans_of(library: LayerLibrary, cluster: Cluster, calibration: Calibration, batch: int, rounds: int) -> list[Plan]:
    """Each device alone, then every planner's plan on ``cluster``; one of each that runs the same, named (its
    ``planner``) by every planner that chose it and by the device it runs alone on."""
    plans: dict[str, Plan] = {}
    names: dict[str, list[str]] = {}
    for device in cluster.device_names:
        plan = single_stage_plan(library, [device], batch_size=batch)
        plans.setdefault(plan.execution_id, plan)
        names.setdefault(plan.execution_id, []).append(f"{ALONE}{device}")
    for name in PLANNERS:
        options: dict[str, object] = {"batch_size": batch, "seed": 0, **({"rounds": rounds} if name == "tapp" else {})}
        try:
            plan = get_planner(name, **options).plan(CostContext(library, cluster, calibration))
        except PlannerError as exc:
            print(f"{name}: no plan: {exc}")
            continue
        plans.setdefault(plan.execution_id, plan)
        names.setdefault(plan.execution_id, []).append(name)
    return [dataclasses.replace(plan, planner=",".join(names[key])) for key, plan in plans.items()]


def by_planner(plan: Plan) -> bool:
    """Whether a planner chose ``plan`` (not only a device alone)."""
    return any(not name.startswith(ALONE) for name in (plan.planner or "").split(","))


def alone_on(plans: list[Plan], measured: list[float]) -> dict[str, float]:
    """Each device's step alone, by device."""
    found = {}
    for plan, step in zip(plans, measured, strict=True):
        for name in (plan.planner or "").split(","):
            if name.startswith(ALONE):
                found[name.removeprefix(ALONE)] = step
    return found


def raced(cluster: Cluster, plans: list[Plan], model: str, rounds: int, steps: int) -> list[float]:
    """Every plan's median over ``rounds`` interleaved rounds on ``cluster``'s pool (none dropped)."""
    options = RaceOptions(min_rounds=rounds, max_rounds=rounds, budget_s=3600.0, eliminate=False)
    with WorkerPool(cluster) as pool:
        pool.prepare(model)
        result = race(pool, plans, model, options, RoundSteps(steps=steps, warmup=1, timeout_s=600.0))
    failed = [f"{p.planner}: {m.error}" for p, m in zip(result.plans, result.measurements, strict=True) if not m.ok]
    if failed:
        raise SystemExit(f"on {cluster.name}, plans failed: " + "; ".join(failed))
    by_id = {p.id: m.step_time_s for p, m in zip(result.plans, result.measurements, strict=True)}
    print(f"  {cluster.name}: {result.rounds} rounds, load {result.load_before:.2f} -> {result.load_after:.2f}")
    return [by_id[p.id] for p in plans]


def detected_links(testbed: Cluster, repeats: int) -> list[float]:
    """Each pair's detected bandwidth against the file's (relative errors), printed."""
    _, pairs = measure_cluster_links(testbed, repeats)
    errors = []
    for pair in pairs:
        said = testbed.link(*pair.between).bandwidth
        errors.append(pair.bandwidth_bytes_per_s / said - 1)
        print(
            f"  {pair.between[0]} <-> {pair.between[1]}: detected {pair.bandwidth_bytes_per_s * 8 / 1e6:8.1f} Mbit/s, "
            f"file {said * 8 / 1e6:8.1f} Mbit/s ({errors[-1]:+.1%}); latency {pair.latency_s * 1e6:.0f} us"
        )
    return errors


def quota_errors(testbed: Cluster, plans: list[Plan], measured: list[float]) -> dict[str, float]:
    """Per quota-limited device: its step alone over the fastest device's, against the inverse ratio of speeds."""
    alone = alone_on(plans, measured)
    fastest = max(testbed.devices, key=lambda d: d.speed)
    errors = {}
    for device in testbed.devices:
        if device.speed >= fastest.speed or device.name not in alone:
            continue
        ratio, expected = alone[device.name] / alone[fastest.name], fastest.speed / device.speed
        errors[device.name] = ratio / expected - 1
        print(
            f"  {device.name}: alone {alone[device.name]:.3f} s, {ratio:.2f}x {fastest.name}'s; speed ratio "
            f"{expected:.2f}x ({errors[device.name]:+.1%})"
        )
    return errors


def own_profiles(testbed: Cluster, library: LayerLibrary, plans: list[Plan], measured: list[float]) -> None:
    """Profile the model inside every quota-limited host; its whole-model time against the scaled library's."""
    alone = alone_on(plans, measured)
    fastest = max(d.speed for d in testbed.devices)
    for device in testbed.devices:
        if device.speed >= fastest or device.host is None or testbed.ssh is None:
            continue
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); from tapp_core.profile.profiler import ProfileRequest, profile_model; "
            "print(profile_model(ProfileRequest(sys.argv[2], int(sys.argv[3]), threads=1)).whole_model_s)"
        )
        remote = [sys.executable, "-c", f'"{code}"', str(ROOT), library.model, str(library.batch_size)]
        done = subprocess.run([testbed.ssh, device.host, *remote], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"  {device.name}: profiling under its quota failed: {done.stderr.strip()[-300:]}")
            continue
        own = float(done.stdout.split()[-1])
        scaled = library.whole_model_s / device.speed
        step = alone.get(device.name, float("nan"))
        print(
            f"  {device.name} (speed {device.speed:.3f}): layers' sum, profiled under its quota {own:.3f} s; "
            f"one-thread library / speed {scaled:.3f} s; measured step alone {step:.3f} s"
        )


def report(
    plans: list[Plan], runs: dict[str, tuple[list[float], Cluster, Calibration]], library: LayerLibrary
) -> dict[str, list[float]]:
    """The table of every plan on every cluster; the absolute errors of the planners' plans per cluster."""
    errors: dict[str, list[float]] = {name: [] for name in runs}
    print(f"\n{'chosen by':32s} {'layout':30s}" + "".join(f" {name + ': measured, est., error':>38s}" for name in runs))
    for index, plan in enumerate(plans):
        layout = " | ".join("+".join(d) for d in plan.stage_devices) + f" m={plan.micro_batches}"
        cells = []
        for name, (measured, cluster, calibration) in runs.items():
            predicted = estimate(plan, CostContext(library, cluster, calibration)).step_time_s
            error = (predicted - measured[index]) / measured[index]
            if by_planner(plan):
                errors[name].append(abs(error))
            cells.append(f" {measured[index]:14.4f} {predicted:11.4f} {error:+11.1%}")
        print(f"{plan.planner or '':32s} {layout:30s}" + "".join(cells))
    return errors


def bench(args: argparse.Namespace, work: Path) -> float:
    emulated = load_cluster(args.cluster)
    testbed = up(args.cluster, work / "testbed.yaml", prefix=NAME, subnet=SUBNET, log=lambda line: print(f"  {line}"))
    print(f"detected links of the testbed ({args.repeats} round trips per size):")
    links = detected_links(testbed, args.repeats)
    library = ProfileCache().cluster_libraries(args.model, args.batch_size, emulated)
    calibrations = {
        "testbed": calibrate(testbed, library, log=lambda line: print(f"  testbed calibration: {line}")),
        "emulated": calibrate(emulated, library, log=lambda line: print(f"  emulated calibration: {line}")),
    }
    plans = plans_of(library, testbed, calibrations["testbed"], args.batch_size, args.tapp_rounds)
    print(f"{len(plans)} distinct plans; racing them {args.rounds} rounds of 1 + {args.steps} steps on each cluster")
    runs = {
        "testbed": (raced(testbed, plans, args.model, args.rounds, args.steps), testbed, calibrations["testbed"]),
        "emulated": (raced(emulated, plans, args.model, args.rounds, args.steps), emulated, calibrations["emulated"]),
    }
    errors = report(plans, runs, library)
    print("\nquota-limited devices alone on the testbed, against their speed ratio:")
    quotas = quota_errors(testbed, plans, runs["testbed"][0])
    if args.own_profile:
        print("a quota-limited device costed from its own profile or from the one-thread library:")
        own_profiles(testbed, library, plans, runs["testbed"][0])
    print()
    for name, found in errors.items():
        print(
            f"{name:9s}: median |error| {statistics.median(found):6.1%}, worst {max(found):6.1%} over {len(found)} plans"
        )
    median, worst = statistics.median(errors["testbed"]), max(errors["testbed"])
    print(
        f"bar: testbed median |error| <= {MEDIAN_BAR:.0%}: {median <= MEDIAN_BAR}; worst <= {WORST_BAR:.0%}: {worst <= WORST_BAR}"
    )
    print(f"bar: detected bandwidths within {BANDWIDTH_BAR:.0%}: {all(abs(e) <= BANDWIDTH_BAR for e in links)}")
    print(
        f"bar: devices alone within {QUOTA_BAR:.0%} of their speed ratio: {all(abs(e) <= QUOTA_BAR for e in quotas.values())}"
    )
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return median


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tapp-rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7, help="ping-pong round trips per message size")
    parser.add_argument("--own-profile", action="store_true", help="also profile inside every quota-limited host")
    args = parser.parse_args()
    print(f"cluster {args.cluster}; load average at the start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="tapp-bench-testbed-") as work:
        try:
            median = bench(args, Path(work))
        finally:
            down(NAME, state_folder(NAME))
    print(f"{median * 100:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
