"""Ranks die with their pool: no rank, mpiexec or hydra proxy outlives the process that started the pool.

Three mechanisms, any of which ends a rank (and a rank that ends without finalising makes Hydra end the rest of
the MPI job, mpiexec included):

- Parent-death signals (Linux ``prctl(PR_SET_PDEATHSIG)``). The pool sets SIGTERM on mpiexec when it starts it
  from the main thread (the signal follows the *thread* that started the child, so a pool started from a worker
  thread cannot use it); mpiexec then ends its job. Every rank sets SIGKILL on itself, so that it dies with its
  parent, Hydra's proxy.
- A watchdog thread in every rank (``RankGuard``), started before the rank imports torch. Twice a second it checks
  that the pool's process is still the same process (``ProcessId``: boot id, pid and start time, so that a reused
  pid does not count; skipped on a host other than the pool's), and that its own parent has not changed.
- A launch deadline: a rank not told that the pool accepted rank 0 within the start timeout exits.

Once started, rank 0 also aborts the MPI job when its link to the pool closes (``coordinator``).

This module imports nothing heavy: a rank runs it first, while torch is still loading.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ORPHANED_EXIT = 75
"""A rank's exit status when it ends itself because its pool's process is gone."""
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5


def _find_prctl() -> Any:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _find_prctl()  # looked up now: a child between fork and exec must not load libraries


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) ends; False where unsupported."""
    return _prctl is not None and int(_prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0


def boot_id() -> str:
    """This boot of this host (Linux); empty where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux); None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of proc(5), counting from the state (field 3)


def running_since(pid: int) -> int | None:
    """``start_time`` of process ``pid`` while it runs; None once it has ended, a zombie its parent has not
    reaped yet included (its entry stays, with its start time, until then)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and fields[0] not in ("Z", "X", "x") else None


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` from the state on (proc(5)'s field 3); [] if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold spaces


@dataclass(frozen=True)
class ProcessId:
    """A process, named so that a later process given the same pid is not taken for it."""

    boot: str
    pid: int
    start: int

    @classmethod
    def current(cls) -> ProcessId:
        return cls(boot_id(), os.getpid(), start_time(os.getpid()) or 0)

    def encode(self) -> str:
        return f"{self.boot}/{self.pid}/{self.start}"

    @classmethod
    def decode(cls, text: str) -> ProcessId:
        """The inverse of ``encode``; ``ValueError`` for anything else."""
        boot, pid, start = text.strip().split("/")
        return cls(boot, int(pid), int(start))

    def alive(self) -> bool | None:
        """Whether the process still runs: None when that cannot be told from here (another host or boot, not
        Linux)."""
        here = boot_id()
        if not here or here != self.boot:
            return None
        return running_since(self.pid) == self.start


class RankGuard:
    """A rank's watchdog: ends the process when its pool's process or its parent is gone, or when the pool has not
    accepted rank 0 by the launch deadline (``started`` marks that it has)."""

    def __init__(self, owner: ProcessId | None, launch_timeout_s: float) -> None:
        self.owner = owner
        self.parent = os.getppid()
        self.launch_deadline = time.monotonic() + launch_timeout_s
        self._started = threading.Event()

    @classmethod
    def start(cls, owner: ProcessId | None, launch_timeout_s: float) -> RankGuard:
        set_parent_death_signal(signal.SIGKILL)
        guard = cls(owner, launch_timeout_s)
        threading.Thread(target=guard._watch, name="tapp-rank-guard", daemon=True).start()
        return guard

    def started(self) -> None:
        """The pool accepted rank 0: the launch deadline no longer applies."""
        self._started.set()

    def reason_to_exit(self) -> str | None:
        if self.owner is not None and self.owner.alive() is False:
            return f"the pool's process {self.owner.pid} is gone"
        if os.getppid() != self.parent:
            return f"its parent process {self.parent} is gone"
        if not self._started.is_set() and time.monotonic() > self.launch_deadline:
            return "the pool did not accept rank 0 within the start timeout"
        return None

    def _watch(self) -> None:
        while True:
            reason = self.reason_to_exit()
            if reason is not None:
                with contextlib.suppress(OSError, ValueError):
                    print(f"worker: exiting because {reason}", file=sys.stderr, flush=True)
                os._exit(ORPHANED_EXIT)
            time.sleep(_POLL_S)
