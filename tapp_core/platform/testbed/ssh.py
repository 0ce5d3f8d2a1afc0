"""The testbed's ssh: a key pair and a host key made for it, an sshd per host, and the client command Hydra uses.

Each host's sshd listens on the host's address only, takes the testbed's key only (no passwords, no PAM), and
gives every session the host's environment (``SetEnv``):

- ``UCX_TLS=tcp,self``: MPICH's UCX finds that the other ranks run on the same kernel and would move their data
  through shared memory, around the shaped links; machines apart use the network, and so do the testbed's hosts;
- ``TAPP_PIN_RANKS=0`` where the host has no cores of its own: pinned to "their" first cores, the ranks of all
  hosts would crowd onto the same ones.

The client (``SshFiles.wrapper``, the cluster file's ``ssh``) is ``ssh -F`` a configuration that names the key and
the hosts' keys (``StrictHostKeyChecking yes``): it connects to the testbed's hosts and nowhere else. Dead links are
noticed within seconds on both sides (``ServerAliveInterval``, ``ClientAliveInterval``), so that a session over a
link taken down ends and takes its processes with it.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tapp_core.platform.testbed import system
from tapp_core.platform.testbed.cgroups import Cgroups, mount_commands
from tapp_core.platform.testbed.layout import TestbedError, TestbedHost

ALIVE_INTERVAL_S = 2
ALIVE_COUNT = 3
START_ATTEMPTS = 3


@dataclass(frozen=True)
class SshFiles:
    folder: Path

    @property
    def key(self) -> Path:
        return self.folder / "id_ed25519"

    @property
    def host_key(self) -> Path:
        return self.folder / "host_ed25519"

    @property
    def wrapper(self) -> Path:
        """The command Hydra's ssh launcher runs: ssh with the testbed's configuration."""
        return self.folder / "ssh"

    @property
    def config(self) -> Path:
        return self.folder / "ssh_config"

    @classmethod
    def make(cls, folder: Path, addresses: list[str]) -> SshFiles:
        """Keys, authorised keys, known hosts, the client configuration and its wrapper, in ``folder``."""
        files = cls(folder)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for key in (files.key, files.host_key):
            system.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"tapp-testbed {folder}", "-f", str(key))
        (folder / "authorized_keys").write_text(files.key.with_suffix(".pub").read_text())
        host_public = files.host_key.with_suffix(".pub").read_text().split()[:2]
        (folder / "known_hosts").write_text("".join(f"{a} {' '.join(host_public)}\n" for a in addresses))
        files.config.write_text(
            "Host *\n"
            "  User root\n"
            f"  IdentityFile {files.key}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {folder / 'known_hosts'}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n"
            "  LogLevel ERROR\n"
            "  ConnectTimeout 5\n"
            f"  ServerAliveInterval {ALIVE_INTERVAL_S}\n"
            f"  ServerAliveCountMax {ALIVE_COUNT}\n"
        )
        files.wrapper.write_text(f'#!/bin/sh\nexec ssh -F "{files.config}" "$@"\n')
        files.wrapper.chmod(0o755)
        return files

    def sshd_config(self, host: TestbedHost) -> Path:
        """Write host ``host``'s sshd configuration; returns its path."""
        environment = "UCX_TLS=tcp,self" + ("" if host.cores else " TAPP_PIN_RANKS=0")
        path = self.folder / f"sshd-{host.name}.conf"
        path.write_text(
            f"ListenAddress {host.address}:22\n"
            f"HostKey {self.host_key}\n"
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}\n"
            f"PidFile {self.folder / f'sshd-{host.name}.pid'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "X11Forwarding no\n"
            "PrintMotd no\n"
            "MaxStartups 64:30:128\n"
            f"ClientAliveInterval {ALIVE_INTERVAL_S}\n"
            f"ClientAliveCountMax {ALIVE_COUNT}\n"
            f"SetEnv {environment}\n"
        )
        return path

    def command(self, address: str, *remote: str) -> list[str]:
        """The command line that runs ``remote`` on the host at ``address``."""
        return [str(self.wrapper), address, *remote]

    def check_hosts(self, addresses: list[str]) -> None:
        """Every host answers over ssh with the testbed's key; ``TestbedError`` naming the first that does not."""
        for address in addresses:
            try:
                done = subprocess.run(self.command(address, "true"), capture_output=True, text=True, timeout=20)
            except subprocess.TimeoutExpired:
                raise TestbedError(f"testbed host {address} did not answer over ssh within 20 s") from None
            if done.returncode != 0:
                said = " ".join(done.stderr.split()) or f"status {done.returncode}"
                raise TestbedError(f"testbed host {address} refused ssh: {said}")


def start_sshd(files: SshFiles, host: TestbedHost, cgroups: Cgroups, record: system.Record) -> None:
    """Start ``host``'s sshd inside its namespace and control group (everything it starts stays in both)."""
    privilege_separation = Path("/run/sshd")  # the folder Debian's sshd insists on
    if not privilege_separation.is_dir():
        record.add("folder", path=str(privilege_separation))
        privilege_separation.mkdir(mode=0o755)
    config = files.sshd_config(host)
    pid = launch_sshd(config, host.namespace, cgroups.procs_files(host.cgroup), host.address)
    record.add(
        "sshd",
        host=host.name,
        pid=pid,
        config=str(config),
        namespace=host.namespace,
        cgroup=host.cgroup,
        address=host.address,
    )


def _read_pid(pid_file: Path, wait_s: float = 5.0) -> int | None:
    """The pid sshd writes to ``pid_file``: it may answer on its port a moment before it has written it."""
    deadline = time.monotonic() + wait_s
    while True:
        words = pid_file.read_text().split() if pid_file.exists() else []
        if words:
            return int(words[0])
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def launch_sshd(config: Path, namespace: str, procs: list[Path], address: str) -> int:
    """Run sshd with ``config`` in ``namespace``, its process first written into the control groups' ``procs``
    files; its pid once it answers on ``address``."""
    sshd = system.sshd_path()
    assert sshd is not None  # system.require checked it
    # `ip netns exec` mounts a /sys of its own, which MPI's transports read the namespace's interfaces from, but
    # without the control groups: they are mounted again there, so that a rank sees the memory limit it runs under.
    join = (
        'for procs; do echo $$ > "$procs" || exit 1; done; '
        'exec ip netns exec "$NS" sh -c \'eval "$MOUNT_CGROUPS"; exec "$SSHD" -f "$CONF" -E "$LOG"\''
    )
    log = config.with_suffix(".log")
    mounts = "".join(f"{{ {command}; }} 2>/dev/null; " for command in mount_commands())
    environment = {
        **os.environ,
        "NS": namespace,
        "SSHD": sshd,
        "CONF": str(config),
        "LOG": str(log),
        "MOUNT_CGROUPS": mounts,
    }
    for attempt in range(START_ATTEMPTS):  # an sshd just killed may hold its address for a moment
        started = subprocess.run(
            ["sh", "-c", join, "sh", *map(str, procs)], env=environment, capture_output=True, text=True, timeout=30
        )
        if started.returncode == 0 and system.wait_for_port(address):
            pid = _read_pid(config.with_suffix(".pid"))
            if pid is not None:
                return pid
        if attempt + 1 < START_ATTEMPTS:
            time.sleep(1.0)
    said = " ".join((started.stderr + _tail(log)).split())
    raise TestbedError(f"the sshd of testbed host {address} did not start: {said or 'no answer on port 22'}")


def _tail(path: Path) -> str:
    try:
        return " ".join(path.read_text().splitlines()[-3:])
    except OSError:
        return ""
