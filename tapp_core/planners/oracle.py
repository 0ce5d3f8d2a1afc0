"""The oracle: exhaustive search that proves the optimum under the cost model, for small cases.

The space is every *contiguous* plan (stages are ranges of the topological order, which is always monotone
over the DAG), with any number of stages, any ordered choice of disjoint device groups (a group of several
devices is a replicated stage), and every micro-batch choice, for each of its schedules (1f1b and async unless
told otherwise: the faster optimum is kept). By default a stage may
end at any of the ``n - 1`` positions; ``clean_cuts_only`` and ``max_blocks`` coarsen the graph (cut only
where one tensor crosses; then merge the lightest neighbouring blocks), and the plan's notes say how many
positions were searched. Plans that differ only by swapping interchangeable devices are tried once.

Branch and bound keeps it exhaustive but affordable: ``bounds.StepTimeBound`` gives a lower bound on the
estimate of every plan extending a partial one, the end of a stage is scanned in increasing order (its bound
only grows) and abandoned once it reaches the incumbent, and a plan is only estimated when its bound is
below the incumbent. Every plan of the space is therefore either estimated or proved no better
(``proved_optimal`` in the notes; False only when a budget or time limit cut the search short). The incumbent
starts from a balanced cut of every device grouping, which only speeds the proof up.

Activation recomputation (``Plan.recompute``) is searched exactly at no cost in plans: each plan of the space
recomputes on exactly the stages whose devices could not hold their activations otherwise
(``checks.memory_choices_where_needed``), the fastest of its variants that fits, since a stage's memory depends on
its own choice alone and recomputing only adds time. The step-time bound of a plan without recomputation bounds
its variants with it too. A replicated stage that does not fit shards its optimiser state first
(``Plan.shard_optimizer``) and recomputes only if that is not enough; sharding where it is not needed for memory,
only for the share of the update it saves, is outside the space (``leaves_out`` says so): it would double the
plans for each replicated stage.

``time_limit_s`` covers the whole search: the enumeration of device groupings (fewest stages first, for at most a
quarter of the limit), their starting incumbents (estimated until half the time left, so that the branch and bound
keeps the other half) and the branch and bound. Where any of the three was cut short the result is the best plan found, ``proved_optimal`` is False and
the notes say which part was cut (``groupings_cut``, ``incumbents_cut``).

``best_cuts`` is the branch and bound on one device grouping alone (TAPP's polish uses it on the best groupings it
found).

What the space leaves out (the notes' ``leaves_out`` says so on every plan): operator parallelism (a group's layers
run data parallel, never split: ``placement`` signatures) and unequal shares (a group shares its work equally). Its
optimum is the optimum of pipelines of data-parallel stages; a plan with split layers can beat it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.cost.checks import memory_choices_where_needed
from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import PlannerBase, PlannerError, ProgressCallback, SearchProgress
from tapp_core.planners.bounds import Chain, StepTimeBound
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.space import balanced_cuts, coarse_cut_positions, contiguous_plan
from tapp_core.planners.stage_costs import device_classes, relative_speeds
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.library import LayerLibrary

LEAVES_OUT = (
    "split layers (operator parallelism) and unequal shares: groups run data parallel with equal shares; "
    "a stage shards its optimiser state only where it needs the memory"
)

DEFAULT_SCHEDULES = ("1f1b", "async")
"""The oracle's schedules unless told: the bound holds for the asynchronous one too, whose steady-state step lasts
at least its busiest worker's work (``bounds.StepTimeBound``), so the branch and bound stays exact there."""

MAX_DEVICES = 16
"""The oracle refuses larger clusters: it enumerates every ordered grouping of the devices."""
MAX_GROUPINGS = 1_500_000
"""Nor does it go on past this many groupings (about 8 distinct devices: each grouping is then estimated)."""


def searchable_groupings(
    cluster: Cluster, max_replicas: int, max_groups: int, deadline: float = math.inf
) -> tuple[list[tuple[tuple[str, ...], ...]], bool]:
    """``device_groupings`` of at most ``max_groups`` groups, fewest stages first, and whether ``deadline`` cut
    their enumeration short. ``PlannerError`` when the cluster is beyond the exhaustive search's reach
    (``MAX_DEVICES``; ``MAX_GROUPINGS`` when no deadline bounds the enumeration)."""
    beyond = f"beyond the oracle's exhaustive search; plan cluster {cluster.name!r} with another method (tapp, pipedream, autoddl)"
    if len(cluster.devices) > MAX_DEVICES:
        raise PlannerError(f"{len(cluster.devices)} devices (the oracle takes at most {MAX_DEVICES}) are {beyond}")
    found: list[tuple[tuple[str, ...], ...]] = []
    for seen, grouping in enumerate(device_groupings(cluster, max_replicas), start=1):
        if len(grouping) > max_groups:
            break
        if seen > MAX_GROUPINGS and deadline == math.inf:
            raise PlannerError(f"more than {MAX_GROUPINGS:,} groupings of {len(cluster.devices)} devices are {beyond}")
        found.append(grouping)
        if seen % 1024 == 0 and time.perf_counter() > deadline:
            return found, True
    return found, False


def device_groupings(cluster: Cluster, max_replicas: int) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every ordered sequence of disjoint non-empty device groups (groups of at most ``max_replicas``), once per
    arrangement up to swapping interchangeable devices; fewest stages first (so a caller that stops early has
    every plan shape with few stages)."""
    classes = device_classes(cluster)
    class_of = {name: i for i, group in enumerate(classes) for name in group}
    names = cluster.device_names

    def extend(
        prefix: tuple[tuple[str, ...], ...], used: frozenset[str], stages: int, seen: set[tuple[tuple[int, ...], ...]]
    ) -> Iterator[tuple[tuple[str, ...], ...]]:
        free = [d for d in names if d not in used]
        for size in range(1, min(max_replicas, len(free)) + 1):
            for group in itertools.combinations(free, size):
                grouping = (*prefix, group)
                signature = tuple(tuple(sorted(class_of[d] for d in g)) for g in grouping)
                if signature in seen:
                    continue
                seen.add(signature)
                if len(grouping) == stages:
                    yield grouping
                else:
                    yield from extend(grouping, used | set(group), stages, seen)

    for stages in range(1, len(names) + 1):
        yield from extend((), frozenset(), stages, set())


@dataclass
class _Search:
    library: LayerLibrary
    positions: list[int]
    evaluator: PlanEvaluator
    schedule: str
    batch: int
    deadline: float
    budget: int | None
    pruned: int = 0
    complete: bool = True
    """No part of the space was left unexplored (so far)."""
    stopped: bool = False
    """The deadline or the budget stopped the branch and bound."""

    def run(self, grouping: tuple[tuple[str, ...], ...], micro_batches: int, bound: StepTimeBound) -> None:
        samples = self.batch // micro_batches
        if any(samples % len(group) for group in grouping):
            return
        groups = [bound.group(group) for group in grouping]
        # suffix_throughput[s]: samples per second of the reference library's work that groups s.. process together.
        suffix_throughput = np.cumsum([g.throughput for g in reversed(groups)])[::-1]
        self._grouping, self._groups, self._bound = grouping, groups, bound
        self._suffix_throughput = suffix_throughput
        self._descend(0, 0, [], 0.0, Chain())

    def _out_of_time(self) -> bool:
        if time.perf_counter() > self.deadline or (
            self.budget is not None and self.evaluator.evaluations >= self.budget
        ):
            self.stopped, self.complete = True, False
        return self.stopped

    def _descend(self, s: int, start: int, cuts: list[int], partial: float, chain: Chain) -> None:
        bound, groups = self._bound, self._groups
        n = bound.costs.n_layers
        k = len(groups)
        last = s == k - 1
        if last:
            stops = [n]
        else:
            stops = [p for p in self.positions if p > start]
            stops = stops[: max(0, len(stops) - (k - 2 - s))]
        work = bound.costs.work_prefix
        m = bound.micro_batches
        samples = self.batch // m
        per_mb = 2 * bound.least_per_call_s
        for stop in stops:
            if self._out_of_time():
                return
            best = self.evaluator.best_time
            if not last:
                rest = float(work[n] - work[stop])
                if m * (samples * rest / self._suffix_throughput[s + 1] + per_mb) >= best:
                    self.pruned += 1
                    continue
            linked = s > 0 and bound.depends(start, stop)
            here = chain if linked else Chain()
            terms = bound.terms(groups[s], start, stop)
            value = max(partial, bound.stage_bound(terms, here, s, k))
            if value >= best:  # the stage's bound only grows with its end
                self.pruned += 1
                break
            if last:
                if bound.bound(cuts, groups) >= best:
                    self.pruned += 1
                    continue
                plan = contiguous_plan(self.library, cuts, self._grouping, m, self.schedule, self.batch)
                self.evaluator.step_time(memory_choices_where_needed(plan, self.evaluator.context))
            else:
                out = bound.transfer(groups[s], groups[s + 1], stop)
                self._descend(s + 1, stop, [*cuts, stop], value, bound.next_chain(here, terms, out))


@dataclass
class OraclePlanner(PlannerBase):
    name = "oracle"

    clean_cuts_only: bool = False
    """Cut only where one tensor crosses (between blocks); False: at every position of the topological order."""
    max_blocks: int | None = None
    """Most blocks of the coarsened graph (cut positions + 1); None: no coarsening."""
    max_replicas: int | None = None
    """Largest replica group; None: any."""
    time_limit_s: float | None = None
    """Stop (unproved) after this long, every schedule's search together (``for_schedule``); None: no limit."""

    def __post_init__(self) -> None:
        """Neither ``schedule`` nor ``schedules`` given: both pipelines (``DEFAULT_SCHEDULES``), each proved on its
        own, the faster kept (``PlannerBase``)."""
        if self.schedules is None and self.schedule == PlannerBase.schedule:
            self.schedules = DEFAULT_SCHEDULES
        super().__post_init__()

    def for_schedule(self, name: str, schedules: int) -> OraclePlanner:
        """On schedule ``name`` alone, with its share of the time limit: the limit bounds the whole search, every
        schedule's proof together."""
        limit = self.time_limit_s / schedules if self.time_limit_s else None
        return dataclasses.replace(self, schedule=name, schedules=None, time_limit_s=limit)

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        started = time.perf_counter()
        deadline = started + self.time_limit_s if self.time_limit_s else math.inf
        batch = self.resolved_batch_size(library)
        choices = self.micro_batch_choices(library)
        bound_of = {m: StepTimeBound(context, self.schedule_spec, m, batch) for m in choices}
        positions = coarse_cut_positions(bound_of[choices[0]].costs, self.max_blocks, self.clean_cuts_only)
        evaluator = PlanEvaluator(context, lazy_validation=True)
        quarter = started + (deadline - started) / 4
        most_replicas = self.max_replicas or len(cluster.devices)
        groupings, groupings_cut = searchable_groupings(cluster, most_replicas, len(positions) + 1, quarter)
        incumbents_ends = time.perf_counter() + (deadline - time.perf_counter()) / 2
        incumbents = self._incumbents(library, groupings, positions, choices, evaluator, batch, incumbents_ends)
        incumbents_cut = len(incumbents) < len(groupings) * len(choices)
        search = _Search(library, positions, evaluator, self.schedule_spec, batch, deadline, budget)
        search.complete = not (groupings_cut or incumbents_cut)
        for done, (_, grouping, m) in enumerate(sorted(incumbents, key=lambda item: item[0]), start=1):
            search.run(grouping, m, bound_of[m])
            if progress and (done % 50 == 0 or done == len(incumbents)):
                progress(
                    SearchProgress(
                        self.name,
                        done,
                        len(incumbents),
                        evaluator.evaluations,
                        evaluator.best_time,
                        time.perf_counter() - started,
                    )
                )
            if search.stopped:
                break
        if evaluator.best_plan is None:
            raise evaluator.no_plan(f"the oracle found no plan of {library.model} that fits cluster {cluster.name!r}")
        notes: dict[str, object] = {
            "evaluations": evaluator.evaluations,
            "proved_optimal": search.complete,
            "cut_positions": len(positions),
            "all_positions": len(library.layers) - 1,
            "coarsened": len(positions) < len(library.layers) - 1,
            "groupings": len(groupings),
            "groupings_cut": groupings_cut,
            "incumbents_cut": incumbents_cut,
            "pruned": search.pruned,
            "leaves_out": LEAVES_OUT,
        }
        return dataclasses.replace(evaluator.best_plan, notes=notes)

    def _incumbents(
        self,
        library: LayerLibrary,
        groupings: Sequence[tuple[tuple[str, ...], ...]],
        positions: list[int],
        choices: Sequence[int],
        evaluator: PlanEvaluator,
        batch: int,
        deadline: float = math.inf,
    ) -> list[tuple[float, tuple[tuple[str, ...], ...], int]]:
        """A balanced cut of every grouping and micro-batch count, estimated in the groupings' order until
        ``deadline`` (at least the first grouping): the starting incumbent, and the order in which the branch and
        bound visits groupings (most promising first)."""
        context = evaluator.context
        weights = [layer.forward_s + layer.backward_s for layer in library.layers]
        speeds = relative_speeds(context)
        out: list[tuple[float, tuple[tuple[str, ...], ...], int]] = []
        for grouping in groupings:
            if out and time.perf_counter() > deadline:
                break
            shares = [len(g) * min(speeds[d] for d in g) for g in grouping]
            cuts = balanced_cuts(weights, shares, positions) if len(grouping) > 1 else []
            for m in choices:
                plan = contiguous_plan(library, cuts, grouping, m, self.schedule_spec, batch)
                out.append((evaluator.step_time(memory_choices_where_needed(plan, context)), grouping, m))
        return out


def best_cuts(
    context: CostContext,
    grouping: Sequence[Sequence[str]],
    micro_batches: int,
    schedule: str,
    batch_size: int,
    below_s: float = math.inf,
    deadline: float = math.inf,
    budget: int | None = None,
    max_blocks: int | None = None,
) -> tuple[Plan | None, int]:
    """The oracle's branch and bound on one sequence of device groups and one micro-batch count: the fastest
    contiguous plan on them faster than ``below_s`` (None if there is none), and how many plans it estimated.
    ``max_blocks`` coarsens the cut positions as the oracle's option does (None: every position). Stops at
    ``deadline`` (``time.perf_counter()``) or after ``budget`` estimates with the best found so far. For a local
    search that has found a good grouping and wants its best cuts."""
    library = context.library
    groups = tuple(tuple(group) for group in grouping)
    evaluator = PlanEvaluator(context, lazy_validation=True)
    evaluator.best_time = below_s
    bound = StepTimeBound(context, schedule, micro_batches, batch_size)
    positions = coarse_cut_positions(bound.costs, max_blocks)
    if len(groups) > len(positions) + 1:
        return None, 0
    search = _Search(library, positions, evaluator, schedule, batch_size, deadline, budget)
    search.run(groups, micro_batches, bound)
    return evaluator.best_plan, evaluator.evaluations
