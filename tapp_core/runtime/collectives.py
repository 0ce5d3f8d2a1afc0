"""Layout changes among the devices of a stage (``tapp_core.plan.placement``), forward and backward, over MPI.

A ``LayoutChange`` module sits in a sharded stage's fx graph (``runtime.sharding``) where the layout pass put a
``Change``. Its forward runs the collective of ``placement.conversion(source, target)`` on the tensor, its backward
the one of ``placement.backward_conversion`` (the change between the dual layouts) on the gradient: an allgather's
backward is a reduce-scatter, an allreduce's an allreduce, a slice's a zero-padding, an all-to-all's the reverse
all-to-all. Shares may be uneven, so every collective is the vector form (Iallgatherv, Ireduce_scatter with
counts, Ialltoallv) along any dimension, each device's part given by ``Held.ranges``.

Every collective is nonblocking and its wait polls (``Transport.wait_collective``), so another rank's abort and
the plan's deadline still end it; on an emulated cluster it also waits out its emulated link time
(``Emulation.collective_time``: ``formulas.collective_s`` with the ideal calibration, over the links among the group,
as the cost model charges it). On an emulated slow device, the compute before each collective is slowed down
before the collective starts (``Segments``): a slow device holds its group up at every change, as the cost model's
coupled group runs each segment between two changes at its slowest device's pace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from tapp_core.plan.placement import LOCAL_COLLECTIVES, Collective, Layout, Split, conversion, dual
from tapp_core.runtime.emulation import Emulation, cpu_now, now
from tapp_core.runtime.transport import Transport

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Held:
    """How a group holds a tensor: its layout and, for a Split, every device's range ``[lo, hi)`` along the split
    dimension, in device order."""

    layout: Layout
    ranges: Ranges = ()

    @property
    def dim(self) -> int:
        if not isinstance(self.layout, Split):
            raise ValueError(f"a tensor held {self.layout} has no split dimension")
        return self.layout.dim

    def size(self, device: int) -> int:
        lo, hi = self.ranges[device]
        return hi - lo

    def dual(self) -> Held:
        """How the tensor's gradient is held."""
        return Held(dual(self.layout), self.ranges)


class Segments:
    """The compute time of one forward or backward that layout changes cut into segments.

    ``begin`` at its start; ``cut`` before each collective slows the segment just computed down (emulation) and
    adds it; ``resume`` after it; ``end`` adds the last segment and returns the compute, collectives excluded."""

    def __init__(self, emulation: Emulation) -> None:
        self.emulation = emulation
        self._mark: float | None = None
        self._cpu_mark = 0.0
        self._compute = 0.0

    def begin(self) -> None:
        self._mark, self._cpu_mark, self._compute = time.perf_counter(), cpu_now(), 0.0

    def cut(self) -> None:
        if self._mark is not None:
            wall, cpu = time.perf_counter() - self._mark, cpu_now() - self._cpu_mark
            self._compute += self.emulation.slow_down(wall, cpu)

    def resume(self) -> None:
        if self._mark is not None:
            self._mark, self._cpu_mark = time.perf_counter(), cpu_now()

    def end(self) -> float:
        if self._mark is None:
            return 0.0
        self.cut()
        self._mark = None
        return self._compute


class Group:
    """The devices of one stage, as layout changes see them: ``comm`` (ranks in device order), this device's
    ``index``, every member's pool rank and share, and the transport and emulation of this rank."""

    def __init__(
        self,
        comm: MPI.Comm,
        index: int,
        ranks: Sequence[int],
        shares: Sequence[float],
        transport: Transport,
        emulation: Emulation,
    ) -> None:
        self.comm = comm
        self.index = index
        self.ranks = tuple(ranks)
        self.shares = tuple(shares)
        self.transport = transport
        self.emulation = emulation
        self.segments = Segments(emulation)

    def change(self, tensor: torch.Tensor, source: Held, target: Held, emulated: bool = True) -> torch.Tensor:
        """``tensor`` (this device's, held as ``source``) as ``target`` holds it: the collective of
        ``placement.conversion``; a local change on the tensor's device, a collective through host memory.
        ``emulated`` false skips the emulated link time (collecting the parameters after a run)."""
        collective = conversion(source.layout, target.layout)
        if collective == "none":
            return tensor
        if collective in LOCAL_COLLECTIVES:
            return _local(collective, tensor.detach(), source, target, self.index)
        self.segments.cut()
        out = self._exchange(collective, tensor.detach().to("cpu").contiguous(), source, target, emulated)
        self.segments.resume()
        return out.to(tensor.device)

    def _exchange(
        self, collective: Collective, data: torch.Tensor, source: Held, target: Held, emulated: bool
    ) -> torch.Tensor:
        if collective == "allgather":
            pending = _allgather(self.comm, data, source)
        elif collective == "allreduce":
            pending = _allreduce(self.comm, data)
        elif collective == "reduce_scatter":
            pending = _reduce_scatter(self.comm, data, target, self.index)
        else:
            pending = _all_to_all(self.comm, data, source, target, self.index)
        joined = np.array([now()])
        requests = [*pending.requests, self.comm.Iallreduce(MPI.IN_PLACE, joined, op=MPI.MAX)]
        full = data.element_size() * (
            data.numel() if not isinstance(source.layout, Split) else _unit(data, source.dim) * source.ranges[-1][1]
        )
        link_s = self.emulation.collective_time(collective, full, self.shares, self.ranks) if emulated else 0.0
        self.transport.wait_collective(requests, joined, link_s, pending.buffers)
        return pending.finish()


def _unit(tensor: torch.Tensor, dim: int) -> int:
    """Elements of ``tensor`` per index along ``dim``."""
    return math.prod(size for d, size in enumerate(tensor.shape) if d != dim)


def _resized(tensor: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(tensor.shape)
    shape[dim] = size
    return shape


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint8).numpy()


def _offsets(counts: Sequence[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


def _joined(flat: torch.Tensor, counts: Sequence[int], shapes: Sequence[list[int]], dim: int) -> torch.Tensor:
    """The parts of ``flat`` (``counts`` elements each, of ``shapes``) concatenated along ``dim``."""
    parts = [part.view(shape) for part, shape in zip(torch.split(flat, list(counts)), shapes, strict=True)]
    return torch.cat(parts, dim=dim)


def _local(collective: Collective, data: torch.Tensor, source: Held, target: Held, index: int) -> torch.Tensor:
    """The changes each device makes on its own: keep its slice (``slice``), or pad with zeros to a partial sum
    (``zero``: a Broadcast tensor is kept whole by the first device only, a Split one padded around its part)."""
    if collective == "slice":
        lo, hi = target.ranges[index]
        return data.narrow(target.dim, lo, hi - lo).clone()
    if not isinstance(source.layout, Split):
        return data.clone() if index == 0 else torch.zeros_like(data)
    dim, (lo, hi) = source.dim, source.ranges[index]
    full = torch.zeros(_resized(data, dim, source.ranges[-1][1]), dtype=data.dtype, device=data.device)
    full.narrow(dim, lo, hi - lo).copy_(data)
    return full


@dataclass
class _Pending:
    """A started collective: its requests, what makes the result once they are done, and the buffers MPI reads
    and writes until then."""

    requests: list[MPI.Request]
    finish: Callable[[], torch.Tensor]
    buffers: tuple[torch.Tensor, ...]


def _allgather(comm: MPI.Comm, data: torch.Tensor, source: Held) -> _Pending:
    dim, unit = source.dim, _unit(data, source.dim)
    sizes = [hi - lo for lo, hi in source.ranges]
    counts = [size * unit for size in sizes]
    recv = torch.empty(sum(counts), dtype=data.dtype)
    width = data.element_size()
    request = comm.Iallgatherv(
        [_bytes(data), MPI.BYTE],
        [_bytes(recv), [c * width for c in counts], [o * width for o in _offsets(counts)], MPI.BYTE],
    )
    shapes = [_resized(data, dim, size) for size in sizes]
    return _Pending([request], lambda: _joined(recv, counts, shapes, dim), (data, recv))


def _allreduce(comm: MPI.Comm, data: torch.Tensor) -> _Pending:
    summed = data.clone()
    return _Pending([comm.Iallreduce(MPI.IN_PLACE, summed.numpy(), op=MPI.SUM)], lambda: summed, (summed,))


def _reduce_scatter(comm: MPI.Comm, data: torch.Tensor, target: Held, index: int) -> _Pending:
    dim = target.dim
    parts = [data.narrow(dim, lo, hi - lo).contiguous().reshape(-1) for lo, hi in target.ranges]
    send = torch.cat(parts)
    counts = [part.numel() for part in parts]
    recv = torch.empty(counts[index], dtype=data.dtype)
    request = comm.Ireduce_scatter(send.numpy(), recv.numpy(), counts, op=MPI.SUM)
    shape = _resized(data, dim, target.size(index))
    return _Pending([request], lambda: recv.view(shape), (send, recv))


def _all_to_all(comm: MPI.Comm, data: torch.Tensor, source: Held, target: Held, index: int) -> _Pending:
    """Split along ``source.dim`` to split along ``target.dim``: device j gets from each device i the part of i's
    slice in j's range of the target dimension."""
    a, b = source.dim, target.dim
    parts = [data.narrow(b, lo, hi - lo).contiguous().reshape(-1) for lo, hi in target.ranges]
    send = torch.cat(parts)
    send_counts = [part.numel() for part in parts]
    mine = _resized(data, b, target.size(index))
    shapes = [[source.size(i) if d == a else size for d, size in enumerate(mine)] for i in range(len(source.ranges))]
    recv_counts = [math.prod(shape) for shape in shapes]
    recv = torch.empty(sum(recv_counts), dtype=data.dtype)
    width = data.element_size()
    request = comm.Ialltoallv(
        [_bytes(send), [c * width for c in send_counts], [o * width for o in _offsets(send_counts)], MPI.BYTE],
        [_bytes(recv), [c * width for c in recv_counts], [o * width for o in _offsets(recv_counts)], MPI.BYTE],
    )
    return _Pending([request], lambda: _joined(recv, recv_counts, shapes, a), (send, recv))


class _Change(torch.autograd.Function):
    """Forward: the change from ``source`` to ``target``; backward: from the gradient's layout at ``target`` to
    its layout at ``source`` (``placement.backward_conversion``)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, change: LayoutChange) -> torch.Tensor:
        ctx.change = change
        return change.group.change(tensor, change.source, change.target)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        change: LayoutChange = ctx.change
        return change.group.change(grad.contiguous(), change.target.dual(), change.source.dual()), None


class LayoutChange(nn.Module):
    """A layout change in a stage's graph: ``source`` to ``target`` among ``group``, forward and backward."""

    def __init__(self, group: Group, source: Held, target: Held) -> None:
        super().__init__()
        self.group = group
        self.source = source
        self.target = target

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Change.apply(tensor, self)  # type: ignore[no-untyped-call]
        return out

    def extra_repr(self) -> str:
        return f"{self.source.layout} -> {self.target.layout}"
