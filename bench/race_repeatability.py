"""Is a race's verdict repeatable? The same plans raced in several independent races (bar: the same winner, or the
same best group, in at least 4 of 5).

    .venv/bin/python bench/race_repeatability.py [--model alexnet --cluster local --races 5]
    .venv/bin/python bench/race_repeatability.py --planners single pipetorch pipedream even

The plans are those the named planners choose (the default experiment's baselines; identical plans are kept once,
and further planners fill in until there are ``--plans`` distinct ones). Each race is the flow's evaluation race
(``tasks.measure.EVALUATION_RACE``, rounds of ``RuntimeSettings``' steps) with its own order seed, on one worker
pool. Printed per race: the winner, the best group, the rounds, why it stopped, its time and the host's load.
Run it on a quiet host: the figures are only as good as the load allows (the load average is printed).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.calibration import cluster_calibration  # noqa: E402
from tapp_core.cost.checks import validate  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.measure.races import RaceResult  # noqa: E402
from tapp_core.plan.plan import Plan  # noqa: E402
from tapp_core.planners import get_planner  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.profile.cache import ProfileCache  # noqa: E402
from tapp_core.runtime import WorkerPool  # noqa: E402
from tapp_core.runtime.pool_race import race  # noqa: E402
from tasks.measure import RuntimeSettings  # noqa: E402

BAR = 4
FILL_IN = ("single", "pipetorch", "pipedream", "autoddl", "even", "bsp")


def layout(plan: Plan) -> str:
    return " | ".join("+".join(d) for d in plan.stage_devices) + f" (m={plan.micro_batches})"


def choose_plans(model: str, cluster: Cluster, batch_size: int, planners: list[str], count: int) -> list[Plan]:
    """The plans of ``planners``, then of ``FILL_IN``, until ``count`` distinct ones that fit."""
    library = ProfileCache().cluster_libraries(model, batch_size, cluster)
    calibration = cluster_calibration(cluster.name, cluster, library)  # `tapp calibrate`'s, else the ideal one
    chosen: dict[str, Plan] = {}
    for name in [*planners, *(p for p in FILL_IN if p not in planners)]:
        if len(chosen) >= count:
            break
        context = CostContext(library, cluster, calibration)
        plan = get_planner(name, batch_size=batch_size).plan(context)
        validate(plan, context)
        chosen.setdefault(plan.id, dataclasses.replace(plan, planner=name))
    return list(chosen.values())


def describe(result: RaceResult, names: dict[str, str]) -> str:
    winner = result.winner()
    group = ", ".join(names[p.id] for p in result.best_group())
    medians = ", ".join(
        f"{names[p.id]} {m.step_time_s:.3f} [{m.interval_low_s:.3f}, {m.interval_high_s:.3f}]"
        if m.ok
        else f"{names[p.id]} failed"
        for p, m in zip(result.plans, result.measurements, strict=True)
    )
    return (
        f"winner {names[winner.id] if winner else '-'}; best group {{{group}}}; {result.rounds} rounds ({result.stop}), "
        f"{result.elapsed_s:.0f} s; load {result.load_before:.2f} -> {result.load_after:.2f}"
        f"{' OVERLOADED' if result.overloaded else ''}\n      {medians}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--planners", nargs="+", default=["single", "pipetorch", "pipedream", "even"])
    parser.add_argument("--plans", type=int, default=4)
    parser.add_argument("--races", type=int, default=5)
    args = parser.parse_args()

    cluster = load_cluster(args.cluster)
    plans = choose_plans(args.model, cluster, args.batch_size, args.planners, args.plans)
    names = {p.id: p.planner for p in plans}
    settings = RuntimeSettings()
    print(f"{len(plans)} plans of {args.model} on {cluster.name}, raced {args.races} times:")
    for plan in plans:
        print(f"  {plan.planner:<10} {plan.id}  {layout(plan)}")
    print(f"race: {settings.race}; rounds of {settings.steps} steps ({settings.warmup} warm-up)")
    results = []
    started = time.perf_counter()
    with WorkerPool(cluster) as pool:
        pool.prepare(args.model)
        for index in range(args.races):
            options = dataclasses.replace(settings.race, seed=index)
            results.append(race(pool, plans, args.model, options, settings.round_steps()))
            print(f"race {index + 1}: {describe(results[-1], names)}", flush=True)
    winners = collections.Counter(r.winner().id if r.winner() else "" for r in results)
    groups = collections.Counter(frozenset(p.id for p in r.best_group()) for r in results)
    (top_winner, same_winner), (top_group, same_group) = winners.most_common(1)[0], groups.most_common(1)[0]
    print(f"same winner ({names.get(top_winner, '-')}) in {same_winner} of {len(results)} races")
    group_names = ", ".join(sorted(names[i] for i in top_group))
    print(f"same best group ({{{group_names}}}) in {same_group} of {len(results)} races")
    same = max(same_winner, same_group)
    needed = BAR * len(results) / 5
    verdict = "PASS" if same >= needed else "FAIL"
    print(f"{verdict} the same winner or best group in {same} of {len(results)} races (bar: >= {needed:g})")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
