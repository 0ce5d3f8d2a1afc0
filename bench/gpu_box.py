"""Issue 12's main bar: every planner on a real CPU+GPU host, estimated against measured, and TAPP against the best.

    source .device-kit/setup.sh && python3 bench/gpu_box.py        # on the GPU machine: detects its cluster
    python3 bench/gpu_box.py --cluster gpubox.yaml --models alexnet   # a given cluster file, one model
    .venv/bin/python bench/gpu_box.py --cpu-only                    # no GPU: this host's CPU ranks, tiny_cnn

1. The cluster: ``--cluster`` (a name or a YAML file), else this host detected (``tapp_core.runtime.detect``: every GPU,
   the cores split into CPU ranks, links by MPI ping-pong). It must hold a cuda device unless ``--cpu-only``.
2. Per model: a layer library per device kind (cpu with its threads, cuda with its GPU model), profiled on this
   host at the batch size through the project's profile cache (``--cache-dir``, else ``$TAPP_CACHE_DIR`` or
   ``.tapp``), as ``tapp profile --cluster`` does; every device is costed from its own kind's library.
3. The calibration: ``--calibration FILE``, or ``--ideal`` (none), else measured per model with ``tapp calibrate``'s
   code on the cluster's workers before planning (a minute or two; its lines are printed).
4. Plans: SingleGPU and SingleCPU (the single-device planners: the whole model on the fastest device of that
   kind), then every planner (bsp, even, pipetorch, pipedream, autoddl, tapp; ``--methods`` adds oracle). The
   same plan found by two methods is measured once.
5. Every distinct plan is measured on one ``WorkerPool`` of the cluster, ``--steps`` steps (the first
   ``--warmup`` dropped) per turn, all plans in turn, ``--rounds`` times, each round in a rotated order; a plan's
   measured step is the median of all its kept steps.
6. Printed per model: estimated and measured step per method, the estimate's error; then the cost model's median
   and worst |error| over the distinct plans of all models (bars: <= 15 %, <= 35 %), and per model whether
   TAPP's measured step is <= 1.05 x the best measured of SingleGPU, SingleCPU, BSP and Pipe-Torch.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.calibration import DEFAULT_CALIBRATION, Calibration  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.errors import TappError  # noqa: E402
from tapp_core.plan.plan import Plan  # noqa: E402
from tapp_core.planners import get_planner  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster, parse_cluster  # noqa: E402
from tapp_core.platform.kinds import device_kind  # noqa: E402
from tapp_core.profile.cache import ProfileCache  # noqa: E402
from tapp_core.profile.library import LayerLibrary  # noqa: E402
from tapp_core.runtime import WorkerPool  # noqa: E402
from tapp_core.runtime.calibrator import calibrate  # noqa: E402
from tapp_core.runtime.pool_race import PoolRounds  # noqa: E402

GPU_MODELS = ("alexnet", "vgg16", "inception_v3")
CPU_ONLY_MODELS = ("tiny_cnn",)
PLANNERS = ("bsp", "even", "pipetorch", "pipedream", "autoddl", "tapp")
BASELINES = ("single-gpu", "single-cpu", "bsp", "pipetorch")
"""TAPP's bar: its measured step against the best of these."""
LABELS = {
    "single-gpu": "SingleGPU",
    "single-cpu": "SingleCPU",
    "bsp": "BSP",
    "even": "Even",
    "pipetorch": "Pipe-Torch",
    "pipedream": "PipeDream",
    "autoddl": "AutoDDL",
    "oracle": "Oracle",
    "tapp": "TAPP",
}
BAR_MEDIAN, BAR_WORST, BAR_TAPP = 0.15, 0.35, 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", help="a cluster name or YAML file (default: detect this host)")
    parser.add_argument("--threads", type=int, default=None, help="threads per CPU rank when detecting")
    parser.add_argument("--cpu-only", action="store_true", help="no GPU needed: CPU ranks, a tiny model, few steps")
    parser.add_argument("--models", nargs="+", default=None, help=f"default {' '.join(GPU_MODELS)}")
    parser.add_argument("--methods", nargs="+", default=None, help="default: single-gpu single-cpu and every planner")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="steps per turn (default 10; 4 with --cpu-only)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="turns per plan (default 3; 1 with --cpu-only)")
    parser.add_argument("--tapp-budget", type=int, default=None, help="TAPP's evaluations (default 200; 30 cpu-only)")
    parser.add_argument("--tapp-reward", choices=("simulated", "hybrid"), default="simulated")
    calibration = parser.add_mutually_exclusive_group()
    calibration.add_argument("--calibration", type=Path, default=None, help="a calibration file (default: measure)")
    calibration.add_argument("--ideal", action="store_true", help="the ideal calibration (no overheads)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="profile cache (default: as tapp profile's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per measured turn")
    args = parser.parse_args(argv)
    small = args.cpu_only
    args.models = args.models or list(CPU_ONLY_MODELS if small else GPU_MODELS)
    args.methods = args.methods or ["single-gpu", "single-cpu", *PLANNERS]
    args.steps = args.steps or (4 if small else 10)
    args.rounds = args.rounds or (1 if small else 3)
    args.tapp_budget = args.tapp_budget or (30 if small else 200)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} leaves nothing after --warmup {args.warmup}")
    return args


# --- the cluster and its kinds --------------------------------------------------------------------------------


def the_cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        cluster = load_cluster(args.cluster)
    else:
        from tapp_core.runtime.detect import detect_cluster

        cluster, text = detect_cluster(args.threads, name="detected")
        print(text, flush=True)
    gpus = [d for d in cluster.devices if d.kind == "cuda"]
    if not gpus and not args.cpu_only:
        raise TappError(f"cluster {cluster.name!r} has no cuda device; give one that has, or --cpu-only")
    if gpus and args.cpu_only:
        cluster = cpu_part(cluster)
    if cluster.emulated:
        print(f"note: cluster {cluster.name!r} is emulated; this bench is for real devices", flush=True)
    return cluster


def cpu_part(cluster: Cluster) -> Cluster:
    """``cluster`` without its GPUs (and the link overrides that only they made)."""
    data = cluster.model_dump()
    cpus = {d["name"] for d in data["devices"] if d["kind"] == "cpu"}
    data["devices"] = [d for d in data["devices"] if d["name"] in cpus]
    overrides = [{**o, "between": [n for n in o["between"] if n in cpus]} for o in data["links"]["overrides"]]
    data["links"]["overrides"] = [o for o in overrides if len(o["between"]) >= 2]
    return parse_cluster(data, f"{cluster.name} (CPU devices)")


def kind_libraries(model: str, batch_size: int, cluster: Cluster, cache: Path | None) -> LayerLibrary:
    """The model's layer library of every kind of ``cluster``, from the profile cache (profiled there if missing)."""
    started = time.perf_counter()
    library = ProfileCache(cache).cluster_libraries(model, batch_size, cluster)
    elapsed = time.perf_counter() - started
    for kind, own in library.kind_libraries.items():
        print(f"{model} on {kind}: whole step {own.whole_model_s * 1e3:.2f} ms", flush=True)
    print(f"  (profiled or read in {elapsed:.0f} s)", flush=True)
    return library


def given_calibration(args: argparse.Namespace) -> Calibration | None:
    """``--ideal``'s or ``--calibration``'s; None: measure one per model (``measured_calibration``)."""
    if args.ideal:
        return DEFAULT_CALIBRATION
    return Calibration.load(args.calibration) if args.calibration else None


def measured_calibration(cluster: Cluster, library: LayerLibrary) -> Calibration:
    print(f"calibrating {cluster.name} for {library.model}", flush=True)
    return calibrate(cluster, library)


# --- plans, estimates and measurements -------------------------------------------------------------------------


@dataclass
class Method:
    name: str
    plan: Plan | None = None
    estimated_s: float = math.nan
    error: str = ""


@dataclass
class Turns:
    """One distinct plan's kept step times over all its turns, and the first failure if any."""

    plan: Plan
    steps: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def measured_s(self) -> float:
        return statistics.median(self.steps) if self.steps and not self.error else math.nan


def plan_methods(
    args: argparse.Namespace, library: LayerLibrary, cluster: Cluster, calibration: Calibration, pool: WorkerPool
) -> list[Method]:
    methods = []
    context = CostContext(library, cluster, calibration)
    for name in args.methods:
        method = Method(name)
        started = time.perf_counter()
        try:
            if name in ("single-gpu", "single-cpu") and not any(
                d.kind == name.removeprefix("single-") for d in cluster.devices
            ):
                continue
            options: dict[str, object] = {"batch_size": args.batch_size, "seed": args.seed}
            if name == "tapp":
                options.update(
                    reward=args.tapp_reward, measurer=PoolRounds(pool) if args.tapp_reward != "simulated" else None
                )
            planner = get_planner(name, **options)
            method.plan = planner.plan(context, args.tapp_budget if name == "tapp" else None)
            method.estimated_s = estimate(method.plan, context).step_time_s
        except TappError as exc:
            method.error = f"planning failed: {exc}"
        print(f"  planned {LABELS.get(name, name)} in {time.perf_counter() - started:.1f} s", flush=True)
        methods.append(method)
    return methods


def measure_in_turns(pool: WorkerPool, plans: list[Plan], args: argparse.Namespace) -> dict[str, Turns]:
    """Every plan ``args.steps`` steps per turn, all in turn, ``args.rounds`` rounds (rotated each round)."""
    turns = {plan.id: Turns(plan) for plan in plans}
    order = list(turns)
    for round_index in range(args.rounds):
        shift = round_index % max(len(order), 1)
        for plan_id in order[shift:] + order[:shift]:
            turn = turns[plan_id]
            if turn.error:
                continue
            measured = pool.measure(
                turn.plan, steps=args.steps, warmup=args.warmup, seed=args.seed, timeout_s=args.timeout
            )
            if measured.ok:
                turn.steps += measured.step_times_s[args.warmup :]
            else:
                turn.error = measured.error or "failed"
    return turns


# --- report -----------------------------------------------------------------------------------------------------


def relative_error(estimated_s: float, measured_s: float) -> float:
    return (estimated_s - measured_s) / measured_s


def describe(plan: Plan) -> str:
    stages = " | ".join("+".join(devices) for devices in plan.stage_devices)
    return f"{stages}, m={plan.micro_batches}, {plan.schedule}"


def report_model(model: str, methods: list[Method], turns: dict[str, Turns]) -> bool | None:
    """Print the model's table; returns whether TAPP met its bar (None: TAPP or every baseline unmeasured)."""
    print(f"\n{model}: estimated and measured step time (s)")
    print(f"{'method':11s} {'estimated':>10s} {'measured':>10s} {'error':>8s}  plan")
    for method in methods:
        label = LABELS.get(method.name, method.name)
        if method.plan is None:
            print(f"{label:11s} {'':>10s} {'':>10s} {'':>8s}  {method.error}")
            continue
        turn = turns[method.plan.id]
        measured = turn.measured_s
        shown = (
            f"{'FAILED':>10s} {'':>8s}"
            if math.isnan(measured)
            else f"{measured:10.4f} {relative_error(method.estimated_s, measured):+8.1%}"
        )
        print(f"{label:11s} {method.estimated_s:10.4f} {shown}  {describe(method.plan)} {turn.error}")
    measured_of = {m.name: turns[m.plan.id].measured_s for m in methods if m.plan is not None}
    baselines = [measured_of[name] for name in BASELINES if not math.isnan(measured_of.get(name, math.nan))]
    tapp = measured_of.get("tapp", math.nan)
    if not baselines or math.isnan(tapp):
        print(f"{model}: TAPP's bar cannot be judged (TAPP or every baseline was not measured)")
        return None
    best = min(baselines)
    met = tapp <= BAR_TAPP * best
    print(
        f"{model}: TAPP {tapp:.4f} s vs best baseline {best:.4f} s: ratio {tapp / best:.3f} (bar <= {BAR_TAPP}) {'met' if met else 'NOT met'}"
    )
    return met


def main() -> int:
    args = parse_args()
    try:
        cluster = the_cluster(args)
        given = given_calibration(args)  # a bad file fails here, before anything is profiled
    except TappError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"cluster {cluster.name}: " + ", ".join(f"{d.name} ({device_kind(d).name})" for d in cluster.devices),
        flush=True,
    )
    errors: list[float] = []
    bars: dict[str, bool | None] = {}
    with WorkerPool(cluster) as pool:
        for model in args.models:
            library = kind_libraries(model, args.batch_size, cluster, args.cache_dir)
            calibration = given if given is not None else measured_calibration(cluster, library)
            pool.prepare(model)
            methods = plan_methods(args, library, cluster, calibration, pool)
            distinct = list({m.plan.id: m.plan for m in methods if m.plan is not None}.values())
            turns = measure_in_turns(pool, distinct, args)
            bars[model] = report_model(model, methods, turns)
            estimated = {m.plan.id: m.estimated_s for m in methods if m.plan is not None}
            errors += [
                abs(relative_error(estimated[i], t.measured_s))
                for i, t in turns.items()
                if not math.isnan(t.measured_s)
            ]
    print()
    if errors:
        median, worst = statistics.median(errors), max(errors)
        print(
            f"cost model |error| over {len(errors)} distinct measured plans: median {median:.1%} (bar <= "
            f"{BAR_MEDIAN:.0%}), worst {worst:.1%} (bar <= {BAR_WORST:.0%})"
        )
    for model, met in bars.items():
        verdict = "cannot be judged" if met is None else ("met" if met else "NOT met")
        print(f"TAPP <= {BAR_TAPP} x best of SingleGPU/SingleCPU/BSP/Pipe-Torch, {model}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
