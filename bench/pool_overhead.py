"""What a worker pool costs per plan beyond the plan's own measured steps (bar: < 0.5 s).

    .venv/bin/python bench/pool_overhead.py [--model alexnet --cluster local --plans 10]

One pool measures plan after plan (different cuts and schedules of one model, as a search would). For each, the
overhead is the wall time of ``pool.measure`` minus the sum of its measured step times (warm-up steps included):
job hand-out, communicators, stage building, result gathering and the reply. The first plan also builds and
traces the model on every rank; it is shown apart.

Around the plans, what the pool costs its host's cores (which on a small host the planner and other pools share):
the CPU its ranks used to start, their CPU share while the pool waits ``--idle-s`` seconds between jobs, and the
wall time of its close (Linux: read from ``/proc``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.model.graph import layer_nodes  # noqa: E402
from tapp_core.model.zoo import build_traced_model  # noqa: E402
from tapp_core.plan.plan import Plan  # noqa: E402
from tapp_core.platform.cluster import load_cluster  # noqa: E402
from tapp_core.platform.hosts import process_cpu_s  # noqa: E402
from tapp_core.runtime import WorkerPool  # noqa: E402


def plans(model: str, cluster_devices: tuple[str, ...], batch_size: int, count: int) -> list[Plan]:
    n_layers = len(layer_nodes(build_traced_model(model)))
    schedules = itertools.cycle(("gpipe", "1f1b", "async"))
    result = []
    for i in range(count):
        stages = 2 + i % (len(cluster_devices) - 1) if len(cluster_devices) > 2 else 2
        # Cuts spread over the layers and shifted per plan, so that each plan is a new split.
        cuts = [max(1, min(n_layers - 1, (n_layers * s) // stages + (i % 3) - 1)) for s in range(1, stages)]
        stage_of_layer = tuple(sum(layer >= c for c in cuts) for layer in range(n_layers))
        devices = tuple((d,) for d in cluster_devices[:stages])
        result.append(Plan(model, batch_size, 4, next(schedules), stage_of_layer, devices))  # type: ignore[arg-type]
    return result


def ranks_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user and system) the processes ``pids`` have used so far (those gone count nothing)."""
    return sum(process_cpu_s(pid) or 0.0 for pid in pids)


def idle_share(pool: WorkerPool, seconds: float) -> float:
    """The ranks' CPU over ``seconds`` of waiting for a job, as a share of one core."""
    before = ranks_cpu_s(pool.rank_pids)
    time.sleep(seconds)
    return (ranks_cpu_s(pool.rank_pids) - before) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--plans", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=10.0)
    args = parser.parse_args()

    cluster = load_cluster(args.cluster)
    started = time.perf_counter()
    with WorkerPool(cluster) as pool:
        pool.start()
        print(
            f"pool of {len(cluster.devices)} ranks up in {time.perf_counter() - started:.2f} s (once per search), "
            f"its ranks' CPU {ranks_cpu_s(pool.rank_pids):.2f} s"
        )
        print(f"idle between jobs: its ranks use {100 * idle_share(pool, args.idle_s):.1f} % of a core")
        print(f"model {args.model} built and traced on every rank in {pool.prepare(args.model):.2f} s (once per model)")
        overheads = []
        for plan in plans(args.model, cluster.device_names, args.batch_size, args.plans):
            start = time.perf_counter()
            measurement = pool.measure(plan, steps=args.steps, warmup=1)
            wall = time.perf_counter() - start
            if not measurement.ok:
                print(f"plan {plan.id} failed: {measurement.error}")
                return 1
            steps = sum(measurement.step_times_s)
            overhead = wall - steps
            print(
                f"plan {plan.id} {plan.schedule:5s} {plan.n_stages} stages: wall {wall:6.3f} s, "
                f"steps {steps:6.3f} s, overhead {overhead:6.3f} s, setup on ranks {measurement.extra['setup_s']:.3f} s"
            )
            overheads.append(overhead)
        print(f"idle after the plans: its ranks use {100 * idle_share(pool, args.idle_s):.1f} % of a core")
        closing = time.perf_counter()
    print(f"pool closed in {time.perf_counter() - closing:.2f} s")
    print(
        f"overhead per plan beyond its measured steps: median {statistics.median(overheads):.3f} s, "
        f"max {max(overheads):.3f} s (bar < 0.5 s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
