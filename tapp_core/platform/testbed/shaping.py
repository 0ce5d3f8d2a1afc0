"""Link shaping inside a testbed host: an ``htb`` queue on the host's veth with one class per peer host.

Each host shapes what it sends: a class per peer at the link's bandwidth (rate and ceiling), chosen by the peer's
address; everything else (to this machine: rank 0's link to the pool, ssh, Hydra) goes through an unshaped class.
So every pair of hosts is shaped both ways, each direction by its sender, as a full-duplex link is. Where the kernel
has netem, each peer's class also delays its packets by the link's latency; where it has not, latency is left as
the veth's.
"""

from __future__ import annotations

from tapp_core.platform.testbed import system
from tapp_core.platform.testbed.layout import TestbedHost, TestbedLayout

UNSHAPED_RATE = "100gbit"
QUANTUM = "60000"
"""Bytes a class sends per round: above the largest segment the veth passes (64 KiB with offloads, which htb
counts as one packet), so that a class is not starved, and below htb's own limit (200000)."""


def shaping_commands(layout: TestbedLayout, host: TestbedHost, latency: bool) -> list[list[str]]:
    """The ``tc`` commands (to run in ``host``'s namespace) that shape what it sends to each peer."""
    device = host.link
    commands = [
        ["tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1"],
        _class(device, "1:1", UNSHAPED_RATE),
    ]
    for shaping in layout.shaping:
        if shaping.source != host.index:
            continue
        peer = layout.hosts[shaping.target]
        classid = f"1:{10 + peer.index}"
        commands.append(_class(device, classid, f"{int(shaping.bytes_per_s * 8)}bit"))
        match = ["match", "ip", "dst", f"{peer.address}/32"]
        commands.append(["tc", "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32"])
        commands[-1] += [*match, "flowid", classid]
        if latency and shaping.latency_s > 0:
            delay = f"{shaping.latency_s * 1e6:.0f}us"
            commands.append(["tc", "qdisc", "add", "dev", device, "parent", classid, "netem", "delay", delay])
    return commands


def _class(device: str, classid: str, rate: str) -> list[str]:
    head = ["tc", "class", "add", "dev", device, "parent", "1:", "classid", classid, "htb"]
    return [*head, "rate", rate, "ceil", rate, "quantum", QUANTUM]


def shape_host(layout: TestbedLayout, host: TestbedHost, latency: bool) -> None:
    for command in shaping_commands(layout, host, latency):
        system.in_namespace(host.namespace, *command)


def netem_available(namespace: str) -> bool:
    """Whether this kernel delays packets with netem: tried on the loopback of a fresh testbed namespace."""
    trial = system.in_namespace(
        namespace, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us", check=False
    )
    if trial.returncode != 0:
        return False
    system.in_namespace(namespace, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    return True
