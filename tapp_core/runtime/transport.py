"""Point-to-point tensors and the gradient allreduces over MPI buffer methods (Isend/Irecv/Iallreduce).

Every operation is nonblocking, and every wait polls (Test, then a short sleep) instead of blocking in MPI:
that lets a wait notice another rank's abort or the plan's deadline, and keeps a waiting rank from spinning
on a core that an oversubscribed host needs for compute. Every message carries a small header on a twin communicator: when its sender posted it and, emulated, when
the link delivers it. A receive's communication wait is the part of the wait after the sender posted the data
(the rest is waiting for the sender's compute: a pipeline bubble, idle time), as the cost model defines it. The
header's times come from CLOCK_MONOTONIC, shared by the processes of one host; across hosts the whole wait counts.

CUDA tensors are staged through pinned host memory unless ``TAPP_MPI_CUDA_AWARE=1`` says the MPI can read GPU
memory. A send of a CUDA tensor returns at once: its copy is queued on a side stream behind the compute that
made the tensor, and the MPI send is posted when the copy is done (each wait and ``progress`` posts those that
are), so the copy overlaps the compute queued after it. A received tensor goes to the GPU on a second side stream
(``to_device``), which the compute stream waits for on the GPU: the copy does not queue behind the compute already
launched, and copies in both directions run at once (APapo's device streams).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from tapp_core.plan.placement import count_shares
from tapp_core.platform import gpu
from tapp_core.platform.hosts import cuda_aware_mpi
from tapp_core.runtime.emulation import Emulation, now, sleep_until

ABORT_TAG = 1
DATA_TAG_BASE = 16
_SPIN_S = 50e-6
_MIN_SLEEP_S = 50e-6
_MAX_SLEEP_S = 1e-3
_SLEEP_SHARE = 0.02
"""A wait sleeps between tests for this share of the time it has waited so far (within the bounds above): the
data is seen at most ~2% late, and a long wait (a pipeline bubble) costs the core little."""
_CHECK_EVERY_S = 2e-3


_abandoned: list[tuple[list[MPI.Request], object]] = []
"""Requests of failed plans and the buffers they point into: MPI may still write or read those buffers, so
they live until the requests complete (cancelled receives do at once; a send nobody receives never does)."""


def abandon(requests: list[MPI.Request], keep_alive: object) -> None:
    _abandoned.append((requests, keep_alive))


def sweep_abandoned() -> int:
    """Drop the abandoned requests that completed; returns how many are left."""
    _abandoned[:] = [(reqs, keep) for reqs, keep in _abandoned if not MPI.Request.Testall(reqs)]
    return len(_abandoned)


class PlanAborted(RuntimeError):
    """Another rank failed this plan; the message is its error."""


class PlanTimeout(RuntimeError):
    """The plan ran past its time limit."""


def _buffer(tensor: torch.Tensor) -> list[object]:
    """An MPI buffer over a contiguous CPU tensor (or a CUDA one when the MPI is CUDA-aware), as raw bytes."""
    if tensor.is_cuda:
        return [tensor.view(torch.uint8), MPI.BYTE]
    return [tensor.view(torch.uint8).numpy(), MPI.BYTE]


class Control:
    """The abort and deadline checks of one plan, shared by every wait of the plan on this rank."""

    def __init__(self, comm: MPI.Comm, deadline: float) -> None:
        self.comm = comm
        self.deadline = deadline
        self._last_check = 0.0
        self._sent: list[MPI.Request] = []

    def check(self, force: bool = False) -> None:
        t = now()
        if not force and t - self._last_check < _CHECK_EVERY_S:
            return
        self._last_check = t
        if t > self.deadline:
            raise PlanTimeout("the plan ran past its time limit")
        status = MPI.Status()
        if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=ABORT_TAG, status=status):
            message = self.comm.recv(source=status.Get_source(), tag=ABORT_TAG)
            raise PlanAborted(str(message))

    def abort(self, message: str) -> None:
        """Tell every other rank of the plan to give up; returns at once."""
        me = self.comm.Get_rank()
        self._sent += [self.comm.isend(message, peer, ABORT_TAG) for peer in range(self.comm.Get_size()) if peer != me]

    def close(self) -> None:
        """Keep the abort messages alive until delivered: a peer that already finished never receives them."""
        if self._sent:
            abandon(self._sent, None)
            self._sent = []


def poll(requests: Sequence[MPI.Request], check: Callable[[], None]) -> None:
    """Wait for ``requests`` without blocking in MPI; ``check`` may raise to give up."""
    reqs = list(requests)
    if MPI.Request.Testall(reqs):
        return
    start = time.perf_counter()
    while not MPI.Request.Testall(reqs):
        check()
        if time.perf_counter() - start > _SPIN_S:
            doze(start)


def doze(since: float, min_s: float = _MIN_SLEEP_S, max_s: float = _MAX_SLEEP_S) -> None:
    """Sleep between two tests of a wait that began at ``since`` (``time.perf_counter``): ``_SLEEP_SHARE`` of the
    time waited so far, within ``[min_s, max_s]``."""
    time.sleep(min(max_s, max(min_s, _SLEEP_SHARE * (time.perf_counter() - since))))


@dataclass
class Receipt:
    """A posted receive: ``tensor`` holds the data once ``Transport.wait`` returned for it."""

    tensor: torch.Tensor
    requests: list[MPI.Request]
    header: np.ndarray
    """The sender's (posted at, delivered at)."""


@dataclass
class Reduction:
    """A started allreduce of one flat gradient buffer."""

    requests: list[MPI.Request]
    flat: torch.Tensor
    host: torch.Tensor
    """What MPI sums: ``flat`` itself, or its host copy (a GPU buffer without CUDA-aware MPI)."""
    started: np.ndarray
    """When the last device started it (the maximum over the devices, once done)."""
    nbytes: int
    peers: list[int]
    link_s: float | None = None
    """Emulated, what the link takes for it (None: an allreduce among ``peers`` of ``nbytes``)."""


@dataclass
class _StagedSend:
    """A send of a CUDA tensor waiting for its copy (or, CUDA-aware, for the compute that makes it)."""

    ready: torch.cuda.Event
    data: torch.Tensor
    """What MPI sends: the pinned host copy, or the device tensor itself."""
    source: torch.Tensor
    """The device tensor, kept alive until the copy is done."""
    dest: int
    tag: int


@dataclass
class Transport:
    """Sends and receives of one rank in one plan. ``wait_s`` accumulates the counted waits."""

    comm: MPI.Comm
    header_comm: MPI.Comm
    """Carries each message's header (posted at, delivered at), under the message's own tag."""
    barrier_comm: MPI.Comm
    """The ranks of the plan (the others are idle)."""
    control: Control
    emulation: Emulation
    shared_clock: bool = True
    """Whether every rank of the plan reads the same clock (one host)."""
    wait_s: float = 0.0
    """Communication wait: blocked in receives after the data was posted, and in allreduces."""
    blocked_s: float = 0.0
    """Every wait, bubbles included."""
    _sends: list[tuple[MPI.Request, object]] = field(default_factory=list)
    _receives: dict[int, Receipt] = field(default_factory=dict)
    _collectives: list[Reduction] = field(default_factory=list)
    _staged: deque[_StagedSend] = field(default_factory=deque)
    _copy_streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)
    """Per GPU: the device-to-host copies of sends."""
    _receive_streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)
    """Per GPU: the host-to-device copies of received tensors."""

    def __post_init__(self) -> None:
        self._stage_through_host = not cuda_aware_mpi()

    def isend(self, tensor: torch.Tensor, dest: int, tag: int) -> None:
        """Send ``tensor``; returns at once. A CUDA tensor's send is posted once its copy to the host is done."""
        data = tensor.detach()
        if data.is_cuda:
            self._stage(data, dest, tag)
        else:
            self._post_send(data.contiguous(), dest, tag)

    def _stage(self, data: torch.Tensor, dest: int, tag: int) -> None:
        """Queue ``data``'s copy to pinned host memory on the side stream, behind the compute that makes it."""
        stream = _side_stream(self._copy_streams, data.device)
        stream.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(stream):
            if self._stage_through_host:
                host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                host.copy_(data, non_blocking=True)
            else:
                host = data.contiguous()
            ready = gpu.recorded_event(stream=stream)
        self._staged.append(_StagedSend(ready, host, data, dest, tag))

    def _post_staged(self, wait: bool = False) -> None:
        """Post the staged sends whose copies are done (all of them, waiting, with ``wait``), in order."""
        while self._staged and (wait or gpu.done(self._staged[0].ready)):
            staged = self._staged.popleft()
            staged.ready.synchronize()
            self._post_send(staged.data, staged.dest, staged.tag)

    def _check(self) -> None:
        """What every wait does between tests: post the sends whose copies are done, and check for aborts."""
        if self._staged:
            self._post_staged()
        self.control.check()

    def _post_send(self, data: torch.Tensor, dest: int, tag: int) -> None:
        posted = now()
        delivered = self.emulation.send_ready_at(dest, data.numel() * data.element_size())
        header = np.array([posted, delivered])
        requests = [self.comm.Isend(_buffer(data), dest, tag), self.header_comm.Isend(header, dest, tag)]
        self._sends += [(r, (data, header)) for r in requests]

    def to_device(self, received: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``received`` (whose receive is done) on ``device``. To a GPU from the host: copied on the receive side
        stream, and the current stream waits for the copy on the GPU, not on the host."""
        if device.type != "cuda" or received.is_cuda:
            return received.to(device)
        stream = _side_stream(self._receive_streams, device)
        with torch.cuda.stream(stream):
            moved = received.to(device, non_blocking=True)
            copied = gpu.recorded_event(stream=stream)
        current = torch.cuda.current_stream(device)
        current.wait_event(copied)
        moved.record_stream(current)  # allocated on the side stream, used (and freed) on the compute stream
        return moved

    def irecv(self, buffer: torch.Tensor, source: int, tag: int) -> Receipt:
        """Post a receive into the contiguous CPU (or CUDA-aware) tensor ``buffer``."""
        header = np.zeros(2)
        requests = [self.comm.Irecv(_buffer(buffer), source, tag), self.header_comm.Irecv(header, source, tag)]
        receipt = Receipt(buffer, requests, header)
        self._receives[id(receipt)] = receipt
        return receipt

    def wait(self, receipts: Sequence[Receipt]) -> None:
        """Block (polling) until every receipt's data is there and, emulated, until its link delivered it."""
        if not receipts:
            return
        start = now()
        poll([r for receipt in receipts for r in receipt.requests], self._check)
        for receipt in receipts:
            del self._receives[id(receipt)]
        if self.emulation.enabled:
            sleep_until(max(float(r.header[1]) for r in receipts))
        end = now()
        posted = max(float(r.header[0]) for r in receipts) if self.shared_clock else start
        self.wait_s += max(0.0, end - max(start, posted))
        self.blocked_s += end - start
        self.progress()

    def start_allreduce(self, flat: torch.Tensor, comm: MPI.Comm, peers: list[int]) -> Reduction:
        """Start summing ``flat`` in place over ``comm`` (the devices of a stage; ``peers`` their ranks in the pool);
        returns at once. ``finish_reductions`` waits for it."""
        host = flat.to("cpu") if flat.is_cuda and self._stage_through_host else flat
        if host.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"allreduce of {host.dtype} gradients is not supported")
        requests = [comm.Iallreduce(MPI.IN_PLACE, host.numpy() if not host.is_cuda else host, op=MPI.SUM)]
        started = np.array([now()])
        # Every device's start, maximised: when the last one joined (the reduction cannot go before that).
        requests.append(comm.Iallreduce(MPI.IN_PLACE, started, op=MPI.MAX))
        reduction = Reduction(requests, flat, host, started, host.numel() * host.element_size(), peers)
        self._collectives.append(reduction)
        return reduction

    def start_reduce_scatter(
        self, flat: torch.Tensor, received: torch.Tensor, counts: Sequence[int], comm: MPI.Comm, ranks: Sequence[int]
    ) -> Reduction:
        """Start summing ``flat`` over ``comm`` (a stage's devices, ``ranks`` their pool ranks in the group's order),
        each device receiving the sum of its ``counts`` elements into ``received``; returns at once.
        ``finish_reductions`` waits for it. CPU tensors (or CUDA-aware MPI) only."""
        if flat.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"reduce-scatter of {flat.dtype} gradients is not supported")
        host = flat.to("cpu") if flat.is_cuda and self._stage_through_host else flat
        out = received.to("cpu") if received.is_cuda and self._stage_through_host else received
        requests = [comm.Ireduce_scatter(_array(host), _array(out), list(counts), op=MPI.SUM)]
        started = np.array([now()])
        requests.append(comm.Iallreduce(MPI.IN_PLACE, started, op=MPI.MAX))
        nbytes = host.numel() * host.element_size()
        link_s = self.emulation.collective_time("reduce_scatter", nbytes, count_shares(counts), list(ranks))
        me = ranks[comm.Get_rank()]
        reduction = Reduction(requests, received, out, started, nbytes, [r for r in ranks if r != me], link_s)
        self._collectives.append(reduction)
        return reduction

    def finish_reductions(self, reductions: Sequence[Reduction]) -> None:
        """Wait for ``reductions`` (started in this order on one communicator) and, emulated, for the link time each
        takes one after another. The wait counts as communication from when the last device joined the last one."""
        if not reductions:
            return
        start = now()
        poll([r for reduction in reductions for r in reduction.requests], self._check)
        if self.emulation.enabled:
            link_free = 0.0
            for reduction in reductions:
                link_free = max(link_free, float(reduction.started[0]))
                link_free += (
                    reduction.link_s
                    if reduction.link_s is not None
                    else self.emulation.allreduce_time(reduction.peers, reduction.nbytes)
                )
            sleep_until(link_free)
        for reduction in reductions:
            if reduction.host is not reduction.flat:
                reduction.flat.copy_(reduction.host)
            self._collectives.remove(reduction)
        end = now()
        joined = float(reductions[-1].started[0]) if self.shared_clock else start
        self.wait_s += max(0.0, end - max(start, joined))
        self.blocked_s += end - start

    def wait_collective(
        self, requests: Sequence[MPI.Request], joined: np.ndarray, link_s: float, buffers: object = None
    ) -> None:
        """Wait (polling) for a layout change's collective among a stage's devices (``runtime.collectives``); its
        requests reduce ``joined`` to when the last device started it. Emulated, the wait lasts until ``link_s``
        after that. Counts as communication from when the last device joined. A wait that gives up (an abort, the
        deadline) leaves the requests and the ``buffers`` they use to ``abandon``."""
        start = now()
        try:
            poll(requests, self._check)
        except BaseException:
            abandon(list(requests), (joined, buffers))
            raise
        if self.emulation.enabled and link_s > 0:
            sleep_until(float(joined[0]) + link_s)
        end = now()
        last = float(joined[0]) if self.shared_clock else start
        self.wait_s += max(0.0, end - max(start, last))
        self.blocked_s += end - start

    def barrier(self) -> None:
        """A barrier of the plan's ranks, not counted as communication (it waits for peers, not for data)."""
        poll([self.barrier_comm.Ibarrier()], self._check)

    def progress(self) -> None:
        """Post the staged sends whose copies are done; complete and drop the sends that finished."""
        if self._staged:
            self._post_staged()
        if self._sends:
            self._sends = [(r, keep) for r, keep in self._sends if not r.Test()]

    def poke(self) -> None:
        """``progress``, and a test of the posted receives and started reductions: calls into MPI that move this
        rank's transfers on (``tapp_core.runtime.progress``). What a test finds complete is done: its ``wait`` or
        ``finish_reductions`` returns at once."""
        self.progress()
        pending = [r for receipt in self._receives.values() for r in receipt.requests]
        pending += [r for reduction in self._collectives for r in reduction.requests]
        if pending:
            MPI.Request.Testall(pending)

    def flush(self) -> None:
        """Post every staged send and wait for every send (at the end of a run, outside every step)."""
        self._post_staged(wait=True)
        poll([r for r, _ in self._sends], self.control.check)
        self._sends.clear()

    def abandon(self) -> None:
        """After a failure: cancel the posted receives and keep alive every buffer MPI may still touch."""
        for receipt in self._receives.values():
            for request in receipt.requests:
                if not request.Test():
                    request.Cancel()
            abandon(receipt.requests, receipt)
        self._receives.clear()
        if self._sends:
            abandon([r for r, _ in self._sends], self._sends)
            self._sends = []
        for reduction in self._collectives:
            abandon(reduction.requests, reduction)
        self._collectives.clear()
        self._staged.clear()  # never posted; the host allocator keeps the pinned copies until they are done


def _array(tensor: torch.Tensor) -> object:
    """What MPI reads or writes of ``tensor``: its NumPy view on the CPU, the tensor itself on a GPU."""
    return tensor if tensor.is_cuda else tensor.numpy()


def _side_stream(streams: dict[int, torch.cuda.Stream], device: torch.device) -> torch.cuda.Stream:
    """``streams``' stream of ``device``, made on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = gpu.new_stream(torch.device("cuda", index))
    return stream
