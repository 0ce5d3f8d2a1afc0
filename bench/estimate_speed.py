"""How long one cost-model estimate takes on an Inception-V3-sized model; the bar is under 5 ms.

Without ``--library`` it synthesizes a 400-layer library with Inception-style branches (four parallel branches
per block, joined by a concatenation), the size of the largest of the paper's three models. With ``--library
DIR`` it uses a library written by ``tapp profile``. The plan splits the layers into contiguous stages of about
equal time on the cluster's first devices. ``--kinds N`` costs every device from the library of its own kind:
the library gets N - 1 other kinds (CPUs of 2..N threads, each layer's time scaled by its own random factor),
the cluster's devices take 1..N threads in turn, and the cluster is real (not emulated), profiled here.

    .venv/bin/python bench/estimate_speed.py [--library DIR] [--cluster hetero4] [--repeats 200] [--kinds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import statistics
import time

import numpy as np

from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.plan.plan import Plan
from tapp_core.plan.schedules import SCHEDULES
from tapp_core.platform.cluster import Cluster, load_cluster
from tapp_core.profile.library import Layer, LayerLibrary

BAR_S = 5e-3
BRANCHES = 4
LAYERS_PER_BRANCH = 3


def synthetic_library(n_layers: int = 400, batch_size: int = 64, seed: int = 0) -> LayerLibrary:
    """A DAG of stem layers and inception blocks (``BRANCHES`` chains of ``LAYERS_PER_BRANCH``, then a concat)."""
    rng = random.Random(seed)
    edges: list[tuple[int, int]] = []
    block = BRANCHES * LAYERS_PER_BRANCH + 1
    stem = 4
    blocks = (n_layers - stem - 1) // block
    edges += [(i, i + 1) for i in range(stem - 1)]
    entry = stem - 1
    for b in range(blocks):
        first = stem + b * block
        concat = first + block - 1
        for branch in range(BRANCHES):
            head = first + branch * LAYERS_PER_BRANCH
            edges.append((entry, head))
            edges += [(head + j, head + j + 1) for j in range(LAYERS_PER_BRANCH - 1)]
            edges.append((head + LAYERS_PER_BRANCH - 1, concat))
        entry = concat
    edges += [(i, i + 1) for i in range(entry, n_layers - 1)]
    successors: dict[int, list[int]] = {i: [] for i in range(n_layers)}
    predecessors: dict[int, list[int]] = {i: [] for i in range(n_layers)}
    for u, v in edges:
        successors[u].append(v)
        predecessors[v].append(u)
    layers = [
        Layer(
            index=i,
            name=f"layer{i}",
            op="Conv2d",
            successors=tuple(successors[i]),
            predecessors=tuple(predecessors[i]),
            flops=rng.uniform(1e6, 1e8),
            param_bytes=rng.randrange(0, 4 * 2**20),
            activation_bytes=rng.randrange(4 * 2**10, 256 * 2**10),
            output_shape=(batch_size, 64, 8, 8),
            forward_s=rng.uniform(1e-4, 5e-3),
            backward_s=rng.uniform(2e-4, 1e-2),
        )
        for i in range(n_layers)
    ]
    return LayerLibrary(
        model="synthetic_inception",
        batch_size=batch_size,
        device="cpu",
        threads=1,
        layers=layers,
        input_bytes=3 * 32 * 32 * 4,
        whole_model_s=sum(layer.forward_s + layer.backward_s for layer in layers),
    )


def with_kinds(library: LayerLibrary, cluster: Cluster, kinds: int) -> tuple[LayerLibrary, Cluster]:
    """``library`` with ``kinds - 1`` more CPU kinds, on ``cluster`` made real with its devices' threads 1..kinds."""
    rng = random.Random(1)
    here = dataclasses.replace(library, host=platform.node(), threads=1)
    others = []
    for threads in range(2, kinds + 1):
        layers = []
        for layer in here.layers:
            factor = rng.uniform(0.3, 1.0)
            layers.append(
                dataclasses.replace(layer, forward_s=layer.forward_s * factor, backward_s=layer.backward_s * factor)
            )
        others.append(dataclasses.replace(here, layers=layers, threads=threads))
    devices = tuple(d.model_copy(update={"threads": 1 + i % kinds}) for i, d in enumerate(cluster.devices))
    return here.with_kinds(others), cluster.model_copy(update={"emulated": False, "devices": devices})


def even_time_plan(library: LayerLibrary, devices: tuple[str, ...], micro_batches: int, schedule: str) -> Plan:
    """Contiguous stages (layers are numbered topologically, so every edge runs forward) of about equal time."""
    times = np.array([layer.forward_s + layer.backward_s for layer in library.layers])
    cumulative = np.cumsum(times) / times.sum()
    stage_of_layer = np.minimum((cumulative * len(devices) - 1e-12).astype(int), len(devices) - 1)
    return Plan(
        model=library.model,
        batch_size=library.batch_size,
        micro_batches=micro_batches,
        schedule=schedule,  # type: ignore[arg-type]
        stage_of_layer=tuple(int(s) for s in stage_of_layer),
        stage_devices=tuple((d,) for d in devices),
        planner="even-time (bench)",
    )


def mean_estimate_s(plan: Plan, context: CostContext, repeats: int, with_timeline: bool) -> float:
    """Mean wall time of one estimate; ``with_timeline`` also builds its TimelineOp list (built lazily)."""
    estimate(plan, context)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        result = estimate(plan, context)
        if with_timeline:
            len(result.timeline)
        times.append(time.perf_counter() - began)
    return statistics.fmean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", help="a layer library directory written by `tapp profile`")
    parser.add_argument("--cluster", default="hetero4")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--kinds", type=int, default=1, help="device kinds, each costed from its own library")
    args = parser.parse_args()

    library = LayerLibrary.load(args.library) if args.library else synthetic_library()
    cluster = load_cluster(args.cluster)
    if args.kinds > 1:
        library, cluster = with_kinds(library, cluster, args.kinds)
    devices = cluster.device_names[: args.stages]
    print(
        f"library: {library.model} ({len(library.layers)} layers, {len(library.edges())} edges, "
        f"batch {library.batch_size}); cluster {cluster.name}; {len(devices)} stages, {args.micro_batches} micro-batches; "
        f"{len(library.kind_libraries)} kind(s)"
    )
    worst = 0.0
    context = CostContext(library, cluster)
    for schedule in SCHEDULES:
        plan = even_time_plan(library, devices, args.micro_batches, schedule)
        mean_s = mean_estimate_s(plan, context, args.repeats, with_timeline=False)
        with_timeline_s = mean_estimate_s(plan, context, args.repeats, with_timeline=True)
        worst = max(worst, mean_s)
        step = estimate(plan, context)
        print(
            f"{schedule:>6}: {mean_s * 1e3:.3f} ms per estimate over {args.repeats} "
            f"({with_timeline_s * 1e3:.3f} ms with its {len(step.timeline)} timeline ops built; "
            f"step {step.step_time_s:.4f} s)"
        )
    verdict = "PASS" if worst < BAR_S else "FAIL"
    print(f"slowest schedule: {worst * 1e3:.3f} ms per estimate; bar < {BAR_S * 1e3:.0f} ms: {verdict}")


if __name__ == "__main__":
    main()
