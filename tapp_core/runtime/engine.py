"""The engine: runs one stage replica's schedule, moving cut values with the transport.

Receives are posted a window of actions ahead, so data lands while the stage computes; sends return at once.
Gradients accumulate over the micro-batches of a step, replicas sum them with one allreduce of a flat buffer,
and the optimiser steps. With weight stashing (async), each forward runs on a snapshot of the weights current
at that moment, and its backward computes the gradient at that snapshot; the gradient is then applied to the
live weights at the stage's next update, as in PipeDream.

On a GPU the host queues work without waiting for it, as a plain PyTorch loop does: the first stage's batches
are prefetched onto the GPU (``DeviceBatches``), received tensors land in pinned memory and are copied
without blocking, sends are copied back on a side stream (``Transport``), the loss stays on the GPU until the
step ends, and compute is timed with CUDA events (``ComputeClock``). Each step ends by synchronising the GPU, so
its step time is the GPU's, not the host's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from tapp_core import gpu
from tapp_core.runtime.batches import IGNORED_LABEL, BatchSource, DeviceBatches
from tapp_core.runtime.emulation import Emulation
from tapp_core.runtime.layout import Layout, Route
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer, micro_batch_loss
from tapp_core.runtime.stage import MODEL_INPUT, Stage
from tapp_core.runtime.transport import DATA_TAG_BASE, Receipt, Transport
from tapp_core.schedules import Action, ForwardOnly, PipelineSchedule

TAG_MICRO_BATCHES = 1024
"""Micro-batch numbers wrap in tags; MPI keeps messages of one tag between two ranks in order anyway."""


def data_tag(value: int, backward: bool, micro_batch: int) -> int:
    return DATA_TAG_BASE + (value * 2 + int(backward)) * TAG_MICRO_BATCHES + micro_batch % TAG_MICRO_BATCHES


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
    """Last stage only: this replica's share of each step's mini-batch loss."""


@dataclass
class EvalRecord:
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0


class ComputeClock:
    """The compute time of a rank's actions, emulated slowdown included: ``stop(start())`` around each action.

    On a CPU, ``stop`` returns the action's wall time. On a GPU whose slowdown is emulated, it synchronises the GPU
    first (the emulation must know the time at once). Otherwise a GPU's actions are timed with CUDA events,
    ``stop`` returns 0, and ``settle`` (at the end of a step) synchronises the GPU and returns their total.
    """

    def __init__(self, device: torch.device, emulation: Emulation) -> None:
        self.device = device
        self.emulation = emulation
        self.gpu = device.type == "cuda"
        self.deferred = self.gpu and not (emulation.enabled and emulation.slowdown > 1.0)
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> float | torch.cuda.Event:
        if self.deferred:
            return gpu.recorded_event(timing=True)
        return time.perf_counter()

    def stop(self, start: float | torch.cuda.Event) -> float:
        if isinstance(start, torch.cuda.Event):
            self._spans.append((start, gpu.recorded_event(timing=True)))
            return 0.0
        if self.gpu:
            torch.cuda.synchronize(self.device)
        return self.emulation.slow_down(time.perf_counter() - start)

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


@dataclass
class _Posted:
    """Receive buffers of one action: per value, one buffer per peer stage (sums for gradients of fan-out)."""

    buffers: dict[int, list[torch.Tensor]]
    receipts: list[Receipt]


class StageEngine:
    def __init__(
        self,
        stage: Stage,
        layout: Layout,
        rank: int,
        transport: Transport,
        schedule: PipelineSchedule,
        optimizer: OptimizerConfig,
        emulation: Emulation,
        batch_size: int,
        micro_batches: int,
        replica_comm: MPI.Comm | None = None,
    ) -> None:
        position = layout.position(rank)
        if position is None or position[0] != stage.index:
            raise ValueError(f"rank {rank} does not run stage {stage.index} in this layout")
        self.stage = stage
        self.replica = position[1]
        self.layout = layout
        self.transport = transport
        self.schedule = schedule
        self.emulation = emulation
        self.batch_size = batch_size
        self.micro_batches = micro_batches
        self.replica_comm = replica_comm
        self.replica_peers = [r for r in layout.stage_ranks[stage.index] if r != rank]
        self.rows = layout.rows(stage.index, self.replica)
        self.local_rows = self.rows[1] - self.rows[0]
        self.in_routes: dict[int, list[Route]] = {
            v.index: layout.routes(stage.index, self.replica, v.producer)
            for v in stage.inputs
            if v.producer != MODEL_INPUT
        }
        self.out_routes: dict[int, list[list[Route]]] = {
            v.index: [layout.routes(stage.index, self.replica, c) for c in v.consumers] for v in stage.outputs
        }
        self.params = dict(stage.module.named_parameters())
        self.clock = ComputeClock(stage.device, emulation)
        self._pin = stage.device.type == "cuda"
        """Receive into pinned host memory, so the copies to the GPU need not block."""
        self._step_loss: dict[int, torch.Tensor] = {}
        self._flat_grads: torch.Tensor | None = None
        """The replicas' allreduce buffer, kept from step to step: a fresh one of AlexNet's 89 MiB of gradients
        cost a 1-thread rank some 40 ms of page faults every step."""
        # A stage of parameter-free layers (activations, pooling) has nothing to update.
        self.optimizer = make_optimizer(self.params.values(), optimizer) if self.params else None
        self._lookahead = 2 * (micro_batches + len(layout.stage_ranks)) + 2
        self._in_flight: dict[int, _InFlight] = {}
        self._version = 0
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._snapshot_users: dict[int, int] = {}

    # --- running --------------------------------------------------------------------------------------------

    def train(self, steps: int, batches: BatchSource) -> RankRecord:
        self.stage.module.train()
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
        actions = self.schedule.actions(self.stage.index, self.stage.graph.n_stages, self.micro_batches, steps)
        losses = [0.0] * steps
        compute = 0.0
        window_start = time.perf_counter()
        wait_mark, blocked_mark = self.transport.wait_s, self.transport.blocked_s
        posted: dict[int, _Posted] = {}
        next_post = 0
        for i, action in enumerate(actions):
            if i == 0 or (self.schedule.synchronous and actions[i - 1].kind == "update"):
                self.transport.barrier()
                window_start, compute = time.perf_counter(), 0.0
                wait_mark, blocked_mark = self.transport.wait_s, self.transport.blocked_s
            while next_post < len(actions) and next_post <= i + self._lookahead:
                posted[next_post] = self._post(actions[next_post])
                next_post += 1
            self.transport.control.check()
            if action.kind == "forward":
                compute += self._forward(action.index, posted.pop(i), batches, training=True)
            elif action.kind == "backward":
                compute += self._backward(action.index, posted.pop(i))
            else:
                posted.pop(i)
                compute += self._update()
                compute += self.clock.settle()
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
        actions = ForwardOnly().actions(self.stage.index, self.stage.graph.n_stages, self.micro_batches, n_batches)
        posted: dict[int, _Posted] = {}
        next_post = 0
        with torch.no_grad():
            for i, action in enumerate(actions):
                while next_post < len(actions) and next_post <= i + self._lookahead:
                    posted[next_post] = self._post(actions[next_post])
                    next_post += 1
                self.transport.control.check()
                self._forward(action.index, posted.pop(i), batches, training=False, evaluation=result)
                self.transport.progress()
        self.transport.flush()
        self.clock.settle()
        self.stage.module.train()
        return result

    # --- actions ----------------------------------------------------------------------------------------------

    def _post(self, action: Action) -> _Posted:
        posted = _Posted(buffers={}, receipts=[])
        if action.kind == "forward":
            for value in self.stage.inputs:
                if value.producer == MODEL_INPUT:
                    continue
                buffer = torch.empty(value.shape(self.local_rows), dtype=value.dtype, pin_memory=self._pin)
                for route in self.in_routes[value.index]:
                    tag = data_tag(value.index, False, action.index)
                    posted.receipts.append(self.transport.irecv(buffer[route.lo : route.hi], route.peer, tag))
                posted.buffers[value.index] = [buffer]
        elif action.kind == "backward" and not self.stage.is_last:
            for value in self.stage.outputs:
                if not value.requires_grad:
                    continue
                buffers = []
                for routes in self.out_routes[value.index]:
                    buffer = torch.empty(value.shape(self.local_rows), dtype=value.dtype, pin_memory=self._pin)
                    for route in routes:
                        tag = data_tag(value.index, True, action.index)
                        posted.receipts.append(self.transport.irecv(buffer[route.lo : route.hi], route.peer, tag))
                    buffers.append(buffer)
                posted.buffers[value.index] = buffers
        return posted

    def _forward(
        self,
        micro_batch: int,
        posted: _Posted,
        batches: BatchSource,
        training: bool,
        evaluation: EvalRecord | None = None,
    ) -> float:
        step, j = divmod(micro_batch, self.micro_batches)
        device = self.stage.device
        if self._reads_data:
            x, y = batches.get(step)
            first = j * (self.batch_size // self.micro_batches) + self.rows[0]
            x, y = x[first : first + self.local_rows], y[first : first + self.local_rows]
        self.transport.wait(posted.receipts)
        inputs = []
        for value in self.stage.inputs:
            if value.producer == MODEL_INPUT:
                tensor = x.to(device)
            else:
                tensor = posted.buffers[value.index][0].to(device, non_blocking=True)
                if training and value.requires_grad:
                    tensor.requires_grad_(True)
            inputs.append(tensor)

        start = self.clock.start()
        params, version = self._weights_for_forward() if training else (None, 0)
        outputs = self.stage.forward(inputs, params)
        loss = None
        if self.stage.is_last:
            labels = y.to(device)
            loss = micro_batch_loss(outputs[0], labels, self.batch_size)
            if training:  # kept on the device until the step ends: reading it would wait for the GPU
                so_far = self._step_loss.get(step)
                self._step_loss[step] = loss.detach() if so_far is None else so_far + loss.detach()
            if evaluation is not None:
                keep = labels != IGNORED_LABEL
                evaluation.loss_sum += float(loss) * self.batch_size
                evaluation.correct += int((outputs[0].argmax(1) == labels)[keep].sum())
                evaluation.samples += int(keep.sum())
        compute = self.clock.stop(start)

        for value, output in zip(self.stage.outputs, outputs, strict=True):
            for routes in self.out_routes[value.index]:
                for route in routes:
                    tag = data_tag(value.index, False, micro_batch)
                    self.transport.isend(output[route.lo : route.hi], route.peer, tag)
        if training:
            self._in_flight[micro_batch] = _InFlight(inputs, outputs, loss, version)
        return compute

    def _backward(self, micro_batch: int, posted: _Posted) -> float:
        context = self._in_flight.pop(micro_batch)
        self.transport.wait(posted.receipts)
        start = self.clock.start()
        if context.loss is not None:
            torch.autograd.backward(context.loss)
        else:
            tensors, grads = [], []
            for value, output in zip(self.stage.outputs, context.outputs, strict=True):
                if value.index in posted.buffers and output.requires_grad:
                    buffers = posted.buffers[value.index]
                    grad = buffers[0].to(self.stage.device, non_blocking=True)
                    for extra in buffers[1:]:
                        grad = grad + extra.to(self.stage.device, non_blocking=True)
                    tensors.append(output)
                    grads.append(grad)
            if tensors:
                torch.autograd.backward(tensors, grads)
        if self.schedule.stashes_weights:
            self._snapshot_users[context.version] -= 1
        compute = self.clock.stop(start)

        for value, tensor in zip(self.stage.inputs, context.inputs, strict=True):
            if value.producer == MODEL_INPUT or not value.requires_grad:
                continue
            grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
            for route in self.in_routes[value.index]:
                self.transport.isend(grad[route.lo : route.hi], route.peer, data_tag(value.index, True, micro_batch))
        return compute

    def _update(self) -> float:
        compute = 0.0
        if self.schedule.stashes_weights:
            start = self.clock.start()
            self._fold_stashed_grads()
            compute += self.clock.stop(start)
        if self.optimizer is None:
            return compute
        if self.replica_comm is not None:
            self._allreduce_grads()
        start = self.clock.start()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.schedule.stashes_weights:
            self._version += 1
            self._drop_unused_snapshots()
        return compute + self.clock.stop(start)

    def _allreduce_grads(self) -> None:
        """Sum the replicas' gradients in one flat buffer; each parameter's gradient becomes a view of it until the
        update has used it (``zero_grad(set_to_none=True)`` drops the views before the next step fills it)."""
        params = list(self.params.values())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        size = sum(g.numel() for g in grads)
        flat = self._flat_grads
        if flat is None or flat.numel() != size or flat.dtype != grads[0].dtype:
            flat = self._flat_grads = torch.empty(size, dtype=grads[0].dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        assert self.replica_comm is not None
        self.transport.allreduce_sum_(flat, self.replica_comm, self.replica_peers)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n

    # --- weight stashing ----------------------------------------------------------------------------------------

    def _weights_for_forward(self) -> tuple[dict[str, torch.Tensor] | None, int]:
        if not self.schedule.stashes_weights:
            return None, 0
        version = self._version
        if version not in self._snapshots:
            self._snapshots[version] = {n: p.detach().clone().requires_grad_(True) for n, p in self.params.items()}
            self._snapshot_users[version] = 0
        self._snapshot_users[version] += 1
        return self._snapshots[version], version

    def _fold_stashed_grads(self) -> None:
        """Move the gradients the snapshots gathered into the live parameters, before the update.

        Every backward done so far belongs to this step or an earlier one (the update follows the step's last
        backward), and earlier steps' gradients were folded at their updates, so this is exactly this step's.
        """
        with torch.no_grad():
            for snapshot in self._snapshots.values():
                for name, param in self.params.items():
                    grad = snapshot[name].grad
                    if grad is None:
                        continue
                    if param.grad is None:
                        param.grad = grad
                    else:
                        param.grad.add_(grad)
                    snapshot[name].grad = None

    def _drop_unused_snapshots(self) -> None:
        for version in [v for v, users in self._snapshot_users.items() if users == 0 and v != self._version]:
            del self._snapshots[version]
            del self._snapshot_users[version]
