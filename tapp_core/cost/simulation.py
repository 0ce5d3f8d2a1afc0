"""The cost model: what one training step of a plan costs on a cluster, by event-driven simulation.

``estimate(plan, context)`` (``context``: the run's ``CostContext``, its library, cluster and calibration) returns
an ``Estimate`` (``tapp_core.cost.estimate``): step time, per-device compute, communication and idle time, peak
memory and the timeline of every operation. The runtime implements the same semantics, so that its Measurement
can be compared with the Estimate term by term: both give their ``StepTerms`` (``tapp_core.measure.step``).

Replicas
    Every device of a stage runs a *replica* of it. A stage with ``k`` replicas splits each micro-batch into ``k``
    equal contiguous sample ranges (``Plan.rows``); each replica computes only its range. The formulas
    below are defined once, in ``tapp_core.cost.formulas``.

Devices and kinds
    Every device is costed from the layer library of its kind (a CPU with its threads, a GPU with its model:
    ``library.kinds``), with its kind's figures of the calibration, and with the slowdown of its ``speed`` only
    where that applies (emulated clusters, libraries of another kind or host): ``CostContext.terms``, whose
    rules are ``tapp_core.platform.kinds``'. A single library on an emulated cluster is one library scaled by each
    device's ``speed``.

Compute
    A replica's forward (backward) of one micro-batch of ``samples`` takes, summed over its stage's layers in its
    device's library, the layer's fixed time plus its per-sample time times ``samples``
    (``Layer.forward_fixed_s`` and the rest of ``forward_s`` over ``library.batch_size``; a library without fixed
    parts scales linearly), times the device's ``compute_factor`` (slowdown times its kind's ``compute_scale``),
    plus its kind's ``per_micro_batch_s`` (``formulas.compute_s``). The backward of a stage that recomputes its
    activations (``Plan.recompute``) runs its forward again first: it costs a forward more.

Cut traffic
    For every layer ``u`` of stage ``a`` and every later stage ``b`` holding one of ``u``'s successors, ``u``'s
    output (``activation_bytes * samples``) is sent directly from ``a`` to ``b`` (a tensor that skips stages is
    not relayed); the backward pass sends the gradient of the same size from ``b`` to ``a``. Each tensor is one
    message. Between replicated stages, source replica ``p`` sends to destination replica ``q`` the samples their
    ranges share. The data source (inputs and labels) is local to every replica and costs nothing.
    All tensors one operation sends to one replica leave together as one *transfer* on the directed link between
    the two devices: ``n_tensors * (latency + per_message_s) + bytes / (bandwidth * bandwidth_scale)``, plus the
    staging of a GPU end through host memory unless MPI is CUDA-aware (``formulas.device_transfer_s``). A directed
    link carries one transfer at a time, first come first served (queueing).
    Transfers never occupy a replica: sends overlap compute, and a replica only waits for what it must receive.

Shared cores
    Where the calibration found the ranks of a host wanting more threads than it has cores (``formulas`` "Shared
    cores"), every compute operation of a replica there lasts what its work takes at the pace the other replicas'
    operations, computing at the same time, leave it. Those durations and the timeline depend on each other: the
    simulation is repeated, each round with the durations the last one implies, until they settle
    (``shared_cores.SHARING_TOLERANCE``).

Schedules
    Every replica of stage ``s`` runs its program (``tapp_core.plan.program.plan_programs``), whose order is the
    schedule's ``PipelineSchedule.compute_order``: the very list the runtime's engine runs (``simulated_programs``
    gives them). gpipe: forwards 0..M-1, then backwards M-1..0. 1f1b: ``min(S - s, M)`` forwards, then one backward
    and one forward alternately, then the remaining backwards. async: 1f1b over consecutive iterations with no
    flush (PipeDream), a stage updating its weights as soon as it has done the last backward of an iteration
    (weight stashing lets forwards of the next iteration run before that). Every operation starts at
    ``max(replica free, all its inputs arrived)``.

End of an iteration
    At a stage's update action its replicas allreduce their gradients (ring: ``2(k-1)/k * param bytes`` over the
    slowest link among the replicas plus ``2(k-1) * (latency + per_message_s)``, plus GPU replicas' staging,
    ``formulas.allreduce_s``), starting when the last replica is ready; then every replica runs the update: its
    kind's ``update_s_per_param_byte * param bytes * slowdown + per_step_s`` (``formulas.update_s``). The step ends
    when the last device finishes its update. Stages holding a tied parameter (``tapp_core.plan.ties``) also sum its
    gradient among all their devices (the same ring allreduce, over those devices' slowest link): the stages a tie
    joins, directly or through another tie, wait for each other there, and update once every tie among them is done,
    one after another, from when the last of them has reduced its buckets. Each holder updates its own copy.
    A stage that shards its optimiser state (``Plan.shard_optimizer``) reduce-scatters each bucket instead (ring:
    ``(1 - smallest share) * bucket bytes`` over the slowest link, ``k - 1`` latencies; ``formulas.collective_s``),
    each device updates its share of the parameters (its share of the rows), and the stage's devices then allgather
    the updated parameters (the same traffic on all of them), from when the last has updated.

Step time
    A synchronous schedule (gpipe, 1f1b): the one simulated step. async: ``PipelineSchedule.window`` gives ``W``
    iterations that fill the pipeline, ``K`` measured ones and enough after them that the measured ones never see
    the drain (``simulated_iterations``); step time = (end of iteration W + K - end of iteration W) / K, counting
    iterations from 1, where an iteration ends when its last update ends. K covers several micro-batches per stage
    because the steady state may repeat only every few iterations.

Per-device breakdown (over the measured window, per step; ``estimate.breakdown`` computes it from any timeline)
    compute: forward, backward and update time. communication: time blocked in allreduce, plus, before each
    forward or backward, how much later it started than it would have if every transfer it waited on had been
    instantaneous (``start - max(replica free, latest time a sender finished producing an input)``); these waits
    appear in the timeline as ``recv`` operations. idle: the rest of the step (pipeline bubbles, imbalance).
    A runtime measures the same by stamping each message with the time its sender posted it.

Timeline
    Every operation of every simulated iteration (``TimelineOp.iteration``): forward, backward, allreduce and
    update; ``send`` on the sending device (``peer`` = receiver) for as long as the link carries it; ``recv`` for
    each communication wait (``peer`` = the device whose transfer arrived last). Built on first use.

Peak memory is ``tapp_core.plan.plan.stage_memory_bytes`` of the device's stage (``plan_memory_bytes``: every stage's). BSP (one stage on every device) and single
device (one stage on one device) are plans like any other. ``estimate`` does not check memory; ``tapp_core.cost.checks.validate`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.calibration import Calibration
from tapp_core.cost.context import CostContext
from tapp_core.cost.estimate import (
    NO_MICRO_BATCH,
    UPDATE,
    Estimate,
    MemoryCurves,
    Timeline,
    TimelineOp,
    per_step,
    window_totals,
)
from tapp_core.cost.formulas import (
    DeviceTerms,
    allreduce_s,
    compute_s,
    device_transfer_s,
    group_collective_s,
    shared_hosts,
    update_s,
)
from tapp_core.cost.layer_arrays import layer_arrays
from tapp_core.cost.memory_curve import memory_curves
from tapp_core.cost.shared_cores import OpKey, Record, settle_sharing
from tapp_core.cost.split_layout import EXCHANGE, split_stage_durations
from tapp_core.plan.plan import (
    Plan,
    PlanError,
    check_devices,
    check_edges,
    check_layers,
    check_shape,
    library_layer_name,
    plan_memory_bytes,
)
from tapp_core.plan.program import BACKWARD, FORWARD, DeviceProgram, plan_programs
from tapp_core.plan.schedules import Action
from tapp_core.plan.ties import plan_ties, tied_copy_bytes
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.library import LayerLibrary

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
    trained_bytes: np.ndarray
    """Per stage: the parameters its update steps (with its tied copies)."""


def _stage_aggregates(plan: Plan, library: LayerLibrary) -> _StageAggregates:
    arrays = layer_arrays(library)
    stage = np.asarray(plan.stage_of_layer, dtype=np.int64)
    check_edges(stage, arrays.edges, library_layer_name(library))
    trained_bytes = np.bincount(stage, arrays.trained_bytes, plan.n_stages)
    if library.shared:
        trained_bytes += tied_copy_bytes(plan.stage_of_layer, plan.n_stages, library.shared, trained=True)
    return _StageAggregates(stage=stage, trained_bytes=trained_bytes)


def _stage_times(stage: np.ndarray, n_stages: int, library: LayerLibrary) -> _StageTimes:
    arrays = layer_arrays(library)
    per_sample = 1.0 / library.batch_size
    forward_fixed = np.bincount(stage, arrays.forward_fixed_s, n_stages)
    backward_fixed = np.bincount(stage, arrays.backward_fixed_s, n_stages)
    return _StageTimes(
        forward_s=(np.bincount(stage, arrays.forward_s, n_stages) - forward_fixed) * per_sample,
        backward_s=(np.bincount(stage, arrays.backward_s, n_stages) - backward_fixed) * per_sample,
        forward_fixed_s=forward_fixed,
        backward_fixed_s=backward_fixed,
    )


def _check_plan(plan: Plan, context: CostContext) -> None:
    """The checks a plan needs before it can be simulated (edges are checked on the arrays, in
    ``_stage_aggregates``). Memory, replica counts and empty stages are ``validate``'s business."""
    library = context.library
    check_shape(plan)
    check_layers(
        plan.stage_of_layer, plan.n_stages, len(library.layers), library_layer_name(library), "the layer library"
    )
    check_devices(plan, context.cluster)


# ---------------------------------------------------------------------------------------------------------------
# Simulated devices: what each action of their programs costs

NO_PEER = -1

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
    gather_s: float = 0.0
    """Its stage sharding its optimiser state (``Plan.shard_optimizer``): the allgather of the updated parameters
    that follows the update of every device of the stage."""


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
    n_stages = len(aggregates.trained_bytes)
    split = split_stage_durations(plan, programs, terms, cluster, calibration)
    for program in programs:
        device = terms[program.device]
        own = times.get(id(device.library))
        if own is None:
            own = times[id(device.library)] = _stage_times(aggregates.stage, n_stages, device.library)
        durations, coupled = split.get(
            program.position, (_compute_durations(own, program, device, plan.recomputes(program.stage)), False)
        )
        devices.append(
            _SimulatedDevice(
                index=program.position,
                stage=program.stage,
                device=program.device,
                order=program.order,
                duration=durations,
                coupled=coupled,
                update_s=update_s(
                    device,
                    float(aggregates.trained_bytes[program.stage])
                    * plan.optimizer_share(program.stage, program.samples),
                ),
                transfers={kind: [] for kind in (FORWARD, BACKWARD)},
                expected={kind: len(program.receives[kind]) for kind in (FORWARD, BACKWARD)},
                bucket_ready=_bucket_ready(program, aggregates.stage, device.library),
                gather_s=_gather_s(plan, program.stage, aggregates, cluster, calibration),
            )
        )
    for program in programs:
        for kind in (FORWARD, BACKWARD):
            for route in program.sends[kind]:
                source, target = terms[program.device], terms[programs[route.peer].device]
                per_sample = message_bytes.get(route.values)
                if per_sample is None:
                    per_sample = message_bytes[route.values] = float(
                        layer_arrays(source.library).activation_bytes[list(route.values)].sum()
                    )
                duration = device_transfer_s(
                    cluster, source, target, per_sample * route.samples, len(route.values), calibration
                )
                link = links.setdefault((source.device, target.device), len(links))
                devices[program.position].transfers[kind].append((route.peer, link, duration))
    return devices


def _compute_durations(
    own: _StageTimes, program: DeviceProgram, device: DeviceTerms, recompute: bool = False
) -> dict[str, float]:
    """A forward's and a backward's time on the device; a recomputing stage's backward runs its forward first."""
    factor, per_call, stage = device.compute_factor, device.figures.per_micro_batch_s, program.stage
    forward = compute_s(
        float(own.forward_fixed_s[stage]), float(own.forward_s[stage]), program.samples, factor, per_call
    )
    backward = compute_s(
        float(own.backward_fixed_s[stage]), float(own.backward_s[stage]), program.samples, factor, per_call
    )
    return {FORWARD: forward, BACKWARD: backward + forward if recompute else backward}


def _gather_s(
    plan: Plan, stage: int, aggregates: _StageAggregates, cluster: Cluster, calibration: Calibration
) -> float:
    """The allgather of ``stage``'s updated parameters among its devices, where it shards its optimiser state."""
    if not plan.shards_optimizer(stage):
        return 0.0
    trained = float(aggregates.trained_bytes[stage])
    return group_collective_s(cluster, plan.stage_devices[stage], "allgather", trained, plan.shares(stage), calibration)


def _bucket_ready(program: DeviceProgram, stage: np.ndarray, library: LayerLibrary) -> tuple[float, ...]:
    """Per bucket of ``program``: the share of its stage's backward (in ``library``'s times) done once the backward
    pass, running from the stage's last layer to its first, has finished the bucket's first layer."""
    if not program.buckets:
        return ()
    if not program.overlap:
        return tuple(1.0 for _ in program.buckets)
    backward = layer_arrays(library).backward_s
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


class _Simulation:
    """Runs every device's program; each operation starts when its device is free and its inputs have arrived."""

    def __init__(
        self,
        devices: list[_SimulatedDevice],
        reduce_s: list[list[float]],
        iterations: int,
        durations: Mapping[OpKey, float],
        tied: Sequence[TiedStages] = (),
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
        self.tied = {stage: group for group in tied for stage in group.stages}
        """The stages a stage's ties join it to, and the ties' time."""
        self.at_tie: dict[tuple[frozenset[int], int], dict[int, tuple[list[int], float]]] = {}
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
        exchange = device.duration.get(EXCHANGE[kind], 0.0)
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
        group = self.tied.get(stage)
        if group is None:
            self._update(waiting, iteration, reduced, d)
            return True
        key = (group.stages, iteration)
        arrived = self.at_tie.setdefault(key, {})
        arrived[stage] = (waiting, reduced)
        if len(arrived) < len(group.stages):
            return False
        del self.at_tie[key]
        everyone = [q for devices, _ in arrived.values() for q in devices]
        start = max(max(r for _, r in arrived.values()), max(self.free[q] for q in everyone))
        tied = start + group.seconds
        for q in everyone:
            self.records.append((q, "reduce", start, tied, iteration, NO_PEER))
        for devices, _ in arrived.values():
            self._update(devices, iteration, tied, d)
        return True

    def _update(self, waiting: list[int], iteration: int, reduced: float, d: int) -> None:
        """Every device of a stage (``waiting``) updates once its gradients are ``reduced``; all but ``d`` (the
        device being advanced) go on."""
        # Waiting for a slower device of the stage to finish its backward is imbalance (idle), not communication.
        slowest = max(self.last_backward[q][1] for q in waiting)
        finish = {}
        for q in waiting:
            start = max(self.free[q], reduced)
            waited_from = max(self.free[q], slowest)
            if start > waited_from:
                self.records.append((q, "allreduce", waited_from, start, iteration, NO_PEER))
            finish[q] = start + self.durations.get((q, UPDATE, iteration), self.devices[q].update_s)
            self.records.append((q, UPDATE, start, finish[q], iteration, NO_PEER))
        gather_s = self.devices[waiting[0]].gather_s
        gathered = max(finish.values()) + gather_s
        for q in waiting:
            if gather_s:  # the updated shares gathered: every device of the stage from when the last has updated
                self.records.append((q, "allreduce", finish[q], gathered, iteration, NO_PEER))
            self.free[q] = gathered if gather_s else finish[q]
            self.iteration_end[iteration] = max(self.iteration_end[iteration], self.free[q])
            if q != d:
                self.position[q] += 1
                self.runnable.append(q)

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
    arrays = layer_arrays(library)
    steps = simulated_iterations(plan)[0]
    specs = library.specs() if plan.signatures else ()
    return plan_programs(plan, arrays.tensor_edges, arrays.trained_bytes, steps, specs=specs, shared=library.shared)


@dataclass(frozen=True)
class TiedStages:
    """Stages that ties join (directly or through one another) and the time of all their ties, one after another."""

    stages: frozenset[int]
    seconds: float


def tied_stages(plan: Plan, context: CostContext) -> tuple[TiedStages, ...]:
    """The plan's ties (``tapp_core.plan.ties``), each a ring allreduce among its holders' devices
    (``formulas.allreduce_s``), grouped by the stages they join."""
    groups: list[tuple[set[int], float]] = []
    for tie in plan_ties(plan.stage_of_layer, context.library.shared):
        devices = [device for stage in tie.stages for device in plan.stage_devices[stage]]
        seconds = allreduce_s(context.cluster, devices, float(tie.nbytes), context.calibration, context.terms)
        joined = [group for group in groups if group[0] & set(tie.stages)]
        stages = set(tie.stages).union(*(group[0] for group in joined))
        groups = [group for group in groups if group not in joined]
        groups.append((stages, seconds + sum(group[1] for group in joined)))
    return tuple(TiedStages(frozenset(stages), seconds) for stages, seconds in groups)


def _simulate(plan: Plan, context: CostContext) -> tuple[_Simulation, list[_SimulatedDevice]]:
    library, cluster, calibration, terms = context.library, context.cluster, context.calibration, context.terms
    aggregates = _stage_aggregates(plan, library)
    programs = simulated_programs(plan, library)
    devices = _simulated_devices(plan, programs, aggregates, terms, cluster, calibration)
    reduce_s: list[list[float]] = [[] for _ in range(plan.n_stages)]
    for program in programs:
        if program.replica == 0:
            group = plan.stage_devices[program.stage]
            reduce_s[program.stage] = [
                (
                    group_collective_s(
                        cluster, group, "reduce_scatter", b.nbytes, plan.shares(program.stage), calibration
                    )
                    if plan.shards_optimizer(program.stage)
                    else allreduce_s(cluster, group, float(b.nbytes), calibration, terms)
                )
                for b in program.buckets
            ]
    iterations = simulated_iterations(plan)[0]
    tied = tied_stages(plan, context)

    def run(durations: Mapping[OpKey, float]) -> _Simulation:
        simulation = _Simulation(devices, reduce_s, iterations, durations, tied)
        simulation.run()
        return simulation

    hosts = shared_hosts(cluster, int(calibration.host_cores))
    return (settle_sharing(run, devices, hosts, terms) if hosts else run({})), devices


def estimate(plan: Plan, context: CostContext) -> Estimate:
    """Predict one training step of ``plan`` on the context's cluster (see the module docstring for the
    semantics)."""
    _check_plan(plan, context)
    simulation, devices = _simulate(plan, context)
    _, warmup, steps = simulated_iterations(plan)
    window = (simulation.iteration_end[warmup - 1] if warmup else 0.0, simulation.iteration_end[warmup + steps - 1])
    records = simulation.records
    spans = (record[:4] for record in records if record[1] not in ("send", "reduce"))
    busy, waiting = window_totals(spans, range(len(devices)), window)
    device_of = [device.device for device in devices]
    compute, communication, idle = per_step(
        {device_of[d]: t for d, t in busy.items()}, {device_of[d]: t for d, t in waiting.items()}, window, steps
    )
    memory = plan_memory_bytes(plan, context.library, context.optimizer_state)
    timeline = Timeline(lambda: _timeline_ops(records, devices, plan.micro_batches))
    return Estimate(
        plan_id=plan.id,
        step_time_s=(window[1] - window[0]) / steps,
        compute_s=compute,
        communication_s=communication,
        idle_s=idle,
        peak_memory_bytes=memory,
        timeline=timeline,
        calibration=context.calibration,
        memory_over_time=MemoryCurves(lambda: memory_curves(plan, context.library, context.optimizer_state, timeline)),
        plan_memory_bytes={device: context.plan_memory[device] for device in memory},
    )
