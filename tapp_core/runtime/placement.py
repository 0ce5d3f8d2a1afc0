"""Where a pool's ranks run, and whether this host can hold its share of them.

A rank is a Python process with torch loaded: about ``RANK_MEMORY_BYTES`` before it builds any model. A pool is
refused before anything starts when the ranks it would put on this host need more memory than the host has
available, or outnumber ``RANKS_PER_CORE`` per core (at least ``MIN_RANKS``, so that the project's 8-device
clusters start on a small machine): beyond that the ranks spend their time waiting for a core, and a measurement
means little. Ranks on other hosts are not checked from here. ``allow_oversubscribe`` (or the environment variable
``OVERSUBSCRIBE_VARIABLE`` set to 1) lifts the limit.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tapp_core.cluster import Device

RANK_MEMORY_BYTES = 400 * 2**20
"""Memory of one rank before its first model: an idle CPU rank (torch, mpi4py, the runtime) measured ~395 MiB
resident, ~260 MiB of it its own."""
RANKS_PER_CORE = 4
MIN_RANKS = 8
OVERSUBSCRIBE_VARIABLE = "TAPP_ALLOW_OVERSUBSCRIBE"
LOOPBACK = "127.0.0.1"


def is_local_host(host: str | None) -> bool:
    """Whether a device's ``host`` is this machine (no host given means this machine)."""
    if host is None:
        return True
    name = socket.gethostname()
    return host in {"localhost", LOOPBACK, "::1", name, name.split(".")[0]}


def bind_address(devices: Sequence[Device]) -> str:
    """Where the pool listens for rank 0: loopback unless a device lives on another host, else this host's name."""
    return LOOPBACK if all(is_local_host(d.host) for d in devices) else socket.gethostname()


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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


def overload(cluster_name: str, devices: Sequence[Device], capacity: HostCapacity | None = None) -> str | None:
    """Why this host cannot hold the ranks of ``devices`` that would run on it (one line), or None if it can."""
    local = sum(1 for d in devices if is_local_host(d.host))
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
