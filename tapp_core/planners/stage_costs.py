"""The layer library in closed form, for planners that reason about stages before building a plan.

Layers are in topological (library) order, so any contiguous range of them is a valid stage and a *position*
``p`` (0..n) cuts the model between layer ``p - 1`` and layer ``p``. ``LayerCosts`` holds prefix sums of the
per-sample layer times, parameters and cut traffic; the time formulas that turn them into seconds on a device
(compute factor, update, transfer, ring allreduce) are ``tapp_core.cost.formulas``', the ones the cost model uses, so a
planner's stage arithmetic agrees with the estimate of the plan it builds.
Layer times are costed at one micro-batch size (``LayerCosts.from_library(library, samples)``): each layer's
fixed part is spread over those samples. That is exact for a stage on one device; a replica computes fewer
samples, so for replicated stages the same arithmetic is a lower bound (each replica pays the whole fixed part).

A stage's time depends on its device's kind, not on one scalar: ``DeviceCosts`` answers "seconds of layers
``[a, b)`` per sample on device ``d``" from the ``LayerCosts`` of ``d``'s own library (``CostContext.terms``
says which), times ``d``'s compute factor. Planners that group devices (a stage's replicas, a class of
interchangeable devices) group them by library, since two libraries' prefix sums are not proportional.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.context import CostContext
from tapp_core.cost.formulas import DeviceTerms, staging_s
from tapp_core.plan.placement import normalized_shares
from tapp_core.platform.cluster import Cluster
from tapp_core.platform.kinds import device_kind
from tapp_core.profile.device_libraries import device_library
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class LayerCosts:
    """Per-sample prefix sums over layers and the traffic crossing every position."""

    n_layers: int
    forward_prefix: np.ndarray
    """``forward_prefix[p]``: forward seconds per sample of layers ``[0, p)`` on the profiling device."""
    backward_prefix: np.ndarray
    param_prefix: np.ndarray
    cut_bytes: np.ndarray
    """``cut_bytes[p]``: activation bytes per sample produced before ``p`` and consumed at or after it."""
    cut_tensors: np.ndarray
    """``cut_tensors[p]``: how many tensors cross position ``p``."""

    @classmethod
    def from_library(cls, library: LayerLibrary, samples: int | None = None) -> LayerCosts:
        """Per-sample costs of micro-batches of ``samples`` samples (default: the library's batch size)."""
        n = len(library.layers)
        samples = samples or library.batch_size
        if samples < 1:
            raise ValueError(f"samples must be at least 1, got {samples}")

        def per_sample(total: np.ndarray, fixed: np.ndarray) -> np.ndarray:
            spread: np.ndarray = (total - fixed) / library.batch_size + fixed / samples
            return spread

        forward = per_sample(
            np.array([layer.forward_s for layer in library.layers]),
            np.array([layer.forward_fixed_s for layer in library.layers]),
        )
        backward = per_sample(
            np.array([layer.backward_s for layer in library.layers]),
            np.array([layer.backward_fixed_s for layer in library.layers]),
        )
        params = np.array([layer.trained_bytes for layer in library.layers], dtype=float)  # what is summed, stepped
        byte_delta = np.zeros(n + 2)
        tensor_delta = np.zeros(n + 2, dtype=np.int64)
        for layer in library.layers:
            if layer.successors:
                last = max(layer.successors)
                byte_delta[layer.index + 1] += layer.activation_bytes
                byte_delta[last + 1] -= layer.activation_bytes
                tensor_delta[layer.index + 1] += 1
                tensor_delta[last + 1] -= 1
        return cls(
            n_layers=n,
            forward_prefix=np.concatenate([[0.0], np.cumsum(forward)]),
            backward_prefix=np.concatenate([[0.0], np.cumsum(backward)]),
            param_prefix=np.concatenate([[0.0], np.cumsum(params)]),
            cut_bytes=np.cumsum(byte_delta)[: n + 1],
            cut_tensors=np.cumsum(tensor_delta)[: n + 1],
        )

    @property
    def work_prefix(self) -> np.ndarray:
        """Forward plus backward seconds per sample of layers ``[0, p)``."""
        total: np.ndarray = self.forward_prefix + self.backward_prefix
        return total

    def work(self, start: int, stop: int) -> float:
        return float(self.work_prefix[stop] - self.work_prefix[start])

    def params(self, start: int, stop: int) -> float:
        return float(self.param_prefix[stop] - self.param_prefix[start])

    def clean_cuts(self) -> list[int]:
        """Interior positions crossed by exactly one tensor (between blocks, not inside parallel branches)."""
        return [p for p in range(1, self.n_layers) if self.cut_tensors[p] == 1]


class DeviceCosts:
    """Per device of a cluster: the prefix sums of its own kind's library, and its compute factor."""

    def __init__(self, context: CostContext) -> None:
        self.context = context
        self.terms: Mapping[str, DeviceTerms] = context.terms
        self._costs: dict[tuple[int, int], LayerCosts] = {}

    def layer_costs(self, device: str, samples: int | None = None) -> LayerCosts:
        """The ``LayerCosts`` of ``device``'s library at micro-batches of ``samples`` (cached per library)."""
        library = self.terms[device].library
        key = (id(library), samples or library.batch_size)
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = LayerCosts.from_library(library, samples)
        return costs

    def factor(self, device: str) -> float:
        """Seconds on ``device`` per second of its library's work."""
        return self.terms[device].compute_factor

    def work_s(self, device: str, start: int, stop: int, samples: int | None = None) -> float:
        """Forward plus backward seconds per sample of layers ``[start, stop)`` on ``device``, at micro-batches of
        ``samples`` samples."""
        return self.layer_costs(device, samples).work(start, stop) * self.factor(device)

    def staging_per_byte(self, sender: str, receiver: str) -> float:
        """Seconds per byte that staging through host memory adds to what ``sender`` sends ``receiver`` (0 between
        CPUs, and with CUDA-aware MPI)."""
        return staging_s(self.terms[sender], self.terms[receiver], 1.0, 0, self.context.calibration)

    def by_library(self, devices: tuple[str, ...]) -> dict[int, list[str]]:
        """``devices`` grouped by the library they are costed from (by its id), in order of first appearance."""
        groups: dict[int, list[str]] = {}
        for device in devices:
            groups.setdefault(id(self.terms[device].library), []).append(device)
        return groups


def relative_speeds(context: CostContext) -> dict[str, float]:
    """Per device, how fast it trains the whole model relative to ``library``'s own kind: its ``speed`` where that
    applies (``tapp_core.platform.kinds``, else 1), times ``library``'s total layer time over its own library's. For the
    planners' balancing heuristics (start points, shares of work); the cost model judges the plans they build.
    With one library on an emulated cluster, every device gets exactly its ``speed``."""
    library, cluster = context.library, context.cluster
    speeds = {}
    for device in cluster.devices:
        chosen = device_library(library, cluster, device.name)
        speed = device.speed if chosen.speed_applies else 1.0
        if chosen.library is not library and chosen.library.layer_time_sum_s > 0:
            speed *= library.layer_time_sum_s / chosen.library.layer_time_sum_s
        speeds[device.name] = speed
    return speeds


def speed_shares(speeds: Mapping[str, float], group: Sequence[str]) -> tuple[float, ...]:
    """A group's shares of its work in proportion to its devices' ``speeds`` (``relative_speeds``), so that it
    does not run at its slowest member's pace (Metis, HetPipe)."""
    return normalized_shares([speeds[d] for d in group])


def device_classes(cluster: Cluster) -> list[list[str]]:
    """Devices grouped into interchangeable classes: same kind (``tapp_core.platform.kinds``), speed, threads, memory and
    host, and the same link to every other device. Swapping two devices of a class changes no estimate, so
    searches try one per class."""
    classes: list[list[str]] = []
    for device in cluster.devices:
        for group in classes:
            if _interchangeable(cluster, group[0], device.name):
                group.append(device.name)
                break
        else:
            classes.append([device.name])
    return classes


def _interchangeable(cluster: Cluster, a: str, b: str) -> bool:
    da, db = cluster.device(a), cluster.device(b)
    if (device_kind(da), da.speed, da.memory, da.host) != (device_kind(db), db.speed, db.memory, db.host):
        return False
    return all(cluster.link(a, c) == cluster.link(b, c) for c in cluster.device_names if c not in (a, b))
