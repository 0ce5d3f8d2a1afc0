"""Every planner on the paper's models and the heterogeneous clusters: estimated step time, gap to the best,
search wall time and reward evaluations, then the bars of the planners issue and, last, the worst TAPP gap.

    .venv/bin/python bench/planners.py                      # alexnet, vgg16, inception_v3 on hetero4, hetero8
    .venv/bin/python bench/planners.py --models alexnet --clusters hetero4
    .venv/bin/python bench/planners.py --measured           # + hybrid TAPP vs Pipe-Torch and BSP, raced locally
    .venv/bin/python bench/planners.py --measured-only      # only that: TAPP (hybrid) in the best group per model

Layer libraries come from bench/libraries/<model>_b<batch>/ (profiled once with ``tapp profile`` settings and
committed), so the numbers do not move with this machine's load. The oracle runs where it can finish (hetero4):
it is exhaustive over every contiguous plan, i.e. every cut position of the topological order, with no
coarsening; TAPP's gap there is to the oracle, elsewhere to the best other planner.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tapp_core.cluster import Cluster, load_cluster
from tapp_core.costmodel import estimate
from tapp_core.library import LayerLibrary
from tapp_core.plan import Plan
from tapp_core.planners import get_planner
from tapp_core.runtime.race import RaceResult

LIBRARIES = Path(__file__).resolve().parent / "libraries"
PLANNERS = ("single", "bsp", "even", "pipetorch", "pipedream", "autoddl", "oracle", "tapp")
ORACLE_CLUSTERS = ("hetero4",)
PAPER_SPEEDUP_OVER_BSP = {"alexnet": 1.33, "vgg16": 1.30, "inception_v3": 1.49}
TAPP_GAP_BAR = 0.03
TAPP_WALL_BAR_S = 120.0
DP_WALL_BAR_S = 2.0
DP_PLANNERS = ("pipetorch", "pipedream")

console = Console(width=160)


@dataclass
class Row:
    model: str
    cluster: str
    planner: str
    step_time_s: float
    wall_s: float
    evaluations: int
    plan: Plan

    @property
    def layout(self) -> str:
        stages = " | ".join("+".join(devices) for devices in self.plan.stage_devices)
        return escape(f"{stages} (m={self.plan.micro_batches})")


def library_for(model: str, batch_size: int) -> LayerLibrary:
    from tapp_core.profiler import PROFILE_VERSION, profile_model

    directory = LIBRARIES / f"{model}_b{batch_size}"
    if (directory / "layers.csv").is_file():
        library = LayerLibrary.load(directory)
        if library.extra.get("profile_version") == PROFILE_VERSION:
            return library
    console.print(f"profiling {model} at batch {batch_size} once into {directory} ...")
    library = profile_model(model, batch_size, threads=1)
    library.save(directory)
    return library


def run_planner(name: str, library: LayerLibrary, cluster: Cluster, args: argparse.Namespace) -> Row:
    options: dict[str, object] = {"schedule": args.schedule, "seed": args.seed}
    if name == "tapp":
        options["time_limit_s"] = args.tapp_time_limit or None
        if args.tapp_rounds:
            options["rounds"] = args.tapp_rounds
    started = time.perf_counter()
    plan = get_planner(name, **options).plan(library, cluster)
    wall = time.perf_counter() - started
    step = estimate(plan, library, cluster).step_time
    return Row(library.model, cluster.name, name, step, wall, int(plan.notes.get("evaluations", 0)), plan)


def reference_for(rows: list[Row]) -> tuple[str, float]:
    """What TAPP is judged against: the oracle where it ran, else the best other planner."""
    by_name = {r.planner: r for r in rows}
    if "oracle" in by_name:
        return "oracle", by_name["oracle"].step_time_s
    best = min((r for r in rows if r.planner != "tapp"), key=lambda r: r.step_time_s)
    return f"best other ({best.planner})", best.step_time_s


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    rounds = args.tapp_rounds or "the planner's default"
    limit = f"{args.tapp_time_limit:.0f} s" if args.tapp_time_limit else "no time limit"
    table = Table(
        title=f"Planners: estimated step time (cost model, default calibration), schedule {args.schedule}, "
        f"batch {args.batch_size}; TAPP: simulated reward, {rounds} rounds or {limit}, then its polish"
    )
    for column in ("model", "cluster", "planner", "step time s", "gap to best", "wall s", "evaluations", "plan"):
        table.add_column(
            column, justify="right" if column in ("step time s", "gap to best", "wall s", "evaluations") else "left"
        )
    for (model, cluster), group in _groups(rows):
        best = min(r.step_time_s for r in group)
        for r in group:
            gap = f"{100 * (r.step_time_s / best - 1):+.1f}%" if math.isfinite(r.step_time_s) else "-"
            table.add_row(
                model, cluster, r.planner, f"{r.step_time_s:.4f}", gap, f"{r.wall_s:.2f}", str(r.evaluations), r.layout
            )
        table.add_section()
    console.print(table)


def _groups(rows: list[Row]) -> list[tuple[tuple[str, str], list[Row]]]:
    keys: list[tuple[str, str]] = []
    for r in rows:
        if (r.model, r.cluster) not in keys:
            keys.append((r.model, r.cluster))
    return [(k, [r for r in rows if (r.model, r.cluster) == k]) for k in keys]


def check_bars(rows: list[Row]) -> list[tuple[str, bool, str]]:
    bars: list[tuple[str, bool, str]] = []
    for (model, cluster), group in _groups(rows):
        by_name = {r.planner: r for r in group}
        tapp = by_name.get("tapp")
        if tapp is None:
            continue
        label, reference = reference_for(group)
        gap = tapp.step_time_s / reference - 1
        bars.append((f"{model} {cluster}: TAPP within 3% of {label}", gap <= TAPP_GAP_BAR, f"gap {100 * gap:+.2f}%"))
        bars.append(
            (
                f"{model} {cluster}: TAPP search < {TAPP_WALL_BAR_S:.0f} s",
                tapp.wall_s < TAPP_WALL_BAR_S,
                f"{tapp.wall_s:.1f} s",
            )
        )
        for name in DP_PLANNERS:
            if name in by_name:
                wall = by_name[name].wall_s
                bars.append(
                    (f"{model} {cluster}: {name} < {DP_WALL_BAR_S:.0f} s", wall < DP_WALL_BAR_S, f"{wall:.2f} s")
                )
        if cluster == "hetero4" and "bsp" in by_name and model in PAPER_SPEEDUP_OVER_BSP:
            speedup = by_name["bsp"].step_time_s / tapp.step_time_s
            paper = PAPER_SPEEDUP_OVER_BSP[model]
            bars.append((f"{model} {cluster}: TAPP speedup over BSP >= {paper}x", speedup >= paper, f"{speedup:.2f}x"))
        if cluster == "hetero4" and "pipetorch" in by_name:
            ratio = tapp.step_time_s / by_name["pipetorch"].step_time_s
            bars.append(
                (f"{model} {cluster}: TAPP never slower than Pipe-Torch", ratio <= 1.0, f"TAPP/Pipe-Torch {ratio:.3f}")
            )
    return bars


def measured_check(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """Hybrid TAPP against Pipe-Torch and BSP on the local cluster: the three final plans raced (the flow's evaluation
    race: interleaved rounds, medians with intervals); TAPP passes where it is in the best group."""
    from tapp_core.runtime.calibration import load_fitted_calibration
    from tapp_core.runtime.pool import WorkerPool
    from tapp_core.runtime.race import race
    from tasks.measure import RuntimeSettings

    cluster = load_cluster("local")
    calibration = load_fitted_calibration()
    settings = RuntimeSettings()
    table = Table(
        title="Measured on the local cluster: the plans raced in interleaved rounds (median over rounds, its "
        f"interval); estimates with the fitted calibration ({calibration.note or 'ideal'})"
    )
    for column in ("model", "planner", "measured s", "interval s", "rounds", "best group", "estimated s", "search s"):
        table.add_column(column)
    table.add_column("plan")
    bars = []
    with WorkerPool(cluster) as pool:
        for model in args.models:
            library = library_for(model, args.batch_size)
            started = time.perf_counter()
            tapp = get_planner(
                "tapp",
                reward="hybrid",
                pool=pool,
                rounds=args.tapp_rounds or 250,
                time_limit_s=args.tapp_time_limit or None,
                measured_rounds=args.measured_rounds,
                measured_per_round=1,
                seed=args.seed,
                calibration=calibration,
            ).plan(library, cluster)
            searched = {"tapp (hybrid)": time.perf_counter() - started, "pipetorch": 0.0, "bsp": 0.0}
            plans = {
                "tapp (hybrid)": tapp,
                "pipetorch": get_planner("pipetorch", calibration=calibration).plan(library, cluster),
                "bsp": get_planner("bsp", calibration=calibration).plan(library, cluster),
            }
            result = race(pool, list(plans.values()), model, settings.race, settings.round_steps())
            group = {p.id for p in result.best_group()}
            console.log(
                f"{model}: raced {result.rounds} rounds ({result.stop}), load {result.load_before:.2f} -> "
                f"{result.load_after:.2f}{' OVERLOADED' if result.overloaded else ''}; "
                f"TAPP chosen by {tapp.notes.get('chosen_by', '?')}"
            )
            for name, plan in plans.items():
                measured = result.measurement(plan.id)
                predicted = estimate(plan, library, cluster, calibration).step_time
                layout = Row(model, cluster.name, name, predicted, 0.0, 0, plan).layout
                shown = (
                    (f"{measured.step_time_s:.4f}", f"[{measured.interval_low_s:.4f}, {measured.interval_high_s:.4f}]")
                    if measured.ok
                    else ("failed", escape(str(measured.error))[:60])
                )
                table.add_row(
                    model,
                    name,
                    *shown,
                    str(measured.rounds),
                    "yes" if plan.id in group else "",
                    f"{predicted:.4f}",
                    f"{searched[name]:.0f}",
                    layout,
                )
            table.add_section()
            bars.append((f"{model} local: measured TAPP (hybrid) in the best group", tapp.id in group, _group(result)))
    console.print(table)
    return bars


def _group(result: RaceResult) -> str:
    return "best group " + ", ".join(
        f"{m.step_time_s:.4f} s"
        for p, m in zip(result.plans, result.measurements, strict=True)
        if p in result.best_group()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["alexnet", "vgg16", "inception_v3"])
    parser.add_argument("--clusters", nargs="+", default=["hetero4", "hetero8"])
    parser.add_argument("--planners", nargs="+", default=list(PLANNERS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tapp-rounds",
        type=int,
        default=600,
        help="TAPP's rounds (0: the planner's default, 250); the time limit stops them sooner on a slow machine",
    )
    parser.add_argument(
        "--tapp-time-limit",
        type=float,
        default=100.0,
        help="stop TAPP's rounds after this many seconds (0: none); the final polish comes after",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--measured", action="store_true", help="add the measured check on the local cluster")
    parser.add_argument("--measured-only", action="store_true", help="only the measured check")
    parser.add_argument("--measured-rounds", type=int, default=3, help="hybrid TAPP: final rounds that measure")
    args = parser.parse_args()

    rows: list[Row] = []
    for model in args.models if not args.measured_only else []:
        library = library_for(model, args.batch_size)
        for cluster_name in args.clusters:
            cluster = load_cluster(cluster_name)
            for name in args.planners:
                if name == "oracle" and cluster_name not in ORACLE_CLUSTERS:
                    continue
                rows.append(run_planner(name, library, cluster, args))
                console.log(f"{model} {cluster_name} {name}: {rows[-1].step_time_s:.4f} s in {rows[-1].wall_s:.1f} s")
    if rows:
        print_table(rows, args)
    oracle_notes = [r.plan.notes for r in rows if r.planner == "oracle"]
    if oracle_notes:
        coarse = [n for n in oracle_notes if n.get("coarsened")]
        unproved = [n for n in oracle_notes if not n.get("proved_optimal")]
        console.print(
            f"oracle: optimum over contiguous plans; coarsened graph in {len(coarse)} of {len(oracle_notes)} cases, "
            f"proved optimal in {len(oracle_notes) - len(unproved)} of {len(oracle_notes)}"
        )
    bars = check_bars(rows)
    if args.measured or args.measured_only:
        bars += measured_check(args)
    for text, ok, detail in bars:
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {text}: {detail}")
    if args.json:
        args.json.write_text(
            json.dumps([{**r.__dict__, "plan": r.plan.to_dict()} for r in rows], indent=2, default=str) + "\n"
        )
    gaps = []
    for (_, _), group in _groups(rows):
        tapp = next((r for r in group if r.planner == "tapp"), None)
        if tapp is not None and len(group) > 1:
            gaps.append(tapp.step_time_s / reference_for(group)[1] - 1)
    if gaps:
        print(f"worst TAPP gap: {100 * max(gaps):+.2f}%")


if __name__ == "__main__":
    main()
