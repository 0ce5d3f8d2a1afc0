"""Every planner on the paper's models and the heterogeneous clusters: estimated step time, gap to the best,
search wall time and reward evaluations, then the bars of the planners issue and, last, the worst TAPP gap.

    .venv/bin/python bench/planners.py                      # alexnet, vgg16, inception_v3 on hetero4, hetero8
    .venv/bin/python bench/planners.py --models alexnet --clusters hetero4
    .venv/bin/python bench/planners.py --measured           # + hybrid TAPP vs Pipe-Torch and BSP, raced locally
    .venv/bin/python bench/planners.py --measured-only      # only that: TAPP (hybrid) in the best group per model
    .venv/bin/python bench/planners.py --random 12 --seed 1 # issue 14: 12 random clusters, a table per cluster
    .venv/bin/python bench/planners.py --clusters out/random-s1-03.yaml --models vgg16   # re-run one such cell
    .venv/bin/python bench/planners.py --random 12 --seed 4 --threads 1 2  # devices of two kinds, a library each
    .venv/bin/python bench/planners.py --scale              # 16 and 32 devices: search time, gap to the others

Layer libraries come from bench/libraries/<model>_b<batch>/ (profiled once with ``tapp profile`` settings and
committed), so the numbers do not move with this machine's load. The oracle runs where it can finish (hetero4):
it is exhaustive over every contiguous plan, i.e. every cut position of the topological order, with no
coarsening; TAPP's gap there is to the oracle, elsewhere to the best other planner.

Issue 14 (TAPP on clusters nobody tuned it for): ``--random N --seed S`` generates N clusters
(``bench/random_clusters.py``; ``--seed`` picks the family and seeds the planners, ``--planner-seed`` sets the
planners' apart) and judges every model on every one of them as a *cell* (``bench/planner_cells.py``): the
time-boxed oracle (``--oracle-time-limit``; it says whether it proved optimality), TAPP (``--tapp-time-limit``
covers its warm start, rounds and polish), the RL alone (no polish, no warm start; ``--no-rl-alone`` skips it),
every other planner and every single-device plan, a table per cluster, then a summary with the issue's bars and the
load average; the last line is TAPP's worst gap. ``--write-clusters DIR`` writes the
clusters as files; a cluster given to ``--clusters`` as a file is judged the same way. ``--scale`` runs hetero8
doubled and quadrupled and random clusters of 16 and 32 devices, without the oracle. ``--threads 1 2`` draws each
random device's CPU thread count, and costs it from its own kind's library (``tapp_core.platform.kinds``) times its speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.planner_cells import (  # noqa: E402
    OTHER_PLANNERS,
    RL_ALONE,
    Cell,
    Settings,
    note_number,
    print_cluster,
    print_summary,
    run_cell,
    worst_gap_line,
)
from bench.random_clusters import describe, random_clusters, replicated, write_cluster  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.plan.plan import Plan  # noqa: E402
from tapp_core.planners import get_planner  # noqa: E402
from tapp_core.planners.tapp.options import DEFAULT_TIME_LIMIT_S  # noqa: E402
from tapp_core.platform.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.profile.library import LayerLibrary  # noqa: E402

LIBRARIES = Path(__file__).resolve().parent / "libraries"
PLANNERS = ("single-cpu", "bsp", "even", "pipetorch", "pipedream", "autoddl", "oracle", "tapp", "tapp-rl")
ORACLE_CLUSTERS = ("hetero4",)
PAPER_SPEEDUP_OVER_BSP = {"alexnet": 1.33, "vgg16": 1.30, "inception_v3": 1.49}
TAPP_GAP_BAR = 0.03
TAPP_WALL_BAR_S = 120.0
DP_WALL_BAR_S = 2.0
DP_PLANNERS = ("pipetorch", "pipedream")
SCALE_DEVICES = (16, 32)

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


def library_for(model: str, batch_size: int, threads: tuple[int, ...] = (1,)) -> LayerLibrary:
    """The committed one-thread library of ``model`` (every named cluster's, and the default random family's);
    for clusters whose devices have other thread counts, the libraries of every count in ``threads``, the fewest
    threads' the reference. Those are profiled together (``-t<N>`` folders), so their ratios are one machine's at
    one time, not two sessions'."""
    if threads == (1,):
        return kind_library(model, batch_size, None)
    reference, *others = (kind_library(model, batch_size, t) for t in sorted(set(threads)))
    return reference.with_kinds(others)


@functools.cache  # every cluster of a run asks again
def kind_library(model: str, batch_size: int, threads: int | None) -> LayerLibrary:
    """``bench/libraries/<model>_b<batch>`` (``threads`` None: the committed one-thread library) or
    ``<model>_b<batch>-t<threads>``, profiled here once if missing or of an old profiler version. Its host is left
    blank: these libraries stand for a kind, not for this machine."""
    from tapp_core.profile.library import PROFILE_VERSION
    from tapp_core.profile.profiler import ProfileRequest, profile_model

    directory = LIBRARIES / (f"{model}_b{batch_size}" + (f"-t{threads}" if threads is not None else ""))
    if (directory / "layers.csv").is_file():
        library = LayerLibrary.load(directory)
        if library.extra.get("profile_version") == PROFILE_VERSION:
            return library
    console.print(f"profiling {model} at batch {batch_size} on {threads or 1} thread(s) once into {directory} ...")
    library = dataclasses.replace(profile_model(ProfileRequest(model, batch_size, threads=threads or 1)), host="")
    library.save(directory)
    return library


def run_planner(name: str, library: LayerLibrary, cluster: Cluster, args: argparse.Namespace) -> Row:
    options: dict[str, object] = {"schedule": args.schedule, "seed": args.seed}
    if name in ("tapp", "tapp-rl"):  # the RL alone: the same rounds and time limit, no warm start, no polish
        options["time_limit_s"] = args.tapp_time_limit or None
        if args.tapp_rounds:
            options["rounds"] = args.tapp_rounds
    started = time.perf_counter()
    plan = get_planner(name, **options).plan(CostContext(library, cluster))
    wall = time.perf_counter() - started
    step = estimate(plan, CostContext(library, cluster)).step_time_s
    return Row(library.model, cluster.name, name, step, wall, int(note_number(plan, "evaluations")), plan)


def reference_for(rows: list[Row]) -> tuple[str, float]:
    """What TAPP is judged against: the oracle where it ran, else the best other planner."""
    by_name = {r.planner: r for r in rows}
    if "oracle" in by_name:
        return "oracle", by_name["oracle"].step_time_s
    best = min((r for r in rows if r.planner not in ("tapp", "tapp-rl")), key=lambda r: r.step_time_s)
    return f"best other ({best.planner})", best.step_time_s


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    rounds = args.tapp_rounds or "the planner's default"
    limit = f"{args.tapp_time_limit:.0f} s" if args.tapp_time_limit else "no time limit"
    table = Table(
        title=f"Planners: estimated step time (cost model, default calibration), schedule {args.schedule}, "
        f"batch {args.batch_size}; TAPP: simulated reward, warm start, {rounds} rounds and its polish within {limit}; "
        "tapp-rl: the same rounds and limit, no warm start, no polish (the paper's algorithm alone)"
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
    from tapp_core.cost.calibration import cluster_calibration
    from tapp_core.runtime.pool import WorkerPool
    from tapp_core.runtime.pool_race import PoolRounds, race
    from tasks.measure import RuntimeSettings

    cluster = load_cluster("local")
    calibration = cluster_calibration("local", cluster)  # `tapp calibrate --cluster local`, else ideal
    settings = RuntimeSettings()
    table = Table(
        title="Measured on the local cluster: the plans raced in interleaved rounds (median over rounds, its "
        f"interval); estimates with the measured calibration ({calibration.note or 'ideal'})"
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
                measurer=PoolRounds(pool),
                rounds=args.tapp_rounds or 250,
                time_limit_s=args.tapp_time_limit or None,
                measured_rounds=args.measured_rounds,
                measured_per_round=1,
                seed=args.seed,
            ).plan(CostContext(library, cluster, calibration))
            searched = {"tapp (hybrid)": time.perf_counter() - started, "pipetorch": 0.0, "bsp": 0.0}
            plans = {
                "tapp (hybrid)": tapp,
                "pipetorch": get_planner("pipetorch").plan(CostContext(library, cluster, calibration)),
                "bsp": get_planner("bsp").plan(CostContext(library, cluster, calibration)),
            }
            result = race(pool, list(plans.values()), model, settings.race, settings.round_steps())
            group = {p.id for p in result.best_group()}
            console.log(
                f"{model}: raced {result.rounds} rounds ({result.stop}), load {result.load_before:.2f} -> "
                f"{result.load_after:.2f}, others took {result.other_cpu_share:.0%} of the CPU"
                f"{' OVERLOADED' if result.overloaded else ''}; TAPP chosen by {tapp.notes.get('chosen_by', '?')}"
            )
            for name, plan in plans.items():
                measured = result.measurement(plan.id)
                predicted = estimate(plan, CostContext(library, cluster, calibration)).step_time_s
                layout = Row(model, cluster.name, name, predicted, 0.0, 0, plan).layout
                shown = (
                    (f"{measured.step_time_s:.4f}", f"[{measured.interval_low_s:.4f}, {measured.interval_high_s:.4f}]")
                    if measured.ok
                    else ("failed", escape(str(measured.error))[:60])
                )
                in_group = "yes" if plan.id in group else ""
                table.add_row(
                    model, name, *shown, str(measured.rounds), in_group, f"{predicted:.4f}", f"{searched[name]:.0f}",
                    layout,
                )  # fmt: skip
            table.add_section()
            medians = ", ".join(
                f"{m.step_time_s:.4f} s"
                for p, m in zip(result.plans, result.measurements, strict=True)
                if p.id in group
            )
            bars.append(
                (f"{model} local: measured TAPP (hybrid) in the best group", tapp.id in group, f"best group {medians}")
            )
    console.print(table)
    return bars


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["alexnet", "vgg16", "inception_v3"])
    parser.add_argument(
        "--clusters",
        nargs="+",
        help="cluster names (the table and bars of hetero4/hetero8, their default) or cluster files (judged cell by "
        "cell, as --random does)",
    )
    parser.add_argument("--planners", nargs="+", default=list(PLANNERS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--seed", type=int, default=0, help="the planners' seed, and the family of --random clusters")
    parser.add_argument("--planner-seed", type=int, help="the planners' seed when it should differ from --seed")
    parser.add_argument(
        "--tapp-rounds",
        type=int,
        default=600,
        help="TAPP's rounds (0: the planner's default, 250); the time limit stops them sooner on a slow machine",
    )
    parser.add_argument(
        "--tapp-time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help="TAPP's time limit in seconds, for its warm start, rounds and polish together (0: none; default: the "
        "planner's)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows (and cells) here")
    parser.add_argument("--measured", action="store_true", help="add the measured check on the local cluster")
    parser.add_argument("--measured-only", action="store_true", help="only the measured check")
    parser.add_argument("--measured-rounds", type=int, default=3, help="hybrid TAPP: final rounds that measure")
    parser.add_argument("--random", type=int, default=0, metavar="N", help="judge N random clusters of family --seed")
    parser.add_argument("--write-clusters", type=Path, metavar="DIR", help="write the random and scale clusters here")
    parser.add_argument(
        "--oracle-time-limit", type=float, default=60.0, help="cells: the oracle's time limit in seconds (0: none)"
    )
    parser.add_argument(
        "--planner-time-limit",
        type=float,
        default=300.0,
        help="cells and scale: kill any other planner (a child process) after this many seconds (0: no limit, and "
        "no child process)",
    )
    parser.add_argument(
        "--rl-alone",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cells and scale: also run TAPP's RL alone (no polish, no warm start) beside the full planner",
    )
    parser.add_argument(
        "--scale", action="store_true", help="run hetero8 x2 and x4 and random 16- and 32-device clusters"
    )
    parser.add_argument("--scale-random", type=int, default=1, help="random clusters of each size with --scale")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="random and scale clusters: each device's CPU thread count is drawn from these, and it is costed from "
        "its own kind's layer library (bench/libraries/<model>_b<batch>-t<N>, profiled once if missing) times its "
        "speed; default 1: one library, scalar speeds",
    )
    args = parser.parse_args(argv)
    if args.random < 0 or args.scale_random < 0:
        parser.error("--random and --scale-random take a count >= 0")
    if min(args.threads) < 1:
        parser.error("--threads takes thread counts >= 1")
    args.threads = tuple(sorted(set(args.threads)))
    if args.planner_seed is None:
        args.planner_seed = args.seed
    if args.clusters is None:
        args.clusters = [] if args.random or args.scale else ["hetero4", "hetero8"]
    return args


def load_average() -> str:
    """The machine's load average over 1, 5 and 15 minutes (timings are only comparable at similar loads)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def is_cluster_file(name: str) -> bool:
    return Path(name).suffix in {".yaml", ".yml"} or Path(name).exists()


def main() -> None:
    args = parse_args()
    named = [c for c in args.clusters if not is_cluster_file(c)]
    files = [c for c in args.clusters if is_cluster_file(c)]
    output: dict[str, object] = {}
    if named or args.measured or args.measured_only:
        output["rows"] = run_classic(args, named)
    judged = [load_cluster(f) for f in files] + random_clusters(args.random, args.seed, threads=args.threads)
    scaled = scale_clusters(args) if args.scale else []
    for cluster in (*judged, *scaled) if args.write_clusters else ():
        console.print(f"wrote {write_cluster(cluster, args.write_clusters)}")
    if scaled:
        output["scale"] = [c.to_dict() for c in run_cells(args, scaled, scale=True)]
    if judged:
        output["cells"] = [c.to_dict() for c in run_cells(args, judged, scale=False)]
    if args.json:
        data = output["rows"] if list(output) == ["rows"] else output
        args.json.write_text(json.dumps(data, indent=2, default=str) + "\n")


def run_classic(args: argparse.Namespace, cluster_names: list[str]) -> list[dict[str, object]]:
    """hetero4 and hetero8: the table, the bars of the planners issue and the worst TAPP gap (as before)."""
    rows: list[Row] = []
    for model in args.models if not args.measured_only else []:
        library = library_for(model, args.batch_size)
        for cluster_name in cluster_names:
            cluster = load_cluster(cluster_name)
            for name in args.planners:
                if name == "oracle" and cluster_name not in ORACLE_CLUSTERS:
                    continue
                rows.append(run_planner(name, library, cluster, args))
                console.log(f"{model} {cluster_name} {name}: {rows[-1].step_time_s:.4f} s in {rows[-1].wall_s:.1f} s")
    if rows:
        print_table(rows, args)
        console.print(f"load average: {load_average()}")
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
    gaps = []
    for (_, _), group in _groups(rows):
        tapp = next((r for r in group if r.planner == "tapp"), None)
        if tapp is not None and len(group) > 1:
            gaps.append(tapp.step_time_s / reference_for(group)[1] - 1)
    if gaps:
        print(f"worst TAPP gap: {100 * max(gaps):+.2f}%")
    return [{**r.__dict__, "plan": r.plan.to_dict()} for r in rows]


def scale_clusters(args: argparse.Namespace) -> list[Cluster]:
    """hetero8 doubled and quadrupled, then ``--scale-random`` random clusters of 16 and of 32 devices."""
    hetero8 = load_cluster("hetero8")
    out = [replicated(hetero8, 2), replicated(hetero8, 4)]
    for devices in SCALE_DEVICES:
        out += random_clusters(args.scale_random, args.seed, devices, args.threads)
    return out


def run_cells(args: argparse.Namespace, clusters: list[Cluster], scale: bool) -> list[Cell]:
    """Every model on every cluster: a table per cluster, then the summary (the last line: TAPP's worst gap)."""
    wanted = (set(args.planners) - {RL_ALONE}) | ({RL_ALONE} if args.rl_alone and "tapp" in args.planners else set())
    order = ("tapp", RL_ALONE, *OTHER_PLANNERS) if scale else ("oracle", "tapp", RL_ALONE, *OTHER_PLANNERS)
    settings = Settings(
        schedule=args.schedule,
        seed=args.planner_seed,
        tapp_rounds=args.tapp_rounds,
        tapp_time_limit_s=args.tapp_time_limit or None,
        oracle_time_limit_s=args.oracle_time_limit or None,
        planner_time_limit_s=args.planner_time_limit or None,
        planners=tuple(p for p in order if p in wanted),
        single_devices=not scale,
        log=console.log,
    )
    console.print(
        f"[bold]{'Scale' if scale else 'Cells'}[/]: {len(clusters)} clusters x {len(args.models)} models; schedule "
        f"{args.schedule}, batch {args.batch_size}, planners' seed {args.planner_seed}; TAPP: simulated reward, "
        f"warm start, {args.tapp_rounds or 'default'} rounds and polish within {args.tapp_time_limit or 'no'} s; "
        + ("no oracle" if scale else f"oracle time limit {args.oracle_time_limit or 'none'} s")
        + f"; other planners killed after {args.planner_time_limit or 'no'} s"
    )
    cells = []
    started = time.perf_counter()
    console.print(f"load average at the start: {load_average()}")
    for cluster in clusters:
        threads = tuple(sorted({*args.threads, *(d.threads for d in cluster.devices)}))
        mine = [run_cell(library_for(model, args.batch_size, threads), cluster, settings) for model in args.models]
        print_cluster(console, mine, describe(cluster))
        cells += mine
    console.print(f"load average at the end: {load_average()}; {time.perf_counter() - started:.0f} s in all")
    print_summary(console, cells, scale=scale)
    console.print(worst_gap_line(cells, scale=scale))
    return cells


if __name__ == "__main__":
    main()
