"""Building plans from contiguous cuts, and coarsening the cut positions of a large graph.

A *cut list* is the sorted interior positions where stages end: ``(p1, p2)`` makes three stages, layers
``[0, p1)``, ``[p1, p2)`` and ``[p2, n)``. Contiguous ranges in topological order are always monotone over the
DAG, so every cut list with one device group per stage is a valid pipeline plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tapp_core.plan.plan import Plan
from tapp_core.plan.schedules import parse_schedule_spec
from tapp_core.planners.stage_costs import LayerCosts
from tapp_core.profile.library import LayerLibrary


def stages_from_cuts(n_layers: int, cuts: Sequence[int]) -> tuple[int, ...]:
    """``stage_of_layer`` for a cut list."""
    stage_of_layer = np.zeros(n_layers, dtype=np.int64)
    for cut in cuts:
        stage_of_layer[cut:] += 1
    return tuple(int(s) for s in stage_of_layer)


def contiguous_plan(
    library: LayerLibrary,
    cuts: Sequence[int],
    stage_devices: Sequence[Sequence[str]],
    micro_batches: int,
    schedule: str,
    batch_size: int,
) -> Plan:
    """The plan of a cut list and its stages' device groups; ``schedule`` may carry a staleness bound
    (``schedules.schedule_spec``: ``async:1``)."""
    if len(stage_devices) != len(cuts) + 1:
        raise ValueError(f"{len(cuts)} cuts make {len(cuts) + 1} stages, but {len(stage_devices)} device groups given")
    name, staleness = parse_schedule_spec(schedule)
    return Plan(
        model=library.model,
        batch_size=batch_size,
        micro_batches=micro_batches,
        schedule=name,
        staleness=staleness,
        stage_of_layer=stages_from_cuts(len(library.layers), cuts),
        stage_devices=tuple(tuple(group) for group in stage_devices),
    )


def balanced_cuts(weights: Sequence[float], shares: Sequence[float], allowed: Sequence[int] | None = None) -> list[int]:
    """Cut positions that give stage ``s`` about ``shares[s]`` of the total weight (shares need not sum to 1).

    Each cut goes to the allowed position nearest its target cumulative weight, kept strictly increasing so that
    no stage is empty. ``allowed`` defaults to every interior position.
    """
    n = len(weights)
    k = len(shares)
    if k > n:
        raise ValueError(f"cannot make {k} non-empty stages from {n} layers")
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    total = prefix[-1]
    fractions = np.cumsum(shares)[:-1] / sum(shares)
    candidates = np.array(sorted(allowed) if allowed is not None else range(1, n), dtype=np.int64)
    cuts: list[int] = []
    for s, fraction in enumerate(fractions):
        lowest = cuts[-1] + 1 if cuts else 1
        highest = n - (k - 1 - s)  # leave one layer for every later stage
        usable = candidates[(candidates >= lowest) & (candidates <= highest)]
        if usable.size == 0:
            usable = np.arange(lowest, highest + 1)
        cuts.append(int(usable[np.argmin(np.abs(prefix[usable] - fraction * total))]))
    return cuts


def coarse_cut_positions(costs: LayerCosts, max_blocks: int | None, clean_only: bool = False) -> list[int]:
    """Interior positions to cut at: every position, or only the clean cuts (one tensor crossing), thinned to at
    most ``max_blocks - 1``.

    While there are too many, the position whose removal merges the two lightest neighbouring blocks (by work)
    goes, so the blocks stay as even as the graph allows. Deterministic.
    """
    positions = costs.clean_cuts() if clean_only else list(range(1, costs.n_layers))
    work = costs.work_prefix
    while max_blocks is not None and len(positions) > max_blocks - 1:
        bounds = [0, *positions, costs.n_layers]
        merged = [work[bounds[i + 2]] - work[bounds[i]] for i in range(len(positions))]
        positions.pop(int(np.argmin(merged)))
    return positions
