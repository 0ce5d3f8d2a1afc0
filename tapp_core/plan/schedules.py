"""Pipeline schedules: the order in which one stage runs its forwards, backwards and updates.

A schedule is a small class with a name in the registry (``SCHEDULE_CLASSES``; ``schedule_for(name, staleness)``
returns one). Its ``compute_order`` is a stage's forwards, backwards and updates over a number of steps; the
communication around them (the receives before and the sends after each, the gradient reductions before each
update) is added to it by ``tapp_core.plan.program``, once for the runtime and the cost model alike. Everything else
about a schedule follows from its order and is computed from it, never restated: the micro-batches a stage holds
at its peak (``in_flight``), the weight versions it must keep (``weight_versions``: a forward whose backward comes
after an update ran on weights that are no longer current), whether it flushes every step (``synchronous``), and
the iterations a steady state needs (``window``).

Micro-batches are numbered globally, ``step * micro_batches + j``, so a schedule can run across steps (the
asynchronous one does). Every replica of a stage runs its stage's order. BSP and single-device training are
one-stage plans.

``async`` is PipeDream's and APapo's asynchronous pipeline: 1F1B across steps with no flush, at most
``n_stages - stage`` micro-batches in flight on a stage, and a stage updates as soon as it has run the backward of
its step's last micro-batch. Its ``staleness`` K bounds the weight delay: a stage runs the forward of step t only
once it has applied the update of step t - K - 1, so every gradient is applied at most K updates after the weights
it was computed on were current. K = 0 is synchronous 1F1B; no bound (None) lets the pipeline's depth decide.
"""

from __future__ import annotations

import functools
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from tapp_core.errors import TappError

ActionKind = Literal[
    "forward", "backward", "update", "recv_forward", "send_forward", "recv_backward", "send_backward", "reduce", "tie"
]
COMPUTE_ACTIONS: frozenset[str] = frozenset({"forward", "backward", "update"})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a device's program.

    ``index`` is the global micro-batch of a forward, a backward, or a send or receive of one of their tensors,
    and the step of an update or a reduction. A send or receive names its ``peer`` (the other device's position in
    the plan's device order), the cut ``values`` it carries (each by the library index of the layer that produced
    it) and the micro-batch ``rows`` ``[lo, hi)`` it carries of them. A reduction names its gradient ``bucket``, a
    tie (the sum of a tied parameter's gradients among its holders, ``tapp_core.plan.ties``) its tie in ``bucket``.
    """

    kind: ActionKind
    index: int
    peer: int = -1
    values: tuple[int, ...] = ()
    rows: tuple[int, int] = (0, 0)
    bucket: int = -1

    def __str__(self) -> str:
        if self.kind in ("update", "reduce", "tie"):
            where = (
                f" {'bucket' if self.kind == 'reduce' else 'parameter'} {self.bucket}" if self.kind != "update" else ""
            )
            return f"{self.kind}{where} of step {self.index}"
        text = f"{self.kind.replace('_', ' ')} of micro-batch {self.index}"
        if self.peer >= 0:
            direction = "from" if self.kind.startswith("recv") else "to"
            text += (
                f" {direction} device #{self.peer} (values {list(self.values)}, rows {self.rows[0]}..{self.rows[1]})"
            )
        return text


class UnknownScheduleError(TappError):
    """A schedule name (or staleness) that the registry does not have; the message lists the choices."""


class PipelineSchedule(ABC):
    name: ClassVar[str]
    staleness: int | None = 0
    """The most updates a gradient may be applied after the weights it was computed on (0: synchronous)."""

    @abstractmethod
    def compute_order(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> tuple[Action, ...]:
        """Every forward, backward and update of ``stage`` over ``steps`` steps, in order."""

    @property
    def synchronous(self) -> bool:
        """Every step's forwards run on the weights of the step before: the plan trains exactly like one device."""
        return self.staleness == 0

    def window(self, n_stages: int, micro_batches: int) -> tuple[int, int, int]:
        """(warm-up steps, measured steps, steps after them) that give a steady-state time per step: one measured
        step for a synchronous schedule. Otherwise the pipeline fill plus one step of warm-up, enough measured
        steps to cover ``MEASURED_MICRO_BATCHES_PER_STAGE`` micro-batches per stage (the steady state may repeat
        only every few steps), and enough steps after them that no stage drains while they run."""
        if self.synchronous:
            return 0, 1, 0
        fill = math.ceil(n_stages / micro_batches)
        measured = max(MIN_MEASURED_STEPS, math.ceil(MEASURED_MICRO_BATCHES_PER_STAGE * n_stages / micro_batches))
        return fill + 1, measured, fill

    def in_flight(self, stage: int, n_stages: int, micro_batches: int) -> int:
        """Micro-batches whose activations ``stage`` holds at its peak (forwards done, backwards not yet)."""
        return _peaks(self, stage, n_stages, micro_batches)[0]

    def weight_versions(self, stage: int, n_stages: int, micro_batches: int) -> int:
        """Extra weight versions ``stage`` keeps at its peak: one per distinct version that forwards in flight ran
        on, where some forward's backward comes after an update (weight stashing); none otherwise."""
        return _peaks(self, stage, n_stages, micro_batches)[1]

    def stashes_weights(self, stage: int, n_stages: int, micro_batches: int) -> bool:
        return self.weight_versions(stage, n_stages, micro_batches) > 0

    def delay(self, stage: int, n_stages: int, micro_batches: int) -> int:
        """The most updates ``stage`` applies between a forward and its backward in the steady state: the age of the
        weights its gradients were computed on when they are applied (0 for a synchronous schedule; at most the
        ``staleness`` bound, and below it where the pipeline is too shallow to reach it)."""
        return _peaks(self, stage, n_stages, micro_batches)[2]

    def round_trip_cover(self, stage: int, n_stages: int, micro_batches: int) -> int:
        """Backwards ``stage`` runs between the forward and the backward of a step's last micro-batch: the time
        they take can hide that micro-batch's round trip through the later stages."""
        order = self.compute_order(stage, n_stages, micro_batches, 1)
        last = micro_batches - 1
        first = order.index(Action("forward", last))
        stop = order.index(Action("backward", last))
        return sum(1 for action in order[first + 1 : stop] if action.kind == "backward")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(staleness={self.staleness})"


MIN_MEASURED_STEPS = 3
MEASURED_MICRO_BATCHES_PER_STAGE = 4


def forward_delays(order: Sequence[Action]) -> dict[int, int]:
    """Per forward of a compute order (by micro-batch): the updates that come between it and its backward."""
    updates = 0
    at_forward: dict[int, int] = {}
    delays: dict[int, int] = {}
    for action in order:
        if action.kind == "forward":
            at_forward[action.index] = updates
        elif action.kind == "backward" and action.index in at_forward:
            delays[action.index] = updates - at_forward.pop(action.index)
        elif action.kind == "update":
            updates += 1
    return delays


@functools.lru_cache(maxsize=1024)
def _peaks(schedule: PipelineSchedule, stage: int, n_stages: int, micro_batches: int) -> tuple[int, int, int]:
    """(micro-batches in flight, extra weight versions, updates between a forward and its backward) at their peaks
    over enough steps for a steady state."""
    warmup, measured, tail = schedule.window(n_stages, micro_batches)
    order = schedule.compute_order(stage, n_stages, micro_batches, warmup + measured + tail + 1)
    delay = max(forward_delays(order).values(), default=0)
    version = 0
    flying: dict[int, int] = {}  # micro-batch -> the weight version its forward ran on
    peak_flying = peak_versions = 0
    stashes = False
    for action in order:
        if action.kind == "forward":
            flying[action.index] = version
        elif action.kind == "backward":
            stashes = flying.pop(action.index) != version or stashes
        else:
            version += 1
        peak_flying = max(peak_flying, len(flying))
        peak_versions = max(peak_versions, len(set(flying.values())))
    return peak_flying, (peak_versions if stashes else 0), delay


def receive_lookahead(micro_batches: int, n_stages: int) -> int:
    """Actions past the current one whose receives a device has posted (``runtime.engine``): more than a step's, so
    that a message finds its receive posted and arrives while the device computes. A posted receive holds its
    buffer until its forward or backward takes it: the memory model's "posted receives" (``posted_receives``)."""
    return 4 * (micro_batches + n_stages) + 8


@functools.lru_cache(maxsize=4096)
def posted_receives(
    schedule: PipelineSchedule, stage: int, n_stages: int, micro_batches: int, forward: bool, backward: bool
) -> tuple[tuple[int, int], ...]:
    """The (forward, backward) receives a device of ``stage`` has posted and not yet taken at once, at the points
    of its program where no other point has as many of both (``forward``/``backward``: whether the stage receives
    activations / gradients). Its program as ``program.DeviceProgram.actions`` lays it out with one peer each way:
    a forward's receive, the forward and its send (a stage that receives gradients sends activations), a backward
    likewise, and the update; the receives posted are those of the next ``receive_lookahead`` actions."""
    warmup, measured, tail = schedule.window(n_stages, micro_batches)
    marks: list[tuple[int, int]] = []
    for action in schedule.compute_order(stage, n_stages, micro_batches, warmup + measured + tail + 1):
        takes, gives, mark = (forward, backward, (1, 0)) if action.kind == "forward" else (backward, forward, (0, 1))
        if action.kind != "update" and takes:
            marks.append(mark)
        marks.append((0, 0))
        if action.kind != "update" and gives:
            marks.append((0, 0))
    window = receive_lookahead(micro_batches, n_stages) + 1
    sums = [(0, 0), *itertools.accumulate(marks, lambda a, b: (a[0] + b[0], a[1] + b[1]))]
    ends = [sums[min(i + window, len(marks))] for i in range(len(marks))]
    counts = {(end[0] - start[0], end[1] - start[1]) for start, end in zip(sums, ends, strict=False)}
    return tuple(sorted(c for c in counts if not any(o != c and o[0] >= c[0] and o[1] >= c[1] for o in counts)))


class GPipe(PipelineSchedule):
    """Fill and drain: every forward, then every backward, the last micro-batch's first (GPipe, torchgpipe)."""

    name = "gpipe"

    def compute_order(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> tuple[Action, ...]:
        order: list[Action] = []
        for step in range(steps):
            base = step * micro_batches
            order += [Action("forward", base + j) for j in range(micro_batches)]
            order += [Action("backward", base + j) for j in reversed(range(micro_batches))]
            order.append(Action("update", step))
        return tuple(order)


def _one_f_one_b(stage: int, n_stages: int, micro_batches: int, steps: int, staleness: int | None) -> list[Action]:
    """1F1B over ``steps`` steps: a forward whenever fewer than ``n_stages - stage`` micro-batches are in flight and
    the staleness bound lets the forward's step start (this stage has applied the update of step t - K - 1), a
    backward otherwise; each step's update right after the backward of its last micro-batch."""
    cap = n_stages - stage
    total = micro_batches * steps
    order: list[Action] = []
    forwards = backwards = updates = 0
    while backwards < total:
        step = forwards // micro_batches
        allowed = staleness is None or step - staleness - 1 < updates
        if forwards < total and forwards - backwards < cap and allowed:
            order.append(Action("forward", forwards))
            forwards += 1
            continue
        order.append(Action("backward", backwards))
        backwards += 1
        if backwards % micro_batches == 0:
            order.append(Action("update", backwards // micro_batches - 1))
            updates += 1
    return order


class OneFOneB(PipelineSchedule):
    """Synchronous 1F1B (PipeDream-flush): at most ``n_stages - stage`` micro-batches in flight on a stage, and
    the pipeline drains before every update."""

    name = "1f1b"

    def compute_order(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> tuple[Action, ...]:
        return tuple(_one_f_one_b(stage, n_stages, micro_batches, steps, staleness=0))


class Async(PipelineSchedule):
    """PipeDream/APapo: 1F1B across steps with weight stashing, bounded by ``staleness`` (see the module)."""

    name = "async"

    def __init__(self, staleness: int | None = None) -> None:
        if staleness is not None and staleness < 0:
            raise UnknownScheduleError(f"staleness must be 0 or more, got {staleness}")
        self.staleness = staleness

    def compute_order(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> tuple[Action, ...]:
        return tuple(_one_f_one_b(stage, n_stages, micro_batches, steps, self.staleness))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Async) and other.staleness == self.staleness

    def __hash__(self) -> int:
        return hash((self.name, self.staleness))


class ForwardOnly(PipelineSchedule):
    """Inference (evaluation): forwards only, no update. Not a training schedule, so not in the registry."""

    name = "forward"

    def compute_order(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> tuple[Action, ...]:
        return tuple(Action("forward", g) for g in range(micro_batches * steps))


FORWARD_ONLY = ForwardOnly()

SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {cls.name: cls for cls in (GPipe, OneFOneB, Async)}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_CLASSES)
"""The schedule names a plan may give."""
BOUNDED: frozenset[str] = frozenset({Async.name})
"""The schedules that take a staleness bound."""

_INSTANCES: dict[tuple[str, int | None], PipelineSchedule] = {}


def schedule_for(name: str, staleness: int | None = None) -> PipelineSchedule:
    """The schedule called ``name`` (with ``staleness``, for those that take one); ``UnknownScheduleError`` (a
    ``ValueError``) naming the choices otherwise. Schedules hold no state, so one instance serves every caller."""
    cls = SCHEDULE_CLASSES.get(name)
    if cls is None:
        raise UnknownScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if staleness is not None and name not in BOUNDED:
        raise UnknownScheduleError(f"schedule {name!r} takes no staleness (only {', '.join(sorted(BOUNDED))} does)")
    key = (name, staleness)
    if key not in _INSTANCES:
        _INSTANCES[key] = Async(staleness) if cls is Async else cls()
    return _INSTANCES[key]


def schedule_spec(name: str, staleness: int | None = None) -> str:
    """One string for a schedule and its staleness bound, as planners pass it around: ``async:1``, ``1f1b`` (a
    staleness is dropped for a schedule that takes none)."""
    return f"{name}:{staleness}" if staleness is not None and name in BOUNDED else name


def parse_schedule_spec(spec: str) -> tuple[str, int | None]:
    """(name, staleness) of a ``schedule_spec``; ``UnknownScheduleError`` for a name or bound that is not one."""
    name, _, bound = spec.partition(":")
    try:
        staleness = int(bound) if bound else None
    except ValueError:
        raise UnknownScheduleError(f"schedule {spec!r}: the staleness after ':' must be a whole number") from None
    schedule_for(name, staleness)
    return name, staleness
