"""TAPP against its strongest peer, measured on real hosts: every method's plan raced on the testbed of clusters of
four and more devices, for AlexNet, VGG-16 and Inception-V3.

    sudo .venv/bin/python bench/peers_testbed.py [--clusters hetero4 hetero6] [--models alexnet vgg16 inception_v3]
        [--batch-size 64] [--rounds 5] [--steps 3] [--tapp-rounds 30]

For each cluster file the bench makes its testbed (``tapp testbed up``'s code: hosts as namespaces with their own
sshd, CPU quotas, shaped links; name ``tapppr``, subnet ``10.219.0.0/24``), and for each model it profiles (the
profile cache), calibrates the testbed (``tapp calibrate``'s code, in memory), plans with every method of the
registry (the oracle stopped at TAPP's time limit, as in an experiment), and races the distinct plans on the
testbed's ranks: ``rounds`` interleaved rounds of a warm-up and ``steps`` timed steps, none dropped. A plan that
several methods chose runs once, under all their names.

Each cell (cluster, model) prints every plan's median and interval and its estimate, the best group (the plans whose interval
overlaps the best's), and TAPP's ratio to its best peer: the method other than TAPP and ``tapp-rl`` with the lowest
median, as the median of the per-round ratios with its interval (``RaceResult.ratio``). TAPP is ahead when that
interval lies below 1, behind when above, and otherwise tied within the noise; "same plan" when the peer chose
TAPP's plan. The last line counts the cells where TAPP is ahead beyond the noise.

Needs root, network namespaces, a cpu cgroup controller and sshd. Each race is one sample of this machine: run it
on a quiet one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.calibration import Calibration  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.measure.races import RaceOptions, RaceResult, RoundSteps  # noqa: E402
from tapp_core.measure.stats import Interval  # noqa: E402
from tapp_core.plan.plan import Plan, plan_execution_id  # noqa: E402
from tapp_core.planners import PLANNER_NAMES, PlannerError, get_planner  # noqa: E402
from tapp_core.planners.tapp.options import DEFAULT_TIME_LIMIT_S  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.platform.testbed import down, state_folder, up  # noqa: E402
from tapp_core.profile.cache import ProfileCache  # noqa: E402
from tapp_core.profile.library import LayerLibrary  # noqa: E402
from tapp_core.runtime import WorkerPool  # noqa: E402
from tapp_core.runtime.calibrator import calibrate  # noqa: E402
from tapp_core.runtime.pool_race import race  # noqa: E402

NAME = "tapppr"
SUBNET = "10.219.0.0/24"
OURS = ("tapp", "tapp-rl")
"""TAPP and the paper's RL alone: not TAPP's peers."""
CPU_METHODS = tuple(name for name in PLANNER_NAMES if name != "single-gpu")


@dataclass(frozen=True)
class Cell:
    """One (cluster, model): its race, and each method's plan id in it."""

    cluster: str
    model: str
    result: RaceResult
    chosen: dict[str, str]
    estimated: dict[str, float]
    """Each plan's step time by the cost model (the testbed calibrated), by plan id."""

    def plan_of(self, method: str) -> Plan | None:
        plan_id = self.chosen.get(method)
        return next((p for p in self.result.plans if p.id == plan_id), None)

    def best_peer(self) -> str | None:
        """The method, other than TAPP's, whose plan measured the lowest median."""
        medians = {
            method: self.result.measurement(plan_id).step_time_s
            for method, plan_id in self.chosen.items()
            if method not in OURS and self.result.measurement(plan_id).ok
        }
        return min(medians, key=lambda m: medians[m]) if medians else None

    def verdict(self) -> tuple[str, Interval | None]:
        """TAPP against its best peer: ("ahead" | "behind" | "within noise" | "same plan" | "no result", ratio)."""
        peer = self.best_peer()
        if peer is None or "tapp" not in self.chosen:
            return "no result", None
        if self.chosen[peer] == self.chosen["tapp"]:
            return "same plan", None
        ratio = self.result.ratio(self.chosen["tapp"], self.chosen[peer])
        if ratio is None:
            return "no result", None
        if ratio.high < 1.0:
            return "ahead", ratio
        if ratio.low > 1.0:
            return "behind", ratio
        return "within noise", ratio


def methods_plans(context: CostContext, batch: int, tapp_rounds: int) -> tuple[list[Plan], dict[str, str]]:
    """The distinct plans of every CPU method, each named by the methods that chose it; each method's plan id."""
    plans: dict[str, Plan] = {}
    names: dict[str, list[str]] = {}
    for method in CPU_METHODS:
        options: dict[str, object] = {"batch_size": batch, "seed": 0}
        if method in OURS:
            options["rounds"] = tapp_rounds
        if method == "oracle":  # as in an experiment: unproved past TAPP's time limit (6 hosts of Inception-V3: hours)
            options["time_limit_s"] = DEFAULT_TIME_LIMIT_S
        started = time.perf_counter()
        try:
            plan = get_planner(method, **options).plan(context)
        except PlannerError as exc:
            print(f"  {method}: no plan: {exc}")
            continue
        print(f"  {method}: planned in {time.perf_counter() - started:.0f} s: {layout(plan)}")
        key = plan_execution_id(plan)
        plans.setdefault(key, plan)
        names.setdefault(key, []).append(method)
    named = {key: dataclasses.replace(plan, planner=",".join(names[key])) for key, plan in plans.items()}
    chosen = {method: named[key].id for key, methods in names.items() for method in methods}
    return list(named.values()), chosen


def layout(plan: Plan) -> str:
    return " | ".join("+".join(d) for d in plan.stage_devices) + f", m={plan.micro_batches}, {plan.schedule}"


def run_cell(testbed: Cluster, emulated: Cluster, model: str, args: argparse.Namespace) -> Cell:
    library: LayerLibrary = ProfileCache().cluster_libraries(model, args.batch_size, emulated)
    calibration: Calibration = calibrate(testbed, library, log=lambda line: print(f"  calibration: {line}"))
    context = CostContext(library, testbed, calibration)
    plans, chosen = methods_plans(context, args.batch_size, args.tapp_rounds)
    print(f"  {len(plans)} distinct plans; racing them {args.rounds} rounds of 1 + {args.steps} steps")
    options = RaceOptions(min_rounds=args.rounds, max_rounds=args.rounds, budget_s=7200.0, eliminate=False)
    with WorkerPool(testbed) as pool:
        pool.prepare(model)
        result = race(pool, plans, model, options, RoundSteps(steps=args.steps, warmup=1, timeout_s=900.0))
    print(
        f"  {result.rounds} rounds in {result.elapsed_s:.0f} s, load {result.load_before:.2f} -> {result.load_after:.2f}"
    )
    return Cell(testbed.name, model, result, chosen, {p.id: estimate(p, context).step_time_s for p in plans})


def print_cell(cell: Cell) -> None:
    group = {p.id for p in cell.result.best_group()}
    print(f"\n{cell.cluster} / {cell.model}:")
    for plan, measured in zip(cell.result.plans, cell.result.measurements, strict=True):
        interval = measured.interval
        figure = f"{interval.median:.4f} s [{interval.low:.4f}, {interval.high:.4f}]" if interval else measured.error
        mark = "*" if plan.id in group else " "
        print(f"  {mark} {plan.planner or '':34s} {layout(plan):44s} {figure}  est. {cell.estimated[plan.id]:.4f} s")
    verdict, ratio = cell.verdict()
    peer = cell.best_peer()
    ratio_text = f"{ratio.median:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]" if ratio else "-"
    print(f"  TAPP / best peer ({peer}): {ratio_text}: {verdict}   (* the best group)")


def summary(cells: list[Cell]) -> None:
    print(f"\n{'cluster':9s} {'model':13s} {'best peer':12s} {'TAPP / best peer':26s} verdict")
    for cell in cells:
        verdict, ratio = cell.verdict()
        ratio_text = f"{ratio.median:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]" if ratio else "1 (same plan)"
        print(f"{cell.cluster:9s} {cell.model:13s} {cell.best_peer() or '-':12s} {ratio_text:26s} {verdict}")
    ahead = sum(cell.verdict()[0] == "ahead" for cell in cells)
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"cells where TAPP is ahead of its best peer beyond the noise: {ahead} of {len(cells)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", nargs="+", default=["hetero4", "hetero6"])
    parser.add_argument("--models", nargs="+", default=["alexnet", "vgg16", "inception_v3"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tapp-rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"load average at the start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cells = []
    for name in args.clusters:
        emulated = load_cluster(name)
        with tempfile.TemporaryDirectory(prefix="tapp-bench-peers-") as work:
            try:
                testbed = up(
                    name, Path(work) / "testbed.yaml", prefix=NAME, subnet=SUBNET, log=lambda x: print(f"  {x}")
                )
                for model in args.models:
                    print(f"{name} / {model}:")
                    cells.append(run_cell(testbed, emulated, model, args))
                    print_cell(cells[-1])
            finally:
                down(NAME, state_folder(NAME))
    summary(cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
