"""The one definition of *step time* and *communication share*, and the Measurement a run produces.

Step time: one training step is forward and backward of every micro-batch of one mini-batch plus the
parameter update, on every device, until the last device is done. A run reports the median over the steps
after the warm-up (at least ``MIN_STEPS`` of them after ``DEFAULT_WARMUP``).

A schedule that flushes every step (gpipe, 1f1b: ``PipelineSchedule.synchronous``) is timed step by step, each
step from a barrier of the plan's devices to the end of the last update. An asynchronous pipeline never drains:
its step time is the steady-state time per mini-batch, over many mini-batches, with the pipeline's fill before
them and its drain after them left out (``run_length``), each mini-batch's time the longest interval, over the
devices, between two of a device's updates. The cost model estimates the same window (``PipelineSchedule.window``),
and a race compares the two kinds alike: time per mini-batch, as a user training for an epoch sees it
(``step_kind`` says which a number is).

Communication share: for each device, the time it waited on sends/receives that did not overlap its compute,
divided by the step time; then averaged over devices.

Plans that are compared are *raced* (``tapp_core.measure.races``): measured in interleaved rounds, each plan's
step time the median over its rounds with a confidence interval (``tapp_core.measure.stats``). Such a Measurement holds
the rounds, the interval and the host's load average before and after the race.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tapp_core.measure.stats import Interval
from tapp_core.measure.step import StepTerms
from tapp_core.plan.schedules import PipelineSchedule

DEFAULT_WARMUP = 2
MIN_STEPS = 5


def step_kind(schedule: PipelineSchedule) -> str:
    """What a plan's step time measures, for tables and captions."""
    return "time per step" if schedule.synchronous else "steady-state time per mini-batch"


def run_length(
    schedule: PipelineSchedule, n_stages: int, micro_batches: int, steps: int, warmup: int
) -> tuple[int, int, int]:
    """(steps to run, warm-up steps, untimed steps after the timed ones) for a measurement asked for ``steps`` steps
    of which the first ``warmup`` are not timed: as asked for a synchronous schedule; an asynchronous one warms up
    for at least its pipeline's fill and runs its drain's steps after the timed ones (``PipelineSchedule.window``)."""
    if schedule.synchronous:
        return steps, warmup, 0
    fill, _, drain = schedule.window(n_stages, micro_batches)
    first = max(warmup, fill)
    return first + (steps - warmup) + drain, first, drain


def step_time(step_times_s: Sequence[float], warmup: int = DEFAULT_WARMUP) -> float:
    """Median step time over the steps after ``warmup``."""
    kept = list(step_times_s)[warmup:]
    if not kept:
        raise ValueError(f"no steps left after {warmup} warm-up steps (got {len(step_times_s)})")
    return statistics.median(kept)


def step_time_spread(step_times_s: Sequence[float], warmup: int = DEFAULT_WARMUP) -> float:
    """Interquartile range of the kept steps (0 for fewer than two)."""
    kept = sorted(list(step_times_s)[warmup:])
    if len(kept) < 2:
        return 0.0
    q = statistics.quantiles(kept, n=4, method="inclusive")
    return q[2] - q[0]


OTHER_CPU_LIMIT = 0.25
"""A race is on an overloaded host when other processes took more than this share of the host's CPU time."""


def host_overloaded(other_cpu_share: float, load_before: float, load_after: float, cpus: int, ranks: int) -> bool:
    """Whether a race ran on a host busy with other work.

    Where the race counted CPU time (Linux), the measure is what other processes than its own (its ranks and the
    process that ran it) took of the host's CPU time while it ran: more than ``OTHER_CPU_LIMIT``. Elsewhere the
    1-minute load average stands in: above the host's cores before the race (its ranks idle), or above the cores
    plus the race's own ranks after it. (The load average alone is a poor measure of others' work: it also holds
    the ranks' own work of the last minute, so back-to-back races would look overloaded.)
    """
    if math.isfinite(other_cpu_share):
        return other_cpu_share > OTHER_CPU_LIMIT
    if cpus <= 0 or not (math.isfinite(load_before) and math.isfinite(load_after)):
        return False
    return load_before > cpus or load_after > cpus + ranks


OLD_NAMES: dict[str, str] = {"device_wait_s": "communication_s"}
"""Fields a stored Measurement may still carry under an earlier name, and their names now."""


@dataclass
class Measurement:
    """What the runtime measured for one plan. ``error`` set means the plan failed and the times mean nothing."""

    plan_id: str
    step_time_s: float = float("nan")
    step_time_spread_s: float = float("nan")
    step_times_s: list[float] = field(default_factory=list)
    communication_share: float = float("nan")
    stage_compute_s: list[float] = field(default_factory=list)
    """Per stage: compute time per step (forward + backward + update), median over kept steps."""
    compute_s: dict[str, float] = field(default_factory=dict)
    """Per device: compute time per step (forward + backward + update), median over kept steps."""
    communication_s: dict[str, float] = field(default_factory=dict)
    """Per device: time per step waiting on communication that did not overlap compute, median over kept steps."""
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    loss: float = float("nan")
    emulated: bool = False
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
    rounds: int = 0
    """Rounds of the race this measurement comes from (0: one run, not raced)."""
    round_step_times_s: dict[int, float] = field(default_factory=dict)
    """Race round number -> that round's step time (median of its steps); ``step_time_s`` is their median."""
    interval_low_s: float = float("nan")
    interval_high_s: float = float("nan")
    """The confidence interval of the median over rounds (order statistics, ``tapp_core.measure.stats``)."""
    coverage: float = float("nan")
    """The interval's probability of holding the true median."""
    load_before: float = float("nan")
    load_after: float = float("nan")
    """The host's 1-minute load average before and after the race."""
    host_cpus: int = 0
    host_ranks: int = 0
    """The cores this process may use, and the race's ranks on this host (for ``overloaded``)."""
    other_cpu_share: float = float("nan")
    """The share of the host's CPU time that other processes than the race's own took while it ran (NaN: not
    counted)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def terms(self) -> StepTerms:
        """The step in the vocabulary an estimate shares (``tapp_core.measure.step``)."""
        return StepTerms(self.step_time_s, self.compute_s, self.communication_s, self.peak_memory_bytes)

    @property
    def interval(self) -> Interval | None:
        """The raced median and its interval; None for a failed or unraced measurement."""
        if not self.ok or self.rounds < 1 or math.isnan(self.interval_low_s):
            return None
        return Interval(self.step_time_s, self.interval_low_s, self.interval_high_s, self.rounds, self.coverage)

    @property
    def overloaded(self) -> bool:
        return host_overloaded(self.other_cpu_share, self.load_before, self.load_after, self.host_cpus, self.host_ranks)

    @classmethod
    def failed(cls, plan_id: str, error: str, emulated: bool = False) -> Measurement:
        return cls(plan_id=plan_id, error=error, emulated=emulated)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=float)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Measurement:
        known = set(cls.__dataclass_fields__)
        renamed = {OLD_NAMES.get(k, k): v for k, v in data.items()}
        values: dict[str, Any] = {k: v for k, v in renamed.items() if k in known}  # as stored by to_dict
        rounds = values.get("round_step_times_s")
        if isinstance(rounds, Mapping):  # JSON keys are strings
            values["round_step_times_s"] = {int(r): float(t) for r, t in rounds.items()}
        return cls(**values)
