"""A lower bound on the cost model's step time of a contiguous plan, cheap enough to prune an exhaustive search.

Every worker runs its operations one at a time, so an async step (a steady-state iteration) lasts at least
as long as the busiest worker's compute (or its gradient reductions, which may overlap it) and its update. The synchronous schedules add dependency
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
every term can only under-estimate the simulation in ``tapp_core.cost.simulation``. Each replica's work is costed from
its own kind's library (``stage_costs.DeviceCosts``), so a group's replicas are taken per library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.context import CostContext
from tapp_core.cost.formulas import allreduce_s, compute_s, device_transfer_s, transfer_s, update_s
from tapp_core.plan.schedules import PipelineSchedule, parse_schedule_spec, schedule_for
from tapp_core.planners.stage_costs import DeviceCosts, LayerCosts
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class KindPart:
    """The replicas of a group of one kind costed from one library: they differ only by their slowdown, so the
    slowest of them is the slowest in compute and in update alike."""

    library: LayerLibrary
    slowest: float
    """Largest compute factor among them (seconds per second of their library's work)."""
    fastest: float
    per_call_s: float
    update_fixed: float
    """The slowest replica's update: its fixed part and its part per parameter byte."""
    update_per_byte: float


@dataclass(frozen=True)
class DeviceGroup:
    """The replicas of one stage, with what the bound needs of them for a given micro-batch size."""

    devices: tuple[str, ...]
    share: int
    """Samples each replica takes from a micro-batch."""
    parts: tuple[KindPart, ...]
    allreduce_fixed: float
    allreduce_per_byte: float
    throughput: float
    """Samples per second of the reference library's work the group processes, at most (the pace of its slowest
    replica, each replica's library no cheaper than its least ratio to the reference's, layer by layer)."""


def device_group(costs: DeviceCosts, devices: Sequence[str], samples: int) -> DeviceGroup:
    """The group of ``devices`` as replicas of a stage, at micro-batches of ``samples`` samples."""
    devices = tuple(devices)
    terms = costs.terms
    cluster, calibration = costs.context.cluster, costs.context.calibration
    parts: dict[tuple[int, str], list[str]] = {}
    for d in devices:
        parts.setdefault((id(terms[d].library), terms[d].kind), []).append(d)
    fixed = allreduce_s(cluster, devices, 0.0, calibration, terms)
    slowest_reference = max(costs.factor(d) * _least_ratio(costs, d, samples) for d in devices)
    return DeviceGroup(
        devices=devices,
        share=samples // len(devices),
        parts=tuple(_kind_part(costs, group) for group in parts.values()),
        allreduce_fixed=fixed,
        allreduce_per_byte=allreduce_s(cluster, devices, 1.0, calibration, terms) - fixed,
        throughput=len(devices) / slowest_reference,
    )


def _kind_part(costs: DeviceCosts, devices: list[str]) -> KindPart:
    slowest = max(devices, key=costs.factor)
    terms = costs.terms[slowest]
    update_fixed = max(update_s(costs.terms[d], 0.0) for d in devices)
    update_per_byte = max(update_s(costs.terms[d], 1.0) - update_s(costs.terms[d], 0.0) for d in devices)
    return KindPart(
        terms.library,
        costs.factor(slowest),
        min(costs.factor(d) for d in devices),
        terms.figures.per_micro_batch_s,
        update_fixed,
        update_per_byte,
    )


def _least_ratio(costs: DeviceCosts, device: str, samples: int) -> float:
    """The least ratio, layer by layer, of ``device``'s library's work to the reference library's (1 for the
    reference itself)."""
    if costs.terms[device].library is costs.context.library:
        return 1.0
    own = np.diff(costs.layer_costs(device, samples).work_prefix)
    reference = np.diff(LayerCosts.from_library(costs.context.library, samples).work_prefix)
    timed = reference > 0
    return float(np.min(own[timed] / reference[timed])) if timed.any() else 1.0


@dataclass(frozen=True)
class PartTerms:
    """A kind part's slowest replica: one micro-batch's forward and backward, and allreduce plus its update."""

    forward: float
    backward: float
    reduce: float
    """The replicas' gradient reductions (which may overlap the backward, ``tapp_core.plan.program``)."""
    tail: float
    """The update."""


@dataclass(frozen=True)
class StageTerms:
    busy: tuple[PartTerms, ...]
    """Per kind part of the group (a replica's compute and update go together: never two replicas' mixed)."""
    chain_forward: float
    """One micro-batch's forward on the fastest replica."""
    chain_backward: float
    tail: float
    """The slowest update among the replicas."""


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
        context: CostContext,
        schedule: str,
        micro_batches: int,
        batch_size: int | None = None,
    ) -> None:
        # Costed at the micro-batch size: exact for one replica, a lower bound for several (see costs).
        library, cluster, calibration = context.library, context.cluster, context.calibration
        self.samples = max(1, (batch_size or library.batch_size) // micro_batches)
        self.device_costs = DeviceCosts(context)
        self.costs = LayerCosts.from_library(library, self.samples)
        """The reference library's prefix sums (positions, traffic, and the work the oracle prunes with)."""
        self.cluster = cluster
        self.calibration = calibration
        self.least_per_call_s = min(t.figures.per_micro_batch_s for t in self.device_costs.terms.values())
        """The least fixed cost of one operation on any device."""
        self.schedule: PipelineSchedule = schedule_for(*parse_schedule_spec(schedule))
        self.micro_batches = micro_batches
        self._round_trip_cover: dict[tuple[int, int], int] = {}
        n = len(library.layers)
        self.first_consumer = np.array([min(layer.successors, default=n) for layer in library.layers])
        self.activation = np.array([layer.activation_bytes for layer in library.layers], dtype=float)

    def group(self, devices: Sequence[str]) -> DeviceGroup:
        """``devices`` as the replicas of one stage of this bound's plans."""
        return device_group(self.device_costs, devices, self.samples)

    def terms(self, group: DeviceGroup, start: int, stop: int) -> StageTerms:
        params = self.costs.params(start, stop)
        allreduce = group.allreduce_fixed + group.allreduce_per_byte * params
        busy, chain_forward, chain_backward = [], [], []
        for part in group.parts:
            c = self._library_costs(part.library)
            # LayerCosts spreads the fixed parts over the samples, so the work is all per sample.
            own_forward = float(c.forward_prefix[stop] - c.forward_prefix[start])
            own_backward = float(c.backward_prefix[stop] - c.backward_prefix[start])
            busy.append(
                PartTerms(
                    compute_s(0.0, own_forward, group.share, part.slowest, part.per_call_s),
                    compute_s(0.0, own_backward, group.share, part.slowest, part.per_call_s),
                    allreduce,
                    part.update_fixed + part.update_per_byte * params,
                )
            )
            chain_forward.append(compute_s(0.0, own_forward, group.share, part.fastest, part.per_call_s))
            chain_backward.append(compute_s(0.0, own_backward, group.share, part.fastest, part.per_call_s))
        return StageTerms(
            busy=tuple(busy),
            chain_forward=min(chain_forward),
            chain_backward=min(chain_backward),
            tail=max(part.tail for part in busy),
        )

    def _library_costs(self, library: LayerLibrary) -> LayerCosts:
        if library is self.device_costs.context.library:
            return self.costs
        device = next(d for d, t in self.device_costs.terms.items() if t.library is library)
        return self.device_costs.layer_costs(device, self.samples)

    def depends(self, start: int, stop: int) -> bool:
        """Whether stage ``[start, stop)`` consumes the output of the layer just before it."""
        return start > 0 and self.first_consumer[start - 1] < stop

    def transfer(self, sender: DeviceGroup, receiver: DeviceGroup, start: int) -> float:
        """Least time one micro-batch's transfer into the stage starting at ``start`` (or its gradient's, back) can
        take."""
        if len(sender.devices) > 1 or len(receiver.devices) > 1:
            # Replicas may exchange as little as one sample: only the least latency is sure.
            links = [self.cluster.link(a, b) for a in sender.devices for b in receiver.devices]
            return transfer_s(min(links, key=lambda link: link.latency), 0.0, 1, self.calibration)
        source, target = (self.device_costs.terms[group.devices[0]] for group in (sender, receiver))
        nbytes = float(self.activation[start - 1]) * receiver.share
        there = device_transfer_s(self.cluster, source, target, nbytes, 1, self.calibration)
        if not (source.cuda or target.cuda):
            return there
        # The gradient comes back the other way, whose staging copies may cost less: the bound takes the lesser.
        return min(there, device_transfer_s(self.cluster, target, source, nbytes, 1, self.calibration))

    def round_trip_cover(self, stage: int, n_stages: int) -> int:
        """The schedule's ``round_trip_cover`` for this micro-batch count (memoised: asked for every candidate)."""
        key = (stage, n_stages)
        cover = self._round_trip_cover.get(key)
        if cover is None:
            cover = self._round_trip_cover[key] = self.schedule.round_trip_cover(stage, n_stages, self.micro_batches)
        return cover

    def own(self, part: PartTerms, stage: int, n_stages: int, round_trip: float) -> float:
        """Time from a replica's first forward to its last backward, given the last micro-batch's round trip
        through the later stages (which a schedule that does not flush overlaps with the next step)."""
        m = self.micro_batches
        if not self.schedule.synchronous:
            return m * (part.forward + part.backward)
        cover = self.round_trip_cover(stage, n_stages)
        return m * part.forward + (m - cover) * part.backward + max(cover * part.backward, round_trip)

    def stage_bound(self, terms: StageTerms, chain: Chain, stage: int, n_stages: int, round_trip: float = 0.0) -> float:
        return max(self._replica_bound(part, chain, stage, n_stages, round_trip) for part in terms.busy)

    def _replica_bound(self, part: PartTerms, chain: Chain, stage: int, n_stages: int, round_trip: float) -> float:
        # The reductions may run during the backward (but not before the stage's work starts); the update waits for
        # the last of them.
        own = self.own(part, stage, n_stages, round_trip)
        if not self.schedule.synchronous:
            return max(own, part.reduce) + part.tail
        after = part.tail if chain.tail is None else max(part.tail, chain.backward + chain.tail)
        return chain.forward + max(own + after, part.reduce + part.tail)

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
