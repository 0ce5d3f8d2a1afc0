"""Emulated heterogeneity on one host: compute slowdown and link delay (a rank's threads and cores: ``tapp_core.platform.hosts``).

A device with ``slowdown`` k sleeps until its compute has lasted k times the work it did, so the compute it reports
is k times the real one. The work is the compute's wall time or, where shorter, the CPU time the rank's process
spent in it: the emulated devices of one host take turns on its cores, and a device of its own would not have
waited for them, so a wait for a core is absorbed in the sleep rather than added to it. A link makes a transfer
take at least ``latency + bytes / bandwidth``; messages on one link queue behind each other, as on a real wire. Both link times are ``tapp_core.cost.formulas``' formulas, the cost model's, with the
ideal calibration (the emulation stands in for the hardware, not for the runtime's overheads). The timestamps that carry this between ranks come from CLOCK_MONOTONIC,
which every process on one host shares, so link emulation is for one host only (it is off on real clusters).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tapp_core.cost.calibration import DEFAULT_CALIBRATION
from tapp_core.cost.formulas import collective_s, ring_allreduce_s, transfer_s
from tapp_core.plan.placement import Collective
from tapp_core.platform.cluster import Cluster, Link


def now() -> float:
    """The runtime's clock: CLOCK_MONOTONIC, the same in every process of the host."""
    return time.monotonic()


def cpu_now() -> float:
    """CPU time of this process (all its threads): what a compute span's work is measured in (``slow_down``)."""
    return time.process_time()


def sleep_until(deadline: float) -> None:
    remaining = deadline - now()
    if remaining > 0:
        time.sleep(remaining)


@dataclass
class Emulation:
    """Slowdown and links of one rank's device; ``enabled`` false makes every method a no-op."""

    enabled: bool
    slowdown: float = 1.0
    links: Mapping[int, Link] = field(default_factory=dict)
    """The link to each peer rank."""
    pair_links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    """The link between every two ranks (lower rank first): the links of a group that a collective uses."""
    _link_free_at: dict[int, float] = field(default_factory=dict)

    @classmethod
    def for_rank(cls, cluster: Cluster, rank_devices: list[str], rank: int, enabled: bool) -> Emulation:
        me = rank_devices[rank]
        links = {peer: cluster.link(me, name) for peer, name in enumerate(rank_devices) if peer != rank}
        pairs = {
            (a, b): cluster.link(rank_devices[a], rank_devices[b])
            for a in range(len(rank_devices))
            for b in range(a + 1, len(rank_devices))
        }
        return cls(enabled=enabled, slowdown=cluster.device(me).slowdown, links=links, pair_links=pairs)

    def slow_down(self, compute_s: float, cpu_s: float | None = None) -> float:
        """Sleep as a slower device would have kept computing after ``compute_s`` of wall time that took ``cpu_s``
        of the process's CPU time (``cpu_now``; None: as long as the wall time); returns the emulated compute time,
        ``slowdown`` times the work, or the wall time where that was longer already."""
        if not self.enabled or self.slowdown <= 1.0 or compute_s <= 0:
            return compute_s
        work = compute_s if cpu_s is None else min(compute_s, cpu_s)
        emulated = max(compute_s, self.slowdown * work)
        sleep_until(now() + emulated - compute_s)
        return emulated

    def send_ready_at(self, peer: int, nbytes: int) -> float:
        """When a message posted now to ``peer`` would have arrived over the emulated link (0 when disabled)."""
        if not self.enabled:
            return 0.0
        # One message at a time on a link, latency included (as the cost model charges every message).
        transfer = transfer_s(self.links[peer], nbytes, 1, DEFAULT_CALIBRATION)
        arrival = max(now(), self._link_free_at.get(peer, 0.0)) + transfer
        self._link_free_at[peer] = arrival
        return arrival

    def allreduce_time(self, peers: list[int], nbytes: int) -> float:
        """Ring allreduce among this rank and ``peers`` over the slowest of its links to them: 2(n-1) messages
        of nbytes/n each."""
        if not self.enabled or not peers:
            return 0.0
        return ring_allreduce_s(len(peers) + 1, nbytes, (self.links[p] for p in peers), DEFAULT_CALIBRATION)

    def collective_time(
        self, collective: Collective, nbytes: int, shares: Sequence[float], ranks: Sequence[int]
    ) -> float:
        """A layout change's ``collective`` on a tensor of ``nbytes`` (whole) among the group of ``ranks`` with
        ``shares``, over the slowest of the links among them (``formulas.collective_s``, as the cost model charges
        it; 0 when disabled)."""
        if not self.enabled or len(ranks) < 2:
            return 0.0
        links = [self.pair_links[(min(a, b), max(a, b))] for i, a in enumerate(ranks) for b in ranks[i + 1 :]]
        return collective_s(collective, nbytes, shares, links, DEFAULT_CALIBRATION)
