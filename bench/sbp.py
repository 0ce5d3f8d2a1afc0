"""Operator parallelism (issue 23): AutoDDL with split layers against the pipeline-only search, BSP and TAPP.

    .venv/bin/python bench/sbp.py [--models alexnet vgg16 vit] [--clusters local hetero4 hetero8 homo4]
    .venv/bin/python bench/sbp.py --measured [--clusters local threads12] [--rounds 3]

Estimated (the default): for every model (its committed one-thread library, ``bench/libraries/<model>_b64``) and
cluster, each method plans on the cost model with the ideal calibration and its estimated step time is printed:
``autoddl`` (split signatures, uneven shares and pipelines: ``tapp_core.planners.autoddl``), ``pipeline-cd``
(the same descent over pipelines of data-parallel stages), ``bsp`` and ``tapp`` (simulated reward). Every method
plans the synchronous schedule (``1f1b``; BSP is one stage) so that the split layers' gain is not mixed with the
asynchronous pipeline's. A row's ``gain`` is pipeline-only's time over AutoDDL's, minus 1. The bars: AutoDDL is
never slower than pipeline-only; it is at least 10 % faster on one cell (named); the last line is the largest gain
in %.

``--measured``: on each cluster (real MPI workers: ``local`` emulated, ``threads12`` real ranks sharing this host's
cores), costed from the layer libraries of its kinds profiled on this host (``ProfileCache.cluster_libraries``, as
``bench/costmodel_error.py``), AlexNet's split plans (AutoDDL's, and the whole model on every device with Megatron pairs and with every
layer column-split) are raced in interleaved rounds with the best pipeline-only plan; each plan's median is held
against its estimate (the cluster's calibration: given, or measured on first use and kept, as `tapp run` does). The last number is
the median |error| of the split plans, in % (bar: <= 15 %).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.calibration import DEFAULT_CALIBRATION, Calibration  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.plan.placement import COLUMN, SIGNATURES, normalized_shares  # noqa: E402
from tapp_core.plan.plan import Plan, single_stage_plan  # noqa: E402
from tapp_core.planners import get_planner  # noqa: E402
from tapp_core.planners.patterns import PATTERNS, pattern_signatures  # noqa: E402
from tapp_core.planners.stage_costs import relative_speeds  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.profile.library import LayerLibrary, load_libraries  # noqa: E402

MODELS = ("alexnet", "vgg16", "vit")
CLUSTERS = ("local", "hetero4", "hetero8", "homo4")
METHODS = ("autoddl", "pipeline-cd", "bsp", "tapp")
LIBRARIES = ROOT / "bench" / "libraries"


def plan_with(method: str, library: LayerLibrary, cluster: Cluster, calibration: Calibration, rounds: int) -> Plan:
    options: dict[str, object] = {"calibration": calibration, "schedule": "1f1b"}
    if method == "tapp":
        options |= {"schedules": ("1f1b",), "rounds": rounds}
    return get_planner(method, **options).plan(CostContext(library, cluster))


def estimated(models: list[str], clusters: list[str], rounds: int) -> int:
    print(f"{'model':8s} {'cluster':8s}" + "".join(f" {m:>12s}" for m in METHODS) + f" {'gain':>7s}  AutoDDL's plan")
    gains: list[tuple[float, str]] = []
    worse = []
    for model in models:
        path = LIBRARIES / f"{model}_b64"
        if not path.exists():
            print(f"{model}: no committed library at {path}; skipped")
            continue
        library = load_libraries(path)
        for name in clusters:
            cluster = load_cluster(name)
            times, plans = {}, {}
            for method in METHODS:
                plans[method] = plan_with(method, library, cluster, DEFAULT_CALIBRATION, rounds)
                times[method] = estimate(plans[method], CostContext(library, cluster)).step_time_s
            gain = times["pipeline-cd"] / times["autoddl"] - 1
            gains.append((gain, f"{model} on {name}"))
            if times["autoddl"] > times["pipeline-cd"] * (1 + 1e-9):
                worse.append(f"{model} on {name}")
            cells = "".join(f" {times[m]:12.4f}" for m in METHODS)
            print(f"{model:8s} {name:8s}{cells} {gain:+7.1%}  {describe(plans['autoddl'], library)}")
            if model == "vit":
                print(megatron_line(library, cluster))
    best_gain, where = max(gains)
    print(
        f"\nAutoDDL never slower than pipeline-only: {not worse}"
        + (f" (slower on {', '.join(worse)})" if worse else "")
    )
    print(f"AutoDDL at least 10% faster than pipeline-only somewhere: {best_gain >= 0.10} (largest on {where})")
    print(f"largest gain of split layers over pipeline-only: {100 * best_gain:.1f} %")
    return 0


def megatron_line(library: LayerLibrary, cluster: Cluster) -> str:
    """The Transformer's Megatron plan (every device one stage; every block's q, k, v col and projection row, fc1
    col and fc2 row, as ``patterns.megatron_signatures`` finds them) beside plain data parallelism on the same
    devices, both with shares by speed (Megatron's rounded to whole heads), both estimated."""
    devices = list(cluster.device_names)
    speeds = relative_speeds(CostContext(library, cluster))
    data = dataclasses.replace(
        single_stage_plan(library, devices, planner="data parallel"),
        stage_shares=(normalized_shares([speeds[d] for d in devices]),),
    )
    layers = [x.index for x in library.layers if x.op in SIGNATURES]
    chosen = pattern_signatures("megatron", layers, {}, library.specs())
    megatron = dataclasses.replace(data, signatures=tuple(sorted((x, s) for x, s in chosen.items() if s != "data")))
    megatron_s = estimate(megatron, CostContext(library, cluster)).step_time_s
    data_s = estimate(data, CostContext(library, cluster)).step_time_s
    pairs = sum(s == "row" for s in chosen.values())
    return (
        f"  vit {cluster.name}: Megatron attention+MLP split ({pairs} col/row pairs on {len(devices)} devices), "
        f"estimated {megatron_s:.4f} s vs data-parallel {data_s:.4f} s"
    )


def describe(plan: Plan, library: LayerLibrary) -> str:
    stages = " | ".join("+".join(group) for group in plan.stage_devices)
    split = ", ".join(f"{library.layers[x].name}:{sig}" for x, sig in plan.signatures) or "no split layer"
    return f"{stages} m={plan.micro_batches}; {split}"


def split_candidates(library: LayerLibrary, cluster: Cluster, calibration: Calibration) -> dict[str, Plan]:
    """AutoDDL's plan, the whole model on every device under each split pattern (shares by speed), and the best
    pipeline-only plan."""
    devices = list(cluster.device_names)
    base = single_stage_plan(library, devices, planner="every device")
    speeds = relative_speeds(CostContext(library, cluster))
    shares = (normalized_shares([speeds[d] for d in devices]),)
    layers = [x.index for x in library.layers if x.op in SIGNATURES]
    plans = {
        "autoddl": plan_with("autoddl", library, cluster, calibration, 0),
        "pipeline-cd": plan_with("pipeline-cd", library, cluster, calibration, 0),
    }
    weights = {x.index: x.param_bytes for x in library.layers}
    for pattern in PATTERNS[1:4]:  # col, pairs, heaviest; megatron is the ViT's (megatron_line)
        chosen = tuple(sorted((x, s) for x, s in pattern_signatures(pattern, layers, weights).items() if s != "data"))
        plans[f"all devices, {pattern}"] = dataclasses.replace(base, signatures=chosen, stage_shares=shares)
    plans["all devices, col (even)"] = dataclasses.replace(base, signatures=tuple((x, COLUMN) for x in layers))
    return plans


def measured(clusters: list[str], rounds: int, steps: int, save: Path | None = None) -> int:
    from tapp_core.profile.cache import ProfileCache
    from tapp_core.runtime import WorkerPool
    from tapp_core.runtime.calibrator import calibration_on_first_use

    errors = []
    saved: list[dict[str, object]] = []
    for name in clusters:
        cluster = load_cluster(name)
        # The libraries of the cluster's kinds on this host (profiled here if the cache has none), as the system
        # costs a run here: a committed library from another day or host is not what these ranks compute.
        library = ProfileCache().cluster_libraries("alexnet", 64, cluster)
        calibration = calibration_on_first_use(name, cluster, library)  # as `tapp run` calibrates by default
        plans = split_candidates(library, cluster, calibration)
        print(f"\n{name}: calibration {calibration.note or 'ideal'}; {len(plans)} plans, {rounds} rounds")
        times: dict[str, list[float]] = {label: [] for label in plans}
        with WorkerPool(cluster) as pool:
            pool.prepare("alexnet")
            for _ in range(rounds):
                for label, plan in plans.items():
                    run = pool.measure(plan, steps=steps + 2, warmup=2, timeout_s=900)
                    if not run.ok:
                        raise SystemExit(f"{label} failed: {run.error}")
                    times[label].append(run.step_time_s)
        for label, plan in plans.items():
            median = statistics.median(times[label])
            predicted = estimate(plan, CostContext(library, cluster, calibration)).step_time_s
            error = (predicted - median) / median
            if plan.signatures:
                errors.append(abs(error))
            saved.append({"cluster": name, "label": label, "plan": plan.to_json(), "measured_s": times[label]})
            spread = f"{min(times[label]):.4f}-{max(times[label]):.4f}"
            print(f"  {label:28s} measured {median:.4f} s ({spread}) estimated {predicted:.4f} s error {error:+.1%}")
    if save is not None:
        save.write_text(json.dumps(saved, indent=1))
    print(f"\nsplit plans: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(errors)}")
    print(f"cost model's median |error| on split plans: {100 * statistics.median(errors):.1f} %")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--clusters", nargs="+", default=None)
    parser.add_argument("--tapp-rounds", type=int, default=20)
    parser.add_argument("--measured", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", type=Path, help="with --measured: write every plan and its rounds' times (JSON)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="no layer library of kind")
    if args.measured:
        return measured(args.clusters or ["local", "threads12"], args.rounds, args.steps, args.save)
    return estimated(args.models, args.clusters or list(CLUSTERS), args.tapp_rounds)


if __name__ == "__main__":
    sys.exit(main())
