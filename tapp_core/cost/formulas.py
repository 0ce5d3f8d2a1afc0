"""Cost terms: the one definition of every time formula, and the ``Calibration`` whose constants they use.

The cost model's simulation (``tapp_core.cost.simulation``), the planners' closed-form arithmetic and lower bounds
(``tapp_core.planners``) and the runtime's link emulation (``tapp_core.runtime.emulation``, with the ideal
``DEFAULT_CALIBRATION``) all call these functions, so they cannot disagree on what an operation costs.

A device is costed from the layer library of its kind, with its kind's figures of the calibration
(``KindCalibration``; a kind the calibration does not list gets its top-level fields) and the slowdown of its
``speed`` where that applies (``tapp_core.platform.kinds`` says which library and when ``speed`` applies):
``DeviceTerms``, which ``tapp_core.cost.context.CostContext.terms`` holds per device of a run. Below, ``slowdown`` is
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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.calibration import Calibration, KindCalibration
from tapp_core.plan.placement import Collective, traffic
from tapp_core.platform.cluster import Cluster, Link
from tapp_core.profile.library import LayerLibrary

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
    """``(1 / speed) ** slowdown_exponent`` where the device's speed applies (``tapp_core.platform.kinds``), else 1."""
    figures: KindCalibration

    @property
    def compute_factor(self) -> float:
        """Seconds on the device per second of its library's work."""
        return self.slowdown * self.figures.compute_scale


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


def group_collective_s(
    cluster: Cluster,
    devices: Sequence[str],
    collective: Collective,
    tensor_bytes: float,
    shares: Sequence[float],
    calibration: Calibration,
) -> float:
    """``collective`` on a tensor of ``tensor_bytes`` among a stage's ``devices`` with ``shares``, over the slowest
    link among them (``collective_s``; 0 for one device)."""
    if len(devices) < 2:
        return 0.0
    links = [cluster.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1 :]]
    return collective_s(collective, tensor_bytes, shares, links, calibration)


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
