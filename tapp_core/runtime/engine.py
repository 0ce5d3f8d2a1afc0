"""The engine: runs one device's program (``tapp_core.plan.program``) over its stage, moving cut values with the transport.

The program is the list the cost model simulates: receives, forwards, sends, backwards, reductions and updates,
in order. The engine posts each receive a window of actions ahead, so data lands while the stage computes; a send
returns at once; a compute action waits for the receives listed before it. Gradients accumulate over a step's
micro-batches; on a stage of several devices each gradient bucket is summed across them as soon as the step's last
backward has made it (``runtime.gradients``), and the update waits for every bucket. Weight versions follow from the
schedule: where a forward's backward comes after an update, the forward runs on a snapshot of its weights; on an
asynchronous schedule that snapshot is the weights predicted as many updates ahead as the stage's delay
(``PipelineSchedule.delay``), and the stage's learning rate is divided by its delay + 1, unless
``OptimizerConfig.stale_compensation`` is off (the stale-gradient compensation, ``runtime.optim``).

On a GPU the host queues work without waiting for it, as a plain PyTorch loop does: the first stage's batches
are prefetched onto the GPU (``DeviceBatches``), received tensors land in pinned memory and are copied
without blocking, sends are copied back on a side stream (``Transport``), the loss stays on the GPU until the
step ends, and compute is timed with CUDA events (``ComputeClock``). Each step ends by synchronising the GPU, so
its step time is the GPU's, not the host's.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from mpi4py import MPI

from tapp_core.model.data import mixed_seed
from tapp_core.model.graph import MODEL_INPUT
from tapp_core.model.workload import Workload
from tapp_core.plan.plan import Plan
from tapp_core.plan.program import BACKWARD, FORWARD, DeviceProgram, plan_programs
from tapp_core.plan.schedules import FORWARD_ONLY, Action, PipelineSchedule, receive_lookahead
from tapp_core.platform import gpu
from tapp_core.runtime.batches import IGNORED_LABEL, BatchSource, DeviceBatches
from tapp_core.runtime.collectives import Group, Segments
from tapp_core.runtime.emulation import Emulation, cpu_now
from tapp_core.runtime.gradients import StageGradients, TiedGradient
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer, micro_batch_loss, predicted_weights
from tapp_core.runtime.optimizer_shards import OptimizerShards
from tapp_core.runtime.progress import Pacer, progress_beside, progress_during
from tapp_core.runtime.sharding import ShardedStage, full_state, shard_stage
from tapp_core.runtime.stage import CutValue, ModelGraph, Stage, StageError
from tapp_core.runtime.transport import DATA_TAG_BASE, Receipt, Transport

TAG_MICRO_BATCHES = 1024
"""Micro-batch numbers wrap in tags; MPI keeps messages of one tag between two ranks in order anyway."""


def data_tag(layer: int, backward: bool, micro_batch: int) -> int:
    """The tag of cut value ``layer``'s tensor (its gradient, ``backward``) of one micro-batch."""
    return DATA_TAG_BASE + (layer * 2 + int(backward)) * TAG_MICRO_BATCHES + micro_batch % TAG_MICRO_BATCHES


@dataclass
class RankRecord:
    """What one rank measured over a run, one entry per step."""

    stage: int
    replica: int
    step_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    """Forward + backward + update, emulated slowdown included."""
    wait_s: list[float] = field(default_factory=list)
    """Communication wait (see ``Transport.wait_s``)."""
    blocked_s: list[float] = field(default_factory=list)
    """Every wait on other ranks, pipeline bubbles included."""
    loss: list[float] = field(default_factory=list)
    """Last stage only: this device's share of each step's mini-batch loss."""
    weight_ages: list[int] = field(default_factory=list)
    """Per backward, in order: updates applied between its forward and it (the staleness its gradient meets)."""


@dataclass
class EvalRecord:
    """A test evaluation's sums over the predictions it scored (a sample's class, or each position's next token):
    their loss, how many were right, how many there were."""

    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0


class ComputeClock:
    """The compute time of a rank's actions, emulated slowdown included: ``stop(start())`` around each action.

    On a CPU, ``stop`` returns the action's wall time. On a GPU whose slowdown is emulated, it synchronises the GPU
    first (the emulation must know the time at once). Otherwise a GPU's actions are timed with CUDA events,
    ``stop`` returns 0, and ``settle`` (at the end of a step) synchronises the GPU and returns their total.
    With ``segments`` (a sharded stage, whose actions run layout changes), an action's time is that of its
    segments between the changes, each slowed down before the change that ends it (``collectives.Segments``).
    """

    def __init__(self, device: torch.device, emulation: Emulation, segments: Segments | None = None) -> None:
        self.device = device
        self.emulation = emulation
        self.gpu = device.type == "cuda"
        self.deferred = self.gpu and not (emulation.enabled and emulation.slowdown > 1.0)
        self.segments = None if self.deferred else segments
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu_start = 0.0

    def start(self) -> float | torch.cuda.Event:
        if self.deferred:
            return gpu.recorded_event(timing=True)
        if self.segments is not None:
            self.segments.begin()
        self._cpu_start = cpu_now()
        return time.perf_counter()

    def stop(self, start: float | torch.cuda.Event) -> float:
        if isinstance(start, torch.cuda.Event):
            self._spans.append((start, gpu.recorded_event(timing=True)))
            return 0.0
        if self.gpu:
            torch.cuda.synchronize(self.device)
        if self.segments is not None:
            return self.segments.end()
        return self.emulation.slow_down(time.perf_counter() - start, cpu_now() - self._cpu_start)

    def settle(self) -> float:
        """Wait for the GPU's queued work; the time of the event-timed actions since the last ``settle``."""
        if not self.gpu:
            return 0.0
        torch.cuda.synchronize(self.device)
        total = sum(gpu.elapsed_s(start, end) for start, end in self._spans)
        self._spans.clear()
        return total


@dataclass
class _InFlight:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    loss: torch.Tensor | None
    version: int


ValueMap = Mapping[int, torch.Tensor]
"""Tensors by the library index of the layer that made the cut value."""
Buffers = dict[tuple[str, int, int, int], torch.Tensor]
"""(direction, cut value, micro-batch, peer's stage) -> this device's rows of what that stage sent."""


@dataclass
class PlanPlace:
    """Where this rank stands in a plan: its position in the plan's device order, and every position's pool rank."""

    plan: Plan
    position: int
    pool_ranks: tuple[int, ...]


class StageEngine:
    _first_step = 0
    """The training's step at which the current ``train`` began (a resumed training's: where it stopped)."""

    def __init__(
        self,
        stage: Stage,
        place: PlanPlace,
        graph: ModelGraph,
        transport: Transport,
        optimizer: OptimizerConfig,
        emulation: Emulation,
        group_comm: MPI.Comm | None = None,
        layout_comm: MPI.Comm | None = None,
        workload: Workload | None = None,
        tie_comms: Mapping[tuple[int, ...], MPI.Comm] | None = None,
        seed: int = 0,
    ) -> None:
        """``group_comm``: the stage's devices, when it has several (for the gradient reductions); ``layout_comm``:
        the same devices, for the layout changes of a stage whose layers run split signatures; ``workload``: whose
        loss the last stage takes (class cross-entropy if None); ``tie_comms``: per group of plan positions holding
        a tied parameter this stage holds, their communicator (``rank.PlanCommunicators.join_ties``); ``seed``: the
        run's, which every training forward's random numbers derive from (``draw_seed``)."""
        self.workload = workload
        self.seed = seed
        self.stage = stage
        self.place = place
        self.plan = place.plan
        self.graph = graph
        self.transport = transport
        self._pacer = Pacer(transport.poke)
        """Pokes MPI from inside the computes (``tapp_core.runtime.progress``)."""
        self.emulation = emulation
        self.schedule: PipelineSchedule = self.plan.pipeline_schedule
        programs = self._programs(1)
        template = programs[place.position]
        self.replica = template.replica
        self.rows = template.rows
        self.local_rows = template.samples
        members = [place.pool_ranks[p.position] for p in programs if p.stage == stage.index]
        self.group: Group | None = None
        self.sharded: ShardedStage | None = None
        self.input_rows = (self.rows[0], self.rows[1])
        """The rows of each micro-batch of the model's input this device reads."""
        if self.plan.runs_split(stage.index):
            self._shard(members, layout_comm)
        # Frozen parameters (requires_grad False, a fine-tuned model's backbone) have no gradient to sum, hook or
        # stash, and the optimiser must not touch them (AdamW's decay would).
        self.params = {name: p for name, p in stage.module.named_parameters() if p.requires_grad}
        group = [rank for rank in members if rank != place.pool_ranks[place.position]]
        stashes = self.schedule.stashes_weights(stage.index, self.plan.n_stages, self.plan.micro_batches)
        layer_of = {local: graph.layer_of_param[name] for local, name in stage.parameter_names().items()}
        # A stage of parameter-free layers (activations, pooling) has nothing to update.
        delay = self.schedule.delay(stage.index, self.plan.n_stages, self.plan.micro_batches)
        sharding = self.plan.shards_optimizer(stage.index) and group_comm is not None
        self.optimizer = (
            make_optimizer(self.params.values(), optimizer, delay) if self.params and not sharding else None
        )
        predict = None
        if optimizer.stale_compensation and delay > 0 and self.optimizer is not None:
            predict = functools.partial(predicted_weights, self.optimizer, self.params, delay)
        ties = self._tied_gradients(template, tie_comms or {})
        self.gradients = StageGradients(
            self.params, stashes, template.buckets, layer_of, transport, group_comm, group, predict=predict, ties=ties
        )
        self.shards: OptimizerShards | None = None
        if sharding:
            self._shard_optimizer(optimizer, members, group_comm)
        self.clock = ComputeClock(stage.device, emulation, self.group.segments if self.group is not None else None)
        self._pin = stage.device.type == "cuda"
        """Receive into pinned host memory, so the copies to the GPU need not block."""
        self._stage_at = [s for s, devices in enumerate(self.plan.stage_devices) for _ in devices]
        """The stage of every position in the plan's device order."""
        self._values = {v.layer: v for v in (*stage.inputs, *stage.outputs)}
        check_routes(template, stage)
        self._step_loss: dict[int, torch.Tensor] = {}
        self._lookahead = receive_lookahead(self.plan.micro_batches, self.plan.n_stages)
        self._in_flight: dict[int, _InFlight] = {}
        self._to_send: dict[str, dict[int, ValueMap]] = {FORWARD: {}, BACKWARD: {}}
        """Per direction and micro-batch: the tensors the sends after the last compute action take rows of."""

    def _tied_gradients(
        self, template: DeviceProgram, tie_comms: Mapping[tuple[int, ...], MPI.Comm]
    ) -> list[TiedGradient]:
        """The tied parameters this device's stage holds, each with its communicator and the other holders' ranks."""
        local = {name: local for local, name in self.stage.parameter_names().items()}
        return [
            TiedGradient(
                tie.index,
                local[tie.name],
                tie_comms[tie.devices],
                [self.place.pool_ranks[p] for p in tie.devices if p != self.place.position],
            )
            for tie in template.ties
        ]

    def _programs(self, steps: int, schedule: PipelineSchedule | None = None) -> tuple[DeviceProgram, ...]:
        graph = self.graph
        return plan_programs(self.plan, graph.edges, graph.trained_bytes, steps, schedule, graph.specs, graph.shared)

    def _shard(self, members: list[int], layout_comm: MPI.Comm | None) -> None:
        """Make the stage this device's part of its sharded stage (``runtime.sharding``)."""
        if layout_comm is None:
            raise ValueError(f"stage {self.stage.index} runs split signatures but has no communicator for its group")
        stage = self.stage.index
        shares = self.plan.shares(stage)
        self.group = Group(layout_comm, self.replica, members, shares, self.transport, self.emulation)
        self.sharded = shard_stage(
            self.stage,
            self.graph.specs,
            self.plan.stage_layers(stage),
            self.plan.signature_of(),
            self.group,
            self.plan.rows(stage),
            self.graph.input_shape,
        )
        if self.sharded.whole_input:
            self.input_rows = (0, self.plan.micro_batch_size)

    def _shard_optimizer(self, config: OptimizerConfig, members: list[int], group_comm: MPI.Comm | None) -> None:
        """Shard the stage's optimiser state among its devices (``runtime.optimizer_shards``): this device's optimiser
        steps its slices of the buckets, and the tied parameters (in no bucket) whole."""
        assert group_comm is not None
        names = self.gradients.bucket_names()
        shards = OptimizerShards(
            self.params, names, self.plan.shares(self.stage.index), group_comm, members, self.transport, self.emulation
        )
        bucketed = {name for bucket in names for name in bucket}
        stepped = [*shards.slices(), *(p for n, p in self.params.items() if n not in bucketed)]
        self.optimizer = make_optimizer(stepped, config) if stepped else None
        self.shards = shards
        self.gradients.shard_with(shards)

    def optimizer_states(self) -> dict[str, dict[str, Any]]:
        """The optimiser's state of each parameter, whole, by the stage module's names. Where the stage shards it,
        every device of the stage must call this: the slices are gathered on the stage's first device (the one that
        writes its checkpoint), and the others get no sharded state."""
        states: dict[str, dict[str, Any]] = {}
        if self.optimizer is not None:
            for local, param in self.stage.module.named_parameters():
                if param in self.optimizer.state:
                    states[local] = dict(self.optimizer.state[param])
        if self.shards is not None:
            states.update(self.shards.whole_states(self.optimizer))
        return states

    def load_optimizer_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Set the optimiser's state of each parameter from ``states`` (whole, by the stage module's names), cut to
        this device's slices where the stage shards it."""
        if self.optimizer is None:
            return
        bucketed = self.shards.bucketed() if self.shards is not None else set()
        for local, param in self.stage.module.named_parameters():
            if local in states and local not in bucketed:
                self.optimizer.state[param] = dict(states[local])
        if self.shards is not None:
            self.shards.load_states(self.optimizer, states)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the stage, whole, under the model's names. On a sharded stage every device
        of the group must call this; the first gets the state, the others an empty dict."""
        if self.sharded is None or self.group is None:
            return self.stage.named_state()
        return full_state(self.stage, self.sharded, self.group)

    # --- running --------------------------------------------------------------------------------------------

    def train(self, steps: int, batches: BatchSource, first_step: int = 0) -> RankRecord:
        """Train ``steps`` steps; ``first_step``: the training's count of steps before them, which the forwards'
        random numbers are drawn by (``draw_seed``)."""
        self.stage.module.train()
        self._first_step = first_step
        on_device = None
        if self._reads_data and self.clock.gpu:
            reads_input = any(v.producer == MODEL_INPUT for v in self.stage.inputs)
            on_device = DeviceBatches(batches, self.stage.device, steps, inputs=reads_input)
        try:
            return self._train(steps, on_device or batches)
        finally:
            if on_device is not None:
                on_device.close()

    def _train(self, steps: int, batches: BatchSource) -> RankRecord:
        record = RankRecord(stage=self.stage.index, replica=self.replica)
        actions = list(self._programs(steps)[self.place.position].actions())
        final = _final_backwards(actions)
        losses = [0.0] * steps
        buffers: Buffers = {}
        pending: list[Receipt] = []
        posted: dict[int, list[Receipt]] = {}
        next_post = 0
        compute, window_start = 0.0, time.perf_counter()
        wait_mark, blocked_mark = self.transport.wait_s, self.transport.blocked_s
        for i, action in enumerate(actions):
            if i == 0 or (self.schedule.synchronous and actions[i - 1].kind == "update"):
                self.transport.barrier()
                window_start, compute = time.perf_counter(), 0.0
                wait_mark, blocked_mark = self.transport.wait_s, self.transport.blocked_s
            while next_post < len(actions) and next_post <= i + self._lookahead:
                posted[next_post] = self._post(actions[next_post], buffers)
                next_post += 1
            self.transport.control.check()
            pending += posted.pop(i)
            kind = action.kind
            if kind == "forward":
                compute += self._forward(action.index, pending, buffers, batches, record)
                pending = []
            elif kind == "backward":
                self.gradients.final_backward(i in final)
                compute += self._backward(action.index, pending, buffers, record)
                self.gradients.final_backward(False)
                pending = []
            elif kind in ("send_forward", "send_backward"):
                self._send(action)
            elif kind == "reduce":
                self.gradients.start_reduction(action.bucket)
            elif kind == "tie":
                self.gradients.start_tie(action.bucket)
            elif kind == "update":
                compute += self._update() + self.clock.settle()
                end = time.perf_counter()
                if action.index in self._step_loss:
                    losses[action.index] = float(self._step_loss.pop(action.index))
                record.step_s.append(end - window_start)
                record.compute_s.append(compute)
                record.wait_s.append(self.transport.wait_s - wait_mark)
                record.blocked_s.append(self.transport.blocked_s - blocked_mark)
                window_start, compute = end, 0.0
                wait_mark, blocked_mark = self.transport.wait_s, self.transport.blocked_s
            self.transport.progress()
        self.transport.flush()
        if self.stage.is_last:
            record.loss = losses
        return record

    @property
    def _reads_data(self) -> bool:
        """Whether this stage reads the batches: the model input, or (last stage) the labels."""
        return self.stage.is_last or any(v.producer == MODEL_INPUT for v in self.stage.inputs)

    def evaluate(self, n_batches: int, batches: BatchSource) -> EvalRecord:
        """Forward-only pass over ``n_batches`` batches (eval mode); the last stage counts loss and hits."""
        self.stage.module.eval()
        result = EvalRecord()
        actions = list(self._programs(n_batches, FORWARD_ONLY)[self.place.position].actions())
        buffers: Buffers = {}
        pending: list[Receipt] = []
        posted: dict[int, list[Receipt]] = {}
        next_post = 0
        with torch.no_grad():
            for i, action in enumerate(actions):
                while next_post < len(actions) and next_post <= i + self._lookahead:
                    posted[next_post] = self._post(actions[next_post], buffers)
                    next_post += 1
                self.transport.control.check()
                pending += posted.pop(i)
                if action.kind == "forward":
                    self._forward(action.index, pending, buffers, batches, None, evaluation=result)
                    pending = []
                elif action.kind == "send_forward":
                    self._send(action)
                self.transport.progress()
        self.transport.flush()
        self.clock.settle()
        self.stage.module.train()
        return result

    # --- communication ------------------------------------------------------------------------------------------

    def _post(self, action: Action, buffers: Buffers) -> list[Receipt]:
        """Post the receives of ``action`` (none for other kinds) into this device's rows of their buffers."""
        if action.kind not in ("recv_forward", "recv_backward"):
            return []
        backward = action.kind == "recv_backward"
        direction = BACKWARD if backward else FORWARD
        peer_stage = self._stage_at[action.peer]
        lo, hi = action.rows[0] - self.rows[0], action.rows[1] - self.rows[0]
        receipts = []
        for layer in action.values:
            key = (direction, layer, action.index, peer_stage)
            buffer = buffers.get(key)
            if buffer is None:
                value = self._value(layer)
                buffer = buffers[key] = torch.empty(
                    value.shape(self.local_rows), dtype=value.dtype, pin_memory=self._pin
                )
            tag = data_tag(layer, backward, action.index)
            receipts.append(self.transport.irecv(buffer[lo:hi], self.place.pool_ranks[action.peer], tag))
        return receipts

    def _value(self, layer: int) -> CutValue:
        value = self._values.get(layer)
        if value is None:
            raise KeyError(f"stage {self.stage.index} neither takes nor makes the output of layer {layer}")
        return value

    def _send(self, action: Action) -> None:
        backward = action.kind == "send_backward"
        lo, hi = action.rows[0] - self.rows[0], action.rows[1] - self.rows[0]
        tensors = self._to_send[BACKWARD if backward else FORWARD][action.index]
        for layer in action.values:
            tag = data_tag(layer, backward, action.index)
            self.transport.isend(tensors[layer][lo:hi], self.place.pool_ranks[action.peer], tag)

    # --- compute -----------------------------------------------------------------------------------------------

    def _forward(
        self,
        micro_batch: int,
        receipts: Sequence[Receipt],
        buffers: Buffers,
        batches: BatchSource,
        record: RankRecord | None,
        evaluation: EvalRecord | None = None,
    ) -> float:
        training = record is not None
        step, j = divmod(micro_batch, self.plan.micro_batches)
        device = self.stage.device
        if self._reads_data:
            x, y = batches.get(step)
            first = j * self.plan.micro_batch_size
            x = x[first + self.input_rows[0] : first + self.input_rows[1]]
            y = y[first + self.rows[0] : first + self.rows[1]]
        self.transport.wait(receipts)
        inputs = []
        for value in self.stage.inputs:
            if value.producer == MODEL_INPUT:
                tensor = x.to(device)
            else:
                tensor = self.transport.to_device(
                    buffers.pop((FORWARD, value.layer, micro_batch, value.producer)), device
                )
                if training and value.requires_grad:
                    tensor.requires_grad_(True)
            inputs.append(tensor)

        if training:
            torch.manual_seed(draw_seed(self.seed, self.stage.index, self.replica, self._first_step + step, j))
        start = self.clock.start()
        params, version = self.gradients.weights_for_forward() if training else (None, 0)
        with progress_during(self._pacer):
            outputs = self.stage.forward(inputs, params, recompute=training and self.plan.recomputes(self.stage.index))
        loss = None
        if self.stage.is_last:
            labels = y.to(device)
            loss = micro_batch_loss(outputs[0], labels, self.plan.batch_size, self.workload)
            if training:  # kept on the device until the step ends: reading it would wait for the GPU
                so_far = self._step_loss.get(step)
                self._step_loss[step] = loss.detach() if so_far is None else so_far + loss.detach()
            if evaluation is not None:
                keep = labels != IGNORED_LABEL
                # The loss is the summed loss over (batch size x positions per sample): back to a sum, per position.
                evaluation.loss_sum += float(loss) * self.plan.batch_size * math.prod(labels.shape[1:])
                evaluation.correct += int((outputs[0].argmax(-1) == labels)[keep].sum())
                evaluation.samples += int(keep.sum())
        compute = self.clock.stop(start)
        self._sending(FORWARD, micro_batch, {v.layer: out for v, out in zip(self.stage.outputs, outputs, strict=True)})
        if training:
            self._in_flight[micro_batch] = _InFlight(inputs, outputs, loss, version)
        return compute

    def _backward(self, micro_batch: int, receipts: Sequence[Receipt], buffers: Buffers, record: RankRecord) -> float:
        context = self._in_flight.pop(micro_batch)
        self.transport.wait(receipts)
        start = self.clock.start()
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if context.loss is not None:
            tensors, grads = [context.loss], [None]
        else:
            for value, output in zip(self.stage.outputs, context.outputs, strict=True):
                parts = [buffers.pop((BACKWARD, value.layer, micro_batch, s)) for s in value.consumers]
                if output.requires_grad and parts:
                    grad = self.transport.to_device(parts[0], self.stage.device)
                    for extra in parts[1:]:
                        grad = grad + self.transport.to_device(extra, self.stage.device)
                    tensors.append(output)
                    grads.append(grad)
        if tensors:
            with progress_during(self._pacer):
                torch.autograd.backward(tensors, grads)
        record.weight_ages.append(self.gradients.backward_done(context.version))
        compute = self.clock.stop(start)
        self._sending(
            BACKWARD,
            micro_batch,
            {
                value.layer: tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                for value, tensor in zip(self.stage.inputs, context.inputs, strict=True)
                if value.producer != MODEL_INPUT
            },
        )
        return compute

    def _sending(self, direction: str, micro_batch: int, tensors: ValueMap) -> None:
        """Keep what the sends right after this compute action take; the earlier action's sends are all posted."""
        self._to_send[FORWARD].clear()
        self._to_send[BACKWARD].clear()
        self._to_send[direction][micro_batch] = tensors

    def _update(self) -> float:
        self.gradients.prepare_update()
        compute_s = 0.0
        if self.optimizer is not None:
            start = self.clock.start()
            with progress_beside(self.transport.poke):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            compute_s = self.clock.stop(start)
        if self.shards is not None:
            self.shards.gather()
        self.gradients.updated()
        return compute_s


def draw_seed(seed: int, stage: int, replica: int, step: int, micro_batch: int) -> int:
    """The seed of the random numbers (dropout's) that one micro-batch's training forward draws on one device of a
    stage: from the run's seed and the forward's place alone, so that what it draws depends neither on the jobs its
    rank ran before (races, other methods' trainings) nor on where a training was stopped and resumed."""
    return mixed_seed(seed, "dropout", stage, replica, step, micro_batch)


def check_routes(program: DeviceProgram, stage: Stage) -> None:
    """``StageError`` unless the program receives exactly the cut values the stage takes and sends exactly those it
    makes: both follow ``program.crossings``, and a difference is a defect found here rather than mid-run."""
    routed = {
        FORWARD: {layer for route in program.receives[FORWARD] for layer in route.values},
        BACKWARD: {layer for route in program.sends[FORWARD] for layer in route.values},
    }
    held = {
        FORWARD: {v.layer for v in stage.inputs if v.producer != MODEL_INPUT},
        BACKWARD: {v.layer for v in stage.outputs if v.consumers},
    }
    for direction, what in ((FORWARD, "takes"), (BACKWARD, "makes")):
        if routed[direction] != held[direction]:
            raise StageError(
                f"stage {stage.index} {what} the outputs of layers {sorted(held[direction])}, but its program routes "
                f"{sorted(routed[direction])}"
            )


def _final_backwards(actions: Sequence[Action]) -> set[int]:
    """The positions of each step's last backward: the backward before each update."""
    final: set[int] = set()
    last = -1
    for i, action in enumerate(actions):
        if action.kind == "backward":
            last = i
        elif action.kind == "update" and last >= 0:
            final.add(last)
            last = -1
    return final
