"""An elastic training: a plan trained in segments of one checkpoint interval each, watched between segments, and
moved to another plan when a device dies or slows.

Each segment is one training job on the pool (``WorkerPool.train`` with ``CheckpointOptions.until``): it resumes
from the last complete checkpoint, trains to the next multiple of the interval and writes a checkpoint there. So
every decision is taken where a checkpoint has just been written, and a move costs a pool start and a load, never
lost steps. Between segments:

- A segment that fails because ranks died or went silent (``WorkerPool.last_fault`` names their devices: the rank
  Hydra saw end first, every device of a host that does not answer over ssh) loses its steps since the last
  checkpoint. The devices named are taken as lost (even where their rank could be restarted: a device that
  killed a training once is not trusted with the rest), the plan is made again on the others (``Replanner``,
  warm-started from the running plan, from the cost model alone), a pool is started for it, and the training
  resumes from the last complete checkpoint. When no plan fits on the survivors, the training ends with an error
  that says so and the checkpoint is kept. A failure that names no device (a bug, a bad batch) ends the training
  as before.
- Each device's measured compute of the segment is compared with the cost model's estimate by the slow-device rule
  (``elastic_rules``); a slow device's speed is re-estimated, the plan made again on the cluster so corrected, and
  the training moves to the new plan only when the estimated gain over the steps left exceeds the cost of the move.

Every event (``ElasticEvent``) goes to ``on_event``: the caller logs it (``tasks`` to MLflow and Prefect).
Elasticity needs checkpoints: the run spec must name a checkpoint folder.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.errors import TappError
from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.model.data import open_dataset
from tapp_core.model.workload import RunSpec, synthetic_samples
from tapp_core.plan.plan import Plan
from tapp_core.runtime.checkpoint import Checkpoint, TrainingCheckpointError, newest_complete
from tapp_core.runtime.elastic_rules import (
    Baseline,
    SlowRule,
    baseline,
    beside_the_others,
    compute_ratios,
    migration,
    reestimated_speed,
    slowdown,
    with_speeds,
    without,
)
from tapp_core.runtime.pool import WorkerPool
from tapp_core.runtime.results import TrainResult

Replanner = Callable[[Plan, CostContext], tuple[Plan, float]]
"""The new plan for the context's cluster, warm-started from the running plan, and its estimated step time; raises
``TappError`` when no plan fits (``tapp_core.planners.replan.replan`` is one)."""

LOST, NO_PLAN, SLOW, MIGRATED, STAYED = "device-lost", "no-plan", "device-slow", "migrated", "stayed"


class ElasticError(TappError):
    """An elastic training that cannot start as asked (no checkpoint folder)."""


@dataclass(frozen=True)
class ElasticEvent:
    """What an elastic training saw and decided, at ``step`` (the steps done: its last checkpoint)."""

    kind: str
    """``LOST`` devices, ``NO_PLAN`` on the survivors, a ``SLOW`` device, then ``MIGRATED`` or ``STAYED``."""
    step: int
    message: str
    devices: tuple[str, ...] = ()
    steps_lost: int = 0
    """``LOST``: the steps trained after the last checkpoint, redone (estimated: the dead ranks cannot report them)."""
    plan_id: str = ""
    """The plan trained from here on (``LOST``, ``MIGRATED``)."""
    values: dict[str, float] = field(default_factory=dict)
    """What the decision weighed (slowdowns, speeds, estimated step times, gain and cost of a move)."""


@dataclass
class PlanSpan:
    """One plan of the training, from step ``start`` on, with its estimated step time."""

    plan: Plan
    start: int
    estimated_step_s: float


@dataclass
class ElasticResult:
    """The training's result (its last segment's, with every step's times of all segments), the plans it ran, the
    events, and the steps done."""

    result: TrainResult
    spans: list[PlanSpan]
    events: list[ElasticEvent]
    steps_done: int
    total_steps: int
    wall_s: float


@dataclass(frozen=True)
class ElasticOptions:
    rule: SlowRule = field(default_factory=SlowRule)
    watch_slow: bool = True
    """Watch for slow devices (the lost ones are always handled)."""
    timeout_s: float = 24 * 3600.0
    """Each segment's time limit."""
    emulate: bool | None = None
    """Emulate the devices' speeds (None: as the cluster says)."""


def total_steps(spec: RunSpec, batch_size: int) -> int:
    """The training's steps: every epoch's batches (cut to ``steps_per_epoch``)."""
    workload = spec.workload
    if workload.images:
        samples = len(open_dataset(workload.data, spec.data_dir, train=True))
    else:
        samples = len(synthetic_samples(workload, train=True))
    per_epoch = samples // batch_size
    if spec.steps_per_epoch is not None:
        per_epoch = min(per_epoch, spec.steps_per_epoch)
    return spec.epochs * per_epoch


def newest_step(folder: str) -> tuple[int, str | None]:
    """The steps done at the newest complete checkpoint in ``folder``, and that checkpoint (0, None: none yet)."""
    try:
        found = newest_complete(Path(folder))
    except (TrainingCheckpointError, FileNotFoundError):
        return 0, None
    return int(found.name.removeprefix("step-")), str(found)


class ElasticTraining:
    """``ElasticTraining(plan, spec, context, replan).run()``: train ``plan`` as ``spec`` says on the context's
    cluster, elastically (the module's doc). ``before_segment(step, pool)`` runs before each segment (a bench's
    fault, at a chosen step). ``pool``: a running pool of the cluster to start on (a flow's); it is its owner's, and
    a move closes it only to free its ranks' place (its owner's next job starts it again)."""

    def __init__(
        self,
        plan: Plan,
        spec: RunSpec,
        context: CostContext,
        replan: Replanner,
        options: ElasticOptions = ElasticOptions(),
        on_event: Callable[[ElasticEvent], None] = lambda event: None,
        before_segment: Callable[[int, WorkerPool], None] = lambda step, pool: None,
        pool: WorkerPool | None = None,
    ) -> None:
        if spec.checkpoints is None or spec.checkpoints.folder is None or spec.checkpoints.every <= 0:
            raise ElasticError(
                "an elastic training needs checkpoints: a checkpoint folder and interval (--checkpoint-dir, "
                "--checkpoint-every)"
            )
        self.spec, self.context, self.replan, self.options = spec, context, replan, options
        self.on_event, self.before_segment = on_event, before_segment
        self.checkpoints: CheckpointOptions = spec.checkpoints
        self.folder: str = spec.checkpoints.folder
        self.every = spec.checkpoints.every
        self.total = total_steps(spec, plan.batch_size)
        self.spans = [PlanSpan(plan, 0, estimate(plan, context).step_time_s)]
        self.events: list[ElasticEvent] = []
        self.baselines: dict[str, Baseline] = {}
        self.step_times: list[float] = []
        self.compute: dict[str, list[float]] = {}
        self.start_s: list[float] = []
        """Every pool start's seconds."""
        self.overhead_s: list[float] = []
        """Every segment's seconds beyond its steps: its job, stage build, checkpoint load and write."""
        self.given = pool

    @property
    def plan(self) -> Plan:
        return self.spans[-1].plan

    def run(self) -> ElasticResult:
        started = time.perf_counter()
        resume = self.checkpoints.resume
        done = Checkpoint.open(resume, verify=False).position()[0] if resume is not None else 0
        last: TrainResult | None = None
        pool = self.given if self.given is not None else self._start_pool()
        try:
            while done < self.total:
                until = min(self.total, (done // self.every + 1) * self.every)
                self.before_segment(done, pool)
                began = time.monotonic()
                result = self._segment(pool, resume, until)
                if result.ok:
                    done, resume = until, newest_step(self.folder)[1]
                    last = self._merge(result, time.monotonic() - began)
                    pool = self._watch(pool, done, result)
                    continue
                pool, failed = self._after_failure(pool, result, done, until, began)
                if failed is not None:
                    last = failed
                    break
        finally:
            if pool is not self.given:
                pool.close()
        assert last is not None, "an elastic training runs at least one segment"
        last.step_times_s, last.device_compute_s = self.step_times, self.compute
        wall = time.perf_counter() - started
        return ElasticResult(last, self.spans, self.events, done, self.total, wall)

    # --- segments and pools -------------------------------------------------------------------------------------

    def _start_pool(self) -> WorkerPool:
        started = time.perf_counter()
        pool = WorkerPool(self.context.cluster, devices=self.plan.devices)
        try:
            pool.start()
        except BaseException:
            pool.close()
            raise
        self.start_s.append(time.perf_counter() - started)
        return pool

    def _segment(self, pool: WorkerPool, resume: str | None, until: int) -> TrainResult:
        options = dataclasses.replace(self.checkpoints, resume=resume, until=until)
        spec = self.spec.with_options(checkpoints=options)
        return pool.train(self.plan, spec, emulate=self.options.emulate, timeout_s=self.options.timeout_s)

    def _merge(self, result: TrainResult, seconds: float) -> TrainResult:
        """Keep the segment's step times; note the first segment's baselines of the plan."""
        self.step_times += result.step_times_s
        self.overhead_s.append(max(seconds - sum(result.step_times_s), 0.0))
        for device, measured in result.device_compute_s.items():
            self.compute.setdefault(device, []).extend(measured)
        return result

    def _emit(self, event: ElasticEvent) -> None:
        self.events.append(event)
        self.on_event(event)

    def _move_cost_s(self) -> float:
        """A move's estimated cost: a pool start and a segment's overhead (its checkpoint loaded), medians so far
        (a given pool's start unseen: twice the overhead)."""
        overhead = statistics.median(self.overhead_s) if self.overhead_s else 0.0
        return (statistics.median(self.start_s) if self.start_s else overhead) + overhead

    # --- a device lost ------------------------------------------------------------------------------------------

    def _after_failure(
        self, pool: WorkerPool, result: TrainResult, done: int, until: int, began: float
    ) -> tuple[WorkerPool, TrainResult | None]:
        """After a failed segment: the pool of a new plan without the lost devices, or the failed result to end with."""
        fault = pool.last_fault
        pool.last_fault = None
        if fault is None or not fault.devices:
            return pool, result
        lost = tuple(d for d in fault.devices if d in self.context.cluster.device_names)
        steps_lost = self._steps_lost(fault.noticed_at - began, until - done)
        survivors = without(self.context.cluster, lost) if len(lost) < len(self.context.cluster.devices) else None
        try:
            if survivors is None:
                raise TappError("no device is left")
            context = CostContext(self.context.library, survivors, self.context.calibration, self.context.optimizer)
            plan, step_s = self.replan(self.plan, context)
        except TappError as exc:
            message = f"no plan fits on the devices left after losing {', '.join(lost)} ({exc}); kept {self.folder}"
            self._emit(ElasticEvent(NO_PLAN, done, message, lost, steps_lost))
            result.error = message
            return pool, result
        self.context = context
        message = (
            f"lost {', '.join(lost)} at step {done} + ~{steps_lost}; resuming from step {done} under plan {plan.id} "
            f"({', '.join(plan.devices)}; estimated {step_s:.3f} s a step)"
        )
        self._emit(ElasticEvent(LOST, done, message, lost, steps_lost, plan.id, {"estimated_step_s": step_s}))
        return self._move(pool, plan, done, step_s), None

    def _steps_lost(self, seconds: float, most: int) -> int:
        """The steps a segment that failed ``seconds`` after it began had trained: its time less a segment's usual
        overhead, over the usual step time (at most ``most``, the segment's)."""
        typical = statistics.median(self.step_times) if self.step_times else self.spans[-1].estimated_step_s
        overhead = statistics.median(self.overhead_s) if self.overhead_s else 0.0
        return min(most, max(0, int((seconds - overhead) / typical))) if typical > 0 else most

    def _move(self, pool: WorkerPool, plan: Plan, done: int, step_s: float) -> WorkerPool:
        pool.close()
        self.spans.append(PlanSpan(plan, done, step_s))
        self.baselines = {}
        return self._start_pool()

    # --- a device slows -----------------------------------------------------------------------------------------

    def _watch(self, pool: WorkerPool, done: int, segment: TrainResult) -> WorkerPool:
        """The slow-device rule over the last segment (its first step left out: it builds the stage); a re-plan and a
        move when it pays (``elastic_rules``). The plan's first segment sets each device's baseline."""
        if not self.options.watch_slow or done >= self.total:
            return pool
        estimated = estimate(self.plan, self.context).compute_s
        ratios = {
            d: compute_ratios(segment.device_compute_s.get(d, [])[1:], estimated.get(d, 0.0)) for d in self.plan.devices
        }
        if not self.baselines:
            for device, series in ratios.items():
                found = baseline(series, estimated.get(device, 0.0), self.options.rule)
                if found is not None:
                    self.baselines[device] = found
            return pool
        slowed: dict[str, float] = {}
        for device, series in beside_the_others(ratios, self.baselines).items():
            factor = slowdown(series, self.baselines[device], self.options.rule)
            if factor is not None:
                slowed[device] = factor
        if not slowed:
            return pool
        measured_s = statistics.median(segment.step_times_s[-self.options.rule.steps :] or [math.nan])
        return self._replan_slow(pool, done, slowed, measured_s)

    def _replan_slow(self, pool: WorkerPool, done: int, slowed: dict[str, float], measured_s: float) -> WorkerPool:
        exponent = self.context.calibration.slowdown_exponent
        speeds = {d: reestimated_speed(self.context.cluster.device(d).speed, f, exponent) for d, f in slowed.items()}
        context = CostContext(
            self.context.library,
            with_speeds(self.context.cluster, speeds),
            self.context.calibration,
            self.context.optimizer,
        )
        seen = ", ".join(f"{d} {f:.2f}x slower (speed {speeds[d]:.3g})" for d, f in slowed.items())
        running_s = estimate(self.plan, context).step_time_s
        values = {f"slowdown_{d}": f for d, f in slowed.items()} | {"running_step_s": running_s}
        self._emit(ElasticEvent(SLOW, done, f"step {done}: {seen}", tuple(slowed), values=values))
        self.context = context
        try:
            plan, step_s = self.replan(self.plan, context)
        except TappError as exc:
            self._emit(ElasticEvent(STAYED, done, f"step {done}: no other plan ({exc}); staying", tuple(slowed)))
            return pool
        measured = measured_s if math.isfinite(measured_s) else None
        verdict = migration(running_s, step_s, self.total - done, self._move_cost_s(), measured)
        values = {"running_step_s": running_s, "new_step_s": step_s, "gain_s": verdict.gain_s, "cost_s": verdict.cost_s}
        values |= {"measured_step_s": measured} if measured is not None else {}
        weighed = (
            f"plan {plan.id} ({', '.join(plan.devices)}) {step_s:.3f} s a step against {running_s:.3f} s"
            f"{f' (measured {measured:.3f} s)' if measured is not None else ''}: "
            f"gain {verdict.gain_s:.1f} s over {self.total - done} steps, move {verdict.cost_s:.1f} s"
        )
        if not verdict.migrate or plan.id == self.plan.id:
            self.spans[-1].estimated_step_s = running_s
            self._emit(ElasticEvent(STAYED, done, f"step {done}: {weighed}: staying", tuple(slowed), values=values))
            return pool
        self._emit(ElasticEvent(MIGRATED, done, f"step {done}: {weighed}: moving", tuple(slowed), 0, plan.id, values))
        return self._move(pool, plan, done, step_s)


__all__ = [
    "LOST",
    "MIGRATED",
    "NO_PLAN",
    "SLOW",
    "STAYED",
    "ElasticError",
    "ElasticEvent",
    "ElasticOptions",
    "ElasticResult",
    "ElasticTraining",
    "PlanSpan",
    "Replanner",
]
