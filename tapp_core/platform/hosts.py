"""Hosts: what a machine has (cores, memory, GPUs, its MPI), where it is reached, and how ranks sit on it.

Below the runtime, the profiler and the cluster tools, which all ask it; it imports nothing heavy (torch only
inside the functions that need it).

- **Which host.** A device's ``host`` names its machine; none means this one (``is_local_host``). The pool
  listens where its rank 0 can reach it (``pool_address``): on loopback when rank 0 runs here, otherwise on this
  machine's address on the route to rank 0's host.
- **Capacity.** A rank is a Python process with torch loaded: about ``RANK_MEMORY_BYTES`` before it builds any
  model. A pool is refused before anything starts (``overload``) when the ranks it would put on this host need
  more memory than the host has available, or outnumber ``RANKS_PER_CORE`` per core (at least ``MIN_RANKS``, so
  that the project's 8-device clusters start on a small machine): beyond that the ranks spend their time waiting
  for a core, and a measurement means little. Ranks on other hosts are not checked from here.
  ``allow_oversubscribe`` (or ``OVERSUBSCRIBE_VARIABLE`` set to 1) lifts the limit.
- **Affinity.** A rank takes its device's ``threads`` for torch (``configure_threads``) and is pinned to cores of
  its own (``pin_rank``) where its host has a core for every thread of its ranks; ``PIN_VARIABLE=0`` leaves
  ranks unpinned.
- **What it has.** ``this_host``: the cores this process may use, the memory and the GPUs; ``cuda_aware_mpi``:
  whether its MPI reads GPU memory.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tapp_core.platform.cluster import Device

RANK_MEMORY_BYTES = 400 * 2**20
"""Memory of one rank before its first model: an idle CPU rank (torch, mpi4py, the runtime) measured ~395 MiB
resident, ~260 MiB of it its own."""
RANKS_PER_CORE = 4
MIN_RANKS = 8
OVERSUBSCRIBE_VARIABLE = "TAPP_ALLOW_OVERSUBSCRIBE"
PIN_VARIABLE = "TAPP_PIN_RANKS"
"""Set to 0 to leave the ranks unpinned (e.g. when several pools share one host)."""
CUDA_AWARE_VARIABLE = "TAPP_MPI_CUDA_AWARE"
LOOPBACK = "127.0.0.1"


# --- which host ---------------------------------------------------------------------------------------------------


def is_local_host(host: str | None) -> bool:
    """Whether a device's ``host`` is this machine (no host given means this machine)."""
    if host is None:
        return True
    name = socket.gethostname()
    return host in {"localhost", LOOPBACK, "::1", name, name.split(".")[0]}


def address_toward(host: str) -> str | None:
    """This machine's address on the route to ``host`` (the source address the kernel would pick); None when
    ``host`` cannot be resolved or routed. Nothing is sent."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def pool_address(devices: Sequence[Device]) -> str:
    """Where a pool of ``devices`` (rank 0 runs ``devices[0]``) listens for its rank 0: loopback when rank 0 runs
    on this host, else this machine's address on the route to rank 0's host (its name, where there is no route)."""
    first = devices[0].host if devices else None
    if first is None or is_local_host(first):
        return LOOPBACK
    return address_toward(first) or socket.gethostname()


# --- capacity -----------------------------------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user and system) process ``pid`` has used so far, from ``/proc`` (None when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def host_cpus() -> int:
    """The cores this process (and the ranks it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class HostCapacity:
    cores: int
    available_bytes: int | None

    @classmethod
    def here(cls) -> HostCapacity:
        return cls(host_cpus(), available_memory_bytes())

    @property
    def max_ranks(self) -> int:
        by_cores = max(MIN_RANKS, RANKS_PER_CORE * self.cores)
        if self.available_bytes is None:
            return by_cores
        return min(by_cores, self.available_bytes // RANK_MEMORY_BYTES)


def oversubscribe_allowed(option: bool | None) -> bool:
    """The pool's option if given, else ``OVERSUBSCRIBE_VARIABLE`` (1, true or yes)."""
    if option is not None:
        return option
    return os.environ.get(OVERSUBSCRIBE_VARIABLE, "").strip().lower() in {"1", "true", "yes"}


def ranks_on_host(devices: Sequence[Device]) -> int:
    """How many of ``devices``' ranks run on this host."""
    return sum(1 for d in devices if is_local_host(d.host))


def overload(cluster_name: str, devices: Sequence[Device], capacity: HostCapacity | None = None) -> str | None:
    """Why this host cannot hold the ranks of ``devices`` that would run on it (one line), or None if it can."""
    local = ranks_on_host(devices)
    capacity = capacity or HostCapacity.here()
    if local <= capacity.max_ranks:
        return None
    memory = (
        f" and {capacity.available_bytes / 2**30:.1f} GiB of memory available"
        if capacity.available_bytes is not None
        else ""
    )
    return (
        f"cluster {cluster_name!r} would start {local} worker ranks on this host, which has {capacity.cores} "
        f"core(s){memory}: at most {capacity.max_ranks} fit (about {RANK_MEMORY_BYTES / 2**30:.2f} GiB each, "
        f"{RANKS_PER_CORE} per core); use fewer devices, or allow it with {OVERSUBSCRIBE_VARIABLE}=1"
    )


# --- affinity -----------------------------------------------------------------------------------------------------


def rank_cores(devices: Sequence[Device], rank: int, available: Sequence[int]) -> tuple[int, ...] | None:
    """The cores rank ``rank`` has to itself, ``devices`` being the devices the ranks run, in rank order: the ranks
    of one host take consecutive blocks of their device's ``threads`` from ``available``, in rank order. None when
    the host's ranks want more threads than it has cores: sharing is then left to the operating system, which
    spreads the load better than any fixed placement can."""
    device = devices[rank]
    if sum(d.threads for d in devices if d.host == device.host) > len(available):
        return None
    start = sum(d.threads for d in devices[:rank] if d.host == device.host)
    return tuple(sorted(available)[start : start + device.threads])


def configure_threads(device: Device) -> None:
    """Set torch's intra-op pool to the device's thread count (the interop pool only if still settable)."""
    import torch

    torch.set_num_threads(device.threads)
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already ran in this process
        torch.set_num_interop_threads(device.threads)


def pin_rank(devices: Sequence[Device], rank: int) -> tuple[int, ...] | None:
    """Pin this process (rank ``rank`` of ranks running ``devices``) to its own cores (``rank_cores``) where the host
    has a core for every thread of its ranks, so that no rank's compute is preempted by another's; returns the
    cores (None: not pinned, or ``PIN_VARIABLE=0``)."""
    if os.environ.get(PIN_VARIABLE, "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = rank_cores(devices, rank, sorted(os.sched_getaffinity(0)))
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores


# --- links between hosts, measured (``tapp_core.runtime.pingpong`` writes them, ``tapp_core.runtime.detect`` reads them) --


@dataclass(frozen=True)
class PairLink:
    """One pair's measured link."""

    between: tuple[str, str]
    latency_s: float
    bandwidth_bytes_per_s: float
    sizes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    """Per size, half the median round trip."""


def fit_link(sizes: Sequence[int], one_way_s: Sequence[float]) -> tuple[float, float]:
    """(latency, bandwidth) from one-way times: the smallest message's time, and bytes / extra time of the others
    (least squares through the origin; a link whose large messages cost no more than the small gives inf)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    latency = one_way_s[order[0]]
    larger = [(sizes[i] - sizes[order[0]], one_way_s[i] - latency) for i in order[1:]]
    extra = sum(n * t for n, t in larger)
    if extra <= 0:
        return latency, float("inf")
    return latency, sum(n * n for n, _ in larger) / extra


# --- what it has --------------------------------------------------------------------------------------------------


def cuda_aware_mpi() -> bool:
    """Whether the MPI library reads and writes GPU memory itself (``TAPP_MPI_CUDA_AWARE=1``); else GPU tensors
    travel through pinned host memory."""
    return os.environ.get(CUDA_AWARE_VARIABLE, "") == "1"


@dataclass(frozen=True)
class Gpu:
    index: int
    model: str
    memory_bytes: int


@dataclass(frozen=True)
class Host:
    """This host's usable cores, memory and GPUs."""

    name: str
    cores: int
    memory_bytes: int
    gpus: tuple[Gpu, ...]


def this_host() -> Host:
    """The cores this process may run on, the physical memory, and every GPU torch can see."""
    import torch

    gpus = tuple(
        Gpu(i, torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Host(socket.gethostname(), host_cpus(), memory, gpus)
