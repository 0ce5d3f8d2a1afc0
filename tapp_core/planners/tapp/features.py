"""What TAPP's networks see (seed 000, section 4.1): per-layer features and per-device features.

A layer is described by its operation name (an index into a small dictionary of operation types, embedded by
the network; anything else is Unknown), its parameter metrics (parameters, FLOPs, activation size and measured
time, log-scaled and normalised to [0, 1], plus where the layer sits in the cumulative work), and the ids of its
first two successor layers (numbered from 1, divided by the layer count; -0.1 when absent). A layer's time is the
mean of its times in the library's kinds (``LayerLibrary.kinds``: the cluster's), a device's speed its speed
relative to the library's kind (``planners.costs.relative_speeds``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary

OP_VOCABULARY: tuple[str, ...] = (
    "Unknown",
    "Convolution",
    "Relu",
    "Pooling",
    "FullyConnected",
    "Padding",
    "BatchNorm",
    "Dropout",
    "Add",
    "Concat",
    "Flatten",
)
UNKNOWN = 0
# Lower-case substrings of op names -> dictionary entry; the first match wins.
_OP_RULES: tuple[tuple[str, str], ...] = (
    ("conv", "Convolution"),
    ("relu", "Relu"),
    ("pool", "Pooling"),
    ("linear", "FullyConnected"),
    ("pad", "Padding"),
    ("batchnorm", "BatchNorm"),
    ("batch_norm", "BatchNorm"),
    ("dropout", "Dropout"),
    ("add", "Add"),
    ("cat", "Concat"),
    ("flatten", "Flatten"),
)
METRIC_NAMES: tuple[str, ...] = ("params_mb", "gflops", "activation_mb", "time_ms", "work_position")
ABSENT_SUCCESSOR = -0.1
SUCCESSOR_SLOTS = 2


def op_index(op: str) -> int:
    """The dictionary entry of an operation name (Unknown if no rule matches)."""
    lowered = op.lower()
    for fragment, entry in _OP_RULES:
        if fragment in lowered:
            return OP_VOCABULARY.index(entry)
    return UNKNOWN


def _log_normalised(values: np.ndarray) -> np.ndarray:
    logged: np.ndarray = np.log1p(np.maximum(values, 0.0))
    top = float(logged.max())
    return logged / top if top > 0 else logged


@dataclass(frozen=True)
class LayerFeatures:
    op_ids: torch.Tensor
    """(layers,) dictionary entries."""
    metrics: torch.Tensor
    """(layers, len(METRIC_NAMES)) in [0, 1]."""
    successors: torch.Tensor
    """(layers, SUCCESSOR_SLOTS) successor ids / layers, ABSENT_SUCCESSOR when absent."""
    work: np.ndarray
    """(layers,) forward plus backward seconds at the library's batch size, the mean over its kinds (not a network
    input)."""

    @property
    def numeric(self) -> torch.Tensor:
        return torch.cat([self.metrics, self.successors], dim=1)


def layer_features(library: LayerLibrary) -> LayerFeatures:
    layers = library.layers
    n = len(layers)
    batch = library.batch_size
    kinds = library.kind_libraries.values()
    work = np.array([[layer.forward_s + layer.backward_s for layer in lib.layers] for lib in kinds]).mean(axis=0)
    cumulative = np.cumsum(work)
    total = cumulative[-1] if cumulative[-1] > 0 else 1.0
    raw = np.array(
        [
            [
                layer.param_bytes / 2**20,
                layer.flops * batch / 1e9,
                layer.activation_bytes * batch / 2**20,
                work[layer.index] * 1e3,
            ]
            for layer in layers
        ]
    )
    metrics = np.column_stack(
        [_log_normalised(raw[:, j]) for j in range(raw.shape[1])] + [(cumulative - work / 2) / total]
    )
    successors = np.full((n, SUCCESSOR_SLOTS), ABSENT_SUCCESSOR)
    for layer in layers:
        for slot, succ in enumerate(sorted(layer.successors)[:SUCCESSOR_SLOTS]):
            successors[layer.index, slot] = (succ + 1) / n
    return LayerFeatures(
        op_ids=torch.tensor([op_index(layer.op) for layer in layers], dtype=torch.long),
        metrics=torch.tensor(metrics, dtype=torch.float32),
        successors=torch.tensor(successors, dtype=torch.float32),
        work=work,
    )


DEVICE_FEATURES: tuple[str, ...] = ("speed", "memory", "mean_bandwidth", "min_bandwidth", "cuda")


def device_features(cluster: Cluster, speeds: Sequence[float] | None = None) -> torch.Tensor:
    """(devices, len(DEVICE_FEATURES)): relative speed (``speeds``, in device order; default: each ``speed``), log
    memory, and the log of the mean and slowest link to the
    other devices (each normalised by the cluster's largest), and whether it is a GPU."""
    names = cluster.device_names
    relative = list(speeds) if speeds is not None else [d.speed for d in cluster.devices]
    rows = []
    for name, speed in zip(names, relative, strict=True):
        device = cluster.device(name)
        others = [cluster.link(name, other).bandwidth for other in names if other != name] or [1.0]
        rows.append(
            [
                speed,
                np.log2(device.memory),
                np.log(np.mean(others)),
                np.log(min(others)),
                float(device.kind == "cuda"),
            ]
        )
    table = np.array(rows, dtype=float)
    for j in range(4):
        top = np.abs(table[:, j]).max()
        if top > 0:
            table[:, j] /= top
    return torch.tensor(table, dtype=torch.float32)


def log_bandwidth_matrix(cluster: Cluster) -> torch.Tensor:
    """(devices, devices) log link bandwidth, 0 for the fastest link and negative for slower ones."""
    names = cluster.device_names
    table = np.zeros((len(names), len(names)))
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if a != b:
                table[i, j] = np.log(cluster.link(a, b).bandwidth)
    off = table[~np.eye(len(names), dtype=bool)]
    if off.size:
        table -= off.max()
        table[np.eye(len(names), dtype=bool)] = 0.0
    return torch.tensor(table, dtype=torch.float32)
