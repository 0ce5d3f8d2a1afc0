"""Where a worker pool's failure happened: the rank that Hydra saw end first, and the hosts that no longer answer.

A failure reaches the pool as a closed link, an mpiexec that exited, or a job without an answer; none of these
says where. After one, the pool asks its witnesses and puts what they say in the failed measurement's error:

- the pool's own watch of its ranks on this machine (``rank_watch``): the one it saw end alone, first;
- Hydra's report of the first rank that ended badly (``BAD TERMINATION ... PID p RUNNING AT h``, then its exit
  code or signal), matched to the pool's ranks by pid and host;
- every host of the pool other than this one, asked over ssh (the cluster's command) whether it still answers,
  all at once and for a few seconds at most: a host behind a dead link, or without its sshd, does not.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tapp_core.platform.cluster import Cluster
from tapp_core.platform.hosts import is_local_host
from tapp_core.runtime.jobs import RankInfo
from tapp_core.runtime.oom_watch import OutOfMemory

ANSWER_TIMEOUT_S = 8.0
_BAD_END = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*(EXIT CODE: \d+|KILLED BY SIGNAL: [^\n=]+?)\s*\n")


def rank_name(cluster: Cluster, devices: Sequence[str], rank: int) -> str:
    """``rank 2 (cpu2 on host 10.213.0.12)``: a rank by its device and, where the cluster gives one, its host."""
    device = cluster.device(devices[rank])
    return f"rank {rank} ({device.name}{f' on host {device.host}' if device.host else ''})"


def first_ended(log: str, ranks: Sequence[RankInfo], cluster: Cluster, devices: Sequence[str]) -> str | None:
    """The rank Hydra reported ending first, from the workers' ``log``; None when it reported none."""
    return _first_ended(log, ranks, cluster, devices)[0]


def _first_ended(
    log: str, ranks: Sequence[RankInfo], cluster: Cluster, devices: Sequence[str]
) -> tuple[str | None, str | None]:
    """``first_ended``'s line, and the device of that rank where it is one of the pool's. A rank killed by a signal
    is preferred to one that exited: a rank whose peer was killed exits with an error of its own, and Hydra may
    report it first."""
    reports = list(_BAD_END.finditer(log))
    if not reports:
        return None, None
    found = next((r for r in reports if r.group(3).upper().startswith("KILLED")), reports[0])
    pid, host, how = int(found.group(1)), found.group(2), found.group(3).strip().lower()
    for index, info in enumerate(ranks):
        device = cluster.device(devices[index])
        if info.pid == pid and (device.host == host or device.host is None):
            return f"{rank_name(cluster, devices, index)} ended first ({how})", device.name
    return f"the rank with pid {pid} on host {host} ended first ({how})", None


def unanswering(cluster: Cluster, devices: Sequence[str], timeout_s: float = ANSWER_TIMEOUT_S) -> list[str]:
    """The pool's hosts (other than this one) that do not answer over ssh within ``timeout_s``, each with its
    devices and what ssh said."""
    return [line for line, _ in _unanswering(cluster, devices, timeout_s)]


def _unanswering(cluster: Cluster, devices: Sequence[str], timeout_s: float) -> list[tuple[str, list[str]]]:
    """``unanswering``'s lines, each with the devices of its host."""
    hosts: dict[str, list[str]] = {}
    for name in devices:
        host = cluster.device(name).host
        if host is not None and not is_local_host(host):
            hosts.setdefault(host, []).append(name)
    ssh = [cluster.ssh or "ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout_s) - 2)}"]
    asked = {
        host: subprocess.Popen(
            [*ssh, host, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for host in hosts
    }
    deadline = time.monotonic() + timeout_s
    silent = []
    for host, process in asked.items():
        try:
            _, said = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            said = f"no answer within {timeout_s:.0f} s"
        if process.returncode != 0:
            reason = " ".join(said.split()) or f"ssh exited with status {process.returncode}"
            silent.append((f"host {host} ({', '.join(hosts[host])}) does not answer over ssh: {reason}", hosts[host]))
    return silent


@dataclass(frozen=True)
class Fault:
    """What the witnesses of a failure said: ``report``, lines to add to an error ("" when they said nothing), and
    ``devices``, the pool's devices they named: the rank that ended first, and every device of a host that does
    not answer."""

    report: str = ""
    devices: tuple[str, ...] = ()
    out_of_memory: tuple[str, ...] = ()
    """The devices whose ranks the kernel killed for memory (``oom_watch``)."""
    noticed_at: float = 0.0
    """When the pool noticed the failure (``time.monotonic``), before asking the witnesses."""


def witness(
    log: str,
    ranks: Sequence[RankInfo],
    cluster: Cluster,
    devices: Sequence[str],
    seen_first: int | None = None,
    out_of_memory: Sequence[OutOfMemory] = (),
) -> Fault:
    """Ask the witnesses (the module's doc) about a failure of the pool of ``devices``. ``seen_first``, the rank
    the pool saw end alone before the others (``rank_watch``), is believed before Hydra's report;
    ``out_of_memory``, the memory groups whose OOM-kill count rose (``oom_watch``), is said first."""
    if seen_first is not None:
        line: str | None = f"{rank_name(cluster, devices, seen_first)} ended first (seen ending by the pool)"
        device: str | None = devices[seen_first]
    else:
        line, device = _first_ended(log, ranks, cluster, devices)
    killed = [_killed_for_memory(group, cluster, devices, device) for group in out_of_memory]
    lines = [said for said, _ in killed] + ([line] if line is not None else [])
    named = [device] if device is not None else []
    for silent, held in _unanswering(cluster, devices, ANSWER_TIMEOUT_S):
        lines.append(silent)
        named += held
    oom = tuple(dict.fromkeys(name for _, names in killed for name in names))
    return Fault("".join(f"\n{line}" for line in lines), tuple(dict.fromkeys(named)), oom)


def _killed_for_memory(
    group: OutOfMemory, cluster: Cluster, devices: Sequence[str], first: str | None
) -> tuple[str, list[str]]:
    """The line naming the device(s) of a memory group the kernel killed in: the rank that ended first where it
    is one of the group's, else every rank of the group."""
    ranks = [r for r in group.ranks if devices[r] == first] or list(group.ranks)
    names = [devices[r] for r in ranks]
    limit = f"its memory limit of {group.limit_bytes / 2**30:.3g} GiB" if group.limit_bytes else "the machine's memory"
    which = ", ".join(repr(n) for n in names)
    ranked = ", ".join(rank_name(cluster, devices, r) for r in ranks)
    return f"out of memory on device {which} ({ranked}): the kernel killed it at {limit}", names


def where(
    log: str, ranks: Sequence[RankInfo], cluster: Cluster, devices: Sequence[str], seen_first: int | None = None
) -> str:
    """What the witnesses say, as lines to add to an error ("" when they say nothing)."""
    return witness(log, ranks, cluster, devices, seen_first).report
