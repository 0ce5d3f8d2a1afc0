"""Which of a pool's ranks on this machine ended first, seen the moment it ended.

Hydra's report of a failed job is not a reliable witness of the first rank to end: when a rank dies, Hydra kills
the others, and with one proxy for all the ranks of a host it reports the lowest rank whose exit was bad, which is
often a rank it killed itself. A rank that runs under this kernel can be watched directly: a pidfd
(``os.pidfd_open``, Linux 5.3+) becomes readable when its process ends, whoever its parent is. A thread waits on
the pidfds of the pool's ranks for the life of one MPI job and keeps the first to end, when it ended alone (ranks
seen ending together name nobody: then the other witnesses speak).
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable, Sequence


class RankWatch:
    """The first of ``pids`` (ranks by index; None: not watchable here) to end, once one has."""

    def __init__(self, pids: Sequence[int | None], is_ours: Callable[[int], bool]) -> None:
        self._fds: dict[int, int] = {}
        for index, pid in enumerate(pids):
            fd = _pidfd(pid) if pid is not None else None
            if fd is None or pid is None:
                continue
            if is_ours(pid):  # checked after opening, so that the fd holds that very process, not a reused pid
                self._fds[fd] = index
            else:
                os.close(fd)
        self._wake_read, self._wake_write = os.pipe()
        self._first: int | None = None
        self._thread = threading.Thread(target=self._wait, name="tapp-rank-watch", daemon=True)
        self._thread.start()

    @property
    def first(self) -> int | None:
        """The rank seen ending alone before any other; None when none has ended, or several ended together."""
        return self._first

    def _wait(self) -> None:
        if not self._fds:
            return
        ready, _, _ = select.select([*self._fds, self._wake_read], [], [])
        ended = [self._fds[fd] for fd in ready if fd in self._fds]
        if len(ended) == 1 and self._wake_read not in ready:
            self._first = ended[0]

    def close(self) -> None:
        """Stop watching; ``first`` keeps what was seen."""
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        for fd in (*self._fds, self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, or None where the process is gone or the kernel has no pidfds."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError:
        return None
    return fd
