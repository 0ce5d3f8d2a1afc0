"""CPU quotas, cores and memory limits of a testbed host, as control groups: version 1 (``cpu.cfs_quota_us`` and
``cpu.cfs_period_us`` in the ``cpu`` hierarchy, ``cpuset.cpus`` in the ``cpuset`` one, ``memory.limit_in_bytes`` in
the ``memory`` one) or version 2 (``cpu.max``, ``cpuset.cpus`` and ``memory.max`` in one group of the unified
hierarchy), whichever this machine mounts for the cpu controller. A host's memory limit is the kernel's: past it
the kernel reclaims, then kills a process of the group (swap is kept from the group where the kernel lets it be).

A group holds every process started in it and their children: the testbed starts each host's sshd in its group,
so that whatever a session starts there (Hydra's proxy, the ranks) runs under the host's quota.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MOUNTS = Path("/proc/self/mounts")
MOUNT_FLAGS = frozenset({"rw", "ro", "nosuid", "nodev", "noexec", "relatime", "noatime", "strictatime", "nodiratime"})
"""The options of a mount that are not a control-group hierarchy's own (its controllers, its name)."""


@dataclass(frozen=True)
class Cgroups:
    """Where this machine's cpu (and cpuset) controllers are mounted."""

    version: int
    cpu: Path
    """The cpu controller's root (v1), or the unified hierarchy's root (v2)."""
    cpuset: Path | None
    """The cpuset controller's root (v1; the unified root on v2 when it offers cpuset); None without it."""
    memory: Path | None = None
    """The memory controller's root (v1; the unified root on v2 when it offers memory); None without it."""

    @classmethod
    def find(cls, mounts: Path = MOUNTS) -> Cgroups | None:
        """The cpu controller as mounted here (version 1 where both are, as on hybrid systems); None without one."""
        v1: dict[str, Path] = {}
        unified: Path | None = None
        try:
            lines = mounts.read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if len(fields) < 4:
                continue
            where, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
            if kind == "cgroup":
                for controller in ("cpu", "cpuset", "memory"):
                    if controller in options:
                        v1.setdefault(controller, where)
            elif kind == "cgroup2":
                unified = unified or where
        if "cpu" in v1 and (v1["cpu"] / "cpu.cfs_quota_us").exists():
            return cls(1, v1["cpu"], v1.get("cpuset"), v1.get("memory"))
        if unified is not None:
            offered = _read(unified / "cgroup.controllers").split()
            if "cpu" in offered:
                return cls(
                    2, unified, unified if "cpuset" in offered else None, unified if "memory" in offered else None
                )
        return None

    def paths(self, name: str) -> list[Path]:
        """The group's folders (one per hierarchy it lives in)."""
        folders = [self.cpu / name]
        if self.version == 1:
            folders += [root / name for root in (self.cpuset, self.memory) if root is not None]
        return folders

    def make(
        self,
        name: str,
        quota_us: int | None,
        period_us: int,
        cores: tuple[int, ...] | None,
        memory_bytes: int | None = None,
    ) -> list[Path]:
        """Make group ``name`` with its quota (None: none), its cores (when given and the cpuset controller is
        here) and its memory limit (when given and the memory controller is here); returns its folders."""
        if self.version == 2:
            self._enable_v2(cores is not None, memory_bytes is not None)
        made = [self.cpu / name]
        if self.version == 1:
            made += [self.cpuset / name] if cores is not None and self.cpuset is not None else []
            made += [self.memory / name] if memory_bytes is not None and self.memory is not None else []
        for folder in made:
            folder.mkdir(exist_ok=True)
        if self.version == 1:
            _write(self.cpu / name / "cpu.cfs_period_us", str(period_us))
            _write(self.cpu / name / "cpu.cfs_quota_us", str(quota_us if quota_us is not None else -1))
        else:
            _write(self.cpu / name / "cpu.max", f"{quota_us if quota_us is not None else 'max'} {period_us}")
        if cores is not None and self.cpuset is not None:
            cpuset = self.cpuset / name
            if self.version == 1:  # a v1 cpuset takes no process before it has memory nodes
                _write(cpuset / "cpuset.mems", _read(self.cpuset / "cpuset.mems") or "0")
            _write(cpuset / "cpuset.cpus", ",".join(map(str, cores)))
        if memory_bytes is not None and self.memory is not None:
            self._limit_memory(self.memory / name, memory_bytes)
        return made

    def _limit_memory(self, group: Path, memory_bytes: int) -> None:
        """The kernel's limit on the group's memory, with no swap to spill into where the kernel says so."""
        if self.version == 1:
            _write(group / "memory.limit_in_bytes", str(memory_bytes))
            if (group / "memory.swappiness").exists():
                _write(group / "memory.swappiness", "0")
            return
        _write(group / "memory.max", str(memory_bytes))
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", "0")

    def memory_limit(self, name: str) -> int | None:
        """Group ``name``'s memory limit in bytes (None: none, or no memory controller)."""
        if self.memory is None:
            return None
        text = _read(self.memory / name / ("memory.limit_in_bytes" if self.version == 1 else "memory.max"))
        return int(text) if text.isdigit() and int(text) < 2**62 else None

    def effective_memory_limit(self, name: str) -> int | None:
        """The lowest memory limit of group ``name`` and the groups above it, in bytes (None: none): what a process
        in it can hold."""
        path = PurePosixPath(name)
        limits = (self.memory_limit(str(p)) for p in (path, *path.parents) if str(p) not in ("", "."))
        return min((limit for limit in limits if limit is not None), default=None)

    def memory_group_of(self, pid: int | str = "self") -> str | None:
        """The memory control group process ``pid`` is in (by default this one, as its own PID namespace names
        it), relative to the memory root ("" for the root itself; None: no memory controller, or no such
        process)."""
        if self.memory is None:
            return None
        for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
            _, controllers, path = line.split(":", 2)
            if (self.version == 1 and "memory" in controllers.split(",")) or (self.version == 2 and not controllers):
                return path.strip("/")
        return None

    def oom_kills(self, name: str) -> int | None:
        """How many processes the kernel has killed in group ``name`` for its memory limit (``oom_kill`` of v2's
        ``memory.events``, of v1's ``memory.oom_control``); None where the kernel does not say."""
        if self.memory is None:
            return None
        text = _read(self.memory / name / ("memory.oom_control" if self.version == 1 else "memory.events"))
        counts = dict(line.split(maxsplit=1) for line in text.splitlines() if " " in line)
        value = counts.get("oom_kill", "").strip()
        return int(value) if value.isdigit() else None

    def _enable_v2(self, cpuset: bool, memory: bool = False) -> None:
        """Let the unified root's children use the cpu (and cpuset, and memory) controllers."""
        wanted = ["cpu"] + (["cpuset"] if cpuset and self.cpuset is not None else [])
        wanted += ["memory"] if memory and self.memory is not None else []
        enabled = _read(self.cpu / "cgroup.subtree_control").split()
        for controller in wanted:
            if controller not in enabled:
                _write(self.cpu / "cgroup.subtree_control", f"+{controller}")

    def procs_files(self, name: str) -> list[Path]:
        """The files a process writes its pid into to join the group (every hierarchy it exists in)."""
        return [folder / "cgroup.procs" for folder in self.paths(name) if folder.is_dir()]

    def pids(self, name: str) -> set[int]:
        """The processes in the group, in any of its hierarchies."""
        found: set[int] = set()
        for procs in self.procs_files(name):
            found |= {int(p) for p in _read(procs).split() if p.isdigit()}
        return found

    def remove(self, name: str) -> list[Path]:
        """Remove the group's folders (they must hold no process); returns those still there."""
        left = []
        for folder in self.paths(name):
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue
            except OSError:
                left.append(folder)
        return left

    def throttled_s(self, name: str) -> float:
        """Seconds the group has been held back by its quota (its ``cpu.stat``)."""
        stat = dict(line.split(None, 1) for line in _read(self.cpu / name / "cpu.stat").splitlines() if " " in line)
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) / 1e6
        return int(stat.get("throttled_time", "0")) / 1e9


def mount_commands(mounts: Path = MOUNTS) -> list[str]:
    """Shell commands that mount again, read-only, the control-group filesystems mounted here under ``/sys/fs/cgroup``
    (a tmpfs holding v1's hierarchies, each hierarchy, v2's unified one): for a fresh ``/sys``, such as the one
    ``ip netns exec`` mounts, so that the processes there still see the groups they run in and their limits."""
    commands = []
    for line in _read(mounts).splitlines():
        fields = line.split()
        if len(fields) < 4 or not fields[1].startswith("/sys/fs/cgroup"):
            continue
        where, kind = shlex.quote(fields[1]), fields[2]
        own = [option for option in fields[3].split(",") if option not in MOUNT_FLAGS]
        if kind == "tmpfs":
            commands.append(f"mount -t tmpfs -o mode=755 cgroup {where}")
        elif kind in ("cgroup", "cgroup2"):
            options = shlex.quote(",".join(["ro", *own]))
            commands.append(f"mkdir -p {where} && mount -t {kind} -o {options} {kind} {where}")
    return commands


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    """Write a control file the way the kernel wants it: one write of the whole value."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
