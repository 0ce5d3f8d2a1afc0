"""What ``tapp calibrate`` measures on the ranks themselves, one MPI rank per cluster device (rank i = device i).

    mpiexec -n N python -m tapp_core.runtime.probe --cluster cluster.json --out probe.json [--emulate]

Each figure is measured on one device of each kind in turn while the other ranks wait asleep (a shared host
must not time two things at once), with the device's threads and, for a GPU, on its GPU:

- **update**: one step of the runtime's optimiser (``optim.make_optimizer``, SGD with momentum) over parameters
  of two sizes, median of several steps; the line through both gives a fixed part and a part per byte;
- **staging** (GPU devices): copies between the GPU and pinned host memory, as the runtime stages tensors for a
  MPI that is not CUDA-aware, each waited for, at two sizes; fixed part per copy and per byte, each way;
- **sharing** (``--model``, given where the host's ranks want more threads than it has cores): each rank's
  training step of the model (forward and backward of a batch) alone, one rank at a time, then while every rank
  computes at once for ``SHARING_WINDOW_STEPS`` times the longest step alone (the steps that end inside the
  window count, so that none ran alone);
- **messages**: a one-float ping-pong between every pair of ranks through the runtime's own ``Transport``
  (its headers, polling and, with ``--emulate``, the emulated link); a message's one-way time is half the median
  round trip.

Rank 0 writes every figure as JSON (``calibration.ProbeResult``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from mpi4py import MPI

from tapp_core.cost.calibration import KindProbe, Line, PairProbe, ProbeResult, SharingProbe
from tapp_core.model.workload import build_workload_model, workload_of
from tapp_core.platform.cluster import Cluster
from tapp_core.platform.hosts import cuda_aware_mpi
from tapp_core.platform.kinds import device_kind
from tapp_core.runtime.emulation import Emulation
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer
from tapp_core.runtime.rank import tool_rank
from tapp_core.runtime.transport import DATA_TAG_BASE, Control, Transport, poll

UPDATE_BYTES = (2**18, 2**25)
"""Parameter bytes of the two timed optimiser steps: 256 KiB and 32 MiB, in four tensors each."""
UPDATE_TRIES = 3
"""Medians of the optimiser's step taken per size; the least is kept."""
STAGING_BYTES = (2**12, 2**24)
"""Bytes of the two timed staging copies: 4 KiB and 16 MiB."""
PING_TAG = DATA_TAG_BASE + 7
SHARING_WINDOW_STEPS = 8
"""Every rank computes at once for this many times the longest step alone (a rank slowed by more than this
would time no step: its figure is then the window itself, a lower bound)."""


def _median_time(run: Callable[[], object], sync: Callable[[], None], repeats: int = 7, warmup: int = 2) -> float:
    times = []
    for _ in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def _sync_of(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def probe_update(device: torch.device) -> Line:
    """The runtime optimiser's step over 4 tensors of each of ``UPDATE_BYTES`` in all."""
    seconds = []
    for nbytes in UPDATE_BYTES:
        params = [torch.nn.Parameter(torch.randn(nbytes // 16, device=device)) for _ in range(4)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = make_optimizer(params, OptimizerConfig())
        # The least of a few medians: a burst of other work on the host (seen: a 2-thread rank's update timed 20x
        # too slow once on a 2-core host) must not become the kind's update rate for good.
        seconds.append(min(_median_time(optimizer.step, _sync_of(device)) for _ in range(UPDATE_TRIES)))
    return Line.through(UPDATE_BYTES, (seconds[0], seconds[1]))


def probe_staging(device: torch.device) -> tuple[Line, Line]:
    """Copies of ``STAGING_BYTES`` from the GPU to pinned host memory and back, each waited for."""
    d2h, h2d = [], []
    for nbytes in STAGING_BYTES:
        on_gpu = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        sync = _sync_of(device)
        d2h.append(_median_time(partial(host.copy_, on_gpu, non_blocking=True), sync, repeats=11))
        h2d.append(_median_time(partial(on_gpu.copy_, host, non_blocking=True), sync, repeats=11))
    return Line.through(STAGING_BYTES, (d2h[0], d2h[1])), Line.through(STAGING_BYTES, (h2d[0], h2d[1]))


def _wait_for_all(comm: MPI.Comm) -> None:
    """A barrier that sleeps while it waits."""
    poll([comm.Ibarrier()], lambda: None)


def probe_kinds(comm: MPI.Comm, cluster: Cluster, device: torch.device) -> list[KindProbe]:
    """Update and staging on the first device of every kind, one at a time; rank 0 gets them all."""
    rank = comm.Get_rank()
    first_of_kind: dict[str, int] = {}
    for index, spec in enumerate(cluster.devices):
        first_of_kind.setdefault(device_kind(spec).name, index)
    mine: list[KindProbe] = []
    for kind, index in first_of_kind.items():
        if rank == index:
            found = KindProbe(kind, cluster.devices[index].name, probe_update(device))
            if device.type == "cuda":
                found.d2h, found.h2d = probe_staging(device)
            mine.append(found)
        _wait_for_all(comm)
    gathered = comm.gather(mine, root=0)
    return [probe for probes in gathered for probe in probes] if gathered is not None else []


def _training_step(model_spec: str, batch_size: int, device: torch.device) -> Callable[[], None]:
    """One forward and backward of a batch of random inputs of the model's workload through it, waited for."""
    workload = workload_of(model_spec)
    model = build_workload_model(workload).to(device)
    inputs, labels = (tensor.to(device) for tensor in workload.batch(batch_size))
    sync = _sync_of(device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.autograd.backward(workload.loss_of(model(inputs), labels, batch_size))
        sync()

    return step


def _steps_inside(step: Callable[[], None], window_s: float) -> float:
    """The median of the steps that start and end within ``window_s`` from now (the window when none does)."""
    deadline = time.perf_counter() + window_s
    times = []
    while (start := time.perf_counter()) < deadline:
        step()
        if (end := time.perf_counter()) <= deadline:
            times.append(end - start)
    return statistics.median(times) if times else window_s


def probe_sharing(
    comm: MPI.Comm, cluster: Cluster, device: torch.device, model_spec: str, batch_size: int
) -> list[SharingProbe]:
    """Every rank's training step alone (one rank at a time) and while every rank computes; rank 0 gets them."""
    rank = comm.Get_rank()
    step = _training_step(model_spec, batch_size, device)
    alone = 0.0
    for index in range(comm.Get_size()):
        if rank == index:
            alone = _median_time(step, lambda: None, repeats=3, warmup=1)
        _wait_for_all(comm)
    window_s = SHARING_WINDOW_STEPS * comm.allreduce(alone, op=MPI.MAX)
    step()  # each rank's first step after waiting is slower; not inside the window
    _wait_for_all(comm)
    together = _steps_inside(step, window_s)
    spec = cluster.devices[rank]
    gathered = comm.gather(SharingProbe(spec.name, device_kind(spec).name, alone, together), root=0)
    return list(gathered) if gathered is not None else []


def ping_pong(transport: Transport, me: int, peer: int, device: torch.device, repeats: int, warmup: int) -> float:
    """Half the median round trip of one float through ``transport`` (the lower rank starts)."""
    message = torch.ones(1, device=device)
    inbox = torch.zeros(1)
    times = []
    for _ in range(warmup + repeats):
        start = time.perf_counter()
        if me < peer:
            transport.isend(message, peer, PING_TAG)
            transport.wait([transport.irecv(inbox, peer, PING_TAG)])
        else:
            transport.wait([transport.irecv(inbox, peer, PING_TAG)])
            transport.isend(message, peer, PING_TAG)
        times.append(time.perf_counter() - start)
        transport.progress()
    transport.flush()
    return statistics.median(times[warmup:]) / 2


def probe_pairs(
    comm: MPI.Comm, cluster: Cluster, device: torch.device, emulate: bool, repeats: int = 30, warmup: int = 5
) -> list[PairProbe]:
    """Every pair's one-way time of one message, one pair at a time; rank 0 gets the list."""
    rank = comm.Get_rank()
    names = list(cluster.device_names)
    data, headers = comm.Dup(), comm.Dup()
    control = Control(data, time.monotonic() + 600.0)
    emulation = Emulation.for_rank(cluster, names, rank, emulate)
    transport = Transport(data, headers, comm, control, emulation)
    found = []
    for a, b in itertools.combinations(range(comm.Get_size()), 2):
        if rank in (a, b):
            one_way = ping_pong(transport, rank, b if rank == a else a, device, repeats, warmup)
            if rank == a:
                found.append(PairProbe((names[a], names[b]), one_way))
        _wait_for_all(comm)
    control.close()
    gathered = comm.gather(found, root=0)
    return [pair for pairs in gathered for pair in pairs] if gathered is not None else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cluster", required=True, help="the cluster as JSON (rank i runs device i)")
    parser.add_argument("--out", required=True, help="where rank 0 writes the figures (JSON)")
    parser.add_argument("--emulate", action="store_true", help="emulate the cluster's links for the messages")
    parser.add_argument("--model", help="measure how the ranks slow each other computing this model at once")
    parser.add_argument("--batch-size", type=int, default=64, help="the batch of that model's steps")
    args = parser.parse_args(argv)
    started = tool_rank(Path(args.cluster), "probe")
    if started is None:
        return 2
    comm, cluster, device = started
    kinds = probe_kinds(comm, cluster, device)
    pairs = probe_pairs(comm, cluster, device, args.emulate)
    sharing = probe_sharing(comm, cluster, device, args.model, args.batch_size) if args.model else []
    if comm.Get_rank() == 0:
        result = ProbeResult(kinds, pairs, sharing, cuda_aware_mpi(), args.emulate)
        Path(args.out).write_text(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
