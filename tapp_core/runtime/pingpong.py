"""The links of a real host, measured: an MPI ping-pong between every pair of ranks, one rank per device.

    mpiexec -n N python -m tapp_core.runtime.pingpong --cluster cluster.json --out links.json

Rank i runs device i of the cluster, with its threads (and its GPU for a cuda device). For every pair of ranks,
messages of each size go back and forth ``repeats`` times after ``warmup`` round trips; the other ranks wait
without spinning. A GPU end stages its messages through pinned host memory as the runtime does (copied to the
host before the send and to the GPU after the receive, both waited for), unless TAPP_MPI_CUDA_AWARE=1 lets MPI
read GPU memory. A size's one-way time is half the median round trip. The link's latency is the one-way time of
the smallest message; its bandwidth is the least-squares fit through the origin of bytes against the extra time
of the larger messages. Rank 0 writes every pair's figures as JSON (``PairLink`` objects under ``"pairs"``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from mpi4py import MPI

from tapp_core.platform.cluster import Cluster, Device
from tapp_core.platform.hosts import PairLink, cuda_aware_mpi, fit_link
from tapp_core.runtime.rank import tool_rank
from tapp_core.runtime.transport import poll

SIZES = (8, 2**20, 2**24)
"""Message sizes in bytes: 8 B for the latency, 1 MiB and 16 MiB (an activation of a large layer) for the
bandwidth."""
PING_TAG = 21


class _End:
    """This rank's end of a ping-pong: its message buffers, on the host and (a GPU end) on its GPU."""

    def __init__(self, device: Device, nbytes: int) -> None:
        self.gpu = torch.device("cuda", device.gpu_index or 0) if device.kind == "cuda" else None
        self.staged = self.gpu is not None and not cuda_aware_mpi()
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.staged)
        self.on_gpu = torch.zeros(nbytes, dtype=torch.uint8, device=self.gpu) if self.gpu is not None else None

    def buffer(self) -> list[object]:
        if self.on_gpu is not None and not self.staged:
            return [self.on_gpu, MPI.BYTE]
        return [self.host.numpy(), MPI.BYTE]

    def send(self, comm: MPI.Comm, peer: int) -> None:
        if self.on_gpu is not None:
            if self.staged:
                self.host.copy_(self.on_gpu, non_blocking=True)
            torch.cuda.synchronize(self.gpu)
        comm.Send(self.buffer(), peer, PING_TAG)

    def receive(self, comm: MPI.Comm, peer: int) -> None:
        comm.Recv(self.buffer(), peer, PING_TAG)
        if self.on_gpu is not None and self.staged:
            self.on_gpu.copy_(self.host, non_blocking=True)
            torch.cuda.synchronize(self.gpu)


def ping_pong(comm: MPI.Comm, me: int, peer: int, device: Device, nbytes: int, repeats: int, warmup: int) -> float:
    """Half the median round trip of ``nbytes`` between ``me`` and ``peer`` (the lower rank starts)."""
    end = _End(device, nbytes)
    times = []
    for _ in range(warmup + repeats):
        start = time.perf_counter()
        if me < peer:
            end.send(comm, peer)
            end.receive(comm, peer)
        else:
            end.receive(comm, peer)
            end.send(comm, peer)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) / 2


def measure_pairs(comm: MPI.Comm, cluster: Cluster, repeats: int, warmup: int) -> list[PairLink]:
    """Every pair's link, measured one pair at a time; rank 0 gets the list, the others an empty one."""
    rank = comm.Get_rank()
    device = cluster.devices[rank]
    found = []
    for a, b in itertools.combinations(range(comm.Get_size()), 2):
        if rank in (a, b):
            peer = b if rank == a else a
            one_way = tuple(ping_pong(comm, rank, peer, device, n, repeats, warmup) for n in SIZES)
            if rank == a:
                latency, bandwidth = fit_link(SIZES, one_way)
                names = (cluster.devices[a].name, cluster.devices[b].name)
                found.append(PairLink(names, latency, bandwidth, SIZES, one_way))
        poll([comm.Ibarrier()], lambda: None)  # the ranks outside the pair wait here, mostly asleep
    gathered = comm.gather(found, root=0)
    return [link for links in gathered for link in links] if gathered is not None else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="the cluster as JSON (rank i runs device i)")
    parser.add_argument("--out", required=True, help="where rank 0 writes the pairs' links (JSON)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    started = tool_rank(Path(args.cluster), "pingpong")
    if started is None:
        return 2
    comm, cluster, _ = started
    links = measure_pairs(comm, cluster, args.repeats, args.warmup)
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps({"pairs": [asdict(link) for link in links]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
