"""Whether the kernel killed a pool's rank for memory: the OOM-kill count of each rank's memory control group.

A rank past its memory limit (a testbed host's ``memory.max``, a container's, a systemd slice's, or the machine's
own) is killed by the kernel with SIGKILL, which Hydra reports like any other kill. The memory controller counts
those kills in each control group. The pool reads the count of every rank's group on this machine when its ranks
start, and again after a failure: a group whose count rose was out of memory, and its ranks' devices are named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tapp_core.platform.testbed.cgroups import Cgroups


@dataclass(frozen=True)
class OutOfMemory:
    """Ranks (by index) of one memory control group whose OOM-kill count rose, and the group's limit."""

    ranks: tuple[int, ...]
    limit_bytes: int | None


class OomWatch:
    """The OOM-kill count of each rank's memory group (ranks by index; None: not on this machine), read when made."""

    def __init__(self, pids: Sequence[int | None]) -> None:
        self._cgroups = Cgroups.find()
        groups = [self._group(pid) for pid in pids]
        self._ranks: dict[str, list[int]] = {}
        for index, group in enumerate(groups):
            if group is not None:
                self._ranks.setdefault(group, []).append(index)
        self._counts = {group: self._kills(group) for group in self._ranks}

    def _group(self, pid: int | None) -> str | None:
        return self._cgroups.memory_group_of(pid) if self._cgroups is not None and pid is not None else None

    def _kills(self, group: str) -> int | None:
        return self._cgroups.oom_kills(group) if self._cgroups is not None else None

    def killed(self) -> list[OutOfMemory]:
        """The groups whose count rose since the ranks started, each with its ranks and its limit."""
        found = []
        for group, ranks in self._ranks.items():
            before, now = self._counts[group], self._kills(group)
            if before is not None and now is not None and now > before:
                limit = self._cgroups.effective_memory_limit(group) if self._cgroups is not None else None
                found.append(OutOfMemory(tuple(ranks), limit))
        return found
