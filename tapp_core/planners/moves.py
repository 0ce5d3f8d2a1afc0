"""Neighbourhood moves on contiguous pipeline plans, shared by the local searches: AutoDDL's coordinate descent
(``autoddl``) and TAPP's polish (``tapp.polish``).

A contiguous plan is a cut list (see ``space``) with one device group per stage, in pipeline order. The moves
here are the ones both searches make: a stage boundary moved between its neighbours, two stages' device groups
exchanged, one stage's group changed (a device added to it, say), and the moves that shrink a plan (a replica
dropped, two neighbouring stages merged), and a stage's activation recomputation turned on or off (memory traded
for a forward more). Each search chooses which positions and devices to try, and in which order; the moves only
one search makes stay with it.

Devices of one class (``planners.stage_costs.device_classes``: interchangeable, no estimate tells them apart) are tried
once where a ``class_of`` mapping is given: a move to another device of the same class gives the same plan up to
names, so large clusters of a few kinds of device cost a few moves, not one per device.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence

from tapp_core.plan.plan import Plan, optimizer_unshardable
from tapp_core.planners.space import stages_from_cuts

Groups = tuple[tuple[str, ...], ...]
"""The device group of every stage, in pipeline order."""


def cuts_of(plan: Plan) -> list[int] | None:
    """The plan's cut list, None if its stages are not contiguous in layer order."""
    order = list(plan.stage_of_layer)
    if order != sorted(order):
        return None
    return [order.index(k) for k in range(1, plan.n_stages)]


def boundary_positions(cuts: Sequence[int], j: int, n_layers: int) -> range:
    """Where cut ``j`` can move with every stage keeping at least one layer: strictly between its neighbours."""
    low = cuts[j - 1] + 1 if j > 0 else 1
    high = cuts[j + 1] - 1 if j + 1 < len(cuts) else n_layers - 1
    return range(low, high + 1)


def moved_cut(cuts: Sequence[int], j: int, position: int) -> tuple[int, ...]:
    """The cut list with cut ``j`` at ``position`` (one of ``boundary_positions``)."""
    return (*cuts[:j], position, *cuts[j + 1 :])


def swapped_groups(groups: Groups, class_of: Mapping[str, int] | None = None) -> Iterator[Groups]:
    """Every two stages' device groups exchanged, pairs ``(a, b)`` with ``a < b`` in order; with ``class_of``, not
    two groups of the same classes (the swap would change nothing but names)."""
    for a, b in itertools.combinations(range(len(groups)), 2):
        if class_of is not None and signature(groups[a], class_of) == signature(groups[b], class_of):
            continue
        swapped = list(groups)
        swapped[a], swapped[b] = groups[b], groups[a]
        yield tuple(swapped)


def with_group(groups: Groups, stage: int, group: tuple[str, ...]) -> Groups:
    """``groups`` with stage ``stage`` on ``group`` instead."""
    return (*groups[:stage], group, *groups[stage + 1 :])


def unused_devices(groups: Groups, devices: Sequence[str]) -> list[str]:
    """The devices, in their order, that no stage uses."""
    used = {d for group in groups for d in group}
    return [d for d in devices if d not in used]


def signature(group: Sequence[str], class_of: Mapping[str, int]) -> tuple[int, ...]:
    """A device group up to interchangeable devices: its devices' classes, sorted."""
    return tuple(sorted(class_of[d] for d in group))


def one_per_class(devices: Sequence[str], class_of: Mapping[str, int] | None) -> list[str]:
    """``devices``, keeping only the first of each class (all of them without ``class_of``)."""
    if class_of is None:
        return list(devices)
    seen: set[int] = set()
    out = []
    for d in devices:
        if class_of[d] not in seen:
            seen.add(class_of[d])
            out.append(d)
    return out


def dropped_replicas(groups: Groups, class_of: Mapping[str, int] | None = None) -> Iterator[Groups]:
    """Every replicated stage with one of its devices (one per class) taken out and left idle."""
    for stage, group in enumerate(groups):
        if len(group) > 1:
            for device in one_per_class(group[::-1], class_of):
                yield with_group(groups, stage, tuple(d for d in group if d != device))


def merged_neighbours(plan: Plan) -> Iterator[Plan]:
    """A contiguous plan with two neighbouring stages made one, on the first's devices, the second's, or both
    (replicas, where each gets a sample of the micro-batch); the devices it no longer uses are left idle."""
    cuts = cuts_of(plan)
    if cuts is None:
        return
    groups = plan.stage_devices
    n = len(plan.stage_of_layer)
    for j in range(len(cuts)):
        stages = stages_from_cuts(n, [*cuts[:j], *cuts[j + 1 :]])
        both = (*groups[j], *groups[j + 1])
        merged = [groups[j], groups[j + 1]] + ([both] if len(both) <= plan.micro_batch_size else [])
        for group in merged:
            devices = (*groups[:j], group, *groups[j + 2 :])
            yield plan.regrouped(stage_of_layer=stages, stage_devices=devices)


def recompute_toggled(plan: Plan) -> Iterator[Plan]:
    """The plan with one stage's activation recomputation turned on or off, stage by stage (a stage whose layers
    run split signatures cannot recompute: it is left as it is)."""
    for stage in range(plan.n_stages):
        if plan.recomputes(stage):
            yield dataclasses.replace(plan, recompute=tuple(s for s in plan.recompute if s != stage))
        elif not plan.runs_split(stage):
            yield dataclasses.replace(plan, recompute=(*plan.recompute, stage))


def optimizer_shard_toggled(plan: Plan) -> Iterator[Plan]:
    """The plan with one stage's sharded optimiser state turned on or off, stage by stage (where it may shard:
    ``plan.optimizer_unshardable``)."""
    for stage in range(plan.n_stages):
        if plan.shards_optimizer(stage):
            yield dataclasses.replace(plan, shard_optimizer=tuple(s for s in plan.shard_optimizer if s != stage))
        elif optimizer_unshardable(plan, stage) is None:
            yield dataclasses.replace(plan, shard_optimizer=(*plan.shard_optimizer, stage))


def collapsed(plan: Plan, devices: Sequence[str]) -> Iterator[Plan]:
    """The whole model on one of ``devices``, a single-stage plan each, at the plan's micro-batch count."""
    for device in devices:
        yield plan.regrouped(stage_of_layer=(0,) * len(plan.stage_of_layer), stage_devices=((device,),))
