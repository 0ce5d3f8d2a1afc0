"""AutoDDL (seed 002): coordinate descent over data, operator and pipeline parallelism on the cost model.

AutoDDL describes a parallelisation scheme with OneFlow's SBP layouts and searches it by coordinate descent over
an analytical cost model. Here the scheme is a contiguous pipeline plan whose stages may run on groups of devices,
each layer of a group with a signature (``tapp_core.plan.placement``: ``data``, or a Linear's or Conv2d's ``col`` and
``row`` splits), and the model is ``tapp_core.cost.simulation``. The coordinates are Pipeline CD's
(``pipeline_cd.Descent``: stage boundaries, device groups, replication, the number of stages, micro-batches) and:

- each split-capable layer's signature on a group of several devices;
- a stage's signatures at once, by pattern (``patterns.PATTERNS``: all ``data``; every such layer ``col``;
  Megatron's pairs; the heaviest layer and its neighbour as a pair; Megatron's attention and MLP splits, found by the
  layout pass), because one layer's split alone rarely pays;
- a left-over device added to a stage together with a pattern (a replica that only pays once the layers split);
- the group's shares: equal, or in proportion to the devices' speeds (their kinds' libraries and speeds);
- each stage's activation recomputation, on or off (``Plan.recompute``: memory for a forward more);
- each replicated stage's sharded optimiser state, on or off (``Plan.shard_optimizer``: the optimiser's memory and
  update shared among the group, for an allgather after the update).

The search runs Pipeline CD's descent to its end (from a split balanced to the devices' speeds), then sweeps every
coordinate above from there, and again from every device running the whole model (data parallel, shares by
speed), each until a sweep changes nothing or the budget is spent; the best plan estimated wins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tapp_core.cost.context import CostContext
from tapp_core.plan.placement import SIGNATURES
from tapp_core.plan.plan import Plan, optimizer_unshardable
from tapp_core.planners.base import ProgressCallback
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.moves import Groups, unused_devices, with_group
from tapp_core.planners.patterns import PATTERNS, pattern_signatures, with_signatures
from tapp_core.planners.pipeline_cd import Descent, PipelineCdPlanner, Point
from tapp_core.planners.stage_costs import relative_speeds, speed_shares
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class SbpPoint(Point):
    signatures: tuple[tuple[int, str], ...] = ()
    """(layer, signature) of the layers that run other than ``data`` (kept only on groups of several devices)."""
    proportional: bool = True
    """Groups share their work in proportion to their devices' speeds (else equally)."""
    recompute: tuple[int, ...] = ()
    """The stages that recompute their activations (``Plan.recompute``; none whose layers run split)."""
    shard_optimizer: tuple[int, ...] = ()
    """The stages that shard their optimiser state (``Plan.shard_optimizer``; kept where the stage may)."""


class SbpDescent(Descent):
    def __init__(self, planner: PipelineCdPlanner, library: LayerLibrary, evaluator: PlanEvaluator, batch: int):
        super().__init__(planner, library, evaluator, batch)
        self.speeds = relative_speeds(evaluator.context)
        self.splittable = [x.index for x in library.layers if x.op in SIGNATURES]
        self.weight = {x.index: x.param_bytes for x in library.layers}

    def point(self, cuts: tuple[int, ...], groups: Groups, micro_batches: int) -> Point:
        return SbpPoint(cuts, groups, micro_batches)

    def plan(self, point: Point) -> Plan:
        plan = super().plan(point)
        if not isinstance(point, SbpPoint):
            return plan
        grouped = {s for s, group in enumerate(point.groups) if len(group) > 1}
        signatures = tuple((x, sig) for x, sig in point.signatures if plan.stage_of_layer[x] in grouped)
        shares: tuple[tuple[float, ...], ...] = ()
        if point.proportional and grouped:
            shares = tuple(speed_shares(self.speeds, group) for group in point.groups)
        split = {plan.stage_of_layer[x] for x, _ in signatures}
        recompute = tuple(s for s in point.recompute if s < plan.n_stages and s not in split)
        plan = dataclasses.replace(plan, signatures=signatures, stage_shares=shares, recompute=recompute)
        shard = tuple(s for s in point.shard_optimizer if optimizer_unshardable(plan, s) is None)
        return dataclasses.replace(plan, shard_optimizer=shard) if shard else plan

    def coordinates(self, point: Point) -> list[Iterator[Point]]:
        assert isinstance(point, SbpPoint)
        out = super().coordinates(point)
        out += [self._grown(point), self._patterns(point), self._shares(point), self._recompute(point)]
        out.append(self._shard_optimizer(point))
        out += [self._layer(point, x) for x in self._grouped_splittable(point)]
        return out

    def _grouped_splittable(self, p: SbpPoint) -> list[int]:
        stages = self._stage_of(p)
        return [x for x in self.splittable if len(p.groups[stages[x]]) > 1]

    def _stage_of(self, p: Point) -> list[int]:
        return list(self.plan(dataclasses.replace(p, micro_batches=self.choices[0])).stage_of_layer)

    def _layer(self, p: SbpPoint, layer: int) -> Iterator[Point]:
        for signature in SIGNATURES[self.library.layers[layer].op]:
            yield dataclasses.replace(p, signatures=with_signatures(p.signatures, {layer: signature}))

    def _shares(self, p: SbpPoint) -> Iterator[Point]:
        yield dataclasses.replace(p, proportional=not p.proportional)

    def _recompute(self, p: SbpPoint) -> Iterator[Point]:
        for stage in range(len(p.groups)):
            turned = set(p.recompute) ^ {stage}
            yield dataclasses.replace(p, recompute=tuple(sorted(turned)))

    def _shard_optimizer(self, p: SbpPoint) -> Iterator[Point]:
        for stage, group in enumerate(p.groups):
            if len(group) > 1:
                yield dataclasses.replace(p, shard_optimizer=tuple(sorted(set(p.shard_optimizer) ^ {stage})))

    def _patterns(self, p: SbpPoint) -> Iterator[Point]:
        stages = self._stage_of(p)
        for s, group in enumerate(p.groups):
            if len(group) > 1:
                layers = [x for x in self.splittable if stages[x] == s]
                for pattern in PATTERNS:
                    yield dataclasses.replace(
                        p, signatures=with_signatures(p.signatures, self.pattern(pattern, layers))
                    )

    def _grown(self, p: SbpPoint) -> Iterator[Point]:
        """A left-over device added to a stage, with each pattern but ``data`` (that is Pipeline CD's move)."""
        stages = self._stage_of(p)
        for device in unused_devices(p.groups, self.devices):
            for s in range(len(p.groups)):
                layers = [x for x in self.splittable if stages[x] == s]
                grown = dataclasses.replace(p, groups=with_group(p.groups, s, (*p.groups[s], device)))
                for pattern in PATTERNS[1:]:
                    yield dataclasses.replace(
                        grown, signatures=with_signatures(p.signatures, self.pattern(pattern, layers))
                    )

    def pattern(self, name: str, layers: Sequence[int]) -> dict[int, str]:
        return pattern_signatures(name, layers, self.weight, self.library.specs())


@dataclass
class AutoDdlPlanner(PipelineCdPlanner):
    """AutoDDL: Pipeline CD's descent to its end, then the descent over every coordinate, operator parallelism
    included, from there: so it never ends behind the pipeline-only search on the same budget and start."""

    name = "autoddl"

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        evaluator = PlanEvaluator(context, budget=budget)
        batch = self.resolved_batch_size(library)
        pipeline = Descent(self, library, evaluator, batch)
        reached, first = self.descend(pipeline, self._start(context, pipeline), progress)
        split = SbpDescent(self, library, evaluator, batch)
        sweeps = first
        for start in (
            SbpPoint(reached.cuts, reached.groups, reached.micro_batches),
            SbpPoint((), (tuple(cluster.device_names),), reached.micro_batches),  # every device on every layer
        ):
            if evaluator.exhausted:
                break
            sweeps += self.descend(split, start, progress)[1]
        return self.found(evaluator, {"sweeps": sweeps, "pipeline_sweeps": first})
