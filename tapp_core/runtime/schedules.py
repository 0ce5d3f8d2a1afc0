"""Pipeline schedules: the order in which one stage runs forwards, backwards and updates.

A schedule only orders work; the engine runs it over a stage and a transport. Micro-batches are numbered
globally, ``step * micro_batches + j``, so a schedule can run across steps (the asynchronous one does). Every
replica of a stage runs its stage's order. BSP and single-device training are one-stage plans under GPipe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

ActionKind = Literal["forward", "backward", "update"]


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    index: int
    """The global micro-batch for forward and backward; the step for update."""


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

    def actions(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> list[Action]:
        """Every action of ``stage`` over ``steps`` steps, in order."""
        order: list[Action] = []
        for step in range(steps):
            base = step * micro_batches
            order += [Action(kind, base + j) for kind, j in self.step_order(stage, n_stages, micro_batches)]
            order.append(Action("update", step))
        return order

    @abstractmethod
    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        """Forwards and backwards of one step, micro-batches numbered 0..micro_batches-1."""


class GPipe(PipelineSchedule):
    """Fill and drain: every forward, then every backward, the last micro-batch's first (GPipe, torchgpipe;
    the cost model assumes the same order)."""

    name = "gpipe"

    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        forwards: list[tuple[ActionKind, int]] = [("forward", j) for j in range(micro_batches)]
        return forwards + [("backward", j) for j in reversed(range(micro_batches))]


class OneFOneB(PipelineSchedule):
    """Synchronous 1F1B (PipeDream-flush): at most ``n_stages - stage`` micro-batches in flight on a stage."""

    name = "1f1b"

    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        return _one_f_one_b(stage, n_stages, micro_batches)


class Async(PipelineSchedule):
    """PipeDream/APapo: 1F1B across steps with no flush, and weight stashing.

    Step k+1's first forwards run before step k's update on all but the last stage; a stage updates as soon
    as it has done the backward of its step's last micro-batch, and each backward uses the weights its forward
    used.
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


class ForwardOnly(PipelineSchedule):
    """Inference (evaluation): forwards only, no update."""

    name = "forward"

    def actions(self, stage: int, n_stages: int, micro_batches: int, steps: int) -> list[Action]:
        return [Action("forward", g) for g in range(micro_batches * steps)]

    def step_order(self, stage: int, n_stages: int, micro_batches: int) -> list[tuple[ActionKind, int]]:
        return [("forward", j) for j in range(micro_batches)]


SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {cls.name: cls for cls in (GPipe, OneFOneB, Async)}


def schedule_for(name: str) -> PipelineSchedule:
    try:
        return SCHEDULE_CLASSES[name]()
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_CLASSES)}") from None
