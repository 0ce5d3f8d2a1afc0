"""``up`` makes a testbed from a cluster file and writes its real cluster file; ``down`` removes it.

``up``, in order, each thing recorded before it is made (``system.Record``): the state folder with the testbed's
ssh keys and client configuration; the bridge; per host its namespace, veth pair, addresses, shaping, control
group and sshd; then it checks that every host answers over ssh and writes the cluster file. A failure at any step
takes down what was made and raises ``TestbedError``. ``down`` ends every process of every host (those in its
control group or its namespace: sshd, sessions, Hydra's proxies, ranks, servers) and removes the namespaces, links,
groups and the state folder: each only if recorded, each step harmless when its object is already gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import yaml

from tapp_core.platform.cluster import Cluster, load_cluster
from tapp_core.platform.testbed import ssh, system
from tapp_core.platform.testbed.cgroups import Cgroups
from tapp_core.platform.testbed.layout import (
    DEFAULT_PREFIX,
    DEFAULT_SUBNET,
    TestbedError,
    TestbedHost,
    TestbedLayout,
    plan_testbed,
    real_cluster,
)
from tapp_core.platform.testbed.shaping import netem_available, shape_host
from tapp_core.platform.testbed.ssh import SshFiles, start_sshd

STATE_ROOT_VARIABLE = "TAPP_TESTBED_STATE"
"""Where testbeds keep their state folders (default ``/run/tapp-testbed``: gone at reboot, like the testbed)."""

Log = Callable[[str], None]


def state_folder(prefix: str = DEFAULT_PREFIX, state: Path | None = None) -> Path:
    """The state folder of testbed ``prefix``: ``state`` if given, else ``$TAPP_TESTBED_STATE/PREFIX``."""
    return state if state is not None else Path(os.environ.get(STATE_ROOT_VARIABLE, "/run/tapp-testbed")) / prefix


def up(
    cluster_file: str | os.PathLike[str],
    out: Path,
    *,
    prefix: str = DEFAULT_PREFIX,
    subnet: str = DEFAULT_SUBNET,
    cores: list[int] | None = None,
    state: Path | None = None,
    service_hosts: Sequence[str] = (),
    log: Log = lambda line: None,
) -> Cluster:
    """Make the testbed of ``cluster_file`` (and hosts ``service_hosts`` without devices), write its real cluster
    file to ``out`` and return it as read back."""
    cgroups = system.require()
    cluster = load_cluster(cluster_file)
    available = cores if cores is not None else sorted(os.sched_getaffinity(0))
    layout = plan_testbed(cluster, available, subnet, prefix, service_hosts)
    folder = state_folder(prefix, state)
    _check_free(layout, folder)
    record = system.Record(folder)
    hosts = [{"name": h.name, "address": h.address, "namespace": h.namespace} for h in layout.hosts]
    record.set(prefix=prefix, cgroups={"version": cgroups.version, "cpu": str(cgroups.cpu)}, hosts=hosts)
    try:
        keys = SshFiles.make(folder, [h.address for h in layout.hosts])
        _make_network(layout, record)
        latency = netem_available(layout.hosts[0].namespace)
        for host in layout.hosts:
            shape_host(layout, host, latency)
            _make_group(cgroups, layout, host, record)
            start_sshd(keys, host, cgroups, record)
        keys.check_hosts([h.address for h in layout.hosts])
        data = real_cluster(cluster, layout, str(keys.wrapper))
        _write_cluster(out, data, _header(cluster_file, layout, folder, latency))
    except BaseException:
        down(prefix, folder)
        raise
    for line in describe(layout, latency):
        log(line)
    return load_cluster(out)


def _check_free(layout: TestbedLayout, folder: Path) -> None:
    """Refuse a testbed whose name, state folder or subnet is taken here."""
    if system.Record.read(folder) is not None:
        raise TestbedError(
            f"a testbed named {layout.prefix!r} is up (its state is in {folder}); take it down first: "
            f"tapp testbed down --name {layout.prefix}"
        )
    taken = [h.namespace for h in layout.hosts if h.namespace in system.namespaces()]
    taken += [n for n in (layout.bridge, *(h.host_link for h in layout.hosts)) if system.link_exists(n)]
    if taken:
        raise TestbedError(f"testbed {layout.prefix!r}: {', '.join(taken)} already exist here; choose another --name")
    overlapping = system.routes_overlapping(layout.network, layout.prefix_length)
    if overlapping:
        raise TestbedError(
            f"subnet {layout.network}/{layout.prefix_length} is in use here ({overlapping[0]}); choose another --subnet"
        )


def _make_network(layout: TestbedLayout, record: system.Record) -> None:
    """The bridge on the subnet's first address, and per host its namespace and veth pair."""
    bridge = layout.bridge
    record.add("link", name=bridge)
    system.run("ip", "link", "add", bridge, "type", "bridge")
    system.run("ip", "addr", "add", f"{layout.bridge_address}/{layout.prefix_length}", "dev", bridge)
    system.run("ip", "link", "set", bridge, "up")
    for host in layout.hosts:
        record.add("netns", name=host.namespace)
        system.run("ip", "netns", "add", host.namespace)
        record.add("link", name=host.host_link)
        system.run("ip", "link", "add", host.host_link, "type", "veth", "peer", "name", host.link)
        system.run("ip", "link", "set", host.link, "netns", host.namespace)
        system.run("ip", "link", "set", host.host_link, "master", bridge, "up")
        inside = ("ip", "-n", host.namespace)
        system.run(*inside, "addr", "add", f"{host.address}/{layout.prefix_length}", "dev", host.link)
        system.run(*inside, "link", "set", host.link, "up")
        system.run(*inside, "link", "set", "lo", "up")


def _make_group(cgroups: Cgroups, layout: TestbedLayout, host: TestbedHost, record: system.Record) -> None:
    record.add("cgroup", name=host.cgroup, paths=[str(p) for p in cgroups.paths(host.cgroup)])
    try:
        cgroups.make(host.cgroup, layout.quota_us(host), layout.period_us, host.cores, host.memory_bytes)
    except OSError as exc:
        raise TestbedError(f"cannot make control group {host.cgroup} for host {host.name}: {exc}") from None


def _write_cluster(out: Path, data: dict[str, object], header: str) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
    except OSError as exc:
        raise TestbedError(f"cannot write the testbed's cluster file {out}: {exc.strerror or exc}") from None


def describe(layout: TestbedLayout, latency: bool) -> list[str]:
    """One line per host and per shaped pair, then the notes."""
    lines = []
    for host in layout.hosts:
        cores = f"cores {','.join(map(str, host.cores))}" if host.cores else "cores shared"
        quota = f"quota {host.quota_cpus:.3f} CPU per {layout.period_us / 1000:g} ms period, {cores}"
        if host.memory_bytes is not None:
            quota += f", memory limit {host.memory_bytes / 2**30:g} GiB"
        what = f"({', '.join(host.devices)})" if host.devices else "(service host, no devices)"
        lines.append(
            f"host {host.name} {what}: {host.address}, namespace {host.namespace}"
            + (f", {quota}" if host.devices else ", no quota")
        )
    for shaping in layout.shaping:
        if shaping.source < shaping.target:
            a, b = layout.hosts[shaping.source], layout.hosts[shaping.target]
            lines.append(f"link {a.name} <-> {b.name}: {shaping.bytes_per_s * 8 / 1e6:g} Mbit/s each way")
    if not latency:
        lines.append("latency is not shaped: this kernel has no netem (links keep the veth's own, tens of us)")
    return lines + list(layout.notes)


def _header(cluster_file: str | os.PathLike[str], layout: TestbedLayout, folder: Path, latency: bool) -> str:
    lines = [
        f"Written by `tapp testbed up --cluster {cluster_file}` at {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: each "
        f"host is a network namespace on bridge {layout.bridge} ({layout.bridge_address}/{layout.prefix_length}) "
        f"with its own sshd; ranks start there through Hydra's ssh launcher. State: {folder}.",
        *describe(layout, latency),
        f"Take it down with `tapp testbed down --name {layout.prefix}`.",
    ]
    return "".join(f"# {line}\n" for line in lines)


def down(prefix: str = DEFAULT_PREFIX, state: Path | None = None, log: Log = lambda line: None) -> bool:
    """Remove testbed ``prefix`` (whatever its record names); False when there was none."""
    cgroups = system.require()
    folder = state_folder(prefix, state)
    record = system.Record.read(folder)
    if record is None:
        return False
    groups = system.names(record.of_kind("cgroup"))
    spaces = system.names(record.of_kind("netns"))
    for _ in range(5):  # processes that fork while being ended are caught by the next pass
        pids = set().union(*(cgroups.pids(g) for g in groups), *(system.namespace_pids(n) for n in spaces))
        pids |= {int(str(e["pid"])) for e in record.of_kind("sshd") if _is_our_sshd(e)}
        if not pids:
            break
        log(f"ending {len(pids)} process(es) of testbed {prefix}")
        system.end_processes(pids)
    for namespace in spaces:
        if namespace in system.namespaces():
            system.run("ip", "netns", "delete", namespace)
    for link in reversed(system.names(record.of_kind("link"))):
        _delete_link(link)
    _remove_groups(cgroups, groups)
    for entry in record.of_kind("folder"):
        with contextlib.suppress(OSError):
            Path(str(entry["path"])).rmdir()  # only if empty: nothing else uses it
    shutil.rmtree(folder, ignore_errors=True)
    if state is None:
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the testbeds' folder, once the last is down
    log(f"testbed {prefix} is down")
    return True


def _delete_link(link: str) -> None:
    """Delete ``link`` if it is there. A veth whose peer's namespace was just deleted vanishes on its own, a moment
    later: its deletion failing because it is gone is success."""
    if not system.link_exists(link):
        return
    try:
        system.run("ip", "link", "delete", link)
    except TestbedError:
        if system.link_exists(link):
            raise


def host_addresses(prefix: str = DEFAULT_PREFIX, state: Path | None = None) -> dict[str, str]:
    """Each host of testbed ``prefix`` by name: its address (empty when the testbed is not up)."""
    record = system.Record.read(state_folder(prefix, state))
    hosts = record.data.get("hosts", []) if record is not None else []
    assert isinstance(hosts, list)
    return {str(h["name"]): str(h["address"]) for h in hosts}


def restart_sshd(host: str, prefix: str = DEFAULT_PREFIX, state: Path | None = None) -> int:
    """Start the sshd of testbed host ``host`` again (one that was killed); returns its pid."""
    cgroups = system.require()
    folder = state_folder(prefix, state)
    record = system.Record.read(folder)
    entries = [e for e in (record.of_kind("sshd") if record else []) if e.get("host") == host]
    if record is None or not entries:
        raise TestbedError(f"testbed {prefix!r} has no host {host!r}")
    entry = entries[-1]
    if _is_our_sshd(entry):
        return int(str(entry["pid"]))
    config, address = Path(str(entry["config"])), str(entry["address"])
    pid = ssh.launch_sshd(config, str(entry["namespace"]), cgroups.procs_files(str(entry["cgroup"])), address)
    record.add("sshd", **{key: value for key, value in entry.items() if key != "kind"} | {"pid": pid})
    return pid


def _is_our_sshd(entry: dict[str, object]) -> bool:
    """Whether the recorded sshd still runs (its pid's command names its own configuration)."""
    return str(entry.get("config", "\0")) in system.command_line(int(str(entry["pid"])))


def _remove_groups(cgroups: Cgroups, groups: list[str]) -> None:
    """Remove the groups, waiting a moment for ended processes to leave them."""
    deadline = time.monotonic() + 5.0
    left = groups
    while left:
        left = [g for g in left if cgroups.remove(g)]
        if not left:
            return
        if time.monotonic() > deadline:
            raise TestbedError(f"control group(s) {', '.join(left)} still hold processes; run down again")
        time.sleep(0.1)
