"""What a testbed is made of, worked out from a cluster file before anything is made (no side effects).

- **Hosts.** Devices that name the same ``host`` share one testbed host; a device without a host is a host of its
  own, named after the device. Host ``i`` is the network namespace ``PREFIX-NAME``, reached at the subnet's
  address ``FIRST_HOST + i`` through a veth pair (``PREFIXhI`` on the bridge ``PREFIXbr``, ``PREFIXnI`` in the
  namespace); the bridge holds the subnet's first address, where the hosts reach this machine (the pool, mpiexec).
- **CPU.** A device's share of a core is its ``speed`` against the fastest device's, times its ``threads``. The
  shares of all hosts are scaled down together until they fit the cores given (default: the cores this process
  may use), so that the hosts do not slow each other as separate machines would not; the ratios between devices
  stay as the file says. A host's quota is the sum of its devices' shares, enforced over a short period
  (``PERIOD_US``): the kernel lets a group run its quota at full speed and then stops it until the period ends, so a
  short period makes the limit act like a slower processor rather than like pauses. Where every host's threads
  fit the cores, each host also gets cores of its own (a cpuset). The written cluster file gives each device the
  ``speed`` it then has against a full core of this machine.
- **Links.** The bandwidth between two hosts is the file's link between their devices (the lowest, where several
  pairs differ), shaped on the sending host's side, one class per peer; links at or above ``UNSHAPED_BPS`` are left
  to the veth. Traffic to this machine (rank 0 to the pool) is not shaped. Latency needs netem, which not every
  kernel has: where it is missing the links keep the veth's own latency, and the testbed says so.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from tapp_core.errors import TappError
from tapp_core.platform.cluster import Cluster, Device

DEFAULT_PREFIX = "tapptb"
DEFAULT_SUBNET = "10.213.0.0/24"
FIRST_HOST = 10
"""Host i's address is the subnet's ``FIRST_HOST + i``; the bridge is its first address."""
PERIOD_US = 10_000
"""The quota's period: with 100 ms (the kernel's default), a half-speed group computing half of the time ran at full
speed; with 10 ms, work longer than a few periods runs at its quota (a 100 ms op took 1.95x at half quota)."""
MIN_QUOTA_US = 1_000
"""The kernel's smallest quota per period."""
UNSHAPED_BPS = 1.25e9
"""Links of 10 Gbit/s or more are not shaped: the veth itself carries about that between two namespaces."""
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class TestbedError(TappError):
    """A testbed that cannot be made or taken down here; the message names what is missing or wrong."""


@dataclass(frozen=True)
class TestbedHost:
    """One host of the testbed: a network namespace, its veth pair, its CPU quota and its sshd."""

    name: str
    index: int
    address: str
    devices: tuple[str, ...]
    quota_cpus: float
    """Its share of this machine's cores; 0 for a service host (no devices, no quota)."""
    cores: tuple[int, ...] | None
    """Cores of its own, or None when the hosts share this machine's cores."""
    prefix: str
    memory_bytes: int | None = None
    """The kernel's limit on its memory: its devices' ``memory`` together; None for a service host."""

    @property
    def namespace(self) -> str:
        return f"{self.prefix}-{self.name}"

    @property
    def cgroup(self) -> str:
        return f"{self.prefix}-{self.name}"

    @property
    def host_link(self) -> str:
        """The veth end on the bridge, in this machine's namespace."""
        return f"{self.prefix}h{self.index}"

    @property
    def link(self) -> str:
        """The veth end inside the host's namespace."""
        return f"{self.prefix}n{self.index}"


@dataclass(frozen=True)
class Shaping:
    """What leaves ``source`` for ``target`` (host indices) is limited to ``bytes_per_s`` (and delayed by
    ``latency_s`` where netem is available)."""

    source: int
    target: int
    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class TestbedLayout:
    prefix: str
    network: str
    bridge_address: str
    prefix_length: int
    hosts: tuple[TestbedHost, ...]
    shaping: tuple[Shaping, ...]
    period_us: int
    scale: float
    """How much every CPU share was scaled down to fit the cores (1: not at all)."""
    cores: int
    speeds: dict[str, float]
    """Each device's speed against a full core of this machine, as the written cluster file gives it."""
    notes: tuple[str, ...]

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def host_of(self, device: str) -> TestbedHost:
        for host in self.hosts:
            if device in host.devices:
                return host
        raise KeyError(device)

    def quota_us(self, host: TestbedHost) -> int | None:
        """The host's quota per period; None for a service host."""
        if not host.devices:
            return None
        return max(MIN_QUOTA_US, round(host.quota_cpus * self.period_us))


def check_prefix(prefix: str) -> str:
    """``prefix`` when it names interfaces within the kernel's 15 characters: a lowercase letter, then at most 7
    lowercase letters or digits."""
    if not _PREFIX.match(prefix):
        raise TestbedError(f"testbed name {prefix!r} must be a lowercase letter and at most 7 letters or digits")
    return prefix


def check_subnet(subnet: str, hosts: int) -> ipaddress.IPv4Network:
    """A private IPv4 subnet with room for the bridge and ``hosts`` hosts."""
    try:
        network = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError as exc:
        raise TestbedError(f"testbed subnet {subnet!r} is not an IPv4 network: {exc}") from None
    if not network.is_private or network.is_loopback:
        raise TestbedError(f"testbed subnet {subnet} is not a private range (10/8, 172.16/12, 192.168/16)")
    if network.num_addresses < FIRST_HOST + hosts + 2:
        raise TestbedError(f"testbed subnet {subnet} has no room for {hosts} hosts; give a larger one")
    return network


def host_groups(cluster: Cluster) -> list[tuple[str, list[Device]]]:
    """The testbed's hosts in order of their first device: devices naming one host together, every other device a
    host of its own named after it."""
    groups: dict[str, list[Device]] = {}
    for device in cluster.devices:
        groups.setdefault(_host_name(device.host or device.name), []).append(device)
    return list(groups.items())


def _host_name(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", name).strip(".-") or "host"
    return cleaned[:40]


def plan_testbed(
    cluster: Cluster,
    cores: list[int],
    subnet: str = DEFAULT_SUBNET,
    prefix: str = DEFAULT_PREFIX,
    service_hosts: Sequence[str] = (),
) -> TestbedLayout:
    """The testbed of ``cluster`` on ``cores`` (the cores its hosts may use), in ``subnet``, its objects named
    ``prefix...``; ``service_hosts`` are hosts without devices (servers: MLflow, Prefect), without quota, after
    the devices' hosts."""
    if not cores:
        raise TestbedError("a testbed needs at least one core")
    if any(d.kind != "cpu" for d in cluster.devices):
        gpus = ", ".join(d.name for d in cluster.devices if d.kind != "cpu")
        raise TestbedError(f"a testbed makes CPU hosts only; cluster {cluster.name!r} has GPU device(s) {gpus}")
    groups = host_groups(cluster)
    services = [_host_name(name) for name in service_hosts]
    names = [name for name, _ in groups] + services
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise TestbedError(f"testbed host name(s) {', '.join(repeated)} given twice")
    network = check_subnet(subnet, len(groups) + len(services))
    fastest = max(d.speed for d in cluster.devices)
    share = {d.name: d.threads * d.speed / fastest for d in cluster.devices}
    scale = min(1.0, len(cores) / sum(share.values()))
    threads = [sum(d.threads for d in devices) for _, devices in groups]
    own_cores = sum(threads) <= len(cores)
    hosts = []
    for index, (name, devices) in enumerate(groups):
        start = sum(threads[:index])
        hosts.append(
            TestbedHost(
                name=name,
                index=index,
                address=str(network[FIRST_HOST + index]),
                devices=tuple(d.name for d in devices),
                quota_cpus=sum(share[d.name] for d in devices) * scale,
                cores=tuple(sorted(cores)[start : start + threads[index]]) if own_cores else None,
                prefix=check_prefix(prefix),
                memory_bytes=sum(d.memory for d in devices),
            )
        )
    smallest = min(h.quota_cpus for h in hosts)
    period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / smallest))
    shaping, notes = _shaping(cluster, hosts)
    for name in services:
        index = len(hosts)
        address = str(network[FIRST_HOST + index])
        hosts.append(TestbedHost(name, index, address, (), 0.0, None, check_prefix(prefix)))
    if scale < 1:
        notes.append(
            f"the devices' CPU shares add up to {sum(share.values()):.2f} cores, more than the {len(cores)} given: "
            f"every share is scaled by {scale:.3f} (the speeds written are against a full core)"
        )
    return TestbedLayout(
        prefix=prefix,
        network=str(network.network_address),
        bridge_address=str(network[1]),
        prefix_length=network.prefixlen,
        hosts=tuple(hosts),
        shaping=tuple(shaping),
        period_us=period,
        scale=scale,
        cores=len(cores),
        speeds={d.name: d.speed / fastest * scale for d in cluster.devices},
        notes=tuple(notes),
    )


def _shaping(cluster: Cluster, hosts: list[TestbedHost]) -> tuple[list[Shaping], list[str]]:
    """Both directions of every pair of hosts, and what could not be shaped as the file says."""
    shaping, notes = [], []
    for a, b in combinations(hosts, 2):
        links = [cluster.link(x, y) for x in a.devices for y in b.devices]
        slowest = min(links, key=lambda link: link.bandwidth)
        if len({(link.bandwidth, link.latency) for link in links}) > 1:
            notes.append(f"hosts {a.name} and {b.name}: their devices' links differ; the slowest is shaped")
        if slowest.bandwidth >= UNSHAPED_BPS:
            notes.append(f"hosts {a.name} and {b.name}: {slowest.bandwidth * 8 / 1e9:g} Gbit/s is not shaped (veth)")
            continue
        shaping += [
            Shaping(a.index, b.index, slowest.bandwidth, slowest.latency),
            Shaping(b.index, a.index, slowest.bandwidth, slowest.latency),
        ]
    for host in hosts:
        if len(host.devices) > 1:
            notes.append(f"host {host.name}: its devices {', '.join(host.devices)} talk over loopback, not shaped")
    return shaping, notes


def real_cluster(cluster: Cluster, layout: TestbedLayout, ssh: str) -> dict[str, object]:
    """The real cluster file of the testbed (as a mapping): every device on its host's address, its speed against a
    full core, emulation off, and Hydra's ssh command."""
    data = cluster.model_dump(mode="json", exclude_none=True)
    data["name"] = f"{cluster.name}-testbed"
    data["emulated"] = False
    data["ssh"] = ssh
    data["devices"] = [
        {**device, "host": layout.host_of(device["name"]).address, "speed": round(layout.speeds[device["name"]], 6)}
        for device in data["devices"]
    ]
    data["links"] = {"bandwidth": _bits(cluster.links.bandwidth), "latency": _micro(cluster.links.latency)}
    if cluster.links.overrides:
        data["links"]["overrides"] = [
            {"between": list(o.between), "bandwidth": _bits(o.bandwidth), "latency": _micro(o.latency)}
            for o in cluster.links.overrides
        ]
    return data


def _bits(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:g}Mbit/s"


def _micro(seconds: float) -> str:
    return f"{seconds * 1e6:g}us"
