"""Pipeline schedules: the order in which one stage runs forwards, backwards and updates.

This module is the one definition of a schedule's semantics. The runtime's engine runs ``actions(...)``; the cost
model simulates the same list over its iterations; a plan's memory asks ``in_flight`` and ``weight_versions``;
the planners' lower bound asks ``synchronous`` and ``round_trip_cover``. A schedule only orders work; the engine
runs it over a stage and a transport.

Micro-batches are numbered globally, ``step * micro_batches + j``, so a schedule can run across steps (the
asynchronous one does). Every replica of a stage runs its stage's order. BSP and single-device training are
one-stage plans under GPipe. ``SCHEDULE_CLASSES`` is the registry of the schedules a plan may name
(``SCHEDULES``); ``schedule_for(name)`` returns one, and names the choices for an unknown name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

from tapp_core.errors import TappError

ActionKind = Literal["forward", "backward", "update"]


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    index: int
    """The global micro-batch for forward and backward; the step for update."""


class UnknownScheduleError(TappError):
    """A schedule name that is not in the registry; the message lists the choices."""


def _one_f_one_b(stage: int, n_stages: int, n_micro: int) -> list[tuple[ActionKind, int]]:
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(n_stages - stage - 1, n_micro)
    order: list[tuple[ActionKind, int]] = [("forward", i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    order += [("backward", i) for i in range(n_micro - warmup, n_micro)]
    return order


class PipelineSchedule(ABC):
    name: ClassVar[str]
    synchronous: ClassVar[bool] = True
    """Synchronous schedules flush the pipeline every step, so they train exactly like one device."""
    stashes_weights: ClassVar[bool] = False
    """Each backward uses the weights its forward used, so a stage keeps a weight version per micro-batch in
    flight."""

    def actions(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> list[Action]:
        """Every action of ``stage`` over ``steps`` steps, in order: the program the runtime runs and the cost
        model simulates."""
        order: list[Action] = []
        for step in range(steps):
            base = step * micro_batches
            order += [Action(kind, base + j) for kind, j in self.step_order(stage, n_stages, micro_batches)]
            order.append(Action("update", step))
        return order

    @abstractmethod
    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        """Forwards and backwards of one step, micro-batches numbered 0..micro_batches-1."""

    @abstractmethod
    def in_flight(self, stage: int, n_stages: int, micro_batches: int) -> int:
        """Micro-batches whose activations ``stage`` holds at its peak (forwards done, backwards not yet)."""

    def weight_versions(self, stage: int, n_stages: int, micro_batches: int) -> int:
        """Extra weight versions ``stage`` keeps at its peak: one per micro-batch in flight when it stashes
        weights, none otherwise."""
        return self.in_flight(stage, n_stages, micro_batches) if self.stashes_weights else 0

    def round_trip_cover(self, stage: int, n_stages: int, micro_batches: int) -> int:
        """Backwards ``stage`` runs between the forward and the backward of a step's last micro-batch: the time
        they take can hide that micro-batch's round trip through the later stages."""
        order = self.step_order(stage, n_stages, micro_batches)
        last = micro_batches - 1
        first, stop = order.index(("forward", last)), order.index(("backward", last))
        return sum(1 for kind, _ in order[first + 1 : stop] if kind == "backward")


class GPipe(PipelineSchedule):
    """Fill and drain: every forward, then every backward, the last micro-batch's first (GPipe, torchgpipe)."""

    name = "gpipe"

    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        forwards: list[tuple[ActionKind, int]] = [("forward", j) for j in range(micro_batches)]
        return forwards + [("backward", j) for j in reversed(range(micro_batches))]

    def in_flight(self, stage: int, n_stages: int, micro_batches: int) -> int:
        return micro_batches


class OneFOneB(PipelineSchedule):
    """Synchronous 1F1B (PipeDream-flush): at most ``n_stages - stage`` micro-batches in flight on a stage."""

    name = "1f1b"

    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        return _one_f_one_b(stage, n_stages, micro_batches)

    def in_flight(self, stage: int, n_stages: int, micro_batches: int) -> int:
        return min(micro_batches, n_stages - stage)


class Async(PipelineSchedule):
    """PipeDream/APapo: 1F1B across steps with no flush, and weight stashing.

    Step k+1's first forwards run before step k's update on all but the last stage; a stage updates as soon
    as it has done the backward of its step's last micro-batch, and each backward uses the weights its forward
    used. Running across steps, a stage has ``n_stages - stage`` micro-batches in flight however few a step has.
    """

    name = "async"
    synchronous = False
    stashes_weights = True

    def actions(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> list[Action]:
        order: list[Action] = []
        for kind, g in _one_f_one_b(stage, n_stages, micro_batches * steps):
            order.append(Action(kind, g))
            if kind == "backward" and g % micro_batches == micro_batches - 1:
                order.append(Action("update", g // micro_batches))
        return order

    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        return _one_f_one_b(stage, n_stages, micro_batches)

    def in_flight(self, stage: int, n_stages: int, micro_batches: int) -> int:
        return n_stages - stage


class ForwardOnly(PipelineSchedule):
    """Inference (evaluation): forwards only, no update. Not a training schedule, so not in the registry."""

    name = "forward"

    def actions(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> list[Action]:
        return [Action("forward", g) for g in range(micro_batches * steps)]

    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        return [("forward", j) for j in range(micro_batches)]

    def in_flight(self, stage: int, n_stages: int, micro_batches: int) -> int:
        return 0  # no backward follows, so no activations are kept for one


SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {cls.name: cls for cls in (GPipe, OneFOneB, Async)}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_CLASSES)
"""The schedule names a plan may give."""

# Schedules hold no state, so one instance of each serves every caller.
_INSTANCES: dict[str, PipelineSchedule] = {name: cls() for name, cls in SCHEDULE_CLASSES.items()}


def schedule_for(name: str) -> PipelineSchedule:
    """The schedule called ``name``; ``UnknownScheduleError`` (a ``ValueError``) naming the choices otherwise."""
    try:
        return _INSTANCES[name]
    except KeyError:
        raise UnknownScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None
