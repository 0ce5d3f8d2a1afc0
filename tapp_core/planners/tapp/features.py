"""What TAPP's networks see (seed 000, section 4.1): per-layer features and per-device features.

A layer is described by its operation name (an index into a small dictionary of operation types, embedded by
the network; anything else is Unknown), its parameter metrics (parameters, FLOPs, activation size and measured
time, log-scaled and normalised to [0, 1], plus where the layer sits in the cumulative work), and the ids of its
first two successor layers (numbered from 1, divided by the layer count; -0.1 when absent). A layer's time is the
mean of its times in the library's kinds (``LayerLibrary.kinds``: the cluster's).

A device is described by what it costs to use it (``DEVICE_FEATURES``): its speed against the fastest (relative to
the library's kind, ``planners.stage_costs.relative_speeds``), its memory
against what the whole model needs on one device, its links (to the fastest device, its best and its mean link,
each against the cluster's best link), and how long sending a typical cut over its best link takes against
computing the whole model on it; so the policy can tell a fast device behind slow links from a fast, well
connected one, and a device the model does not fit alone from one it does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tapp_core.plan.plan import stage_memory_bytes
from tapp_core.planners.space import contiguous_plan
from tapp_core.planners.stage_costs import LayerCosts
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.library import LayerLibrary

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


DEVICE_FEATURES: tuple[str, ...] = (
    "speed",
    "memory",
    "fits_alone",
    "link_to_fastest",
    "best_link",
    "mean_link",
    "communication",
    "cuda",
)
SPEED_RANGE = 1000.0
"""Speeds this many times below the fastest all read -1."""
LINK_RANGE = 10_000.0
"""Links this many times slower than the cluster's best all read -1."""
MEMORY_RANGE = 16.0
"""Memory this many times more (less) than the model needs alone reads 1 (-1)."""
COMMUNICATION_RANGE = 1000.0
"""A cut sent this many times faster (slower) than the whole model computes reads -1 (1)."""


def _scaled_log(ratio: np.ndarray, span: float, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    clipped: np.ndarray = np.clip(np.log(ratio) / np.log(span), low, high)
    return clipped


@dataclass(frozen=True)
class ModelNeeds:
    """What the model asks of a device, for the device features."""

    memory_bytes: float
    """Least memory the whole model needs on one device (over the micro-batch counts)."""
    compute_s: float
    """Seconds of one step's layer work on the library's device (speed 1)."""
    cut_bytes: float
    """Bytes a typical cut sends one way per step (the median over positions)."""


def model_needs(
    library: LayerLibrary, micro_batch_choices: Sequence[int], batch_size: int, schedule: str
) -> ModelNeeds:
    """The model's ``ModelNeeds`` at this batch size and schedule."""
    memory = min(
        stage_memory_bytes(contiguous_plan(library, [], [["device"]], m, schedule, batch_size), library, 0)["device"]
        for m in micro_batch_choices
    )
    costs = LayerCosts.from_library(library)
    cuts = costs.cut_bytes[1:-1] if costs.n_layers > 1 else np.zeros(1)
    return ModelNeeds(
        memory_bytes=float(memory),
        compute_s=float(costs.work_prefix[-1]) * batch_size,
        cut_bytes=float(np.median(cuts)) * batch_size,
    )


def device_features(
    cluster: Cluster,
    needs: ModelNeeds,
    speeds: Sequence[float] | None = None,
    memory: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """(devices, len(DEVICE_FEATURES)), each in [-1, 1]: log speed against the fastest (``speeds``, in device
    order; default: each ``speed``); log memory (a plan's, ``CostContext.plan_memory``; default: each ``memory``)
    against the model's need alone, and whether the model fits alone;
    the log bandwidth to the fastest device (the fastest's own: its best link), of its best and its mean link, each
    against the cluster's best link; the log of the time to send a typical cut both ways over its best link against
    its time for the whole model's work; whether it is a GPU."""
    names = cluster.device_names
    n = len(names)
    speed = np.array(list(speeds) if speeds is not None else [d.speed for d in cluster.devices], dtype=float)
    held = np.array([memory[name] if memory else cluster.device(name).memory for name in names], dtype=float)
    bandwidth = np.ones((n, n))
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i != j:
                bandwidth[i, j] = cluster.link(a, b).bandwidth
    off = ~np.eye(n, dtype=bool)
    top_link = bandwidth[off].max() if n > 1 else 1.0
    best = np.array([bandwidth[i, off[i]].max() for i in range(n)]) if n > 1 else np.ones(1)
    mean = np.array([np.exp(np.log(bandwidth[i, off[i]]).mean()) for i in range(n)]) if n > 1 else np.ones(1)
    fastest = int(np.argmax(speed))
    to_fastest = bandwidth[:, fastest].copy()
    to_fastest[fastest] = best[fastest]
    sending = 2 * needs.cut_bytes / best
    computing = needs.compute_s / speed
    columns = [
        _scaled_log(speed / speed.max(), SPEED_RANGE, high=0.0),
        _scaled_log(held / max(needs.memory_bytes, 1.0), MEMORY_RANGE),
        (held >= needs.memory_bytes).astype(float),
        _scaled_log(to_fastest / top_link, LINK_RANGE, high=0.0),
        _scaled_log(best / top_link, LINK_RANGE, high=0.0),
        _scaled_log(mean / top_link, LINK_RANGE, high=0.0),
        _scaled_log(np.maximum(sending, 1e-12) / np.maximum(computing, 1e-12), COMMUNICATION_RANGE),
        np.array([float(cluster.device(name).kind == "cuda") for name in names]),
    ]
    return torch.tensor(np.column_stack(columns), dtype=torch.float32)


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
