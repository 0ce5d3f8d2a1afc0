"""The one definition of *step time* and *communication share*, and the Measurement a run produces.

Step time: one training step is forward and backward of every micro-batch of one mini-batch plus the
parameter update, on every device, until the last device is done. A run reports the median over the steps
after the warm-up (at least ``MIN_STEPS`` of them after ``DEFAULT_WARMUP``).

Communication share: for each device, the time it waited on sends/receives that did not overlap its compute,
divided by the step time; then averaged over devices.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_WARMUP = 2
MIN_STEPS = 5


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


def communication_share(wait_s: Mapping[str, float], step_time_s: float) -> float:
    """Mean over devices of (non-overlapped communication wait per step) / step time."""
    if not wait_s or step_time_s <= 0:
        return 0.0
    return sum(min(w, step_time_s) for w in wait_s.values()) / (len(wait_s) * step_time_s)


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
    device_wait_s: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    loss: float = float("nan")
    emulated: bool = False
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

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
        values: dict[str, Any] = {k: v for k, v in data.items() if k in known}  # as stored by to_dict
        return cls(**values)
