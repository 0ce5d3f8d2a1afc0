"""What the cost model returns for one plan: the ``Estimate`` of one step and the timeline of its operations.

``tapp_core.cost.simulation.estimate`` makes them. The estimate speaks the step's vocabulary
(``tapp_core.measure.step``): seconds per step and bytes, per device, under the names a ``Measurement`` uses, so
that the two compare term by term (``Estimate.terms``, ``tapp_core.measure.step.compare``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

from tapp_core.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tapp_core.measure.step import StepTerms, communication_share

OP_KINDS: tuple[str, ...] = ("forward", "backward", "send", "recv", "collective", "reduce", "allreduce", "update")


COMPUTE_KINDS = frozenset({"forward", "backward", "update"})


COMMUNICATION_KINDS = frozenset({"recv", "collective", "allreduce"})
"""Waits that count as communication: for a receive, for the layout changes inside a coupled stage's forward or
backward (``collective``, drawn after its compute), and for the gradient reductions before an update
(``allreduce``). Sends and the reductions themselves (``reduce``) overlap compute and do not count."""


UPDATE = "update"
NO_MICRO_BATCH = -1
"""``TimelineOp.micro_batch`` of operations that belong to a whole iteration (reduce, allreduce, update)."""


@dataclass(frozen=True, slots=True)
class TimelineOp:
    """One operation of one device: predicted by the cost model or recorded by the runtime."""

    device: str
    stage: int
    micro_batch: int
    """Index within its iteration; ``NO_MICRO_BATCH`` for allreduce and update."""
    kind: str
    """One of ``OP_KINDS``."""
    start: float
    end: float
    iteration: int = 0
    peer: str = ""
    """For send: the receiving device; for recv: the device whose transfer arrived last."""
    bucket: int = -1
    """For reduce: the gradient bucket (``tapp_core.plan.program.Bucket``)."""

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TimelineOp:
        kind = str(data["kind"])
        if kind not in OP_KINDS:
            raise ValueError(f"timeline operation kind {kind!r} is not one of {', '.join(OP_KINDS)}")
        return cls(
            device=str(data["device"]),
            stage=int(_number(data["stage"])),
            micro_batch=int(_number(data["micro_batch"])),
            kind=kind,
            start=float(_number(data["start"])),
            end=float(_number(data["end"])),
            iteration=int(_number(data.get("iteration", 0))),
            peer=str(data.get("peer", "")),
            bucket=int(_number(data.get("bucket", -1))),
        )


class Timeline(Sequence[TimelineOp]):
    """A read-only list of ``TimelineOp`` built on first use: a planner that needs only the step time of
    thousands of plans never pays for building their operations."""

    def __init__(self, build: Callable[[], list[TimelineOp]]) -> None:
        self._build: Callable[[], list[TimelineOp]] | None = build
        self._ops: list[TimelineOp] = []

    def _materialized(self) -> list[TimelineOp]:
        if self._build is not None:
            self._ops, self._build = self._build(), None
        return self._ops

    def __len__(self) -> int:
        return len(self._materialized())

    @overload
    def __getitem__(self, index: int) -> TimelineOp: ...
    @overload
    def __getitem__(self, index: slice) -> list[TimelineOp]: ...
    def __getitem__(self, index: int | slice) -> TimelineOp | list[TimelineOp]:
        return self._materialized()[index]

    def __iter__(self) -> Iterator[TimelineOp]:
        return iter(self._materialized())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Timeline({len(self)} operations)"


MemoryCurve = tuple[tuple[float, float], ...]
"""A device's memory in use over a timeline: (time, bytes) at the start and after every change."""


class MemoryCurves(Mapping[str, MemoryCurve]):
    """Per device, its ``MemoryCurve``, built on first use (``tapp_core.cost.memory_curve``), as ``Timeline``."""

    def __init__(self, build: Callable[[], Mapping[str, MemoryCurve]]) -> None:
        self._build: Callable[[], Mapping[str, MemoryCurve]] | None = build
        self._curves: Mapping[str, MemoryCurve] = {}

    def _materialized(self) -> Mapping[str, MemoryCurve]:
        if self._build is not None:
            self._curves, self._build = self._build(), None
        return self._curves

    def __getitem__(self, device: str) -> MemoryCurve:
        return self._materialized()[device]

    def __iter__(self) -> Iterator[str]:
        return iter(self._materialized())

    def __len__(self) -> int:
        return len(self._materialized())

    def __repr__(self) -> str:
        return f"MemoryCurves({len(self)} devices)"


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one plan, in the step's vocabulary (``tapp_core.measure.step``): seconds per
    step, bytes, per device."""

    plan_id: str
    step_time_s: float
    compute_s: dict[str, float]
    """Per device: forward, backward and update seconds per step."""
    communication_s: dict[str, float]
    """Per device: seconds per step waiting on communication that did not overlap compute."""
    idle_s: dict[str, float]
    """Per device: the rest of the step (pipeline bubbles, imbalance)."""
    peak_memory_bytes: dict[str, int]
    timeline: Sequence[TimelineOp] = field(repr=False)
    calibration: Calibration = DEFAULT_CALIBRATION
    memory_over_time: Mapping[str, MemoryCurve] = field(default_factory=dict, repr=False)
    """Per device: its memory in use over the timeline (the memory model's terms on it; none in an estimate written
    before they were)."""
    plan_memory_bytes: Mapping[str, int] = field(default_factory=dict)
    """Per device: the memory a plan may use there (``CostContext.plan_memory``)."""

    @property
    def terms(self) -> StepTerms:
        """The terms a ``Measurement`` has too (``tapp_core.measure.step.compare`` compares them)."""
        return StepTerms(self.step_time_s, self.compute_s, self.communication_s, self.peak_memory_bytes)

    @property
    def communication_share(self) -> float:
        return communication_share(self.communication_s, self.step_time_s)

    def to_dict(self, include_timeline: bool = True) -> dict[str, object]:
        data: dict[str, object] = {
            "plan_id": self.plan_id,
            "step_time_s": self.step_time_s,
            "communication_share": self.communication_share,
            "compute_s": dict(self.compute_s),
            "communication_s": dict(self.communication_s),
            "idle_s": dict(self.idle_s),
            "peak_memory_bytes": dict(self.peak_memory_bytes),
            "calibration": self.calibration.to_dict(),
        }
        if self.plan_memory_bytes:
            data["plan_memory_bytes"] = dict(self.plan_memory_bytes)
        if include_timeline:
            data["timeline"] = [op.to_dict() for op in self.timeline]
            data["memory_over_time"] = {d: [list(point) for point in c] for d, c in self.memory_over_time.items()}
        return data

    def to_json(self, include_timeline: bool = True) -> str:
        return json.dumps(self.to_dict(include_timeline), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Estimate:
        timeline = data.get("timeline", [])
        calibration = data.get("calibration", {})
        if not isinstance(timeline, list) or not isinstance(calibration, Mapping):
            raise ValueError("estimate: timeline must be a list and calibration a mapping")
        return cls(
            plan_id=str(data["plan_id"]),
            step_time_s=float(_number(data["step_time_s"])),
            compute_s=_number_map(data["compute_s"], float),
            communication_s=_number_map(data["communication_s"], float),
            idle_s=_number_map(data["idle_s"], float),
            peak_memory_bytes=_number_map(data["peak_memory_bytes"], int),
            timeline=[TimelineOp.from_dict(op) for op in timeline],
            calibration=Calibration.from_dict(calibration),
            memory_over_time=_curves(data.get("memory_over_time", {})),
            plan_memory_bytes=_number_map(data.get("plan_memory_bytes", {}), int),
        )


def _curves(value: object) -> dict[str, MemoryCurve]:
    """``Estimate.memory_over_time`` read from JSON: per device, a list of [time, bytes] pairs."""
    if not isinstance(value, Mapping):
        raise ValueError(f"estimate: memory_over_time must be a mapping, got {value!r}")
    curves = {}
    for device, points in value.items():
        if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 2 for p in points):
            raise ValueError(f"estimate: memory_over_time of {device!r} must be a list of [time, bytes] pairs")
        curves[str(device)] = tuple((float(_number(t)), float(_number(b))) for t, b in points)
    return curves


def _number(value: object) -> int | float | str:
    """A value read from JSON that ``int()`` or ``float()`` may convert."""
    if isinstance(value, int | float | str):
        return value
    raise ValueError(f"expected a number, got {value!r}")


_Number = TypeVar("_Number", int, float)


def _number_map(value: object, convert: Callable[[int | float | str], _Number]) -> dict[str, _Number]:
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping of names to numbers, got {value!r}")
    return {str(name): convert(_number(number)) for name, number in value.items()}


def breakdown(
    timeline: Iterable[TimelineOp], devices: Sequence[str], window: tuple[float, float], steps: int = 1
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per-device compute, communication and idle time per step, from the operations inside ``window``.

    Only the part of each operation inside the window counts; sends overlap compute and do not count. Works on
    a measured timeline as well as on a predicted one.
    """
    spans = ((op.device, op.kind, op.start, op.end) for op in timeline)
    busy, waiting = window_totals(spans, devices, window)
    return per_step(busy, waiting, window, steps)


_Key = TypeVar("_Key", bound=Hashable)


def window_totals(
    spans: Iterable[tuple[_Key, str, float, float]], keys: Iterable[_Key], window: tuple[float, float]
) -> tuple[dict[_Key, float], dict[_Key, float]]:
    """Compute and communication time inside ``window`` per key, from (key, kind, start, end) spans."""
    low, high = window
    busy = dict.fromkeys(keys, 0.0)
    waiting = dict.fromkeys(busy, 0.0)
    for key, kind, start, end in spans:
        if end <= low or start >= high:
            continue
        inside = min(end, high) - max(start, low)
        if kind in COMPUTE_KINDS:
            busy[key] += inside
        elif kind in COMMUNICATION_KINDS:
            waiting[key] += inside
    return busy, waiting


def per_step(
    busy: Mapping[str, float], waiting: Mapping[str, float], window: tuple[float, float], steps: int
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Window totals divided by the steps in the window; idle is what is left of each step."""
    step = (window[1] - window[0]) / steps
    compute = {d: t / steps for d, t in busy.items()}
    communication = {d: t / steps for d, t in waiting.items()}
    idle = {d: max(0.0, step - compute[d] - communication[d]) for d in compute}
    return compute, communication, idle
