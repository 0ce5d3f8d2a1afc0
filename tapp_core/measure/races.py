"""Races: plans compared by measuring them in interleaved rounds on one pool, under the same conditions.

On a shared host the same plan measures +-10 % from one minute to the next, more than the gap between good plans,
so plans measured one after the other are compared under different loads. A race measures them in turns:

    round 1: B A C    round 2: C B A    round 3: A C B    ...

- **A round** gives every plan still in the race one run of a few steps (``RoundSteps``: warm-up steps, then
  timed ones; each run builds the plan's stage afresh, so the warm-up is paid in every round). The round's value
  for the plan is the median of its timed steps. The order is shuffled every round (seeded): no plan always runs
  first, or always right after the same neighbour, and rounds pair the plans in time.
- **After each round** from ``min_rounds`` on, every plan has its median over rounds and an order-statistics
  confidence interval (``tapp_core.measure.stats``, which says why not the bootstrap); no verdict is drawn from an
  interval with fewer rounds than its confidence needs (5 at 90 %). The race **stops** when the best
  plan's interval lies below every other's (``separated``), when ``max_rounds`` are done, or when ``budget_s``
  has passed (checked between rounds). A plan whose interval already lies wholly above the best's stops running
  (``eliminate``): it has lost, and its rounds so far are its result.
- **A plan that fails** (raises, runs out of memory, times out, loses a rank) is reported failed, with the round
  it failed in, and the race goes on with the others.
- **The verdict**: the best group (every plan whose interval overlaps the best's) and, for a caller that must
  pick one, the winner: the plan with fewest devices in the best group (it frees resources at the same speed),
  then the lowest median. Per-round paired ratios (``ratio``) compare two plans with an interval of their own.
- **Load**: every Measurement holds the host's 1-minute load average before and after the race, the cores this
  process may use, the race's ranks on the host, and the share of the host's CPU time that other processes took
  while it ran (counted from ``/proc``), so a report can warn about an overloaded host
  (``tapp_core.measure.metrics.host_overloaded``).

``run_race`` is the protocol over any ``run_round(plan) -> Measurement`` (it needs no MPI: a planner's measured
reward races with it too); ``tapp_core.runtime.pool_race.race`` runs it on a ``WorkerPool``. Identical plans (same id)
are raced once.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tapp_core.errors import TappError
from tapp_core.measure.metrics import Measurement, host_overloaded, step_time_spread
from tapp_core.measure.stats import (
    DEFAULT_CONFIDENCE,
    Interval,
    best_group,
    best_index,
    median_interval,
    paired_ratio_interval,
)
from tapp_core.measure.step import TIMED_STEPS, WARMUP_STEPS
from tapp_core.plan.plan import Plan
from tapp_core.platform.hosts import host_cpus, process_cpu_s

RoundRunner = Callable[[Plan], Measurement]
"""Runs one plan for one round (warm-up and timed steps) and measures it; never raises for a failing plan."""

SEPARATED = "separated"
MAX_ROUNDS = "max rounds"
TIME_BUDGET = "time budget"
ONE_PLAN = "one plan left"
ALL_FAILED = "every plan failed"


def rounds_count(rounds: int) -> str:
    """``1 round``, ``3 rounds``: how every view names a count of race rounds."""
    return f"{rounds} round{'' if rounds == 1 else 's'}"


class RaceError(TappError):
    """Race options that make no sense; the message names the option."""


@dataclass(frozen=True)
class RaceOptions:
    """The protocol's knobs: how many rounds, for how long, at what confidence."""

    min_rounds: int = 5
    """Rounds before any verdict: with order statistics, 5 is the fewest whose whole range covers the median with
    at least 90 % (93.75 %)."""
    max_rounds: int = 15
    budget_s: float = 600.0
    """Wall time after which no new round starts."""
    confidence: float = DEFAULT_CONFIDENCE
    seed: int = 0
    """Seeds the order of every round."""
    eliminate: bool = True
    """A plan whose interval lies wholly above the best's stops running (from ``min_rounds`` on)."""

    def __post_init__(self) -> None:
        if self.min_rounds < 1:
            raise RaceError(f"a race needs at least 1 round before a verdict, got min_rounds {self.min_rounds}")
        if self.max_rounds < self.min_rounds:
            raise RaceError(f"max_rounds ({self.max_rounds}) is below min_rounds ({self.min_rounds})")
        if self.budget_s <= 0:
            raise RaceError(f"a race's time budget must be positive, got {self.budget_s} s")
        if not 0 < self.confidence < 1:
            raise RaceError(f"confidence must be between 0 and 1, got {self.confidence}")


@dataclass(frozen=True)
class RoundSteps:
    """What one plan runs in one round on a pool: ``warmup`` steps not counted, then ``steps`` timed ones."""

    steps: int = TIMED_STEPS
    warmup: int = WARMUP_STEPS
    timeout_s: float = 600.0
    """Per plan and round: a guard against hangs; a run past it fails the plan."""
    seed: int = 0
    """Seeds the model's initial weights and the synthetic batches (the same in every round)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0:
            raise RaceError(
                f"a round needs at least 1 timed step and no negative warm-up, got {self.steps} and {self.warmup}"
            )


@dataclass
class _Entrant:
    plan: Plan
    runs: dict[int, Measurement] = field(default_factory=dict)
    """Round number -> that round's run."""
    error: str | None = None
    running: bool = True

    def record(self, number: int, run: Measurement) -> None:
        if not run.ok:
            self.error = f"failed in round {number}: {run.error}"
            self.running = False
            return
        self.runs[number] = run

    def interval(self, confidence: float) -> Interval | None:
        if self.error is not None or not self.runs:
            return None
        return median_interval([run.step_time_s for run in self.runs.values()], confidence)


@dataclass
class RaceResult:
    """What a race found: one Measurement per distinct plan (in the order first given), and how the race went."""

    plans: list[Plan]
    measurements: list[Measurement]
    rounds: int
    stop: str
    """Why it stopped: separated, max rounds, time budget, one plan, every plan failed."""
    elapsed_s: float
    orders: list[list[str]]
    """Per round, the ids of the plans in the order they ran."""
    options: RaceOptions
    load_before: float
    load_after: float
    host_cpus: int
    host_ranks: int
    other_cpu_share: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Names the race, so that records of its plans can be paired round by round later."""

    def measurement(self, plan_id: str) -> Measurement:
        for plan, measured in zip(self.plans, self.measurements, strict=True):
            if plan.id == plan_id:
                return measured
        raise KeyError(f"plan {plan_id} was not in this race")

    def intervals(self) -> list[Interval | None]:
        return [m.interval for m in self.measurements]

    def best(self) -> Plan | None:
        """The plan with the lowest median; None when every plan failed."""
        index = best_index(self.intervals())
        return self.plans[index] if index is not None else None

    def best_group(self) -> list[Plan]:
        """Every plan whose interval overlaps the best's: no winner is declared among them."""
        return [self.plans[i] for i in best_group(self.intervals())]

    def winner(self) -> Plan | None:
        """The one plan to choose: fewest devices within the best group, then the lowest median."""
        group = best_group(self.intervals())
        if not group:
            return None
        chosen = min(group, key=lambda i: (len(self.plans[i].devices), self.measurements[i].step_time_s, i))
        return self.plans[chosen]

    def ratio(self, numerator_id: str, denominator_id: str) -> Interval | None:
        """Median and interval of the per-round ratio of two plans' step times, over the rounds both ran."""
        a, b = self.measurement(numerator_id), self.measurement(denominator_id)
        if not (a.ok and b.ok):
            return None
        return paired_ratio_interval(a.round_step_times_s, b.round_step_times_s, self.options.confidence)

    @property
    def overloaded(self) -> bool:
        return host_overloaded(self.other_cpu_share, self.load_before, self.load_after, self.host_cpus, self.host_ranks)

    def summary(self) -> dict[str, object]:
        """Plain data for a plan's notes, a log or JSON: the verdict, every plan's interval, the conditions."""
        winner, group = self.winner(), {p.id for p in self.best_group()}
        return {
            "race_id": self.id,
            "rounds": self.rounds,
            "stop": self.stop,
            "elapsed_s": round(self.elapsed_s, 3),
            "confidence": self.options.confidence,
            "winner": winner.id if winner is not None else None,
            "best_group": [p.id for p in self.plans if p.id in group],
            "load_before": self.load_before,
            "load_after": self.load_after,
            "host_cpus": self.host_cpus,
            "other_cpu_share": self.other_cpu_share,
            "overloaded": self.overloaded,
            "plans": [_plan_summary(p, m) for p, m in zip(self.plans, self.measurements, strict=True)],
        }


def _plan_summary(plan: Plan, measured: Measurement) -> dict[str, object]:
    interval = measured.interval
    return {
        "plan_id": plan.id,
        "devices": " | ".join("+".join(d) for d in plan.stage_devices),
        "median_s": measured.step_time_s if interval is not None else None,
        "low_s": interval.low if interval is not None else None,
        "high_s": interval.high if interval is not None else None,
        "rounds": measured.rounds,
        "error": measured.error,
    }


def load_average() -> float:
    """The host's 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


@dataclass(frozen=True)
class HostLoad:
    """The conditions a race ran in: the 1-minute load average before and after it, the cores this process may use,
    the race's ranks on this host, and the share of the host's CPU time other processes took meanwhile."""

    before: float
    after: float
    cpus: int
    ranks: int
    other_cpu_share: float

    def stamp(self, measured: Measurement) -> Measurement:
        return replace(
            measured,
            load_before=self.before,
            load_after=self.after,
            host_cpus=self.cpus,
            host_ranks=self.ranks,
            other_cpu_share=self.other_cpu_share,
        )


def _host_busy_s() -> float:
    """CPU seconds every core of the host has spent busy since boot (``/proc/stat``; NaN without it)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherWork:
    """Counts the CPU time that other processes than ``own()`` (the race's ranks and this process) take from the
    host between ``__init__`` and ``share()``."""

    def __init__(self, own: Callable[[], Sequence[int]]) -> None:
        self.own = own
        self.started = time.monotonic()
        self.host = _host_busy_s()
        self.ours = {pid: process_cpu_s(pid) for pid in {os.getpid(), *own()}}

    def share(self) -> float:
        """Others' CPU seconds over the host's CPU seconds available meanwhile (NaN where it cannot be counted)."""
        elapsed = time.monotonic() - self.started
        host = _host_busy_s() - self.host
        if not math.isfinite(host) or elapsed <= 0:
            return math.nan
        ours = 0.0
        for pid in {os.getpid(), *self.own()}:
            now, before = process_cpu_s(pid), self.ours.get(pid)
            ours += (now or 0.0) - (before or 0.0) if now is not None else 0.0
        return max(host - ours, 0.0) / (elapsed * (os.cpu_count() or 1))


def run_race(
    run_round: RoundRunner,
    plans: Sequence[Plan],
    options: RaceOptions = RaceOptions(),
    *,
    host_ranks: int = 0,
    own_pids: Callable[[], Sequence[int]] = list,
    on_round: Callable[[int, RaceResult], None] | None = None,
) -> RaceResult:
    """Race ``plans`` with ``run_round`` as the protocol above says; ``on_round(number, so_far)`` after each round.
    ``own_pids()`` names the processes on this machine that run the plans (the ranks), whose CPU time is not others'
    work; the race's ranks on this host are those, or ``host_ranks`` where it names none."""
    distinct: dict[str, Plan] = {}
    for plan in plans:
        distinct.setdefault(plan.id, plan)
    entrants = [_Entrant(p) for p in distinct.values()]
    if not entrants:
        raise RaceError("a race needs at least one plan")
    order_random = random.Random(options.seed)
    load_before, started, others = load_average(), time.monotonic(), OtherWork(own_pids)
    orders: list[list[str]] = []

    def result(stop: str) -> RaceResult:
        load = HostLoad(load_before, load_average(), host_cpus(), len(own_pids()) or host_ranks, others.share())
        return _result(entrants, stop, time.monotonic() - started, orders, options, load)

    for number in range(1, options.max_rounds + 1):
        order = [e for e in entrants if e.running]
        order_random.shuffle(order)
        orders.append([e.plan.id for e in order])
        for entrant in order:
            entrant.record(number, run_round(entrant.plan))
        verdict = _verdict(entrants, number, options)
        if on_round is not None:
            on_round(number, result("running"))
        if verdict is not None:
            return result(verdict)
        if time.monotonic() - started >= options.budget_s and number < options.max_rounds:
            return result(TIME_BUDGET)
    return result(MAX_ROUNDS)


def _verdict(entrants: list[_Entrant], number: int, options: RaceOptions) -> str | None:
    """Why the race stops after round ``number`` (None: it goes on); drops the plans that have lost."""
    alive = [e for e in entrants if e.error is None]
    if not alive:
        return ALL_FAILED
    if number < options.min_rounds:
        return None
    if len(alive) == 1:
        return ONE_PLAN
    intervals = [e.interval(options.confidence) for e in alive]
    best = best_index(intervals)
    leader = intervals[best] if best is not None else None
    if leader is None or leader.coverage < options.confidence:
        return None  # too few rounds for an interval that means what it says
    losers = [
        e
        for e, iv in zip(alive, intervals, strict=True)
        if iv is not None and iv.coverage >= options.confidence and iv.above(leader)
    ]
    if len(losers) == len(alive) - 1:
        return SEPARATED
    if options.eliminate:
        for entrant in losers:
            entrant.running = False
    return None


def _result(
    entrants: list[_Entrant], stop: str, elapsed_s: float, orders: list[list[str]], options: RaceOptions, load: HostLoad
) -> RaceResult:
    return RaceResult(
        plans=[e.plan for e in entrants],
        measurements=[load.stamp(_pooled(e, options.confidence)) for e in entrants],
        rounds=len(orders),
        stop=stop,
        elapsed_s=elapsed_s,
        orders=[list(o) for o in orders],
        options=options,
        load_before=load.before,
        load_after=load.after,
        host_cpus=load.cpus,
        host_ranks=load.ranks,
        other_cpu_share=load.other_cpu_share,
    )


def _pooled(entrant: _Entrant, confidence: float) -> Measurement:
    """One Measurement from a plan's rounds: medians over rounds, the interval, the pooled timed steps."""
    runs = [entrant.runs[n] for n in sorted(entrant.runs)]
    emulated = runs[0].emulated if runs else False
    if entrant.error is not None or not runs:
        return replace(Measurement.failed(entrant.plan.id, entrant.error or "no round ran", emulated), rounds=len(runs))
    interval = median_interval([r.step_time_s for r in runs], confidence)
    steps = [t for r in runs for t in _timed_steps(r)]
    devices = sorted({d for r in runs for d in r.communication_s})
    computing = sorted({d for r in runs for d in r.compute_s})
    stages = min(len(r.stage_compute_s) for r in runs)
    return Measurement(
        plan_id=entrant.plan.id,
        step_time_s=interval.median,
        step_time_spread_s=step_time_spread(steps, 0),
        step_times_s=steps,
        communication_share=statistics.median(r.communication_share for r in runs),
        stage_compute_s=[statistics.median(r.stage_compute_s[s] for r in runs) for s in range(stages)],
        compute_s={d: statistics.median(r.compute_s[d] for r in runs if d in r.compute_s) for d in computing},
        communication_s={
            d: statistics.median(r.communication_s[d] for r in runs if d in r.communication_s) for d in devices
        },
        peak_memory_bytes={d: max(r.peak_memory_bytes.get(d, 0) for r in runs) for d in runs[-1].peak_memory_bytes},
        loss=runs[-1].loss,
        emulated=emulated,
        extra={"warmup": 0, "setup_s": statistics.median(_setup_s(r) for r in runs)},
        rounds=len(runs),
        round_step_times_s={n: entrant.runs[n].step_time_s for n in sorted(entrant.runs)},
        interval_low_s=interval.low,
        interval_high_s=interval.high,
        coverage=interval.coverage,
    )


def _timed_steps(run: Measurement) -> list[float]:
    warmup = run.extra.get("warmup", 0)
    return list(run.step_times_s)[warmup if isinstance(warmup, int) else 0 :]


def _setup_s(run: Measurement) -> float:
    value = run.extra.get("setup_s", 0.0)
    return float(value) if isinstance(value, int | float) else 0.0


def own_processes(measurer: object) -> Callable[[], Sequence[int]]:
    """The processes that run ``measurer``'s plans, for ``OtherWork``: its ``rank_pids`` where it has them (a pool,
    ``PoolRounds``), else none."""
    return lambda: list(getattr(measurer, "rank_pids", ()))


def pooled_rounds(earlier: Measurement, later: Measurement, confidence: float = DEFAULT_CONFIDENCE) -> Measurement:
    """One plan's rounds from two races (``later``'s renumbered after ``earlier``'s), as one Measurement: the median
    and interval over all of them, the rest from ``later``. A failed one leaves the other as it is."""
    if not earlier.ok or not earlier.round_step_times_s:
        return later
    if not later.ok or not later.round_step_times_s:
        return earlier
    offset = max(earlier.round_step_times_s)
    rounds = {**earlier.round_step_times_s, **{offset + n: t for n, t in later.round_step_times_s.items()}}
    interval = median_interval(list(rounds.values()), confidence)
    return replace(
        later,
        step_time_s=interval.median,
        step_times_s=[*earlier.step_times_s, *later.step_times_s],
        rounds=len(rounds),
        round_step_times_s=rounds,
        interval_low_s=interval.low,
        interval_high_s=interval.high,
        coverage=interval.coverage,
        load_before=earlier.load_before,
    )
