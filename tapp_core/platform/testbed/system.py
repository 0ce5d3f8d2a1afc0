"""The testbed's dealings with the kernel and the system tools: what is missing, running ``ip``/``tc``/sshd, the
record of what was made, and ending processes.

Everything the testbed makes is recorded *before* it is made (``Record.add``), in its state folder, so that
``down`` finds it by name after a crash at any point, and removes that and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tapp_core.platform.testbed.cgroups import Cgroups
from tapp_core.platform.testbed.layout import TestbedError

RECORD_FILE = "testbed.json"
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/bin/sshd")


def sshd_path() -> str | None:
    found = shutil.which("sshd")
    return found or next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)


def missing() -> list[str]:
    """What this machine lacks for a testbed (empty: nothing), each as the words a user can act on."""
    lacks = []
    if os.geteuid() != 0:
        lacks.append(f"root (this is uid {os.geteuid()})")
    if not Path("/proc/self/ns/net").exists() or not (shutil.which("ip") and shutil.which("tc")):
        lacks.append("network namespaces with iproute2 (ip, tc)")
    if Cgroups.find() is None:
        lacks.append("a cpu cgroup controller (v1 cpu.cfs_quota_us or v2 cpu.max)")
    if sshd_path() is None or not (shutil.which("ssh") and shutil.which("ssh-keygen")):
        lacks.append("sshd and ssh (Debian: apt-get install openssh-server)")
    return lacks


def require() -> Cgroups:
    """This machine's cgroups; ``TestbedError`` naming everything missing otherwise."""
    lacks = missing()
    if lacks:
        raise TestbedError(
            "a testbed needs root, network namespaces, CPU cgroups and sshd; missing here: " + "; ".join(lacks)
        )
    cgroups = Cgroups.find()
    assert cgroups is not None  # missing() said it is there
    return cgroups


def run(*command: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a system tool; ``TestbedError`` with its own words when ``check`` and it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"`{' '.join(command)}` failed: {exc}") from None
    if check and done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split()) or f"status {done.returncode}"
        raise TestbedError(f"`{' '.join(command)}` failed: {said}")
    return done


def in_namespace(namespace: str, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run("ip", "netns", "exec", namespace, *command, check=check)


def namespaces() -> set[str]:
    return {line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()}


def link_exists(name: str) -> bool:
    return run("ip", "link", "show", "dev", name, check=False).returncode == 0


def namespace_pids(namespace: str) -> set[int]:
    if namespace not in namespaces():
        return set()
    return {int(p) for p in run("ip", "netns", "pids", namespace, check=False).stdout.split() if p.isdigit()}


def routes_overlapping(network: str, prefix_length: int) -> list[str]:
    """This machine's IPv4 addresses and routes that overlap the subnet (a testbed there would take them over)."""
    import ipaddress

    subnet = ipaddress.IPv4Network(f"{network}/{prefix_length}")
    found = []
    for line in run("ip", "-4", "-o", "route", "show", "table", "all", check=False).stdout.splitlines():
        target = line.split()[0] if line.split() else ""
        if target in {"default", "local", "broadcast", "unreachable"}:
            target = line.split()[1] if len(line.split()) > 1 else ""
        try:
            if target and ipaddress.IPv4Network(target, strict=False).overlaps(subnet):
                found.append(line.strip())
        except ValueError:
            continue
    return found


def port_open(address: str, port: int = 22) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(address: str, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(address):
            return True
        time.sleep(0.1)
    return False


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def end_processes(pids: Iterable[int], grace_s: float = 3.0) -> set[int]:
    """SIGTERM, then SIGKILL after ``grace_s``, to every process of ``pids`` still there (never this one); returns
    those signalled."""
    targets = {p for p in pids if p != os.getpid() and Path(f"/proc/{p}").exists()}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in targets):
            time.sleep(0.05)
        if not any(_alive(p) for p in targets):
            break
    return targets


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: it only waits for its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


class Record:
    """The state folder's list of what the testbed made, in order, written before each thing is made."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / RECORD_FILE
        self.data: dict[str, object] = {"made": []}

    @classmethod
    def read(cls, folder: Path) -> Record | None:
        record = cls(folder)
        try:
            record.data = json.loads(record.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise TestbedError(f"the testbed's record {record.path} cannot be read: {exc}") from None
        return record

    @property
    def made(self) -> list[dict[str, object]]:
        made = self.data.setdefault("made", [])
        assert isinstance(made, list)
        return made

    def of_kind(self, kind: str) -> list[dict[str, object]]:
        return [entry for entry in self.made if entry.get("kind") == kind]

    def set(self, **fields: object) -> None:
        self.data.update(fields)
        self.save()

    def add(self, kind: str, **fields: object) -> None:
        self.made.append({"kind": kind, **fields})
        self.save()

    def save(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=2))
        temporary.replace(self.path)


def names(entries: Sequence[dict[str, object]], key: str = "name") -> list[str]:
    return [str(entry[key]) for entry in entries if key in entry]
