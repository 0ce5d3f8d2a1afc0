"""A lower bound on the cost model's step time of a contiguous plan, cheap enough to prune an exhaustive search.

Every worker runs its operations one at a time, so an async step (a steady-state iteration) lasts at least
as long as the busiest worker's compute, allreduce and update. The synchronous schedules add dependency
chains. When stage ``s`` consumes the output of the layer just before it (and so on back to stage ``c``):

- its first forward waits for micro-batch 0's forwards and transfers through stages ``c..s-1``;
- after its last backward, the gradient still flows back through ``s-1..c`` before stage ``c`` can allreduce
  and update;
- its last micro-batch's backward waits for that micro-batch's round trip through the later stages that
  form a chain after it, which can hide behind at most the backwards the schedule runs between that
  micro-batch's forward and its backward (``PipelineSchedule.round_trip_cover``: none in gpipe, the other
  cool-down backwards in 1f1b).

Chain terms use a stage's fastest replica and only the one tensor the layer before the cut sends (latency plus
its bytes over the link); a stage's own work uses its slowest replica. Transfers are otherwise left out, so
every term can only under-estimate the simulation in ``tapp_core.costmodel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.cluster import Cluster
from tapp_core.costs import Calibration, allreduce_s, compute_factor, compute_s, transfer_s, update_s
from tapp_core.library import LayerLibrary
from tapp_core.planners.costs import LayerCosts
from tapp_core.schedules import PipelineSchedule, schedule_for


@dataclass(frozen=True)
class DeviceGroup:
    """The replicas of one stage, with what the bound needs of them for a given micro-batch size."""

    devices: tuple[str, ...]
    share: int
    """Samples each replica takes from a micro-batch."""
    slowest: float
    """Largest compute factor among the replicas (seconds per second of profiled work)."""
    fastest: float
    allreduce_fixed: float
    allreduce_per_byte: float
    update_fixed: float
    update_per_byte: float

    @property
    def throughput(self) -> float:
        """Samples per second of profiled work the group processes at the pace of its slowest replica."""
        return len(self.devices) / self.slowest


def device_group(cluster: Cluster, devices: Sequence[str], samples: int, calibration: Calibration) -> DeviceGroup:
    devices = tuple(devices)
    factors = [compute_factor(cluster, d, calibration) for d in devices]
    fixed = allreduce_s(cluster, devices, 0.0, calibration)
    updates_fixed = [update_s(cluster, d, 0.0, calibration) for d in devices]
    updates_per_byte = [update_s(cluster, d, 1.0, calibration) - f for d, f in zip(devices, updates_fixed, strict=True)]
    return DeviceGroup(
        devices=devices,
        share=samples // len(devices),
        slowest=max(factors),
        fastest=min(factors),
        allreduce_fixed=fixed,
        allreduce_per_byte=allreduce_s(cluster, devices, 1.0, calibration) - fixed,
        update_fixed=max(updates_fixed),
        update_per_byte=max(updates_per_byte),
    )


@dataclass(frozen=True)
class StageTerms:
    forward: float
    """One micro-batch's forward on the slowest replica."""
    backward: float
    chain_forward: float
    """One micro-batch's forward on the fastest replica."""
    chain_backward: float
    tail: float
    """Allreduce plus the slowest replica's update."""


@dataclass(frozen=True)
class Chain:
    """What the stages before the current one impose on it (zero when it starts a new chain)."""

    forward: float = 0.0
    backward: float = 0.0
    tail: float | None = None
    """Tail of the chain's first stage (None: the current stage starts the chain)."""


class StepTimeBound:
    """Lower bounds for contiguous plans of one library, cluster, schedule and micro-batch count."""

    def __init__(
        self,
        library: LayerLibrary,
        cluster: Cluster,
        calibration: Calibration,
        schedule: str,
        micro_batches: int,
        batch_size: int | None = None,
    ) -> None:
        # Costed at the micro-batch size: exact for one replica, a lower bound for several (see costs).
        samples = max(1, (batch_size or library.batch_size) // micro_batches)
        self.costs = LayerCosts.from_library(library, samples)
        self.cluster = cluster
        self.calibration = calibration
        self.schedule: PipelineSchedule = schedule_for(schedule)
        self.micro_batches = micro_batches
        self._round_trip_cover: dict[tuple[int, int], int] = {}
        n = len(library.layers)
        self.first_consumer = np.array([min(layer.successors, default=n) for layer in library.layers])
        self.activation = np.array([layer.activation_bytes for layer in library.layers], dtype=float)

    def terms(self, group: DeviceGroup, start: int, stop: int) -> StageTerms:
        c = self.costs
        cal = self.calibration
        # LayerCosts spreads the fixed parts over the samples, so the work is all per sample.
        forward = float(c.forward_prefix[stop] - c.forward_prefix[start])
        backward = float(c.backward_prefix[stop] - c.backward_prefix[start])
        params = c.params(start, stop)
        return StageTerms(
            forward=compute_s(0.0, forward, group.share, group.slowest, cal),
            backward=compute_s(0.0, backward, group.share, group.slowest, cal),
            chain_forward=compute_s(0.0, forward, group.share, group.fastest, cal),
            chain_backward=compute_s(0.0, backward, group.share, group.fastest, cal),
            tail=group.allreduce_fixed
            + group.allreduce_per_byte * params
            + group.update_fixed
            + group.update_per_byte * params,
        )

    def depends(self, start: int, stop: int) -> bool:
        """Whether stage ``[start, stop)`` consumes the output of the layer just before it."""
        return start > 0 and self.first_consumer[start - 1] < stop

    def transfer(self, sender: DeviceGroup, receiver: DeviceGroup, start: int) -> float:
        """Least time one micro-batch's transfer into the stage starting at ``start`` can take."""
        links = [self.cluster.link(a, b) for a in sender.devices for b in receiver.devices]
        if len(sender.devices) > 1 or len(receiver.devices) > 1:
            # Replicas may exchange as little as one sample: only the least latency is sure.
            return transfer_s(min(links, key=lambda link: link.latency), 0.0, 1, self.calibration)
        return transfer_s(links[0], float(self.activation[start - 1]) * receiver.share, 1, self.calibration)

    def round_trip_cover(self, stage: int, n_stages: int) -> int:
        """The schedule's ``round_trip_cover`` for this micro-batch count (memoised: asked for every candidate)."""
        key = (stage, n_stages)
        cover = self._round_trip_cover.get(key)
        if cover is None:
            cover = self._round_trip_cover[key] = self.schedule.round_trip_cover(stage, n_stages, self.micro_batches)
        return cover

    def own(self, terms: StageTerms, stage: int, n_stages: int, round_trip: float) -> float:
        """Time from the stage's first forward to its last backward, given the last micro-batch's round trip
        through the later stages (which a schedule that does not flush overlaps with the next step)."""
        m = self.micro_batches
        if not self.schedule.synchronous:
            return m * (terms.forward + terms.backward)
        cover = self.round_trip_cover(stage, n_stages)
        return m * terms.forward + (m - cover) * terms.backward + max(cover * terms.backward, round_trip)

    def stage_bound(self, terms: StageTerms, chain: Chain, stage: int, n_stages: int, round_trip: float = 0.0) -> float:
        own = self.own(terms, stage, n_stages, round_trip)
        if not self.schedule.synchronous:
            return own + terms.tail
        after = terms.tail if chain.tail is None else max(terms.tail, chain.backward + chain.tail)
        return chain.forward + own + after

    def next_chain(self, chain: Chain, terms: StageTerms, transfer_out: float) -> Chain:
        """The chain the next stage continues, if it depends on this one."""
        tail = terms.tail if chain.tail is None else chain.tail
        return Chain(
            chain.forward + terms.chain_forward + transfer_out,
            chain.backward + terms.chain_backward + transfer_out,
            tail,
        )

    def bound(self, cuts: Sequence[int], groups: Sequence[DeviceGroup]) -> float:
        """Lower bound on the step time of the contiguous plan with these cuts and device groups."""
        bounds = [0, *cuts, self.costs.n_layers]
        k = len(groups)
        terms = [self.terms(g, bounds[s], bounds[s + 1]) for s, g in enumerate(groups)]
        linked = [s > 0 and self.depends(bounds[s], bounds[s + 1]) for s in range(k)]
        transfers = [self.transfer(groups[s - 1], groups[s], bounds[s]) if linked[s] else 0.0 for s in range(k)]
        round_trips = [0.0] * k
        for s in range(k - 2, -1, -1):
            if linked[s + 1]:
                t = terms[s + 1]
                round_trips[s] = 2 * transfers[s + 1] + t.chain_forward + t.chain_backward + round_trips[s + 1]
        best = 0.0
        chain = Chain()
        for s in range(k):
            if not linked[s]:
                chain = Chain()
            best = max(best, self.stage_bound(terms[s], chain, s, k, round_trips[s]))
            if s + 1 < k:
                chain = self.next_chain(chain, terms[s], transfers[s + 1])
        return best
