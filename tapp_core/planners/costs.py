"""The layer library in closed form, for planners that reason about stages before building a plan.

Layers are in topological (library) order, so any contiguous range of them is a valid stage and a *position*
``p`` (0..n) cuts the model between layer ``p - 1`` and layer ``p``. ``LayerCosts`` holds prefix sums of the
per-sample layer times, parameters and cut traffic; the time formulas that turn them into seconds on a device
(compute factor, update, transfer, ring allreduce) are ``tapp_core.costs``', the ones the cost model uses, so a
planner's stage arithmetic agrees with the estimate of the plan it builds.
Layer times are costed at one micro-batch size (``LayerCosts.from_library(library, samples)``): each layer's
fixed part is spread over those samples. That is exact for a stage on one device; a replica computes fewer
samples, so for replicated stages the same arithmetic is a lower bound (each replica pays the whole fixed part).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary


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
        params = np.array([layer.param_bytes for layer in library.layers], dtype=float)
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


def device_classes(cluster: Cluster) -> list[list[str]]:
    """Devices grouped into interchangeable classes: same kind, speed, threads and memory, and the same link to
    every other device. Swapping two devices of a class changes no estimate, so searches try one per class."""
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
    if (da.kind, da.speed, da.threads, da.memory) != (db.kind, db.speed, db.threads, db.memory):
        return False
    return all(cluster.link(a, c) == cluster.link(b, c) for c in cluster.device_names if c not in (a, b))
