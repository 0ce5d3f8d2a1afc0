"""Cost terms: the one definition of every time formula, and the ``Calibration`` whose constants they use.

The cost model's simulation (``tapp_core.costmodel``), the planners' closed-form arithmetic and lower bounds
(``tapp_core.planners``) and the runtime's link emulation (``tapp_core.runtime.emulation``, with the ideal
``DEFAULT_CALIBRATION``) all call these functions, so they cannot disagree on what an operation costs.

Compute
    One forward (or backward) of a micro-batch of ``samples`` samples on a device:
    ``(fixed_s + per_sample_s * samples) * compute_factor + per_micro_batch_s``, where ``compute_factor`` is
    ``slowdown ** slowdown_exponent * compute_scale`` and ``slowdown = 1 / device.speed``.
Update
    ``update_s_per_param_byte * param bytes * slowdown ** slowdown_exponent + per_step_s``.
Transfer
    ``tensors`` messages of ``nbytes`` in all over one link:
    ``tensors * (latency + per_message_s) + nbytes / (bandwidth * bandwidth_scale)``.
Ring allreduce
    Among ``k`` replicas, over the slowest link among them (least bandwidth, most latency):
    ``2 (k - 1) / k * param bytes / (bandwidth * bandwidth_scale) + 2 (k - 1) * (latency + per_message_s)``;
    0 for one replica.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from tapp_core.cluster import Cluster, Link


class CalibrationError(ValueError):
    """A calibration file or dictionary that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Calibration:
    """The constants that turn the ideal model into a fitted one. The defaults are the ideal model."""

    per_message_s: float = 0.0
    """Fixed cost of every message (tensor) sent, on top of the link latency."""
    per_step_s: float = 0.0
    """Fixed cost per step on every device, charged to its update."""
    per_micro_batch_s: float = 0.0
    """Fixed cost of every forward and every backward operation."""
    update_s_per_param_byte: float = 0.0
    """Optimizer step time per parameter byte of the stage, on the profiling device."""
    compute_scale: float = 1.0
    """Multiplies all layer compute times (profiled in isolation; a pipeline stage may run slower or faster)."""
    slowdown_exponent: float = 1.0
    """Compute on a device of slowdown ``x`` takes ``x ** slowdown_exponent`` times longer (emulation may differ)."""
    bandwidth_scale: float = 1.0
    """Effective fraction of the nominal link bandwidth."""
    note: str = ""
    """Where the constants came from (fitted on which cluster and runs)."""

    def __post_init__(self) -> None:
        for name in ("per_message_s", "per_step_s", "per_micro_batch_s", "update_s_per_param_byte"):
            if not getattr(self, name) >= 0:
                raise CalibrationError(f"calibration field {name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("compute_scale", "bandwidth_scale"):
            if not getattr(self, name) > 0:
                raise CalibrationError(f"calibration field {name} must be > 0, got {getattr(self, name)!r}")
        if not math.isfinite(self.slowdown_exponent):
            raise CalibrationError(
                f"calibration field slowdown_exponent must be finite, got {self.slowdown_exponent!r}"
            )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str = "<calibration>") -> Calibration:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CalibrationError(f"calibration {source} has unknown field(s): {', '.join(unknown)}")
        numbers: dict[str, Any] = {}  # floats, for the float fields (Any: ``note`` is a str field)
        for name, value in data.items():
            if name == "note":
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                numbers[name] = float(value)
            else:
                raise CalibrationError(f"calibration {source} field {name} must be a number, got {value!r}")
        try:
            return replace(cls(note=str(data.get("note", ""))), **numbers)
        except CalibrationError as exc:
            raise CalibrationError(f"calibration {source}: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "<calibration>") -> Calibration:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"calibration {source} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise CalibrationError(f"calibration {source} must be a JSON object")
        return cls.from_dict(data, source)

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.to_json() + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        src = Path(path)
        if not src.is_file():
            raise CalibrationError(f"calibration file {src} does not exist")
        return cls.from_json(src.read_text(), str(src))


DEFAULT_CALIBRATION = Calibration()
"""The ideal model: no overheads. The runtime's link emulation uses it (it emulates the links, not the runtime)."""


def compute_factor(cluster: Cluster, device: str, calibration: Calibration) -> float:
    """Seconds on ``device`` per second of work on the profiling device."""
    slowdown: float = (1.0 / cluster.device(device).speed) ** calibration.slowdown_exponent
    return slowdown * calibration.compute_scale


def compute_s(fixed_s: float, per_sample_s: float, samples: int, factor: float, calibration: Calibration) -> float:
    """One forward (or backward) of ``samples`` samples: profiled ``fixed_s + per_sample_s * samples`` seconds of
    work, on a device of ``compute_factor`` ``factor``."""
    return (fixed_s + per_sample_s * samples) * factor + calibration.per_micro_batch_s


def update_s(cluster: Cluster, device: str, param_bytes: float, calibration: Calibration) -> float:
    """The optimizer step of ``param_bytes`` of parameters on ``device``, with the fixed cost of a step."""
    slowdown: float = (1.0 / cluster.device(device).speed) ** calibration.slowdown_exponent
    return calibration.update_s_per_param_byte * param_bytes * slowdown + calibration.per_step_s


def transfer_s(link: Link, nbytes: float, tensors: int, calibration: Calibration) -> float:
    """``tensors`` messages of ``nbytes`` bytes in all, sent together over ``link``."""
    return tensors * (link.latency + calibration.per_message_s) + nbytes / (
        link.bandwidth * calibration.bandwidth_scale
    )


def ring_allreduce_s(replicas: int, param_bytes: float, links: Iterable[Link], calibration: Calibration) -> float:
    """Ring allreduce of ``param_bytes`` among ``replicas`` over the slowest of ``links`` (least bandwidth, most
    latency, taken separately)."""
    if replicas == 1:
        return 0.0
    chosen = list(links)
    bandwidth = min(link.bandwidth for link in chosen) * calibration.bandwidth_scale
    latency = max(link.latency for link in chosen) + calibration.per_message_s
    return 2 * (replicas - 1) / replicas * param_bytes / bandwidth + 2 * (replicas - 1) * latency


def allreduce_s(cluster: Cluster, devices: Sequence[str], param_bytes: float, calibration: Calibration) -> float:
    """Ring allreduce of a stage's gradients among its replicas ``devices``, over the slowest link among them."""
    if len(devices) == 1:
        return 0.0
    links = (cluster.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1 :])
    return ring_allreduce_s(len(devices), param_bytes, links, calibration)
