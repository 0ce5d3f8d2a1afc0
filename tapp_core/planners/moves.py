"""Neighbourhood moves on contiguous pipeline plans, shared by the local searches: AutoDDL's coordinate descent
(``autoddl``) and TAPP's polish (``tapp.polish``).

A contiguous plan is a cut list (see ``space``) with one device group per stage, in pipeline order. The moves
here are the ones both searches make: a stage boundary moved between its neighbours, two stages' device groups
exchanged, one stage's group changed (a device added to it, say). Each search chooses which positions and
devices to try, and in which order; the moves only one search makes stay with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from tapp_core.plan import Plan

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


def swapped_groups(groups: Groups) -> Iterator[Groups]:
    """Every two stages' device groups exchanged, pairs ``(a, b)`` with ``a < b`` in order."""
    for a, b in itertools.combinations(range(len(groups)), 2):
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
