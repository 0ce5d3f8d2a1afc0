"""Cost terms: the one definition of every time formula, and the ``Calibration`` whose constants they use.

The cost model's simulation (``tapp_core.costmodel``), the planners' closed-form arithmetic and lower bounds
(``tapp_core.planners``) and the runtime's link emulation (``tapp_core.runtime.emulation``, with the ideal
``DEFAULT_CALIBRATION``) all call these functions, so they cannot disagree on what an operation costs.

A device is costed from the layer library of its kind, with its kind's figures of the calibration
(``KindCalibration``; a kind the calibration does not list gets its top-level fields) and the slowdown of its
``speed`` where that applies (``tapp_core.kinds`` says which library and when ``speed`` applies):
``DeviceTerms``, from ``device_terms(library, cluster, calibration)``. Below, ``slowdown`` is
``(1 / device.speed) ** slowdown_exponent`` where the speed applies and 1 where it does not.

Compute
    One forward (or backward) of a micro-batch of ``samples`` samples on a device:
    ``(fixed_s + per_sample_s * samples) * compute_factor + per_micro_batch_s``, where ``fixed_s`` and
    ``per_sample_s`` come from the device's library and ``compute_factor`` is ``slowdown * compute_scale``.
Update
    ``update_s_per_param_byte * param bytes * slowdown + per_step_s``.
Transfer
    ``tensors`` messages of ``nbytes`` in all over one link:
    ``tensors * (latency + per_message_s) + nbytes / (bandwidth * bandwidth_scale)``; plus, when MPI is not
    CUDA-aware (``Calibration.cuda_aware_mpi``), the staging of a GPU end through host memory: a GPU sender's
    ``tensors * staging_per_copy_s + nbytes * d2h_s_per_byte`` and a GPU receiver's
    ``tensors * staging_per_copy_s + nbytes * h2d_s_per_byte`` (``staging_s``).
Ring allreduce
    Among ``k`` replicas, over the slowest link among them (least bandwidth, most latency):
    ``2 (k - 1) / k * param bytes / (bandwidth * bandwidth_scale) + 2 (k - 1) * (latency + per_message_s)``;
    0 for one replica. GPU replicas without CUDA-aware MPI stage the gradients to the host and back: the
    slowest replica's ``2 * staging_per_copy_s + param bytes * (d2h_s_per_byte + h2d_s_per_byte)`` is added.
Shared cores
    Where the ranks of one host want more threads than it has cores (``Calibration.host_cores``, measured by
    ``tapp calibrate``), a device computes slower while ``A`` threads of the host compute (its own included): its
    work progresses at ``1 / (1 + (shared_cores_factor - 1) * clamp((A - cores) / (host threads - cores), 0, 1))``
    of its speed alone, so not slower while the computing threads fit the cores, and by its kind's measured
    ``shared_cores_factor`` while every rank computes (``sharing_excess``, ``sharing_stretch``). The
    measured factor, not ``threads / cores``, because sharing is far from even: on 2 cores, a 1-thread and a
    2-thread rank computing VGG-16 together slowed by 1.06x and 7.1x (the 2-thread rank's threads wait for each
    other), Inception-V3 by 1.04x and 11.5x.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from tapp_core.cluster import Cluster, Link
from tapp_core.errors import TappError
from tapp_core.kinds import device_library
from tapp_core.library import LayerLibrary
from tapp_core.placement import Collective, traffic


class CalibrationError(TappError):
    """A calibration file or dictionary that cannot be used; the message names the field."""


def _numbers(cls: type[Any], data: Mapping[str, object], source: str, skip: Iterable[str] = ()) -> dict[str, Any]:
    """``data``'s fields of dataclass ``cls`` as floats; an unknown field or a value that is not a number is an
    error naming it."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CalibrationError(f"calibration {source} has unknown field(s): {', '.join(unknown)}")
    numbers: dict[str, Any] = {}
    for name, value in data.items():
        if name in skip:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers[name] = float(value)
        else:
            raise CalibrationError(f"calibration {source} field {name} must be a number, got {value!r}")
    return numbers


def _check_non_negative(owner: object, names: Iterable[str], where: str = "") -> None:
    for name in names:
        if not getattr(owner, name) >= 0:
            raise CalibrationError(f"calibration field {where}{name} must be >= 0, got {getattr(owner, name)!r}")


@dataclass(frozen=True)
class KindCalibration:
    """One device kind's figures (``Calibration.kinds``), measured by ``tapp calibrate`` on a device of the kind."""

    compute_scale: float = 1.0
    """Measured compute over the kind's library's: a whole-model step on one device of the kind against the sum
    of its layers."""
    per_micro_batch_s: float = 0.0
    """Fixed cost of every forward and every backward beyond the library's per-layer fixed parts (a GPU's
    launches, the runtime's own work per operation)."""
    update_s_per_param_byte: float = 0.0
    """The optimiser's step per parameter byte (a GPU updates far faster than a CPU rank)."""
    per_step_s: float = 0.0
    """Fixed cost of every update."""
    d2h_s_per_byte: float = 0.0
    """A GPU kind's copy to host memory per byte (staging a tensor for MPI); 0 on a CPU."""
    h2d_s_per_byte: float = 0.0
    """A GPU kind's copy from host memory per byte."""
    staging_per_copy_s: float = 0.0
    """A GPU kind's fixed cost of one staging copy (launch and wait)."""
    shared_cores_factor: float = 1.0
    """On a host whose ranks want more threads than it has cores (``Calibration.host_cores``): a device of the
    kind's compute while every rank of the host computes, over its compute alone (``sharing_stretch``)."""

    def __post_init__(self) -> None:
        positive = ("compute_scale", "shared_cores_factor")
        _check_non_negative(self, (f.name for f in fields(self) if f.name not in positive), "kinds.")
        for name in positive:
            if not getattr(self, name) > 0:
                raise CalibrationError(f"calibration field kinds.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def stages_through_host(self) -> bool:
        return bool(self.d2h_s_per_byte or self.h2d_s_per_byte or self.staging_per_copy_s)


@dataclass(frozen=True)
class MadeFor:
    """What a measured calibration was made for; ``tapp_core.calibration`` refuses it anywhere else."""

    host: str
    cluster: str
    kinds: tuple[str, ...]
    """The kinds of the cluster's devices, by name."""
    torch_version: str
    profiler_version: int
    model: str
    batch_size: int
    cuda_aware_mpi: bool
    date: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str) -> MadeFor:
        try:
            kinds = data["kinds"]
            if not isinstance(kinds, list | tuple):
                raise TypeError("kinds must be a list")
            return cls(
                host=str(data["host"]),
                cluster=str(data["cluster"]),
                kinds=tuple(str(k) for k in kinds),
                torch_version=str(data["torch_version"]),
                profiler_version=int(str(data["profiler_version"])),
                model=str(data["model"]),
                batch_size=int(str(data["batch_size"])),
                cuda_aware_mpi=bool(data["cuda_aware_mpi"]),
                date=str(data.get("date", "")),
            )
        except KeyError as exc:
            raise CalibrationError(f"calibration {source}: made_for has no {exc} field") from None
        except (TypeError, ValueError) as exc:
            raise CalibrationError(f"calibration {source}: made_for is malformed: {exc}") from None


@dataclass(frozen=True)
class Calibration:
    """The constants that turn the ideal model into a fitted one. The defaults are the ideal model.

    The top-level compute, update and per-operation fields are those of every kind ``kinds`` does not list."""

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
    host_cores: float = 0.0
    """The cores of each host the cluster's ranks run on, where they want more threads than that (0: the ranks
    were not found sharing cores; no sharing is costed). See ``shared_hosts``."""
    note: str = ""
    """Where the constants came from (fitted on which cluster and runs)."""
    kinds: Mapping[str, KindCalibration] = field(default_factory=dict)
    """Per device kind (``tapp_core.kinds.DeviceKind.name``): its own compute, update and staging figures."""
    cuda_aware_mpi: bool = False
    """Whether MPI reads GPU memory itself (``TAPP_MPI_CUDA_AWARE=1``): then no tensor is staged through the host."""
    made_for: MadeFor | None = None
    """What a measured calibration was made for; None for one made by hand (tests, what-if studies)."""

    def __post_init__(self) -> None:
        _check_non_negative(
            self, ("per_message_s", "per_step_s", "per_micro_batch_s", "update_s_per_param_byte", "host_cores")
        )
        for name in ("compute_scale", "bandwidth_scale"):
            if not getattr(self, name) > 0:
                raise CalibrationError(f"calibration field {name} must be > 0, got {getattr(self, name)!r}")
        if not math.isfinite(self.slowdown_exponent):
            raise CalibrationError(
                f"calibration field slowdown_exponent must be finite, got {self.slowdown_exponent!r}"
            )

    def for_kind(self, kind: str) -> KindCalibration:
        """The figures of device kind ``kind``: its own, else the top-level ones (no staging)."""
        found = self.kinds.get(kind)
        if found is not None:
            return found
        return KindCalibration(
            compute_scale=self.compute_scale,
            per_micro_batch_s=self.per_micro_batch_s,
            update_s_per_param_byte=self.update_s_per_param_byte,
            per_step_s=self.per_step_s,
        )

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["kinds"] = {name: asdict(figures) for name, figures in self.kinds.items()}
        if self.made_for is not None:
            data["made_for"] = {**asdict(self.made_for), "kinds": list(self.made_for.kinds)}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str = "<calibration>") -> Calibration:
        extra = ("note", "kinds", "cuda_aware_mpi", "made_for")
        numbers = _numbers(cls, data, source, skip=extra)
        kinds = data.get("kinds") or {}
        if not isinstance(kinds, Mapping):
            raise CalibrationError(f"calibration {source} field kinds must be a mapping of kind names")
        made_for = data.get("made_for")
        if made_for is not None and not isinstance(made_for, Mapping):
            raise CalibrationError(f"calibration {source} field made_for must be a mapping")
        try:
            parsed_kinds = {}
            for name, figures in kinds.items():
                if not isinstance(figures, Mapping):
                    raise CalibrationError(f"calibration {source} kind {name} must be a mapping")
                parsed_kinds[str(name)] = KindCalibration(**_numbers(KindCalibration, figures, f"{source} kind {name}"))
            return replace(
                cls(
                    note=str(data.get("note", "")),
                    kinds=parsed_kinds,
                    cuda_aware_mpi=bool(data.get("cuda_aware_mpi", False)),
                    made_for=MadeFor.from_dict(made_for, source) if made_for is not None else None,
                ),
                **numbers,
            )
        except CalibrationError as exc:
            message = str(exc)
            raise CalibrationError(message if source in message else f"calibration {source}: {message}") from None

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


# ---------------------------------------------------------------------------------------------------------------
# What one device of a cluster costs


@dataclass(frozen=True)
class DeviceTerms:
    """What the formulas need of one device of a cluster: the library its layers are costed from, the slowdown
    its speed adds, its kind's figures of the calibration."""

    device: str
    library: LayerLibrary
    kind: str
    """The device's kind name (its figures in ``Calibration.kinds``)."""
    cuda: bool
    slowdown: float
    """``(1 / speed) ** slowdown_exponent`` where the device's speed applies (``tapp_core.kinds``), else 1."""
    figures: KindCalibration

    @property
    def compute_factor(self) -> float:
        """Seconds on the device per second of its library's work."""
        return self.slowdown * self.figures.compute_scale


_TERMS_CACHE: dict[tuple[int, int, int], tuple[LayerLibrary, Cluster, Calibration, dict[str, DeviceTerms]]] = {}
_TERMS_CACHE_SIZE = 16


def device_terms(library: LayerLibrary, cluster: Cluster, calibration: Calibration) -> Mapping[str, DeviceTerms]:
    """Per device of ``cluster``: its ``DeviceTerms`` (cached: a search costs thousands of plans of one set-up)."""
    key = (id(library), id(cluster), id(calibration))
    cached = _TERMS_CACHE.get(key)
    if cached is not None and cached[0] is library and cached[1] is cluster and cached[2] is calibration:
        return cached[3]
    terms = {}
    for device in cluster.devices:
        chosen = device_library(library, cluster, device.name)
        slowdown = (1.0 / device.speed) ** calibration.slowdown_exponent if chosen.speed_applies else 1.0
        kind = chosen.kind.name
        terms[device.name] = DeviceTerms(
            device.name, chosen.library, kind, chosen.kind.is_cuda, slowdown, calibration.for_kind(kind)
        )
    if len(_TERMS_CACHE) >= _TERMS_CACHE_SIZE:
        del _TERMS_CACHE[next(iter(_TERMS_CACHE))]
    _TERMS_CACHE[key] = (library, cluster, calibration, terms)
    return terms


@dataclass(frozen=True)
class SharedHost:
    """The devices of one host whose ranks want more threads than it has cores: while several of them compute,
    they share the cores and each computes slower (``sharing_stretch``)."""

    threads: Mapping[str, int]
    """Per device of the host: the threads its rank computes with."""
    cores: int

    @property
    def total_threads(self) -> int:
        return sum(self.threads.values())


def shared_hosts(cluster: Cluster, cores: int) -> list[SharedHost]:
    """The hosts of ``cluster`` (its devices grouped by ``host``) whose devices' threads exceed ``cores``, each
    host's cores; none for 0 (a calibration that measured no sharing, e.g. of an emulated cluster, whose ranks
    mostly sleep)."""
    if cores <= 0:
        return []
    by_host: dict[str | None, dict[str, int]] = {}
    for device in cluster.devices:
        by_host.setdefault(device.host, {})[device.name] = device.threads
    return [SharedHost(threads, cores) for threads in by_host.values() if sum(threads.values()) > cores]


def sharing_excess(active_threads: np.ndarray, own_threads: int, host: SharedHost) -> np.ndarray:
    """Per value of ``active_threads`` (threads of ``host`` computing at once, a device's ``own_threads``
    included): how far they go beyond what the device meets alone (the cores, or its own threads where it has more),
    0 while they fit, 1 when every rank of the host computes (as ``tapp calibrate`` measured
    ``shared_cores_factor``), linear between."""
    alone = max(host.cores, own_threads)
    if host.total_threads <= alone:
        return np.zeros_like(active_threads, dtype=float)
    return np.clip((active_threads - alone) / (host.total_threads - alone), 0.0, 1.0)


def sharing_stretch(figures: KindCalibration, excess: np.ndarray) -> np.ndarray:
    """How much slower a device computes at each ``sharing_excess`` of ``excess``: 1 at 0, its kind's measured
    ``shared_cores_factor`` at 1."""
    return 1.0 + (figures.shared_cores_factor - 1.0) * excess


def compute_s(fixed_s: float, per_sample_s: float, samples: int, factor: float, per_call_s: float) -> float:
    """One forward (or backward) of ``samples`` samples: profiled ``fixed_s + per_sample_s * samples`` seconds of
    work, on a device of ``compute_factor`` ``factor`` whose kind costs ``per_call_s`` per operation."""
    return (fixed_s + per_sample_s * samples) * factor + per_call_s


def update_s(terms: DeviceTerms, param_bytes: float) -> float:
    """The optimizer step of ``param_bytes`` of parameters on a device, with the fixed cost of a step."""
    return terms.figures.update_s_per_param_byte * param_bytes * terms.slowdown + terms.figures.per_step_s


def transfer_s(link: Link, nbytes: float, tensors: int, calibration: Calibration) -> float:
    """``tensors`` messages of ``nbytes`` bytes in all, sent together over ``link``."""
    return tensors * (link.latency + calibration.per_message_s) + nbytes / (
        link.bandwidth * calibration.bandwidth_scale
    )


def staging_s(
    sender: DeviceTerms, receiver: DeviceTerms, nbytes: float, tensors: int, calibration: Calibration
) -> float:
    """Copying what crosses from ``sender`` to ``receiver`` through host memory: a GPU end's copies, unless MPI is
    CUDA-aware."""
    if calibration.cuda_aware_mpi:
        return 0.0
    total = 0.0
    if sender.cuda:
        total += tensors * sender.figures.staging_per_copy_s + nbytes * sender.figures.d2h_s_per_byte
    if receiver.cuda:
        total += tensors * receiver.figures.staging_per_copy_s + nbytes * receiver.figures.h2d_s_per_byte
    return total


def device_transfer_s(
    cluster: Cluster, sender: DeviceTerms, receiver: DeviceTerms, nbytes: float, tensors: int, calibration: Calibration
) -> float:
    """``tensors`` messages of ``nbytes`` in all from one device to another: the link and any staging."""
    over_link = transfer_s(cluster.link(sender.device, receiver.device), nbytes, tensors, calibration)
    if not (sender.cuda or receiver.cuda):
        return over_link
    return over_link + staging_s(sender, receiver, nbytes, tensors, calibration)


def collective_s(
    collective: Collective,
    tensor_bytes: float,
    shares: Sequence[float],
    links: Iterable[Link],
    calibration: Calibration,
) -> float:
    """A collective among a group with ``shares`` on a tensor of ``tensor_bytes``, over the slowest of ``links``
    (least bandwidth, most latency, taken separately): each of its rounds a latency, and what the busiest device
    sends (``placement.traffic``) over the bandwidth."""
    moved = traffic(collective, tensor_bytes, shares)
    if moved.rounds == 0:
        return 0.0
    chosen = list(links)
    bandwidth = min(link.bandwidth for link in chosen) * calibration.bandwidth_scale
    latency = max(link.latency for link in chosen) + calibration.per_message_s
    return moved.bytes_per_device / bandwidth + moved.rounds * latency


def ring_allreduce_s(replicas: int, param_bytes: float, links: Iterable[Link], calibration: Calibration) -> float:
    """Ring allreduce of ``param_bytes`` among ``replicas``: ``2 (k - 1) / k * param bytes`` over the bandwidth and
    ``2 (k - 1)`` latencies (``collective_s``)."""
    return collective_s("allreduce", param_bytes, [1.0 / replicas] * replicas, links, calibration)


def allreduce_s(
    cluster: Cluster,
    devices: Sequence[str],
    param_bytes: float,
    calibration: Calibration,
    terms: Mapping[str, DeviceTerms] | None = None,
) -> float:
    """Ring allreduce of a stage's gradients among its replicas ``devices``, over the slowest link among them,
    with the slowest GPU replica's staging through host memory (``terms``: the devices' ``DeviceTerms``; without
    them nothing is staged)."""
    if len(devices) == 1:
        return 0.0
    links = (cluster.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1 :])
    ring = ring_allreduce_s(len(devices), param_bytes, links, calibration)
    if terms is None or calibration.cuda_aware_mpi:
        return ring
    staged = [
        2 * t.figures.staging_per_copy_s + param_bytes * (t.figures.d2h_s_per_byte + t.figures.h2d_s_per_byte)
        for t in (terms[d] for d in devices)
        if t.cuda
    ]
    return ring + max(staged) if staged else ring
