"""Gradient reductions overlapped with the backward pass (issue 24): bucketed against allreduce-after-backward.

    .venv/bin/python bench/bucket_overlap.py [--cluster local] [--models alexnet vgg16] [--rounds 7]

For each model, plans whose stages run on several devices (BSP with shares by speed; the features data-parallel on
the two slower devices feeding the classifier on the fastest) run twice: as planned, their gradients reduced in
buckets that start during the step's last backward (``tapp_core.plan.program``), and with ``bucket_bytes`` 0, one
reduction after the whole backward (how the runtime reduced before). The pairs are raced in interleaved rounds on
the cluster's workers (``tapp_core.runtime.pool_race``: medians with their intervals); beside each, the cost model's
estimate of the same program. The last lines: each pair's measured and estimated gain; bar: bucketed is no slower
(its interval's low end is not above the other's high end).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.plan.placement import normalized_shares  # noqa: E402
from tapp_core.plan.plan import Plan, single_stage_plan  # noqa: E402
from tapp_core.planners.stage_costs import relative_speeds  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.profile.library import LayerLibrary, load_libraries  # noqa: E402

LIBRARIES = ROOT / "bench" / "libraries"


def replicated_plans(library: LayerLibrary, cluster: Cluster) -> dict[str, Plan]:
    speeds = relative_speeds(CostContext(library, cluster))
    ranked = sorted(cluster.device_names, key=lambda d: -speeds[d])
    bsp = single_stage_plan(library, ranked, planner="bsp")
    plans = {"BSP": dataclasses.replace(bsp, stage_shares=(normalized_shares([speeds[d] for d in ranked]),))}
    cut = next(x.index for x in library.layers if x.op == "flatten") + 1
    slow = tuple(ranked[1:])
    plans["features on the slower devices"] = Plan(
        library.model,
        library.batch_size,
        2,
        "1f1b",
        tuple(int(x.index >= cut) for x in library.layers),
        (slow, (ranked[0],)),
        stage_shares=(normalized_shares([speeds[d] for d in slow]), (1.0,)),
    )
    return plans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--models", nargs="+", default=["alexnet", "vgg16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from tapp_core.measure.races import RaceOptions, RoundSteps
    from tapp_core.runtime import WorkerPool
    from tapp_core.runtime.pool_race import race

    cluster = load_cluster(args.cluster)
    verdicts = []
    for model in args.models:
        library = load_libraries(LIBRARIES / f"{model}_b64")
        pairs = {
            name: (plan, dataclasses.replace(plan, bucket_bytes=0))
            for name, plan in replicated_plans(library, cluster).items()
        }
        plans = [p for pair in pairs.values() for p in pair]
        options = RaceOptions(min_rounds=args.rounds, max_rounds=args.rounds, eliminate=False, budget_s=3600)
        with WorkerPool(cluster) as pool:
            pool.prepare(model)
            result = race(pool, plans, model, options, RoundSteps(steps=args.steps, warmup=1))
        print(f"\n{model} on {cluster.name}: {result.rounds} interleaved rounds of {args.steps} steps")
        for name, (bucketed, after) in pairs.items():
            got = {}
            for label, plan in (("bucketed", bucketed), ("after backward", after)):
                m = result.measurement(plan.id)
                predicted = estimate(plan, CostContext(library, cluster)).step_time_s
                got[label] = (m, predicted)
                print(
                    f"  {name:32s} {label:15s} measured {m.step_time_s:.4f} s [{m.interval_low_s:.4f}, "
                    f"{m.interval_high_s:.4f}]  estimated {predicted:.4f} s"
                )
            (mb, eb), (ma, ea) = got["bucketed"], got["after backward"]
            no_slower = mb.interval_low_s <= ma.interval_high_s
            verdicts.append(no_slower)
            print(
                f"  {name:32s} gain of buckets: measured {ma.step_time_s / mb.step_time_s - 1:+.1%}, "
                f"estimated {ea / eb - 1:+.1%}; bucketed no slower: {no_slower}"
            )
    print(f"\nbar: bucketed is no slower on every plan: {all(verdicts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
