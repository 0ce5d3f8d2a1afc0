"""Judging TAPP cell by cell (one model on one cluster) against everything that could have been chosen instead, for
``bench/planners.py --random``, ``--clusters file.yaml`` and ``--scale`` (issue 14).

A cell holds one ``Result`` per contender:

- ``oracle``: the exhaustive oracle, time-boxed (its ``time_limit_s`` covers its whole search); its note says whether it
  proved optimality;
- ``tapp``: the full planner (its note: the warm start's best candidate, the rounds, the polish, the load average);
  ``tapp-rl``: the RL alone (``RL_ALONE_OPTIONS``: no warm start, no polish), a run of its own with the same seed,
  rounds and time limit;
- every other planner (``OTHER_PLANNERS``), each optionally in a child process killed at a time limit;
- ``single:<device>``: every device alone, at its best micro-batch count (``n/a`` where the model never fits).

TAPP's gaps: to the oracle (only where it proved optimality), to the best single device, to the best other planner
and to the best known plan (every contender but TAPP's own rows, the oracle's unproved best included); the last is
the cell's *worst gap* figure.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.errors import TappError
from tapp_core.plan.plan import Plan, PlanError
from tapp_core.planners import DEFAULT_MICRO_BATCHES, get_planner, planner_options
from tapp_core.planners.oracle import OraclePlanner
from tapp_core.planners.space import contiguous_plan
from tapp_core.planners.tapp.options import DEFAULT_TIME_LIMIT_S
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.library import LayerLibrary

OTHER_PLANNERS = ("single", "bsp", "even", "pipetorch", "pipedream", "autoddl")
TAPP = "tapp"
RL_ALONE = "tapp-rl"
RL_ALONE_OPTIONS: dict[str, object] = {"polish": False, "warm_start": False}
"""TAPP's options that leave the RL alone (no warm start, no polish); those the planner does not have are skipped,
and the note of the ``tapp-rl`` row says which were applied."""
SINGLE = "single:"
SINGLE_DEVICE_BAR = 0.005
OTHER_PLANNER_BAR = 0.005
ORACLE_MEDIAN_BAR = 0.01
ORACLE_WORST_BAR = 0.03
SEARCH_BAR_S = 120.0


@dataclass
class Result:
    planner: str
    step_time_s: float
    """Estimated step time; ``inf`` when the contender found no plan that runs (see ``note``)."""
    wall_s: float
    evaluations: int = 0
    plan: Plan | None = None
    note: str = ""

    @property
    def layout(self) -> str:
        if self.plan is None:
            return "-"
        stages = " | ".join("+".join(devices) for devices in self.plan.stage_devices)
        return f"{stages} (m={self.plan.micro_batches})"

    def to_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "plan": self.plan.to_dict() if self.plan is not None else None}


@dataclass
class Cell:
    model: str
    cluster: Cluster
    results: list[Result] = field(default_factory=list)

    def get(self, planner: str) -> Result | None:
        return next((r for r in self.results if r.planner == planner), None)

    @property
    def oracle_proved(self) -> bool:
        oracle = self.get("oracle")
        return oracle is not None and oracle.plan is not None and bool(oracle.plan.notes.get("proved_optimal"))

    def best(self, kind: str) -> Result | None:
        """The fastest finite result of a kind: 'single' (single-device plans), 'other' (other planners),
        'oracle' (where it proved optimality) or 'known' (everything but TAPP's rows)."""
        chosen = {
            "single": [r for r in self.results if r.planner.startswith(SINGLE)],
            "other": [r for r in self.results if r.planner in OTHER_PLANNERS],
            "oracle": [r for r in self.results if r.planner == "oracle" and self.oracle_proved],
            "known": [r for r in self.results if r.planner not in (TAPP, RL_ALONE)],
        }[kind]
        finite = [r for r in chosen if math.isfinite(r.step_time_s)]
        return min(finite, key=lambda r: r.step_time_s) if finite else None

    def gap(self, planner: str, kind: str) -> float | None:
        """``planner``'s step time over the best of ``kind``, minus 1 (None where either is missing)."""
        mine, best = self.get(planner), self.best(kind)
        if mine is None or best is None:
            return None
        return mine.step_time_s / best.step_time_s - 1

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "cluster": self.cluster.model_dump(mode="json", exclude_none=True),
            "results": [r.to_dict() for r in self.results],
        }


@dataclass(frozen=True)
class Settings:
    schedule: str = "1f1b"
    seed: int = 0
    tapp_rounds: int = 600
    """TAPP's rounds (0: the planner's default)."""
    tapp_time_limit_s: float | None = DEFAULT_TIME_LIMIT_S
    """TAPP's time limit for its warm start, rounds and polish (None: none)."""
    oracle_time_limit_s: float | None = 60.0
    planner_time_limit_s: float | None = None
    """Kill each other planner's run after this long (a child process); None: run it here, however long."""
    planners: tuple[str, ...] = ("oracle", TAPP, RL_ALONE, *OTHER_PLANNERS)
    single_devices: bool = True
    log: Callable[[str], None] = print


def run_cell(library: LayerLibrary, cluster: Cluster, settings: Settings) -> Cell:
    cell = Cell(library.model, cluster)
    for name in settings.planners:
        if name == "oracle":
            result = _run_oracle(library, cluster, settings)
        elif name in (TAPP, RL_ALONE):
            result = _run_tapp(library, cluster, settings, rl_alone=name == RL_ALONE)
        else:
            result = _run_other(name, library, cluster, settings)
        cell.results.append(result)
        settings.log(
            f"{library.model} {cluster.name} {name}: {result.step_time_s:.4f} s in {result.wall_s:.1f} s {result.note}"
        )
    if settings.single_devices:
        cell.results += single_device_results(library, cluster, settings.schedule)
    return cell


def single_device_results(
    library: LayerLibrary,
    cluster: Cluster,
    schedule: str = "1f1b",
    micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
) -> list[Result]:
    """Every device alone, the whole model on it, at its best micro-batch count under ``schedule`` (more micro-batches
    hold fewer activations under 1F1B, so a device too small at one may fit at another); ``n/a`` where none fits."""
    out = []
    for device in cluster.devices:
        name = f"{SINGLE}{device.name}"
        best = Result(name, math.inf, 0.0, 0, None, "n/a: does not fit")
        for m in (m for m in micro_batches if library.batch_size % m == 0):
            plan = contiguous_plan(library, [], [[device.name]], m, schedule, library.batch_size)
            try:
                validate(plan, CostContext(library, cluster))
            except PlanError:
                continue
            step = estimate(plan, CostContext(library, cluster)).step_time_s
            if step < best.step_time_s:
                best = Result(name, step, 0.0, best.evaluations + 1, plan)
            else:
                best.evaluations += 1
        out.append(best)
    return out


def note_number(plan: Plan, key: str) -> float:
    """A number from a plan's notes (0 when absent or not a number)."""
    value = plan.notes.get(key, 0)
    return float(value) if isinstance(value, int | float) else 0.0


def _finished(name: str, plan: Plan, wall: float, library: LayerLibrary, cluster: Cluster, note: str = "") -> Result:
    step = estimate(plan, CostContext(library, cluster)).step_time_s
    return Result(name, step, wall, int(note_number(plan, "evaluations")), plan, note)


def _run_oracle(library: LayerLibrary, cluster: Cluster, settings: Settings) -> Result:
    oracle = OraclePlanner(schedule=settings.schedule, seed=settings.seed, time_limit_s=settings.oracle_time_limit_s)
    started = time.perf_counter()
    try:
        plan = oracle.plan(CostContext(library, cluster))
    except TappError as exc:
        return Result("oracle", math.inf, time.perf_counter() - started, note=f"failed: {exc}")
    wall = time.perf_counter() - started
    proved = bool(plan.notes.get("proved_optimal"))
    note = "proved optimal" if proved else "NOT proved (time limit)"
    cut = [part for part in ("groupings", "incumbents") if plan.notes.get(f"{part}_cut")]
    if cut:
        note += f", {' and '.join(cut)} cut"
    return _finished("oracle", plan, wall, library, cluster, note)


def rl_alone_options() -> dict[str, object]:
    """The options of ``RL_ALONE_OPTIONS`` that TAPP's planner has."""
    known = planner_options(TAPP)
    return {k: v for k, v in RL_ALONE_OPTIONS.items() if k in known}


def _run_tapp(library: LayerLibrary, cluster: Cluster, settings: Settings, rl_alone: bool) -> Result:
    options: dict[str, object] = {
        "schedule": settings.schedule,
        "seed": settings.seed,
        "time_limit_s": settings.tapp_time_limit_s,
    }
    if settings.tapp_rounds:
        options["rounds"] = settings.tapp_rounds
    note = ""
    if rl_alone:
        options |= rl_alone_options()
        missing = sorted(set(RL_ALONE_OPTIONS) - set(options))
        note = "RL alone: " + ", ".join(f"{k}={v}" for k, v in rl_alone_options().items())
        note += f" (TAPP has no {', '.join(missing)})" if missing else ""
    started = time.perf_counter()
    try:
        plan = get_planner(TAPP, **options).plan(CostContext(library, cluster))
    except TappError as exc:
        return Result(RL_ALONE if rl_alone else TAPP, math.inf, time.perf_counter() - started, note=f"failed: {exc}")
    wall = time.perf_counter() - started
    if not rl_alone:
        note = tapp_note(plan)
    note += f"; load {os.getloadavg()[0]:.1f}"
    return _finished(RL_ALONE if rl_alone else TAPP, plan, wall, library, cluster, note)


def tapp_note(plan: Plan) -> str:
    """What TAPP's row says about its search: the warm start's best candidate, the rounds, the polish's gain."""
    rounds = int(note_number(plan, "rounds"))
    parts = []
    warm = plan.notes.get("warm_start")
    winner = plan.notes.get("warm_start_winner")
    if isinstance(warm, dict) and winner in warm:
        parts.append(f"warm {note_number(plan, 'warm_start_s'):.0f} s: {winner} {warm[winner]:.4f}")
    parts.append(f"{rounds} rounds in {note_number(plan, 'search_rounds_s'):.0f} s")
    parts.append(f"polish {note_number(plan, 'polish_s'):.0f} s -{100 * note_number(plan, 'polish_gain'):.1f}%")
    return ", ".join(parts)


def _run_other(name: str, library: LayerLibrary, cluster: Cluster, settings: Settings) -> Result:
    planner = get_planner(name, schedule=settings.schedule, seed=settings.seed)
    started = time.perf_counter()
    outcome = run_with_time_limit(lambda: planner.plan(CostContext(library, cluster)), settings.planner_time_limit_s)
    wall = time.perf_counter() - started
    if isinstance(outcome, str):
        return Result(name, math.inf, wall, note=outcome)
    return _finished(name, outcome, wall, library, cluster)


def _child(find: Callable[[], Plan], send: Connection) -> None:
    try:
        send.send(("plan", find().to_dict()))
    except TappError as exc:
        send.send(("error", str(exc)))


def run_with_time_limit(find: Callable[[], Plan], limit_s: float | None) -> Plan | str:
    """``find()``'s plan, or a note saying why there is none: it failed, or (with a limit) it ran in a forked child
    process that was killed after ``limit_s`` seconds."""
    if limit_s is None:
        try:
            return find()
        except TappError as exc:
            return f"failed: {exc}"
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(find, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(limit_s):
            return f"n/a: timed out after {limit_s:.0f} s"
        kind, payload = receive.recv()
    except EOFError:
        return "failed: the planner's process died"
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    return Plan.from_dict(payload) if kind == "plan" else f"failed: {payload}"


# --- printing -----------------------------------------------------------------------------------------------------


def _percent(gap: float | None) -> str:
    if gap is None:
        return "-"
    return f"{100 * gap:+.2f}%" if math.isfinite(gap) else "inf"


def print_cluster(console: Console, cells: Sequence[Cell], description: str) -> None:
    """One table for a cluster, a section per model; then TAPP's (and the RL alone's) gaps per cell."""
    if not cells:
        return
    table = Table(title=escape(f"{cells[0].cluster.name}: {description}"), title_justify="left")
    for column in ("model", "planner", "step time s", "gap to best", "wall s", "evaluations", "note", "plan"):
        table.add_column(column, justify="right" if column in ("step time s", "gap to best", "wall s") else "left")
    for cell in cells:
        finite = [r.step_time_s for r in cell.results if math.isfinite(r.step_time_s)]
        fastest = min(finite) if finite else math.inf
        for r in cell.results:
            table.add_row(
                cell.model,
                r.planner,
                f"{r.step_time_s:.4f}" if math.isfinite(r.step_time_s) else "n/a",
                _percent(r.step_time_s / fastest - 1 if math.isfinite(r.step_time_s) else None),
                f"{r.wall_s:.2f}",
                str(r.evaluations),
                escape(r.note),
                escape(r.layout),
            )
        table.add_section()
    console.print(table)
    for cell in cells:
        best = cell.best("known")
        console.print(escape(f"{cell.model}: {cell_line(cell, TAPP)}; best known: {best.planner if best else '-'}"))
        if cell.get(RL_ALONE):
            console.print(escape(f"{cell.model}: {cell_line(cell, RL_ALONE)}"))


def cell_line(cell: Cell, planner: str) -> str:
    mine = cell.get(planner)
    if mine is None:
        return f"{planner}: not run"
    oracle = f"{_percent(cell.gap(planner, 'oracle'))} to the oracle" if cell.oracle_proved else "oracle not proved"
    single, other = cell.best("single"), cell.best("other")
    parts = [] if cell.get("oracle") is None else [oracle]
    if single is not None:
        parts.append(f"{_percent(cell.gap(planner, 'single'))} to the best single device ({single.planner})")
    parts.append(
        f"{_percent(cell.gap(planner, 'other'))} to the best other planner ({other.planner if other else '-'})"
    )
    return f"{planner}: " + "; ".join([*parts, f"search {mine.wall_s:.1f} s"])


def _worst(values: Iterable[tuple[float | None, str]]) -> tuple[float, str] | None:
    known = [(g, where) for g, where in values if g is not None]
    return max(known, key=lambda item: item[0]) if known else None


def summary_figures(cells: Sequence[Cell], planner: str) -> dict[str, Any]:
    """The figures the issue's bars are about, for one of TAPP's rows."""
    where = [f"{c.model} {c.cluster.name}" for c in cells]
    proved = [(c.gap(planner, "oracle"), w) for c, w in zip(cells, where, strict=True) if c.oracle_proved]
    proved_gaps = [g for g, _ in proved if g is not None]
    searches = [(r.wall_s, w) for c, w in zip(cells, where, strict=True) if (r := c.get(planner)) is not None]
    return {
        "proved_cells": len(proved_gaps),
        "median_oracle": statistics.median(proved_gaps) if proved_gaps else None,
        "worst_oracle": _worst(proved),
        "worst_single": _worst((c.gap(planner, "single"), w) for c, w in zip(cells, where, strict=True)),
        "worst_other": _worst((c.gap(planner, "other"), w) for c, w in zip(cells, where, strict=True)),
        "worst_known": _worst((c.gap(planner, "known"), w) for c, w in zip(cells, where, strict=True)),
        "longest_search": max(searches) if searches else None,
    }


def print_summary(console: Console, cells: Sequence[Cell], scale: bool = False) -> None:
    """A row per cell, then the figures and the bars of issue 14 (at scale: the gap to the best other planner)."""
    if scale:
        print_scale_summary(console, cells)
        return
    table = Table(title="Summary: TAPP (and the RL alone) per cell; gaps are step time over the reference, minus 1")
    columns = ("model", "cluster", "oracle s", "tapp s", "rl s", "to oracle", "to single", "to other", "to known")
    for column in (*columns, "rl to known", "search s"):
        table.add_column(column, justify="left" if column in ("model", "cluster") else "right")
    for c in cells:
        oracle, tapp, rl = c.get("oracle"), c.get(TAPP), c.get(RL_ALONE)
        table.add_row(
            c.model,
            c.cluster.name,
            f"{oracle.step_time_s:.4f}{'' if c.oracle_proved else '?'}" if oracle else "-",
            f"{tapp.step_time_s:.4f}" if tapp else "-",
            f"{rl.step_time_s:.4f}" if rl else "n/a",
            _percent(c.gap(TAPP, "oracle")),
            _percent(c.gap(TAPP, "single")),
            _percent(c.gap(TAPP, "other")),
            _percent(c.gap(TAPP, "known")),
            _percent(c.gap(RL_ALONE, "known")),
            f"{tapp.wall_s:.1f}" if tapp else "-",
        )
    console.print(table)
    console.print("('?' after the oracle's time: it did not prove optimality within its time limit)")
    print_planner_walls(console, cells)
    for planner in (RL_ALONE, TAPP):
        if any(c.get(planner) for c in cells):
            _print_figures(console, cells, planner)


def print_planner_walls(console: Console, cells: Sequence[Cell]) -> None:
    names = [n for n in ("oracle", TAPP, RL_ALONE, *OTHER_PLANNERS) if any(c.get(n) for c in cells)]
    parts = []
    for name in names:
        walls = [r.wall_s for c in cells if (r := c.get(name)) is not None]
        parts.append(f"{name} median {statistics.median(walls):.2f} s, max {max(walls):.2f} s")
    console.print("wall time per planner over the cells: " + "; ".join(parts))


def _print_figures(console: Console, cells: Sequence[Cell], planner: str) -> None:
    f = summary_figures(cells, planner)

    def show(item: tuple[float, str] | None) -> str:
        return f"{_percent(item[0])} ({item[1]})" if item else "-"

    console.print(
        f"{planner}: gap to the oracle over the {f['proved_cells']} cells where it proved optimality: median "
        f"{_percent(f['median_oracle'])}, worst {show(f['worst_oracle'])}; worst gap to the best single device "
        f"{show(f['worst_single'])}; to the best other planner {show(f['worst_other'])}; longest search "
        + (f"{f['longest_search'][0]:.1f} s ({f['longest_search'][1]})" if f["longest_search"] else "-")
    )
    if planner != TAPP:
        return
    bars = [
        ("never slower than the best single device by > 0.5%", f["worst_single"], SINGLE_DEVICE_BAR),
        ("never slower than any other planner by > 0.5%", f["worst_other"], OTHER_PLANNER_BAR),
        ("worst gap to the proved oracle <= 3%", f["worst_oracle"], ORACLE_WORST_BAR),
    ]
    for text, item, bar in bars:
        ok = item is None or item[0] <= bar
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] TAPP {text}: {show(item)}")
    median = f["median_oracle"]
    ok = median is None or median <= ORACLE_MEDIAN_BAR
    console.print(
        f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] TAPP median gap to the proved oracle <= 1%: "
        f"{_percent(median)}"
    )
    longest = f["longest_search"]
    ok = longest is None or longest[0] <= SEARCH_BAR_S
    console.print(
        f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] every TAPP search <= {SEARCH_BAR_S:.0f} s: "
        + (f"{longest[0]:.1f} s" if longest else "-")
    )


def print_scale_summary(console: Console, cells: Sequence[Cell]) -> None:
    table = Table(title="Scale: TAPP against the best other planner (no oracle)")
    for column in ("model", "cluster", "devices", "tapp s", "rl s", "best other", "other s", "gap", "search s"):
        table.add_column(column, justify="left" if column in ("model", "cluster", "best other") else "right")
    for c in cells:
        tapp, rl, other = c.get(TAPP), c.get(RL_ALONE), c.best("other")
        table.add_row(
            c.model,
            c.cluster.name,
            str(len(c.cluster.devices)),
            f"{tapp.step_time_s:.4f}" if tapp else "-",
            f"{rl.step_time_s:.4f}" if rl else "n/a",
            other.planner if other else "-",
            f"{other.step_time_s:.4f}" if other else "-",
            _percent(c.gap(TAPP, "other")),
            f"{tapp.wall_s:.1f}" if tapp else "-",
        )
    console.print(table)
    print_planner_walls(console, cells)
    worst = summary_figures(cells, TAPP)["worst_other"]
    ok = worst is None or worst[0] <= 0.0
    detail = f"{_percent(worst[0])} ({worst[1]})" if worst else "-"
    console.print(
        f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] TAPP no worse than the best other planner at scale: {detail}"
    )


def worst_gap_line(cells: Sequence[Cell], scale: bool = False) -> str:
    """The last line: TAPP's worst gap to the best known plan of its cell (at scale: to the best other planner)."""
    worst = summary_figures(cells, TAPP)["worst_other" if scale else "worst_known"]
    reference = "the best other planner" if scale else "the best known plan of its cell"
    if worst is None:
        return f"worst TAPP gap (to {reference}): -"
    return f"worst TAPP gap (to {reference}): {_percent(worst[0])} ({worst[1]})"
