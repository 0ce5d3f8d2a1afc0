"""The cost model: what one training step of a plan costs on a cluster, by event-driven simulation.

``estimate(plan, library, cluster, calibration)`` returns an ``Estimate``: step time, per-device compute,
communication and idle time, peak memory and the timeline of every operation. The runtime implements the same
semantics, so that its Measurement can be compared with the Estimate term by term.

Workers
    Every device of a stage is a *worker*. A stage with ``k`` replicas splits each micro-batch into ``k`` equal
    contiguous sample ranges (``plan.replica_slices``); each replica computes only its range.

Compute
    A worker's forward (backward) of one micro-batch of ``samples`` takes, summed over its stage's layers, the
    layer's fixed time plus its per-sample time times ``samples`` (``Layer.forward_fixed_s`` and the rest of
    ``forward_s`` over ``library.batch_size``; a library without fixed parts scales linearly), times
    ``slowdown ** calibration.slowdown_exponent`` (``slowdown = 1 / device.speed``), times
    ``calibration.compute_scale``, plus ``calibration.per_micro_batch_s``.

Cut traffic
    For every layer ``u`` of stage ``a`` and every later stage ``b`` holding one of ``u``'s successors, ``u``'s
    output (``activation_bytes * samples``) is sent directly from ``a`` to ``b`` (a tensor that skips stages is
    not relayed); the backward pass sends the gradient of the same size from ``b`` to ``a``. Each tensor is one
    message. Between replicated stages, source replica ``p`` sends to destination replica ``q`` the samples their
    ranges share. The data source (inputs and labels) is local to every worker and costs nothing.
    All tensors one operation sends to one worker leave together as one *transfer* on the directed link between
    the two devices: ``n_tensors * (latency + per_message_s) + bytes / (bandwidth * bandwidth_scale)``. A directed
    link carries one transfer at a time, first come first served (queueing). Transfers never occupy a worker:
    sends overlap compute, and a worker only waits for what it must receive.

Schedules (the order of operations on every worker of stage ``s`` of ``S``, ``M`` micro-batches)
    gpipe: forwards 0..M-1, then backwards M-1..0.
    1f1b: ``min(S - s, M)`` warm-up forwards, then one backward and one forward alternately, then the remaining
    backwards.
    async: 1f1b over consecutive iterations with no flush (PipeDream): the warm-up is ``S - s`` forwards and the
    micro-batches of the next iteration follow straight on; a stage updates its weights as soon as it has done
    the last backward of an iteration (weight stashing lets forwards of the next iteration run before that).
    Every operation starts at ``max(worker free, all its inputs arrived)``.

End of an iteration
    After a stage's last backward of an iteration its replicas allreduce their gradients (ring: ``2(k-1)/k *
    param bytes`` over the slowest link among the replicas plus ``2(k-1) * (latency + per_message_s)``), starting
    when the last replica is ready; then every worker runs the update: ``update_s_per_param_byte * param bytes *
    slowdown ** slowdown_exponent + per_step_s``. The step ends when the last device finishes its update.

Step time
    gpipe and 1f1b: the one simulated step. async: ``W = async_warmup_iterations(S, M)`` iterations fill the
    pipeline, then ``K = async_measured_iterations(S, M)`` are measured, then enough iterations follow that the
    measured ones never see the drain; step time = (end of iteration W + K - end of iteration W) / K, counting
    iterations from 1, where an iteration ends when its last update ends. K covers several micro-batches per
    stage because the steady state may repeat only every few iterations.

Per-device breakdown (over the measured window, per step; ``breakdown`` computes it from any timeline)
    compute: forward, backward and update time. communication: time blocked in allreduce, plus, before each
    forward or backward, how much later it started than it would have if every transfer it waited on had been
    instantaneous (``start - max(worker free, latest time a sender finished producing an input)``); these waits
    appear in the timeline as ``recv`` operations. idle: the rest of the step (pipeline bubbles, imbalance).
    A runtime measures the same by stamping each message with the time its sender posted it.

Timeline
    Every operation of every simulated iteration (``TimelineOp.iteration``): forward, backward, allreduce and
    update; ``send`` on the sending device (``peer`` = receiver) for as long as the link carries it; ``recv`` for
    each communication wait (``peer`` = the device whose transfer arrived last). Built on first use.

Peak memory is ``plan.stage_memory_bytes`` of the device's stage. BSP (one stage on every device) and single
device (one stage on one device) are plans like any other. ``estimate`` does not check memory; ``validate`` does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import overload

import numpy as np

from tapp_core.cluster import Cluster
from tapp_core.library import Layer, LayerLibrary
from tapp_core.metrics import communication_share
from tapp_core.plan import SCHEDULES, Plan, PlanError, replica_slices, stage_memory_bytes

OP_KINDS: tuple[str, ...] = ("forward", "backward", "send", "recv", "allreduce", "update")
COMPUTE_KINDS = frozenset({"forward", "backward", "update"})
COMMUNICATION_KINDS = frozenset({"recv", "allreduce"})
NO_MICRO_BATCH = -1
"""``TimelineOp.micro_batch`` of operations that belong to a whole iteration (allreduce, update)."""

ASYNC_MIN_MEASURED_ITERATIONS = 3
ASYNC_MEASURED_MICRO_BATCHES_PER_STAGE = 4


def async_measured_iterations(n_stages: int, micro_batches: int) -> int:
    """Iterations the async schedule measures: steady state can repeat only every few iterations (a cycle
    spanning up to about ``2 * n_stages`` micro-batches), so the window covers at least
    ``ASYNC_MEASURED_MICRO_BATCHES_PER_STAGE * n_stages`` micro-batches."""
    needed = math.ceil(ASYNC_MEASURED_MICRO_BATCHES_PER_STAGE * n_stages / micro_batches)
    return max(ASYNC_MIN_MEASURED_ITERATIONS, needed)


def async_warmup_iterations(n_stages: int, micro_batches: int) -> int:
    """Iterations the async schedule runs before measuring: those the pipeline fill reaches, plus one."""
    return math.ceil(n_stages / micro_batches) + 1


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
        values: dict[str, object] = {}
        for name, value in data.items():
            if name == "note":
                values[name] = str(value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                values[name] = float(value)
            else:
                raise CalibrationError(f"calibration {source} field {name} must be a number, got {value!r}")
        try:
            return cls(**values)  # type: ignore[arg-type]
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
            stage=int(data["stage"]),  # type: ignore[call-overload]
            micro_batch=int(data["micro_batch"]),  # type: ignore[call-overload]
            kind=kind,
            start=float(data["start"]),  # type: ignore[arg-type]
            end=float(data["end"]),  # type: ignore[arg-type]
            iteration=int(data.get("iteration", 0)),  # type: ignore[call-overload]
            peer=str(data.get("peer", "")),
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


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one plan; times in seconds per step, memory in bytes."""

    plan_id: str
    step_time: float
    compute: dict[str, float]
    communication: dict[str, float]
    idle: dict[str, float]
    peak_memory: dict[str, int]
    timeline: Sequence[TimelineOp] = field(repr=False)
    calibration: Calibration = DEFAULT_CALIBRATION

    @property
    def communication_share(self) -> float:
        return communication_share(self.communication, self.step_time)

    def to_dict(self, include_timeline: bool = True) -> dict[str, object]:
        data: dict[str, object] = {
            "plan_id": self.plan_id,
            "step_time": self.step_time,
            "communication_share": self.communication_share,
            "compute": dict(self.compute),
            "communication": dict(self.communication),
            "idle": dict(self.idle),
            "peak_memory": dict(self.peak_memory),
            "calibration": self.calibration.to_dict(),
        }
        if include_timeline:
            data["timeline"] = [op.to_dict() for op in self.timeline]
        return data

    def to_json(self, include_timeline: bool = True) -> str:
        return json.dumps(self.to_dict(include_timeline), indent=2)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Estimate:
        return cls(
            plan_id=str(data["plan_id"]),
            step_time=float(data["step_time"]),  # type: ignore[arg-type]
            compute=dict(data["compute"]),  # type: ignore[call-overload]
            communication=dict(data["communication"]),  # type: ignore[call-overload]
            idle=dict(data["idle"]),  # type: ignore[call-overload]
            peak_memory=dict(data["peak_memory"]),  # type: ignore[call-overload]
            timeline=[TimelineOp.from_dict(op) for op in data.get("timeline", [])],  # type: ignore[attr-defined]
            calibration=Calibration.from_dict(data.get("calibration", {})),  # type: ignore[arg-type]
        )


def breakdown(
    timeline: Iterable[TimelineOp], devices: Sequence[str], window: tuple[float, float], steps: int = 1
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per-device compute, communication and idle time per step, from the operations inside ``window``.

    Only the part of each operation inside the window counts; sends overlap compute and do not count. Works on
    a measured timeline as well as on a predicted one.
    """
    spans = ((op.device, op.kind, op.start, op.end) for op in timeline)
    busy, waiting = _window_totals(spans, devices, window)
    return _per_step(busy, waiting, window, steps)  # type: ignore[arg-type] - keys are the device names


def _window_totals(
    spans: Iterable[tuple[Hashable, str, float, float]], keys: Iterable[Hashable], window: tuple[float, float]
) -> tuple[dict[Hashable, float], dict[Hashable, float]]:
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


def _per_step(
    busy: Mapping[str, float], waiting: Mapping[str, float], window: tuple[float, float], steps: int
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Window totals divided by the steps in the window; idle is what is left of each step."""
    step = (window[1] - window[0]) / steps
    compute = {d: t / steps for d, t in busy.items()}
    communication = {d: t / steps for d, t in waiting.items()}
    idle = {d: max(0.0, step - compute[d] - communication[d]) for d in compute}
    return compute, communication, idle


# ---------------------------------------------------------------------------------------------------------------
# Per-stage aggregates (numpy, once per estimate)


@dataclass(frozen=True)
class _StageAggregates:
    forward_s: np.ndarray
    """Per stage: forward time per sample on the profiling device, beyond the fixed part."""
    backward_s: np.ndarray
    forward_fixed_s: np.ndarray
    """Per stage: forward time per call that does not depend on the number of samples."""
    backward_fixed_s: np.ndarray
    param_bytes: np.ndarray
    cut_bytes: np.ndarray
    """``cut_bytes[a, b]``: bytes per sample stage ``a`` sends to stage ``b`` in the forward pass."""
    cut_tensors: np.ndarray
    """``cut_tensors[a, b]``: number of tensors stage ``a`` sends to stage ``b``."""


@dataclass(frozen=True)
class _LayerArrays:
    snapshot: tuple[Layer, ...]
    """The layers these arrays were read from."""
    forward_s: np.ndarray
    backward_s: np.ndarray
    forward_fixed_s: np.ndarray
    backward_fixed_s: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    edge_sources: np.ndarray
    edge_targets: np.ndarray


_LAYER_ARRAYS_CACHE: dict[int, _LayerArrays] = {}
_LAYER_ARRAYS_CACHE_SIZE = 8


def _layer_arrays(library: LayerLibrary) -> _LayerArrays:
    """The library's layers as arrays, cached: a planner estimates thousands of plans of one library."""
    snapshot = tuple(library.layers)
    cached = _LAYER_ARRAYS_CACHE.get(id(library.layers))
    # Comparing tuples of the same Layer objects is an identity check per element, so this is cheap and exact.
    if cached is not None and cached.snapshot == snapshot:
        return cached
    table = np.array(
        [
            (x.forward_s, x.backward_s, x.forward_fixed_s, x.backward_fixed_s, x.param_bytes, x.activation_bytes)
            for x in snapshot
        ],
        dtype=float,
    ).reshape(-1, 6)
    edges = np.array([(x.index, succ) for x in snapshot for succ in x.successors], dtype=np.int64).reshape(-1, 2)
    arrays = _LayerArrays(snapshot, *table.T, edges[:, 0], edges[:, 1])
    if len(_LAYER_ARRAYS_CACHE) >= _LAYER_ARRAYS_CACHE_SIZE:
        _LAYER_ARRAYS_CACHE.pop(next(iter(_LAYER_ARRAYS_CACHE), None), None)
    _LAYER_ARRAYS_CACHE[id(library.layers)] = arrays
    return arrays


def _stage_aggregates(plan: Plan, library: LayerLibrary) -> _StageAggregates:
    n_stages = plan.n_stages
    arrays = _layer_arrays(library)
    stage = np.asarray(plan.stage_of_layer, dtype=np.int64)
    sources, targets = arrays.edge_sources, arrays.edge_targets
    _check_edges_forward(stage, sources, targets, library)
    # A layer's output goes once to each later stage that consumes it, however many consumers it has there.
    crossing = stage[targets] > stage[sources]
    sent = np.unique(sources[crossing] * n_stages + stage[targets[crossing]])
    sent_layer, sent_to = np.divmod(sent, n_stages)
    pair = stage[sent_layer] * n_stages + sent_to
    square = n_stages * n_stages
    per_sample = 1.0 / library.batch_size
    forward_fixed = np.bincount(stage, arrays.forward_fixed_s, n_stages)
    backward_fixed = np.bincount(stage, arrays.backward_fixed_s, n_stages)
    return _StageAggregates(
        forward_s=(np.bincount(stage, arrays.forward_s, n_stages) - forward_fixed) * per_sample,
        backward_s=(np.bincount(stage, arrays.backward_s, n_stages) - backward_fixed) * per_sample,
        forward_fixed_s=forward_fixed,
        backward_fixed_s=backward_fixed,
        param_bytes=np.bincount(stage, arrays.param_bytes, n_stages),
        cut_bytes=np.bincount(pair, arrays.activation_bytes[sent_layer], square).reshape(n_stages, n_stages),
        cut_tensors=np.bincount(pair, minlength=square).reshape(n_stages, n_stages),
    )


def _check_edges_forward(stage: np.ndarray, sources: np.ndarray, targets: np.ndarray, library: LayerLibrary) -> None:
    backward = np.flatnonzero(stage[targets] < stage[sources])
    if backward.size:
        u, v = int(sources[backward[0]]), int(targets[backward[0]])
        raise PlanError(
            f"edge {library.layers[u].name} -> {library.layers[v].name} runs backward: "
            f"stage {stage[u]} feeds stage {stage[v]}"
        )


def _check_plan(plan: Plan, library: LayerLibrary, cluster: Cluster) -> None:
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {plan.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if len(plan.stage_of_layer) != len(library.layers):
        raise PlanError(f"plan places {len(plan.stage_of_layer)} layers but the library has {len(library.layers)}")
    if plan.micro_batches <= 0 or plan.batch_size % plan.micro_batches:
        raise PlanError(f"batch size {plan.batch_size} is not divisible by {plan.micro_batches} micro-batches")
    if min(plan.stage_of_layer) < 0 or max(plan.stage_of_layer) >= plan.n_stages:
        raise PlanError(f"plan places a layer outside stages 0..{plan.n_stages - 1}")
    known = set(cluster.device_names)
    for stage, devices in enumerate(plan.stage_devices):
        if not devices:
            raise PlanError(f"stage {stage} has no device")
        unknown = [d for d in devices if d not in known]
        if unknown:
            raise PlanError(f"stage {stage} uses unknown device {unknown[0]!r} (cluster {cluster.name!r})")
    if len(set(plan.devices)) != len(plan.devices):
        raise PlanError("a device is used by two stages")


# ---------------------------------------------------------------------------------------------------------------
# Workers, their programs and the routes of their transfers

FORWARD, BACKWARD, END_OF_ITERATION = "forward", "backward", "end"
NO_PEER = -1

Route = tuple[int, int, float]
"""(receiving worker, directed link id, transfer duration)."""


@dataclass
class _Worker:
    index: int
    stage: int
    device: str
    samples: tuple[int, int]
    duration: dict[str, float]
    """Per direction (FORWARD, BACKWARD): time of one micro-batch."""
    update_s: float
    routes: dict[str, list[Route]] = field(default_factory=lambda: {FORWARD: [], BACKWARD: []})
    expected: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    """Per direction: how many transfers each of this worker's operations waits for."""


def _make_workers(
    plan: Plan, cluster: Cluster, aggregates: _StageAggregates, calibration: Calibration
) -> list[_Worker]:
    workers = []
    for stage, devices in enumerate(plan.stage_devices):
        for replica, (first, stop) in enumerate(replica_slices(plan.micro_batch_size, len(devices))):
            name = devices[replica]
            slowdown = (1.0 / cluster.device(name).speed) ** calibration.slowdown_exponent
            samples = stop - first
            compute_factor = slowdown * calibration.compute_scale
            update_s = calibration.update_s_per_param_byte * float(aggregates.param_bytes[stage]) * slowdown
            forward_s = (
                float(aggregates.forward_fixed_s[stage] + aggregates.forward_s[stage] * samples) * compute_factor
                + calibration.per_micro_batch_s
            )
            backward_s = (
                float(aggregates.backward_fixed_s[stage] + aggregates.backward_s[stage] * samples) * compute_factor
                + calibration.per_micro_batch_s
            )
            workers.append(
                _Worker(
                    index=len(workers),
                    stage=stage,
                    device=name,
                    samples=(first, stop),
                    duration={FORWARD: forward_s, BACKWARD: backward_s},
                    update_s=update_s + calibration.per_step_s,
                )
            )
    return workers


def _shared_samples(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _connect_workers(
    workers: list[_Worker], cluster: Cluster, aggregates: _StageAggregates, calibration: Calibration
) -> int:
    """Fill every worker's routes and expected counts; returns the number of directed links used."""
    link_ids: dict[tuple[str, str], int] = {}
    by_stage: dict[int, list[_Worker]] = {}
    for worker in workers:
        by_stage.setdefault(worker.stage, []).append(worker)
    rows, cols = np.nonzero(aggregates.cut_tensors)
    for a, b in zip(rows.tolist(), cols.tolist(), strict=True):
        tensors = int(aggregates.cut_tensors[a, b])
        bytes_per_sample = float(aggregates.cut_bytes[a, b])
        for sender in by_stage[a]:
            for receiver in by_stage[b]:
                shared = _shared_samples(sender.samples, receiver.samples)
                if not shared:
                    continue
                link = cluster.link(sender.device, receiver.device)
                bandwidth = link.bandwidth * calibration.bandwidth_scale
                duration = tensors * (link.latency + calibration.per_message_s) + bytes_per_sample * shared / bandwidth
                there = link_ids.setdefault((sender.device, receiver.device), len(link_ids))
                back = link_ids.setdefault((receiver.device, sender.device), len(link_ids))
                sender.routes[FORWARD].append((receiver.index, there, duration))
                receiver.routes[BACKWARD].append((sender.index, back, duration))
                receiver.expected[FORWARD] += 1
                sender.expected[BACKWARD] += 1
    return len(link_ids)


def _one_f_one_b(warmup: int, total: int) -> list[tuple[str, int]]:
    program = [(FORWARD, m) for m in range(warmup)]
    for m in range(total - warmup):
        program += [(BACKWARD, m), (FORWARD, warmup + m)]
    program += [(BACKWARD, m) for m in range(total - warmup, total)]
    return program


def _stage_program(
    schedule: str, stage: int, n_stages: int, micro_batches: int, iterations: int
) -> list[tuple[str, int]]:
    """The operations of every worker of ``stage``: (direction, global micro-batch) or (END_OF_ITERATION, iteration)."""
    if schedule == "gpipe":
        forwards = [(FORWARD, m) for m in range(micro_batches)]
        return [*forwards, *((BACKWARD, m) for m in reversed(range(micro_batches))), (END_OF_ITERATION, 0)]
    if schedule == "1f1b":
        return [*_one_f_one_b(min(n_stages - stage, micro_batches), micro_batches), (END_OF_ITERATION, 0)]
    total = micro_batches * iterations
    program: list[tuple[str, int]] = []
    for kind, g in _one_f_one_b(min(n_stages - stage, total), total):
        program.append((kind, g))
        if kind == BACKWARD and g % micro_batches == micro_batches - 1:
            program.append((END_OF_ITERATION, g // micro_batches))
    return program


def _allreduce_s(cluster: Cluster, devices: Sequence[str], param_bytes: float, calibration: Calibration) -> float:
    """Ring allreduce of a stage's gradients among its replicas, over the slowest link among them."""
    k = len(devices)
    if k == 1:
        return 0.0
    links = [cluster.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1 :]]
    bandwidth = min(link.bandwidth for link in links) * calibration.bandwidth_scale
    latency = max(link.latency for link in links) + calibration.per_message_s
    return 2 * (k - 1) / k * param_bytes / bandwidth + 2 * (k - 1) * latency


# ---------------------------------------------------------------------------------------------------------------
# The simulation

Record = tuple[int, str, float, float, int, int]
"""(worker, kind, start, end, global micro-batch or iteration, peer worker or NO_PEER): a TimelineOp in the
making, kept as a plain tuple because building thousands of frozen dataclasses would dominate the run time."""


class _Simulation:
    """Runs every worker's program; each operation starts when its worker is free and its inputs have arrived."""

    def __init__(self, workers: list[_Worker], programs: list[list[tuple[str, int]]], allreduce_s: list[float]) -> None:
        self.workers = workers
        self.programs = programs
        """Per worker (its stage's program)."""
        self.allreduce_s = allreduce_s
        """Per stage."""
        self.replicas = [0] * len(allreduce_s)
        for worker in workers:
            self.replicas[worker.stage] += 1
        iterations = 1 + max(number for program in programs for kind, number in program if kind == END_OF_ITERATION)
        self.position = [0] * len(workers)
        self.free = [0.0] * len(workers)
        self.link_free: dict[int, float] = {}
        # (worker, direction, micro-batch) -> [transfers still missing, latest ready, latest arrival, last sender]
        self.inbox: dict[tuple[int, str, int], list] = {}
        self.blocked_on: list[tuple[int, str, int] | None] = [None] * len(workers)
        self.at_barrier: dict[tuple[int, int], list[int]] = {}
        self.iteration_end = [0.0] * iterations
        self.records: list[Record] = []
        self.runnable = list(range(len(workers)))

    def run(self) -> None:
        while self.runnable:
            self._advance(self.runnable.pop())
        stuck = [w.device for w in self.workers if self.position[w.index] < len(self.programs[w.index])]
        if stuck:
            raise PlanError(f"the schedule deadlocks: devices {', '.join(stuck)} never finish")

    def _advance(self, w: int) -> None:
        program = self.programs[w]
        while self.position[w] < len(program):
            kind, number = program[self.position[w]]
            done = self._reach_barrier(w, number) if kind == END_OF_ITERATION else self._try_compute(w, kind, number)
            if not done:
                return
            self.position[w] += 1

    def _try_compute(self, w: int, kind: str, g: int) -> bool:
        worker = self.workers[w]
        start = free = self.free[w]
        if worker.expected[kind]:
            key = (w, kind, g)
            box = self.inbox.get(key)
            if box is None or box[0]:
                self.blocked_on[w] = key
                return False
            del self.inbox[key]
            _, ready, arrival, sender = box
            if arrival > free:
                start = arrival
                waited_from = max(free, ready)
                if start > waited_from:
                    self.records.append((w, "recv", waited_from, start, g, sender))
        end = start + worker.duration[kind]
        self.records.append((w, kind, start, end, g, NO_PEER))
        self.free[w] = end
        self._send(w, worker.routes[kind], kind, g, end)
        return True

    def _send(self, w: int, routes: list[Route], kind: str, g: int, ready: float) -> None:
        for receiver, link, duration in routes:
            start = max(ready, self.link_free.get(link, 0.0))
            arrival = start + duration
            self.link_free[link] = arrival
            self.records.append((w, "send", start, arrival, g, receiver))
            key = (receiver, kind, g)
            box = self.inbox.get(key)
            if box is None:
                box = self.inbox[key] = [self.workers[receiver].expected[kind], ready, arrival, w]
            else:
                box[1] = max(box[1], ready)
                if arrival >= box[2]:
                    box[2], box[3] = arrival, w
            box[0] -= 1
            if not box[0] and self.blocked_on[receiver] == key:
                self.blocked_on[receiver] = None
                self.runnable.append(receiver)

    def _reach_barrier(self, w: int, iteration: int) -> bool:
        """Allreduce and update once every replica of the stage is here; False while some are missing."""
        stage = self.workers[w].stage
        waiting = self.at_barrier.setdefault((stage, iteration), [])
        waiting.append(w)
        if len(waiting) < self.replicas[stage]:
            return False
        del self.at_barrier[(stage, iteration)]
        start = max(self.free[r] for r in waiting)
        end = start + self.allreduce_s[stage]
        for r in waiting:
            if end > start:
                self.records.append((r, "allreduce", start, end, iteration, NO_PEER))
            finish = end + self.workers[r].update_s
            self.records.append((r, "update", end, finish, iteration, NO_PEER))
            self.free[r] = finish
            self.iteration_end[iteration] = max(self.iteration_end[iteration], finish)
            if r != w:
                self.position[r] += 1
                self.runnable.append(r)
        return True


def _timeline_ops(records: list[Record], workers: list[_Worker], micro_batches: int) -> list[TimelineOp]:
    ops = []
    for w, kind, start, end, number, peer in records:
        worker = workers[w]
        peer_device = workers[peer].device if peer != NO_PEER else ""
        if kind in ("allreduce", "update"):
            iteration, micro_batch = number, NO_MICRO_BATCH
        else:
            iteration, micro_batch = divmod(number, micro_batches)
        ops.append(TimelineOp(worker.device, worker.stage, micro_batch, kind, start, end, iteration, peer_device))
    return ops


def _simulated_iterations(plan: Plan) -> tuple[int, int, int]:
    """(iterations to simulate, warm-up iterations before the measured ones, measured iterations)."""
    if plan.schedule != "async":
        return 1, 0, 1
    warmup = async_warmup_iterations(plan.n_stages, plan.micro_batches)
    measured = async_measured_iterations(plan.n_stages, plan.micro_batches)
    # Past the measured iterations, enough forwards that no stage drains while they run.
    tail = math.ceil(plan.n_stages / plan.micro_batches)
    return warmup + measured + tail, warmup, measured


def _simulate(
    plan: Plan, cluster: Cluster, library: LayerLibrary, calibration: Calibration
) -> tuple[_Simulation, list[_Worker]]:
    aggregates = _stage_aggregates(plan, library)
    workers = _make_workers(plan, cluster, aggregates, calibration)
    _connect_workers(workers, cluster, aggregates, calibration)
    iterations = _simulated_iterations(plan)[0]
    by_stage = [
        _stage_program(plan.schedule, s, plan.n_stages, plan.micro_batches, iterations) for s in range(plan.n_stages)
    ]
    allreduce_s = [
        _allreduce_s(cluster, devices, float(aggregates.param_bytes[s]), calibration)
        for s, devices in enumerate(plan.stage_devices)
    ]
    simulation = _Simulation(workers, [by_stage[w.stage] for w in workers], allreduce_s)
    simulation.run()
    return simulation, workers


def estimate(
    plan: Plan, library: LayerLibrary, cluster: Cluster, calibration: Calibration = DEFAULT_CALIBRATION
) -> Estimate:
    """Predict one training step of ``plan`` on ``cluster`` (see the module docstring for the semantics)."""
    _check_plan(plan, library, cluster)
    simulation, workers = _simulate(plan, cluster, library, calibration)
    _, warmup, steps = _simulated_iterations(plan)
    window = (simulation.iteration_end[warmup - 1] if warmup else 0.0, simulation.iteration_end[warmup + steps - 1])
    records = simulation.records
    spans = (record[:4] for record in records if record[1] != "send")
    busy, waiting = _window_totals(spans, range(len(workers)), window)
    device_of = [worker.device for worker in workers]
    compute, communication, idle = _per_step(
        {device_of[w]: t for w, t in busy.items()}, {device_of[w]: t for w, t in waiting.items()}, window, steps
    )
    memory = {
        name: stage_memory_bytes(plan, library, s) for s, names in enumerate(plan.stage_devices) for name in names
    }
    return Estimate(
        plan_id=plan.id,
        step_time=(window[1] - window[0]) / steps,
        compute=compute,
        communication=communication,
        idle=idle,
        peak_memory=memory,
        timeline=Timeline(lambda: _timeline_ops(records, workers, plan.micro_batches)),
        calibration=calibration,
    )
