"""TAPP's polish: a local search over the cost model from the best plans the search knows.

The policies learn where the good plans are; a few exact steps around the best of them find what sampling is
unlikely to hit (a boundary one layer over, a relay stage, a replica too many). The polish starts from the
``starts`` fastest distinct plans the search remembers (its best plan, every policy's elite and the warm start's
candidates: different policies hold different basins, and the best plan's basin is not always the one whose
neighbourhood holds the best plan), fastest first, and continues while it improves and ``exhausted()`` (the
search's budget and deadline) allows: stopping early keeps the best found so far.

A *descent* keeps the best of every micro-batch count, every stage's activation recomputation turned on or off
and, in a contiguous plan, every stage boundary moved by 1, 2, 4, ... up to ``span`` layers either way. Each pass descends from the plan, from the ``tries`` most promising
device moves (two stages' devices swapped; a stage moved to, or replicated onto, an unused device) and relay
insertions (``relay_moves``), and from the ``SHRINK_TRIES`` most promising shrinking moves (a replica dropped, two
neighbouring stages merged, the whole model on one of the plan's devices); device and shrinking moves come also
with their stages re-balanced to the new speeds, because a device move pays off only once the boundaries follow
it. Last, the device groups of the best plans found get their best cuts by the oracle's branch and bound
(``exact``): a descent moves one boundary at a time, the branch and bound all of them. Devices of one class (interchangeable,
``planners.stage_costs.device_classes``) are tried once per move, so a large cluster of few kinds costs few moves. The
moves that AutoDDL's coordinate descent makes too come from ``tapp_core.planners.moves``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import Plan
from tapp_core.plan.schedules import parse_schedule_spec
from tapp_core.planners.moves import (
    Groups,
    boundary_positions,
    collapsed,
    cuts_of,
    dropped_replicas,
    merged_neighbours,
    moved_cut,
    one_per_class,
    optimizer_shard_toggled,
    recompute_toggled,
    swapped_groups,
    unused_devices,
    with_group,
)
from tapp_core.planners.oracle import best_cuts
from tapp_core.planners.space import balanced_cuts, stages_from_cuts
from tapp_core.planners.stage_costs import LayerCosts, device_classes, relative_speeds
from tapp_core.planners.tapp.rewards import RewardSource, TimedPlan

SPAN = 32
"""Largest boundary shift a descent tries, in layers (it tries 1, 2, 4, ... up to it)."""
TRIES = 4
"""Device and relay moves a pass descends from, the most promising first."""
STARTS = 8
"""Distinct remembered plans the polish starts from, the fastest first."""
EXACT_MOVES = 12
"""Moves from the best plan whose groupings get exact cuts."""
EXACT_BLOCKS = 256
"""The exact cuts' graph: at most this many blocks (cut positions + 1); a descent (boundaries moved by up to
``SPAN`` layers) follows, so it need not be every position, which can take minutes on a large graph."""
SHRINK_TRIES = 2
"""Shrinking moves a pass descends from, the most promising first."""
RELAY_CLASSES = 4
"""Relay stages run on the unused devices of one speed, of at most this many speeds (the fastest)."""


def polish_starts(remembered: Iterable[TimedPlan], count: int = STARTS) -> list[TimedPlan]:
    """The ``count`` fastest distinct plans of ``remembered`` that ran (of equal plans, the first)."""
    seen: dict[str, TimedPlan] = {}
    for item in remembered:
        if math.isfinite(item.step_time_s):
            seen.setdefault(item.plan.id, item)
    return sorted(seen.values(), key=lambda item: item.step_time_s)[:count]


class Polish:
    """The local search on one reward source (the cost model); ``exhausted()`` says when the budget is spent."""

    def __init__(
        self,
        context: CostContext,
        reward: RewardSource,
        micro_batch_choices: Sequence[int],
        schedules: Sequence[str],
        exhausted: Callable[[], bool],
        deadline: float = math.inf,
        estimates_left: Callable[[], int | None] = lambda: None,
    ) -> None:
        library, cluster = context.library, context.cluster
        self.context = context
        self.library = library
        self.cluster = cluster
        self.reward = reward
        self.micro_batch_choices = tuple(micro_batch_choices)
        self.schedules = tuple(parse_schedule_spec(spec) for spec in schedules)
        """(name, staleness) of every schedule the search may choose."""
        self.exhausted = exhausted
        self.speeds = relative_speeds(context)
        """Per device, its speed relative to the library's kind (its own kind's library and its speed)."""
        self.deadline = deadline
        """``time.perf_counter()`` at which the exact cuts stop (``exhausted`` says it too)."""
        self.estimates_left = estimates_left
        """How many more estimates the exact cuts may make (None: no limit)."""
        self.evaluations = 0
        """Estimates the exact cuts made on their own (beyond those of ``reward``)."""
        self.class_of = {d: i for i, group in enumerate(device_classes(cluster)) for d in group}
        """Device -> its class of interchangeable devices."""
        self._work_by_samples: dict[int, np.ndarray] = {}

    def run(self, best: TimedPlan, starts: Sequence[TimedPlan], span: int = SPAN, tries: int = TRIES) -> TimedPlan:
        """The fastest of ``best`` and the plans found from each of ``starts`` in turn, then the best cuts of the
        best groupings found (``exact``) and a last pass from there, while the budget lasts."""
        found = [best]
        for start in starts:
            if self.exhausted():
                break
            found.append(self.improve(start, span, tries))
        best = min(found, key=lambda t: t.step_time_s)
        exact = self.exact(found, span)
        if exact.step_time_s < best.step_time_s:
            best = min(best, self.improve(exact, span, tries), key=lambda t: t.step_time_s)
        return best

    def exact(self, found: Sequence[TimedPlan], span: int = SPAN) -> TimedPlan:
        """Faster cuts for promising device groupings by the oracle's branch and bound (``oracle.best_cuts``, on a
        graph of at most ``EXACT_BLOCKS`` blocks), each followed by a descent.

        The candidates, in turn: the groupings (with micro-batch counts) of ``found``, fastest first; the best
        plan's at the other micro-batch counts (the nearest first); those of the ``EXACT_MOVES`` best moves from
        the best plan. Each looks only for plans faster than the best so far (the tighter that bound, the quicker
        the search) and gets half of its share of the time left, while the budget lasts."""
        ranked = sorted(found, key=lambda t: t.step_time_s)
        best = ranked[0]
        if self.exhausted():
            return best
        top = best.plan.micro_batches
        counts = sorted((m for m in self.micro_batch_choices if m != top), key=lambda m: abs(math.log2(m / top)))
        moves = [*self.device_moves(best.plan), *self.relay_moves(best.plan, span), *self.shrink_moves(best.plan)]
        times = self.reward.step_times(moves)
        promising = [moves[i] for i in np.argsort(times)[:EXACT_MOVES] if math.isfinite(times[i])]
        plans = [*(t.plan for t in ranked), *(dataclasses.replace(best.plan, micro_batches=m) for m in counts)]
        candidates = list(dict.fromkeys(_grouping(plan) for plan in [*plans, *promising]))
        for k, candidate in enumerate(candidates):
            now = time.perf_counter()
            share = (self.deadline - now) / max(1, 2 * (len(candidates) - k - 1))
            plan = self._cut(best.plan, candidate, best.step_time_s, now + share, EXACT_BLOCKS)
            if plan is not None:
                best = min(best, self.descend(plan, span), key=lambda t: t.step_time_s)
        return best

    def _cut(
        self, template: Plan, grouping: tuple[Groups, int], below_s: float, deadline: float, blocks: int | None
    ) -> TimedPlan | None:
        """``oracle.best_cuts`` on a grouping and micro-batch count (with ``template``'s schedule and batch size),
        costed by the reward source; None when it finds nothing faster than ``below_s`` or the budget is spent."""
        if self.exhausted():
            return None
        plan, estimates = best_cuts(
            self.context,
            grouping[0],
            grouping[1],
            template.schedule_spec,
            template.batch_size,
            below_s,
            min(deadline, self.deadline),
            self.estimates_left(),
            blocks,
        )
        self.evaluations += estimates
        if plan is None:
            return None
        step = self.reward.step_times([plan])[0]
        return TimedPlan(step, plan) if step < below_s else None

    def improve(self, start: TimedPlan, span: int = SPAN, tries: int = TRIES) -> TimedPlan:
        """Passes from ``start`` while one improves: a descent from the plan, from its ``tries`` best device and
        relay moves and from its ``SHRINK_TRIES`` best shrinking moves (fastest first, so a deadline keeps the
        most promising)."""
        best = start
        while not self.exhausted():
            candidates = self._best_of(self.device_moves(best.plan) + self.relay_moves(best.plan, span), tries)
            candidates += self._best_of(self.shrink_moves(best.plan), SHRINK_TRIES)
            candidates.sort(key=lambda t: t.step_time_s)
            found = best
            for candidate in [best, *candidates]:
                if self.exhausted():
                    break
                descended = self.descend(candidate, span)
                if descended.step_time_s < found.step_time_s:
                    found = descended
            if found.step_time_s >= best.step_time_s:
                break
            best = found
        return best

    def _best_of(self, moves: list[Plan], count: int) -> list[TimedPlan]:
        times = self.reward.step_times(moves)
        order = np.argsort(times)[:count]
        return [TimedPlan(float(times[i]), moves[i]) for i in order if math.isfinite(times[i])]

    def descend(self, start: TimedPlan, span: int = SPAN) -> TimedPlan:
        """Steepest descent over ``shifts`` until no neighbour is faster."""
        best = start
        while not self.exhausted():
            neighbours = self.shifts(best.plan, span)
            times = self.reward.step_times(neighbours)
            i = int(np.argmin(times))
            if times[i] >= best.step_time_s:
                break
            best = TimedPlan(float(times[i]), neighbours[i])
        return best

    def shifts(self, plan: Plan, span: int) -> list[Plan]:
        """Every micro-batch count and schedule; every stage's recomputation and sharded optimiser state turned on or off; every boundary of a contiguous plan moved by powers of two up to
        ``span``, and every two neighbouring boundaries moved together (a stage shifted whole: a small stage between
        two large ones moves only so)."""
        neighbours = [
            dataclasses.replace(plan, micro_batches=m, schedule=name, staleness=staleness)
            for m in self.micro_batch_choices
            for name, staleness in self.schedules
        ]
        neighbours += recompute_toggled(plan)
        neighbours += optimizer_shard_toggled(plan)
        cuts = cuts_of(plan)
        if cuts is None:
            return neighbours
        n = len(plan.stage_of_layer)
        sizes = sorted({*(2**k for k in range(span.bit_length()) if 2**k <= span), span} - {0})
        for j, cut in enumerate(cuts):
            allowed = boundary_positions(cuts, j, n)
            for shift in (sign * size for size in sizes for sign in (-1, 1)):
                if cut + shift in allowed:
                    stages = stages_from_cuts(n, moved_cut(cuts, j, cut + shift))
                    neighbours.append(plan.regrouped(stage_of_layer=stages))
        for j in range(len(cuts) - 1):
            low = cuts[j - 1] if j > 0 else 0
            high = cuts[j + 2] if j + 2 < len(cuts) else n
            for shift in (sign * size for size in sizes for sign in (-1, 1)):
                if low < cuts[j] + shift and cuts[j + 1] + shift < high:
                    moved = (*cuts[:j], cuts[j] + shift, cuts[j + 1] + shift, *cuts[j + 2 :])
                    neighbours.append(plan.regrouped(stage_of_layer=stages_from_cuts(n, moved)))
        return neighbours

    def device_moves(self, plan: Plan) -> list[Plan]:
        """Two stages' devices swapped; a stage moved to, or replicated onto, an unused device (one per class of
        interchangeable devices); each of these also with its stages re-balanced to the new speeds
        (``rebalanced``)."""
        groups = plan.stage_devices
        moves = [plan.regrouped(stage_devices=swapped) for swapped in swapped_groups(groups, self.class_of)]
        unused = one_per_class(unused_devices(groups, self.cluster.device_names), self.class_of)
        for stage in range(len(groups)):
            for device in unused:
                moves.append(plan.regrouped(stage_devices=with_group(groups, stage, (device,))))
                replicated = with_group(groups, stage, (*groups[stage], device))
                moves.append(plan.regrouped(stage_devices=replicated))
        return moves + [self.rebalanced(move) for move in moves]

    def shrink_moves(self, plan: Plan) -> list[Plan]:
        """Moves to fewer devices or stages: a replica dropped (one per class) or two neighbouring stages merged,
        each also re-balanced; the whole model on one of the plan's devices (one per class)."""
        groups = plan.stage_devices
        moves = [plan.regrouped(stage_devices=fewer) for fewer in dropped_replicas(groups, self.class_of)]
        moves += list(merged_neighbours(plan))
        moves += [self.rebalanced(move) for move in moves if move.n_stages > 1]
        used = [d for group in groups for d in group]
        return moves + list(collapsed(plan, one_per_class(used, self.class_of) if len(used) > 1 else []))

    def relay_moves(self, plan: Plan, span: int) -> list[Plan]:
        """A one-layer stage on unused devices inserted beside a stage boundary, the boundary first moved by 0, 1,
        2, 4, ... up to ``span`` layers either way. Under 1F1B stage ``s`` of ``S`` runs ``S - s`` warm-up forwards,
        so a cheap extra stage gives every stage before it one more micro-batch in flight (filling its bubbles,
        at the price of its activations' memory and two small transfers); where it goes and on which devices is
        the search's to find. The relay's devices: the unused ones of one speed (1, 2, 4, ... or all of them),
        or every unused device."""
        unused = unused_devices(plan.stage_devices, self.cluster.device_names)
        cuts = cuts_of(plan)
        if not unused or cuts is None:
            return []
        n = len(plan.stage_of_layer)
        bounds = [0, *cuts, n]
        relays = self._relay_groups(unused)
        sizes = {0, *(2**k for k in range(span.bit_length()) if 2**k <= span), span}
        moves = []
        for j, cut in enumerate(cuts):
            positions = {cut + sign * size for size in sizes for sign in (-1, 1)}
            for low in sorted({p - 1 for p in positions} | positions):  # the relay's layer, before or after
                if not bounds[j] < low < low + 1 < bounds[j + 2]:
                    continue
                stages = stages_from_cuts(n, [*cuts[:j], low, low + 1, *cuts[j + 1 :]])
                for relay in relays:
                    devices = (*plan.stage_devices[: j + 1], relay, *plan.stage_devices[j + 1 :])
                    moves.append(plan.regrouped(stage_of_layer=stages, stage_devices=devices))
        return moves

    def _relay_groups(self, unused: Sequence[str]) -> list[tuple[str, ...]]:
        """The device groups a relay stage may run on, sorted: every unused device, or 1, 2, 4, ... or all of the
        unused devices of one speed (of the ``RELAY_CLASSES`` fastest speeds)."""
        by_speed: dict[float, list[str]] = {}
        for device in unused:
            by_speed.setdefault(self.speeds[device], []).append(device)
        relays = {tuple(unused)}
        for speed in sorted(by_speed, reverse=True)[:RELAY_CLASSES]:
            same = by_speed[speed]
            relays |= {tuple(same[:k]) for k in (*(2**i for i in range(len(same).bit_length())), len(same))}
        return sorted(relays)

    def rebalanced(self, plan: Plan) -> Plan:
        """The plan's devices with contiguous stages whose work matches each stage's speed (its slowest replica's
        speed times its replicas), costed at the plan's micro-batch size."""
        work = self.layer_work(plan.micro_batch_size)
        shares = [len(group) * min(self.speeds[d] for d in group) for group in plan.stage_devices]
        cuts = balanced_cuts(work.tolist(), shares)
        return plan.regrouped(stage_of_layer=stages_from_cuts(len(work), cuts))

    def layer_work(self, samples: int) -> np.ndarray:
        """Per-layer work per sample at micro-batches of ``samples`` (what the polish re-balances by), cached."""
        if samples not in self._work_by_samples:
            self._work_by_samples[samples] = np.diff(LayerCosts.from_library(self.library, samples).work_prefix)
        return self._work_by_samples[samples]


def _grouping(plan: Plan) -> tuple[Groups, int]:
    return plan.stage_devices, plan.micro_batches
