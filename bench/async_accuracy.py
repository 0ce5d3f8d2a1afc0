"""Asynchronous (PipeDream/APapo, weight stashing) against synchronous pipeline training on real data.

    .venv/bin/python bench/async_accuracy.py [--model tiny_cnn --epochs 2 --batch-size 64 --micro-batches 1]
        [--stages 3] [--no-uncompensated]

Fashion-MNIST from Debian's dataset-fashion-mnist (padded to 3x32x32), the same model, seed, plan cut, epochs
and optimiser; only the schedule differs: 1f1b (trains exactly like one device), async with staleness 1, and async
at its default (as deep as the pipeline: with 3 stages and one micro-batch per step, a gradient meets weights up to
2 updates old). The async runs use the runtime's stale-gradient compensation (on by default: a stage with delay d
updates at lr / (d + 1) and runs its forwards on weights predicted d updates ahead, ``tapp_core.runtime.optim``);
unless ``--no-uncompensated``, each is run again without it (plain weight stashing),
marked ``(plain)``, to show what the compensation gains. Prints every test accuracy and the gaps to 1f1b last
(bar: the compensated async within 2 points, at staleness 1 and at the default).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.model.data import FASHION_MNIST_ROOT  # noqa: E402
from tapp_core.model.graph import layer_nodes  # noqa: E402
from tapp_core.model.zoo import build_traced_model  # noqa: E402
from tapp_core.plan.plan import Plan  # noqa: E402
from tapp_core.plan.schedules import parse_schedule_spec  # noqa: E402
from tapp_core.platform.cluster import parse_cluster  # noqa: E402
from tapp_core.runtime import OptimizerConfig, WorkerPool  # noqa: E402

SCHEDULES = ("1f1b", "async:1", "async")
PLAIN = " (plain)"
"""Marks an async run without the stale-gradient compensation."""


def split_by_parameter_layers(model: str, stages: int) -> tuple[int, ...]:
    """Contiguous stages with an equal share of the layers that have weights, so every stage trains (and every
    stage but the last runs ahead on stale weights under async)."""
    traced = build_traced_model(model)
    nodes = layer_nodes(traced)
    weighted = [
        i
        for i, node in enumerate(nodes)
        if node.op == "call_module" and any(True for _ in traced.get_submodule(str(node.target)).parameters())
    ]
    if len(weighted) < stages:
        raise SystemExit(f"{model} has {len(weighted)} layers with weights, fewer than {stages} stages")
    starts = [weighted[len(weighted) * s // stages] for s in range(1, stages)]
    return tuple(sum(i >= start for start in starts) for i in range(len(nodes)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_cnn")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--stages", type=int, default=3, choices=(2, 3, 4))
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--data-dir", default=FASHION_MNIST_ROOT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-uncompensated",
        dest="uncompensated",
        action="store_false",
        help="skip the async runs without stale-gradient compensation",
    )
    args = parser.parse_args()

    if not Path(args.data_dir).is_dir():
        print(f"{args.data_dir} is missing: apt-get install -y dataset-fashion-mnist", file=sys.stderr)
        return 2
    devices = [{"name": f"cpu{i}", "memory": "4GiB"} for i in range(args.stages)]
    cluster = parse_cluster(
        {
            "name": "async-bench",
            "emulated": False,
            "devices": devices,
            "links": {"bandwidth": "10Gbit/s", "latency": "0us"},
        }
    )
    stage_of_layer = split_by_parameter_layers(args.model, args.stages)
    optimizer = OptimizerConfig(lr=args.lr, momentum=args.momentum)
    runs = [(s, optimizer) for s in SCHEDULES]
    if args.uncompensated:
        plain = OptimizerConfig(lr=args.lr, momentum=args.momentum, stale_compensation=False)
        runs += [(s + PLAIN, plain) for s in SCHEDULES[1:]]
    accuracy = {}
    with WorkerPool(cluster) as pool:
        for label, config in runs:
            name, staleness = parse_schedule_spec(label.removesuffix(PLAIN))
            plan = Plan(
                args.model,
                args.batch_size,
                args.micro_batches,
                name,
                stage_of_layer,
                tuple((d["name"],) for d in devices),
                staleness=staleness,
            )
            start = time.perf_counter()
            result = pool.train(
                plan,
                dataset="fashion-mnist",
                data_dir=args.data_dir,
                epochs=args.epochs,
                seed=args.seed,
                optimizer=config,
            )
            if not result.ok:
                print(f"{label}: training failed: {result.error}", file=sys.stderr)
                return 1
            per_epoch = ", ".join(
                f"epoch {i + 1}: loss {loss:.4f} acc {acc:.4f}"
                for i, (loss, acc) in enumerate(zip(result.epoch_losses, result.epoch_test_accuracy, strict=True))
            )
            delays = plan.pipeline_schedule.delay
            per_stage = ",".join(str(delays(s, plan.n_stages, plan.micro_batches)) for s in range(plan.n_stages))
            print(f"{label:15s} (delays {per_stage}; {time.perf_counter() - start:.0f} s): {per_epoch}", flush=True)
            accuracy[label] = result.test_accuracy
    print(
        f"model {args.model}, {args.stages} stages, batch {args.batch_size}, {args.micro_batches} micro-batches, {args.epochs} epochs, SGD lr {args.lr} momentum {args.momentum}"
    )
    print("test accuracy (10000 test images): " + ", ".join(f"{s} {a * 100:.2f}%" for s, a in accuracy.items()))
    gaps = {s: (accuracy["1f1b"] - accuracy[s]) * 100 for s in accuracy if s != "1f1b"}
    for label, gap in gaps.items():
        print(f"sync - {label}: {gap:+.2f} points")
    met = all(abs(gaps[s]) <= 2 for s in SCHEDULES[1:])
    print(f"bar: async (compensated) within 2 points of sync at staleness 1 and at the default: {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
