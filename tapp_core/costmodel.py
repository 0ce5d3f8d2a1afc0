"""The cost model: what one training step of a plan costs on a cluster, by event-driven simulation.

``estimate(plan, library, cluster, calibration)`` returns an ``Estimate``: step time, per-device compute,
communication and idle time, peak memory and the timeline of every operation. The runtime implements the same
semantics, so that its Measurement can be compared with the Estimate term by term.

Replicas
    Every device of a stage runs a *replica* of it. A stage with ``k`` replicas splits each micro-batch into ``k``
    equal contiguous sample ranges (``plan.replica_slices``); each replica computes only its range. The formulas
    below are defined once, in ``tapp_core.costs``.

Devices and kinds
    Every device is costed from the layer library of its kind (a CPU with its threads, a GPU with its model:
    ``library.kinds``), with its kind's figures of the calibration, and with the slowdown of its ``speed`` only
    where that applies (emulated clusters, libraries of another kind or host): ``costs.device_terms``, whose
    rules are ``tapp_core.kinds``'. A single library on an emulated cluster is one library scaled by each
    device's ``speed``.

Compute
    A replica's forward (backward) of one micro-batch of ``samples`` takes, summed over its stage's layers in its
    device's library, the layer's fixed time plus its per-sample time times ``samples``
    (``Layer.forward_fixed_s`` and the rest of ``forward_s`` over ``library.batch_size``; a library without fixed
    parts scales linearly), times the device's ``compute_factor`` (slowdown times its kind's ``compute_scale``),
    plus its kind's ``per_micro_batch_s`` (``costs.compute_s``).

Cut traffic
    For every layer ``u`` of stage ``a`` and every later stage ``b`` holding one of ``u``'s successors, ``u``'s
    output (``activation_bytes * samples``) is sent directly from ``a`` to ``b`` (a tensor that skips stages is
    not relayed); the backward pass sends the gradient of the same size from ``b`` to ``a``. Each tensor is one
    message. Between replicated stages, source replica ``p`` sends to destination replica ``q`` the samples their
    ranges share. The data source (inputs and labels) is local to every replica and costs nothing.
    All tensors one operation sends to one replica leave together as one *transfer* on the directed link between
    the two devices: ``n_tensors * (latency + per_message_s) + bytes / (bandwidth * bandwidth_scale)``, plus the
    staging of a GPU end through host memory unless MPI is CUDA-aware (``costs.device_transfer_s``). A directed
    link carries one transfer at a time, first come first served (queueing).
    Transfers never occupy a replica: sends overlap compute, and a replica only waits for what it must receive.

Shared cores
    Where the calibration found the ranks of a host wanting more threads than it has cores (``costs`` "Shared
    cores"), every compute operation of a replica there lasts what its work takes at the pace the other replicas'
    operations, computing at the same time, leave it. Those durations and the timeline depend on each other: the
    simulation is repeated, each round with the durations the last one implies, until they settle
    (``SHARING_TOLERANCE``).

Schedules
    Every replica of stage ``s`` runs the schedule's program, ``tapp_core.schedules``' ``actions(s, S, M,
    iterations)``: the very list the runtime's engine runs (``simulated_programs`` gives it per stage). gpipe:
    forwards 0..M-1, then backwards M-1..0. 1f1b: ``min(S - s, M)`` forwards, then one backward and one forward
    alternately, then the remaining backwards. async: 1f1b over consecutive iterations with no flush (PipeDream),
    a stage updating its weights as soon as it has done the last backward of an iteration (weight stashing lets
    forwards of the next iteration run before that). Every operation starts at ``max(replica free, all its
    inputs arrived)``.

End of an iteration
    At a stage's update action its replicas allreduce their gradients (ring: ``2(k-1)/k * param bytes`` over the
    slowest link among the replicas plus ``2(k-1) * (latency + per_message_s)``, plus GPU replicas' staging,
    ``costs.allreduce_s``), starting when the last replica is ready; then every replica runs the update: its
    kind's ``update_s_per_param_byte * param bytes * slowdown + per_step_s`` (``costs.update_s``). The step ends
    when the last device finishes its update.

Step time
    A synchronous schedule (gpipe, 1f1b): the one simulated step. async: ``W = async_warmup_iterations(S, M)``
    iterations fill the pipeline, then ``K = async_measured_iterations(S, M)`` are measured, then enough
    iterations follow that the measured ones never see the drain; step time = (end of iteration W + K - end of
    iteration W) / K, counting iterations from 1, where an iteration ends when its last update ends. K covers
    several micro-batches per stage because the steady state may repeat only every few iterations.

Per-device breakdown (over the measured window, per step; ``breakdown`` computes it from any timeline)
    compute: forward, backward and update time. communication: time blocked in allreduce, plus, before each
    forward or backward, how much later it started than it would have if every transfer it waited on had been
    instantaneous (``start - max(replica free, latest time a sender finished producing an input)``); these waits
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

import itertools
import json
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

import numpy as np

from tapp_core.cluster import Cluster, Link
from tapp_core.costs import (
    DEFAULT_CALIBRATION,
    Calibration,
    DeviceTerms,
    KindCalibration,
    SharedHost,
    allreduce_s,
    collective_s,
    compute_s,
    device_terms,
    device_transfer_s,
    shared_hosts,
    sharing_excess,
    sharing_stretch,
    update_s,
)
from tapp_core.library import Layer, LayerLibrary
from tapp_core.metrics import communication_share
from tapp_core.placement import StageLayouts
from tapp_core.plan import (
    Plan,
    PlanError,
    check_devices,
    check_edges,
    check_layers,
    check_shape,
    library_layer_name,
    stage_memory_bytes,
)
from tapp_core.program import BACKWARD, FORWARD, DeviceProgram, plan_programs
from tapp_core.schedules import Action

OP_KINDS: tuple[str, ...] = ("forward", "backward", "send", "recv", "collective", "reduce", "allreduce", "update")
COMPUTE_KINDS = frozenset({"forward", "backward", "update"})
COMMUNICATION_KINDS = frozenset({"recv", "collective", "allreduce"})
"""Waits that count as communication: for a receive, for the layout changes inside a coupled stage's forward or
backward (``collective``, drawn after its compute), and for the gradient reductions before an update
(``allreduce``). Sends and the reductions themselves (``reduce``) overlap compute and do not count."""
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
    """For reduce: the gradient bucket (``tapp_core.program.Bucket``)."""

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
        timeline = data.get("timeline", [])
        calibration = data.get("calibration", {})
        if not isinstance(timeline, list) or not isinstance(calibration, Mapping):
            raise ValueError("estimate: timeline must be a list and calibration a mapping")
        return cls(
            plan_id=str(data["plan_id"]),
            step_time=float(_number(data["step_time"])),
            compute=_number_map(data["compute"], float),
            communication=_number_map(data["communication"], float),
            idle=_number_map(data["idle"], float),
            peak_memory=_number_map(data["peak_memory"], int),
            timeline=[TimelineOp.from_dict(op) for op in timeline],
            calibration=Calibration.from_dict(calibration),
        )


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
    busy, waiting = _window_totals(spans, devices, window)
    return _per_step(busy, waiting, window, steps)


_Key = TypeVar("_Key", bound=Hashable)


def _window_totals(
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
class _StageTimes:
    """Per stage, from one kind's library."""

    forward_s: np.ndarray
    """Per stage: forward time per sample on the library's device, beyond the fixed part."""
    backward_s: np.ndarray
    forward_fixed_s: np.ndarray
    """Per stage: forward time per call that does not depend on the number of samples."""
    backward_fixed_s: np.ndarray


@dataclass(frozen=True)
class _StageAggregates:
    stage: np.ndarray
    """The plan's stage of every layer."""
    param_bytes: np.ndarray
    """Per stage."""


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
    edges: np.ndarray
    """Shape (edges, 2): (producer, consumer) layer indices."""
    tensor_edges: np.ndarray
    """The edges whose value is a tensor (``LayerLibrary.tensor_edges``): what crosses cuts."""

    @property
    def edge_sources(self) -> np.ndarray:
        return self.edges[:, 0]

    @property
    def edge_targets(self) -> np.ndarray:
        return self.edges[:, 1]


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
    tensors = np.array([x.outputs_tensor for x in snapshot], dtype=bool)
    forward_s, backward_s, forward_fixed_s, backward_fixed_s, param_bytes, activation_bytes = table.T
    arrays = _LayerArrays(
        snapshot,
        forward_s,
        backward_s,
        forward_fixed_s,
        backward_fixed_s,
        param_bytes,
        activation_bytes,
        edges,
        edges[tensors[edges[:, 0]]],
    )
    if len(_LAYER_ARRAYS_CACHE) >= _LAYER_ARRAYS_CACHE_SIZE:
        del _LAYER_ARRAYS_CACHE[next(iter(_LAYER_ARRAYS_CACHE))]
    _LAYER_ARRAYS_CACHE[id(library.layers)] = arrays
    return arrays


def _stage_aggregates(plan: Plan, library: LayerLibrary) -> _StageAggregates:
    arrays = _layer_arrays(library)
    stage = np.asarray(plan.stage_of_layer, dtype=np.int64)
    check_edges(stage, arrays.edges, library_layer_name(library))
    return _StageAggregates(stage=stage, param_bytes=np.bincount(stage, arrays.param_bytes, plan.n_stages))


def _stage_times(stage: np.ndarray, n_stages: int, library: LayerLibrary) -> _StageTimes:
    arrays = _layer_arrays(library)
    per_sample = 1.0 / library.batch_size
    forward_fixed = np.bincount(stage, arrays.forward_fixed_s, n_stages)
    backward_fixed = np.bincount(stage, arrays.backward_fixed_s, n_stages)
    return _StageTimes(
        forward_s=(np.bincount(stage, arrays.forward_s, n_stages) - forward_fixed) * per_sample,
        backward_s=(np.bincount(stage, arrays.backward_s, n_stages) - backward_fixed) * per_sample,
        forward_fixed_s=forward_fixed,
        backward_fixed_s=backward_fixed,
    )


def _check_plan(plan: Plan, library: LayerLibrary, cluster: Cluster) -> None:
    """The checks a plan needs before it can be simulated (edges are checked on the arrays, in
    ``_stage_aggregates``). Memory, replica counts and empty stages are ``validate``'s business."""
    check_shape(plan)
    check_layers(
        plan.stage_of_layer, plan.n_stages, len(library.layers), library_layer_name(library), "the layer library"
    )
    check_devices(plan, cluster)


# ---------------------------------------------------------------------------------------------------------------
# Simulated devices: what each action of their programs costs

UPDATE = "update"
NO_PEER = -1
_EXCHANGE = {FORWARD: "forward exchange", BACKWARD: "backward exchange"}
"""``_SimulatedDevice.duration`` keys: the part of a coupled forward (backward) spent in its stage's collectives."""

Transfer = tuple[int, int, float]
"""What a device sends after one operation to one other device: (receiving device, directed link id, transfer
duration)."""


@dataclass
class _SimulatedDevice:
    """One device running its program: what its operations take and where it sends their outputs. ``index`` is
    its program's position (the plan's device order)."""

    index: int
    stage: int
    device: str
    order: tuple[Action, ...]
    duration: dict[str, float]
    """Per direction (FORWARD, BACKWARD): time of one micro-batch."""
    update_s: float
    transfers: dict[str, list[Transfer]]
    expected: dict[str, int]
    """Per direction: how many transfers each of this device's operations waits for."""
    bucket_ready: tuple[float, ...]
    """Per gradient bucket: the share of the step's last backward done when the bucket's gradients are complete."""
    coupled: bool = False
    """Its stage's devices exchange data inside every forward and backward: they run them together."""


def _simulated_devices(
    plan: Plan,
    programs: Sequence[DeviceProgram],
    aggregates: _StageAggregates,
    terms: Mapping[str, DeviceTerms],
    cluster: Cluster,
    calibration: Calibration,
) -> list[_SimulatedDevice]:
    times: dict[int, _StageTimes] = {}  # per library (by id): the kinds the plan's devices use
    links: dict[tuple[str, str], int] = {}
    message_bytes: dict[tuple[int, ...], float] = {}
    devices = []
    n_stages = len(aggregates.param_bytes)
    split = _split_stage_durations(plan, programs, terms, cluster, calibration)
    for program in programs:
        device = terms[program.device]
        own = times.get(id(device.library))
        if own is None:
            own = times[id(device.library)] = _stage_times(aggregates.stage, n_stages, device.library)
        durations, coupled = split.get(program.position, (_compute_durations(own, program, device), False))
        devices.append(
            _SimulatedDevice(
                index=program.position,
                stage=program.stage,
                device=program.device,
                order=program.order,
                duration=durations,
                coupled=coupled,
                update_s=update_s(device, float(aggregates.param_bytes[program.stage])),
                transfers={kind: [] for kind in (FORWARD, BACKWARD)},
                expected={kind: len(program.receives[kind]) for kind in (FORWARD, BACKWARD)},
                bucket_ready=_bucket_ready(program, aggregates.stage, device.library),
            )
        )
    for program in programs:
        for kind in (FORWARD, BACKWARD):
            for route in program.sends[kind]:
                source, target = terms[program.device], terms[programs[route.peer].device]
                per_sample = message_bytes.get(route.values)
                if per_sample is None:
                    per_sample = message_bytes[route.values] = float(
                        _layer_arrays(source.library).activation_bytes[list(route.values)].sum()
                    )
                duration = device_transfer_s(
                    cluster, source, target, per_sample * route.samples, len(route.values), calibration
                )
                link = links.setdefault((source.device, target.device), len(links))
                devices[program.position].transfers[kind].append((route.peer, link, duration))
    return devices


def _compute_durations(own: _StageTimes, program: DeviceProgram, device: DeviceTerms) -> dict[str, float]:
    factor, per_call, stage = device.compute_factor, device.figures.per_micro_batch_s, program.stage
    return {
        FORWARD: compute_s(
            float(own.forward_fixed_s[stage]), float(own.forward_s[stage]), program.samples, factor, per_call
        ),
        BACKWARD: compute_s(
            float(own.backward_fixed_s[stage]), float(own.backward_s[stage]), program.samples, factor, per_call
        ),
    }


def _split_stage_durations(
    plan: Plan,
    programs: Sequence[DeviceProgram],
    terms: Mapping[str, DeviceTerms],
    cluster: Cluster,
    calibration: Calibration,
) -> dict[int, tuple[dict[str, float], bool]]:
    """Per device of a stage whose layers run split signatures: its forward and backward, and whether the stage is
    coupled. A layer's work on a device is its share of the layer as the layouts run it (``_layer_work``); a coupled
    group runs each segment between two layout changes at its slowest device's pace, then the change's collective
    (``costs.collective_s``, the backward's from the dual layouts)."""
    out: dict[int, tuple[dict[str, float], bool]] = {}
    for stage in range(plan.n_stages):
        if not plan.runs_split(stage):
            continue
        members = [p for p in programs if p.stage == stage]
        library = terms[members[0].device].library
        layouts = plan.layouts(library, stage)
        group = plan.stage_devices[stage]
        links = [cluster.link(a, b) for i, a in enumerate(group) for b in group[i + 1 :]]
        work = {
            p.position: _layer_work(plan, layouts, stage, p, terms[p.device]) * terms[p.device].compute_factor
            for p in members
        }
        durations = {p.position: {FORWARD: 0.0, BACKWARD: 0.0} for p in members}
        for kind, column in ((FORWARD, 0), (BACKWARD, 1)):
            if layouts.coupled:
                busy, exchange = _coupled_time(plan, layouts, stage, work, column, library, links, calibration, kind)
                for p in members:
                    durations[p.position][kind] = busy + exchange + terms[p.device].figures.per_micro_batch_s
                    durations[p.position][_EXCHANGE[kind]] = exchange
            else:
                for p in members:
                    seconds = float(work[p.position][:, column].sum())
                    durations[p.position][kind] = seconds + terms[p.device].figures.per_micro_batch_s
        for p in members:
            out[p.position] = (durations[p.position], layouts.coupled)
    return out


def _layer_work(
    plan: Plan, layouts: StageLayouts, stage: int, program: DeviceProgram, terms: DeviceTerms
) -> np.ndarray:
    """(stage layers, 2): each layer's forward and backward work on the device, in seconds of its library: the fixed
    part and the per-sample part times what the device runs of the layer (its rows of a Split(0) input; its share
    of the whole micro-batch where the layer is split along its features, fixed part included; all of it where
    the layer is replicated)."""
    arrays = _layer_arrays(terms.library)
    layers = np.asarray(plan.stage_layers(stage))
    per_sample = 1.0 / terms.library.batch_size
    share = plan.shares(stage)[program.replica]
    micro = plan.micro_batch_size
    fixed_part = np.array([share if layouts.split(int(x)) else 1.0 for x in layers])
    samples = np.array(
        [share * micro if layouts.split(int(x)) else (micro if layouts.replicated(int(x)) else program.samples)
         for x in layers]
    )  # fmt: skip
    forward = (
        arrays.forward_fixed_s[layers] * fixed_part
        + (arrays.forward_s[layers] - arrays.forward_fixed_s[layers]) * per_sample * samples
    )
    backward = (
        arrays.backward_fixed_s[layers] * fixed_part
        + (arrays.backward_s[layers] - arrays.backward_fixed_s[layers]) * per_sample * samples
    )
    return np.stack([forward, backward], axis=1)


def _coupled_time(
    plan: Plan,
    layouts: StageLayouts,
    stage: int,
    work: Mapping[int, np.ndarray],
    column: int,
    library: LayerLibrary,
    links: Sequence[Link],
    calibration: Calibration,
    kind: str,
) -> tuple[float, float]:
    """A coupled group's forward (``column`` 0) or backward (1): (each segment of layers between layout changes at
    the pace of its slowest device (``work`` is per device, in its seconds), every change's collective on the
    micro-batch)."""
    layers = plan.stage_layers(stage)
    position = {layer: i for i, layer in enumerate(layers)}
    breaks = sorted({position[c.layer] for c in layouts.changes if c.layer in position} | {0, len(layers)})
    total = 0.0
    for start, stop in itertools.pairwise(breaks):
        total += max(float(w[start:stop, column].sum()) for w in work.values())
    shares = plan.shares(stage)
    activation = _layer_arrays(library).activation_bytes
    exchange = 0.0
    for change in layouts.changes:
        collective = change.forward if kind == FORWARD else change.backward
        tensor_bytes = float(activation[change.value]) * plan.micro_batch_size
        exchange += collective_s(collective, tensor_bytes, shares, links, calibration)
    return total, exchange


def _bucket_ready(program: DeviceProgram, stage: np.ndarray, library: LayerLibrary) -> tuple[float, ...]:
    """Per bucket of ``program``: the share of its stage's backward (in ``library``'s times) done once the backward
    pass, running from the stage's last layer to its first, has finished the bucket's first layer."""
    if not program.buckets:
        return ()
    if not program.overlap:
        return tuple(1.0 for _ in program.buckets)
    backward = _layer_arrays(library).backward_s
    layers = np.flatnonzero(stage == program.stage)
    total = float(backward[layers].sum())
    ready = []
    for bucket in program.buckets:
        first = min(bucket.layers)
        done = float(backward[layers[layers >= first]].sum())
        ready.append(done / total if total > 0 else 1.0)
    return tuple(ready)


# ---------------------------------------------------------------------------------------------------------------
# The simulation

OpKey = tuple[int, str, int]
"""(device, kind, global micro-batch or iteration): one operation of a simulation."""
Record = tuple[int, str, float, float, int, int]
"""(device, kind, start, end, global micro-batch or iteration, peer device or bucket or NO_PEER): a TimelineOp in
the making, kept as a plain tuple because building thousands of frozen dataclasses would dominate the run time."""


class _Simulation:
    """Runs every device's program; each operation starts when its device is free and its inputs have arrived."""

    def __init__(
        self,
        devices: list[_SimulatedDevice],
        reduce_s: list[list[float]],
        iterations: int,
        durations: Mapping[OpKey, float],
    ) -> None:
        self.devices = devices
        self.durations = durations
        """Operations that last other than their device's time for their kind (on a shared host)."""
        self.reduce_s = reduce_s
        """Per stage, per gradient bucket: the allreduce among the stage's devices."""
        self.group_size = [0] * len(reduce_s)
        for device in devices:
            self.group_size[device.stage] += 1
        self.position = [0] * len(devices)
        self.free = [0.0] * len(devices)
        self.last_backward = [(0.0, 0.0)] * len(devices)
        self.link_free: dict[int, float] = {}
        # (device, direction, micro-batch) -> [transfers still missing, latest ready, latest arrival, last sender]
        self.inbox: dict[tuple[int, str, int], list[float]] = {}
        self.blocked_on: list[tuple[int, str, int] | None] = [None] * len(devices)
        self.at_update: dict[tuple[int, int], list[int]] = {}
        self.at_meeting: dict[tuple[int, str, int], list[tuple[int, tuple[float, float, int]]]] = {}
        self.iteration_end = [0.0] * iterations
        self.records: list[Record] = []
        self.runnable = list(range(len(devices)))

    def run(self) -> None:
        while self.runnable:
            self._advance(self.runnable.pop())
        stuck = [d.device for d in self.devices if self.position[d.index] < len(d.order)]
        if stuck:
            raise PlanError(f"the schedule deadlocks: devices {', '.join(stuck)} never finish")

    def _advance(self, d: int) -> None:
        order = self.devices[d].order
        while self.position[d] < len(order):
            action = order[self.position[d]]
            if action.kind == UPDATE:
                done = self._reach_update(d, action.index)
            else:
                done = self._try_compute(d, action.kind, action.index)
            if not done:
                return
            self.position[d] += 1

    def _try_compute(self, d: int, kind: str, g: int) -> bool:
        """Run the operation once its inputs are here (and, on a coupled stage, once every device of the stage
        has its own); False while it cannot start."""
        device = self.devices[d]
        ready = self._inputs_ready(d, kind, g)
        if ready is None:
            return False
        if device.coupled:
            return self._meet(d, kind, g, ready)
        self._run(d, kind, g, ready[0], ready)
        return True

    def _inputs_ready(self, d: int, kind: str, g: int) -> tuple[float, float, int] | None:
        """(when the operation may start, when its wait for data began, the last sender) once every transfer it
        waits for is in (taken from the inbox); None while some is missing."""
        device = self.devices[d]
        free = self.free[d]
        if not device.expected[kind]:
            return free, free, NO_PEER
        key = (d, kind, g)
        box = self.inbox.get(key)
        if box is None or box[0]:
            self.blocked_on[d] = key
            return None
        del self.inbox[key]
        _, ready, arrival, sender = box
        return max(free, arrival), max(free, ready), int(sender)

    def _run(self, d: int, kind: str, g: int, start: float, ready: tuple[float, float, int] | None = None) -> None:
        device = self.devices[d]
        if ready is not None and ready[0] > ready[1]:
            self.records.append((d, "recv", ready[1], ready[0], g, ready[2]))
        end = start + self.durations.get((d, kind, g), device.duration[kind])
        exchange = device.duration.get(_EXCHANGE[kind], 0.0)
        self.records.append((d, kind, start, end - exchange, g, NO_PEER))
        if exchange:
            self.records.append((d, "collective", end - exchange, end, g, NO_PEER))
        self.free[d] = end
        if kind == BACKWARD:
            self.last_backward[d] = (start, end)
        self._send(d, device.transfers[kind], kind, g, end)

    def _meet(self, d: int, kind: str, g: int, ready: tuple[float, float, int]) -> bool:
        """A coupled stage's operation: every device of the stage starts it together, once the last has its inputs
        (waiting for the others is idle time, not communication)."""
        key = (self.devices[d].stage, kind, g)
        waiting = self.at_meeting.setdefault(key, [])
        waiting.append((d, ready))
        if len(waiting) < self.group_size[self.devices[d].stage]:
            return False
        del self.at_meeting[key]
        start = max(r[0] for _, r in waiting)
        for q, q_ready in waiting:
            self._run(q, kind, g, start, q_ready)
            if q != d:
                self.position[q] += 1
                self.runnable.append(q)
        return True

    def _send(self, d: int, transfers: list[Transfer], kind: str, g: int, ready: float) -> None:
        for receiver, link, duration in transfers:
            start = max(ready, self.link_free.get(link, 0.0))
            arrival = start + duration
            self.link_free[link] = arrival
            self.records.append((d, "send", start, arrival, g, receiver))
            key = (receiver, kind, g)
            box = self.inbox.get(key)
            if box is None:
                box = self.inbox[key] = [self.devices[receiver].expected[kind], ready, arrival, d]
            else:
                box[1] = max(box[1], ready)
                if arrival >= box[2]:
                    box[2], box[3] = arrival, d
            box[0] -= 1
            if not box[0] and self.blocked_on[receiver] == key:
                self.blocked_on[receiver] = None
                self.runnable.append(receiver)

    def _reach_update(self, d: int, iteration: int) -> bool:
        """Once every device of the stage is here: the gradient buckets' reductions (each from when every device's
        last backward had made its gradients, one after another), then every device's update once they are done.
        False while some device of the stage is missing."""
        stage = self.devices[d].stage
        waiting = self.at_update.setdefault((stage, iteration), [])
        waiting.append(d)
        if len(waiting) < self.group_size[stage]:
            return False
        del self.at_update[(stage, iteration)]
        reduced = self._reduce(stage, iteration, waiting)
        # Waiting for a slower device of the stage to finish its backward is imbalance (idle), not communication.
        slowest = max(self.last_backward[q][1] for q in waiting)
        for q in waiting:
            start = max(self.free[q], reduced)
            waited_from = max(self.free[q], slowest)
            if start > waited_from:
                self.records.append((q, "allreduce", waited_from, start, iteration, NO_PEER))
            finish = start + self.durations.get((q, UPDATE, iteration), self.devices[q].update_s)
            self.records.append((q, UPDATE, start, finish, iteration, NO_PEER))
            self.free[q] = finish
            self.iteration_end[iteration] = max(self.iteration_end[iteration], finish)
            if q != d:
                self.position[q] += 1
                self.runnable.append(q)
        return True

    def _reduce(self, stage: int, iteration: int, group: list[int]) -> float:
        """Simulate the stage's bucket reductions of ``iteration``; returns when the last ends (0 with none)."""
        end = 0.0
        for bucket, seconds in enumerate(self.reduce_s[stage]):
            ready = max(
                self.last_backward[q][0]
                + self.devices[q].bucket_ready[bucket] * (self.last_backward[q][1] - self.last_backward[q][0])
                for q in group
            )
            start = max(ready, end)
            end = start + seconds
            for q in group:
                self.records.append((q, "reduce", start, end, iteration, bucket))
        return end


def _timeline_ops(records: list[Record], devices: list[_SimulatedDevice], micro_batches: int) -> list[TimelineOp]:
    ops = []
    for d, kind, start, end, number, peer in records:
        device = devices[d]
        bucket = peer if kind == "reduce" else -1
        peer_device = devices[peer].device if peer != NO_PEER and kind in ("send", "recv") else ""
        if kind in ("reduce", "allreduce", UPDATE):
            iteration, micro_batch = number, NO_MICRO_BATCH
        else:
            iteration, micro_batch = divmod(number, micro_batches)
        ops.append(
            TimelineOp(device.device, device.stage, micro_batch, kind, start, end, iteration, peer_device, bucket)
        )
    return ops


def simulated_iterations(plan: Plan) -> tuple[int, int, int]:
    """(iterations the cost model simulates, warm-up iterations before the measured ones, measured iterations):
    the schedule's ``window``."""
    warmup, measured, tail = plan.pipeline_schedule.window(plan.n_stages, plan.micro_batches)
    return warmup + measured + tail, warmup, measured


def simulated_programs(plan: Plan, library: LayerLibrary) -> tuple[DeviceProgram, ...]:
    """Every device's program as the cost model simulates it for ``plan``: over the iterations of
    ``simulated_iterations`` (one for a synchronous schedule)."""
    arrays = _layer_arrays(library)
    steps = simulated_iterations(plan)[0]
    return plan_programs(
        plan, arrays.tensor_edges, arrays.param_bytes, steps, specs=library.specs() if plan.signatures else ()
    )


def _simulate(
    plan: Plan, cluster: Cluster, library: LayerLibrary, calibration: Calibration
) -> tuple[_Simulation, list[_SimulatedDevice]]:
    aggregates = _stage_aggregates(plan, library)
    terms = device_terms(library, cluster, calibration)
    programs = simulated_programs(plan, library)
    devices = _simulated_devices(plan, programs, aggregates, terms, cluster, calibration)
    reduce_s: list[list[float]] = [[] for _ in range(plan.n_stages)]
    for program in programs:
        if program.replica == 0:
            group = plan.stage_devices[program.stage]
            reduce_s[program.stage] = [
                allreduce_s(cluster, group, float(b.nbytes), calibration, terms) for b in program.buckets
            ]
    iterations = simulated_iterations(plan)[0]

    def run(durations: Mapping[OpKey, float]) -> _Simulation:
        simulation = _Simulation(devices, reduce_s, iterations, durations)
        simulation.run()
        return simulation

    hosts = shared_hosts(cluster, int(calibration.host_cores))
    return (_settle_sharing(run, devices, hosts, terms) if hosts else run({})), devices


SHARING_ROUNDS = 32
SHARING_TOLERANCE = 1e-4
"""The operations' shared-core durations have settled when none changes by more than this share in a round."""


def _settle_sharing(
    run: Callable[[Mapping[OpKey, float]], _Simulation],
    replicas: Sequence[_SimulatedDevice],
    hosts: Sequence[SharedHost],
    terms: Mapping[str, DeviceTerms],
) -> _Simulation:
    """Simulate with every compute operation on a shared host lasting what its work takes at the pace the other
    replicas' operations leave it (``costs.sharing_stretch``), until the durations settle: they are a fixed point,
    since an operation that lasts longer overlaps others more. Each round takes the durations the last timeline
    implies; once a round changes them more than the round before (the iteration oscillates), each round moves
    only half way."""
    durations: dict[OpKey, float] = {}
    simulation = run(durations)
    step, last_change = 1.0, math.inf
    for _ in range(SHARING_ROUNDS):
        implied = _shared_durations(simulation.records, replicas, hosts, terms)
        change = max(
            (abs(seconds / durations[key] - 1.0) if key in durations else math.inf for key, seconds in implied.items()),
            default=0.0,
        )
        if change <= SHARING_TOLERANCE:
            break
        if change > last_change:
            step = 0.5
        last_change = change
        durations = {
            key: durations.get(key, seconds) + step * (seconds - durations.get(key, seconds))
            for key, seconds in implied.items()
        }
        simulation = run(durations)
    return simulation


def _shared_durations(
    records: Sequence[Record],
    replicas: Sequence[_SimulatedDevice],
    hosts: Sequence[SharedHost],
    terms: Mapping[str, DeviceTerms],
) -> dict[OpKey, float]:
    """Per compute operation of a replica on a shared host, from when it started in ``records``: how long its
    work takes while the other replicas' operations compute as they did there."""
    durations: dict[OpKey, float] = {}
    for host in hosts:
        ops = [
            (r, kind, start, end, number)
            for r, kind, start, end, number, _ in records
            if kind in COMPUTE_KINDS and end > start and replicas[r].device in host.threads
        ]
        for r in sorted({op[0] for op in ops}):
            replica = replicas[r]
            others = [(host.threads[replicas[o[0]].device], o[2], o[3]) for o in ops if o[0] != r]
            pace = _Pace(others, host.threads[replica.device], host, terms[replica.device].figures)
            for _, kind, start, _, number in (op for op in ops if op[0] == r):
                work = replica.update_s if kind == UPDATE else replica.duration[kind]
                durations[(r, kind, number)] = pace.finish(start, work) - start
    return durations


class _Pace:
    """How fast one replica's work progresses on its shared host while other replicas' operations compute:
    ``progress`` is the work (in seconds alone) it could have done from the first of ``times`` to each. Before
    the first and after the last of the others' operations it computes as alone (``sharing_excess`` 0)."""

    def __init__(
        self, others: Sequence[tuple[int, float, float]], own: int, host: SharedHost, figures: KindCalibration
    ) -> None:
        """``others``: (threads, start, end) of the other replicas' operations; ``own``: this replica's threads."""
        if not others:
            self.times = self.progress = np.zeros(1)
            return
        table = np.array(others, dtype=float)
        threads = table[:, 0]
        times = np.concatenate([table[:, 1], table[:, 2]])
        order = np.argsort(times, kind="stable")
        self.times = times[order]
        active = own + np.cumsum(np.concatenate([threads, np.negative(threads)])[order])[:-1]
        rate = 1.0 / sharing_stretch(figures, sharing_excess(active, own, host))
        self.progress = np.concatenate([[0.0], np.cumsum(rate * np.diff(self.times))])

    def finish(self, start: float, work: float) -> float:
        """When work of ``work`` seconds alone, started at ``start``, is done."""
        times, progress = self.times, self.progress
        if start <= times[0]:
            target = progress[0] - (times[0] - start) + work
        elif start >= times[-1]:
            target = progress[-1] + (start - times[-1]) + work
        else:
            target = np.interp(start, times, progress) + work
        if target <= progress[0]:
            return float(times[0] - (progress[0] - target))
        if target >= progress[-1]:
            return float(times[-1] + (target - progress[-1]))
        return float(np.interp(target, progress, times))


def estimate(
    plan: Plan, library: LayerLibrary, cluster: Cluster, calibration: Calibration = DEFAULT_CALIBRATION
) -> Estimate:
    """Predict one training step of ``plan`` on ``cluster`` (see the module docstring for the semantics)."""
    _check_plan(plan, library, cluster)
    simulation, devices = _simulate(plan, cluster, library, calibration)
    _, warmup, steps = simulated_iterations(plan)
    window = (simulation.iteration_end[warmup - 1] if warmup else 0.0, simulation.iteration_end[warmup + steps - 1])
    records = simulation.records
    spans = (record[:4] for record in records if record[1] not in ("send", "reduce"))
    busy, waiting = _window_totals(spans, range(len(devices)), window)
    device_of = [device.device for device in devices]
    compute, communication, idle = _per_step(
        {device_of[d]: t for d, t in busy.items()}, {device_of[d]: t for d, t in waiting.items()}, window, steps
    )
    memory = {name: need for s in range(plan.n_stages) for name, need in stage_memory_bytes(plan, library, s).items()}
    return Estimate(
        plan_id=plan.id,
        step_time=(window[1] - window[0]) / steps,
        compute=compute,
        communication=communication,
        idle=idle,
        peak_memory=memory,
        timeline=Timeline(lambda: _timeline_ops(records, devices, plan.micro_batches)),
        calibration=calibration,
    )
