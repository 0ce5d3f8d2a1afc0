"""Sharded optimiser state (ZeRO stage 1, ``Plan.shard_optimizer``): each device of a stage holds and updates the
optimiser state of its share of every gradient bucket.

A bucket's parameters become views of one flat buffer, so a device's share of the bucket is one contiguous slice of
it: a leaf tensor over the same memory, which the device's optimiser steps in place. The bucket's gradients are
reduce-scattered (each device receives the sum of its slice alone), the optimiser steps the slices, and the flat
buffers are all-gathered in place, which leaves every parameter updated on every device. A device's slice is its
share of the stage (``placement.split_ranges`` of the bucket's elements): the device that computes more rows also
updates more. An optimiser that steps each element on its own (SGD, Adam, AdamW: the ones the runtime knows) steps
a slice as it would the whole parameters, so the stage trains as if it were not sharded.

A checkpoint stores the optimiser state by the model's parameter names, as for any stage: ``whole_states`` gathers
each parameter's state from the slices on the stage's first device, which writes it (every device of the stage takes
part; no other holds the whole state), and ``load_states`` cuts it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from tapp_core.plan.placement import count_shares, split_ranges
from tapp_core.runtime.emulation import Emulation, now
from tapp_core.runtime.transport import Reduction, Transport

__all__ = ["BucketShard", "OptimizerShards"]


@dataclass
class BucketShard:
    """One gradient bucket of a sharding stage, on one device."""

    names: tuple[str, ...]
    """Its parameters (the stage module's names), in the order of its flat buffers."""
    flat: torch.Tensor
    """Every parameter of the bucket, flattened one after another: each parameter is a view of it."""
    counts: list[int]
    """Each device's elements of the bucket, in the group's order."""
    start: int
    own: nn.Parameter | None
    """This device's slice of ``flat`` (None: an empty one), the tensor its optimiser steps."""
    received: torch.Tensor
    """This device's slice of the bucket's summed gradient."""


class OptimizerShards:
    """The buckets of a sharding stage on one device: their reduce-scatters, the slices the device's optimiser
    steps, and the allgather of the updated parameters."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        buckets: Sequence[Sequence[str]],
        shares: Sequence[float],
        comm: MPI.Comm,
        ranks: Sequence[int],
        transport: Transport,
        emulation: Emulation,
    ) -> None:
        """``buckets``: the parameters (names of ``params``) of each bucket, in the order their gradients are
        flattened; ``comm``: the stage's devices, ``ranks`` their pool ranks, both in the group's order."""
        self.params = params
        self.comm = comm
        self.ranks = list(ranks)
        self.index = comm.Get_rank()
        self.shares = list(shares)
        self.transport = transport
        self.emulation = emulation
        self.buckets = [self._bucket(tuple(names)) for names in buckets if names]
        self._bucket_index = {bucket.names: b for b, bucket in enumerate(self.buckets)}

    def _bucket(self, names: tuple[str, ...]) -> BucketShard:
        with torch.no_grad():
            flat = torch.cat([self.params[n].detach().reshape(-1) for n in names])
            offset = 0
            for name in names:
                param = self.params[name]
                param.data = flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
        ranges = split_ranges(flat.numel(), self.shares)
        start, stop = ranges[self.index]
        own = nn.Parameter(flat[start:stop]) if stop > start else None  # shares flat's memory
        received = torch.empty(stop - start, dtype=flat.dtype, device=flat.device)
        return BucketShard(names, flat, [b - a for a, b in ranges], start, own, received)

    def slices(self) -> list[nn.Parameter]:
        """What this device's optimiser steps: its slice of every bucket."""
        return [bucket.own for bucket in self.buckets if bucket.own is not None]

    def bucket_of(self, names: Sequence[str]) -> int | None:
        """The bucket of these parameter names (None: none is)."""
        return self._bucket_index.get(tuple(names))

    def start_reduction(self, bucket: int, gradients: torch.Tensor) -> Reduction:
        """Start reduce-scattering ``bucket``'s flattened ``gradients``: this device receives its slice's sum."""
        shard = self.buckets[bucket]
        return self.transport.start_reduce_scatter(gradients, shard.received, shard.counts, self.comm, self.ranks)

    def take_gradients(self) -> None:
        """Give each slice its summed gradient (the reductions are finished)."""
        for bucket in self.buckets:
            if bucket.own is not None:
                bucket.own.grad = bucket.received

    def gather(self) -> None:
        """Allgather every bucket's updated slices in place: each device's parameters hold the whole update."""
        requests = []
        hosts = [b.flat.cpu() for b in self.buckets]  # a GPU's buckets gathered through host memory
        for bucket, host in zip(self.buckets, hosts, strict=True):
            view = host.view(torch.uint8).numpy()
            requests.append(self.comm.Iallgatherv(MPI.IN_PLACE, [view, *_in_bytes(bucket), MPI.BYTE]))
        joined = np.array([now()])
        requests.append(self.comm.Iallreduce(MPI.IN_PLACE, joined, op=MPI.MAX))
        link_s = sum(
            self.emulation.collective_time(
                "allgather", b.flat.numel() * b.flat.element_size(), count_shares(b.counts), self.ranks
            )
            for b in self.buckets
        )
        self.transport.wait_collective(requests, joined, link_s, hosts)
        for bucket, host in zip(self.buckets, hosts, strict=True):
            if host is not bucket.flat:
                bucket.flat.copy_(host)

    # --- checkpoints -----------------------------------------------------------------------------------------

    def whole_states(self, optimizer: torch.optim.Optimizer | None, root: int = 0) -> dict[str, dict[str, Any]]:
        """Each bucket parameter's optimiser state, whole, by the stage module's names, on the group's device
        ``root`` (the one that writes the stage's checkpoint); the others get none. Every device of the stage must
        call this: the slices are gathered to ``root`` alone, so no other device holds the whole state. Before the
        optimiser's first step there is none."""
        states: dict[str, dict[str, Any]] = {}
        for bucket in self.buckets:
            first = next(i for i, c in enumerate(bucket.counts) if c > 0)  # the first device with a slice
            mine = optimizer.state.get(bucket.own, {}) if bucket.own is not None and optimizer is not None else {}
            keys: list[str] = self.comm.bcast(sorted(mine), root=first)
            for key in keys:
                whole = self._gathered(bucket, mine.get(key), first, root)
                if whole is None:
                    continue
                for name, part in self._per_parameter(bucket, whole).items():
                    states.setdefault(name, {})[key] = part
        return states

    def _gathered(self, bucket: BucketShard, value: torch.Tensor | None, first: int, root: int) -> torch.Tensor | None:
        """``value`` of every device's slice on device ``root`` (None elsewhere): a state per element gathered into
        the bucket's size; a number (a step count) as device ``first`` holds it."""
        per_element = self.comm.bcast(value is not None and value.dim() == 1, root=first)
        if not per_element:
            number = np.array([float(value) if value is not None else 0.0])
            self.comm.Bcast(number, root=first)
            return torch.tensor(number[0], dtype=torch.float32) if self.index == root else None
        local = value.detach().cpu().contiguous() if value is not None else torch.empty(0, dtype=bucket.flat.dtype)
        whole = torch.empty(bucket.flat.numel(), dtype=bucket.flat.dtype) if self.index == root else None
        received = [whole.view(torch.uint8).numpy(), *_in_bytes(bucket), MPI.BYTE] if whole is not None else None
        self.comm.Gatherv([local.view(torch.uint8).numpy(), MPI.BYTE], received, root=root)
        return whole

    def _per_parameter(self, bucket: BucketShard, whole: torch.Tensor) -> dict[str, torch.Tensor]:
        """A gathered state cut into each parameter's (a number: the same for each)."""
        if whole.dim() == 0:
            return {name: whole.clone() for name in bucket.names}
        parts, offset = {}, 0
        for name in bucket.names:
            param = self.params[name]
            parts[name] = whole[offset : offset + param.numel()].view_as(param).clone()
            offset += param.numel()
        return parts

    def bucketed(self) -> set[str]:
        """The parameters in a bucket: those whose optimiser state is sharded."""
        return {name for bucket in self.buckets for name in bucket.names}

    def load_states(self, optimizer: torch.optim.Optimizer, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Set each slice's optimiser state from the whole states of its bucket's parameters (by the stage module's
        names): a state shaped as its parameter is flattened and cut to the slice, any other (a step count) taken
        from the bucket's first parameter."""
        for bucket in self.buckets:
            if bucket.own is None or not all(name in states for name in bucket.names):
                continue
            state: dict[str, torch.Tensor] = {}
            for key, first in states[bucket.names[0]].items():
                if first.shape == self.params[bucket.names[0]].shape:
                    flat = torch.cat([states[n][key].reshape(-1) for n in bucket.names])
                    stop = bucket.start + bucket.own.numel()
                    state[key] = flat[bucket.start : stop].to(bucket.own.device).clone()
                else:
                    state[key] = first.to(bucket.own.device).clone()
            optimizer.state[bucket.own] = state


def _in_bytes(bucket: BucketShard) -> tuple[list[int], list[int]]:
    """Each device's slice of ``bucket`` in bytes: the counts and offsets of an allgather over it."""
    counts = [c * bucket.flat.element_size() for c in bucket.counts]
    return counts, [int(x) for x in np.cumsum([0, *counts[:-1]])]
