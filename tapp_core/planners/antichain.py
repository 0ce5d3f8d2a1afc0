"""The antichain DAG of PipeDream / APapo: the down-sets of the layer graph a pipeline can cut at.

A *down-set* is a set of layers closed under predecessors: everything before a cut. Stage ``k`` of a pipeline
is the difference of two nested down-sets, so the down-sets are the states of a dynamic program over the DAG
(PipeDream's antichain DAG, APapo's augmented antichains). Enumerating all down-sets explodes on wide graphs,
so the graph is reduced first: positions crossed by a single tensor split it into *blocks* (a chain layer is a
block of its own; an Inception module is one block); inside a block, chains of layers with one consumer whose
consumer has one producer are contracted, because cutting inside such a chain only moves work between two
stages that a cut at the chain's end can also reach. A block with more than ``max_per_block`` down-sets is
kept whole, and ``DownSets.whole_blocks`` says which.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from tapp_core.planners.stage_costs import LayerCosts
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class DownSets:
    members: np.ndarray
    """``members[s, i]``: layer ``i`` is in down-set ``s``. Sorted by size: 0 is empty, the last is every layer."""
    work: np.ndarray
    """Forward plus backward seconds per sample of each down-set's layers, in the library they were built from
    (``work_in`` gives them in another kind's library)."""
    params: np.ndarray
    out_bytes: np.ndarray
    """Activation bytes per sample leaving the down-set (what a cut after it sends)."""
    out_tensors: np.ndarray
    strict_subset: np.ndarray
    """``strict_subset[a, b]``: down-set ``a`` is a strict subset of down-set ``b``."""
    whole_blocks: tuple[tuple[int, int], ...]
    """Layer ranges kept whole because they had too many down-sets."""

    def __len__(self) -> int:
        return len(self.members)

    def work_in(self, costs: LayerCosts) -> np.ndarray:
        """Forward plus backward seconds per sample of each down-set's layers, from ``costs``."""
        work: np.ndarray = self.members.astype(np.float64) @ _layer_work(costs)
        return work


def _layer_work(costs: LayerCosts) -> np.ndarray:
    work: np.ndarray = np.diff(costs.forward_prefix) + np.diff(costs.backward_prefix)
    return work


def _block_down_sets(library: LayerLibrary, start: int, stop: int, limit: int) -> list[int] | None:
    """Down-sets of the layers ``[start, stop)`` as bitmasks over those layers (bit ``i - start``), empty and
    full included; None if there are more than ``limit``."""
    size = stop - start
    group = list(range(size))  # chain contraction: every layer points at its chain's head

    def head(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i in range(start, stop):
        succ = library.layers[i].successors
        if len(succ) == 1 and start <= succ[0] < stop and len(library.layers[succ[0]].predecessors) == 1:
            group[succ[0] - start] = head(i - start)
    heads = sorted({head(i) for i in range(size)})
    mask_of = {h: 0 for h in heads}
    for i in range(size):
        mask_of[head(i)] |= 1 << i
    needs = {h: 0 for h in heads}
    for i in range(size):
        for p in library.layers[start + i].predecessors:
            if start <= p < stop and head(p - start) != head(i):
                needs[head(i)] |= mask_of[head(p - start)]
    found = {0}
    frontier = [0]
    while frontier:
        grown = []
        for current in frontier:
            for h in heads:
                if not current & mask_of[h] and needs[h] & current == needs[h]:
                    bigger = current | mask_of[h]
                    if bigger not in found:
                        found.add(bigger)
                        grown.append(bigger)
                        if len(found) > limit:
                            return None
        frontier = grown
    return sorted(found)


def down_sets(library: LayerLibrary, max_per_block: int = 512) -> DownSets:
    costs = LayerCosts.from_library(library)
    n = costs.n_layers
    bounds = [0, *costs.clean_cuts(), n]
    rows: list[np.ndarray] = []
    whole: list[tuple[int, int]] = []
    for start, stop in itertools.pairwise(bounds):
        masks = _block_down_sets(library, start, stop, max_per_block)
        if masks is None:
            whole.append((start, stop))
            masks = [0, (1 << (stop - start)) - 1]
        for mask in masks[:-1]:  # the full block is the next block's empty one
            row = np.zeros(n, dtype=bool)
            row[:start] = True
            row[start:stop] = [(mask >> i) & 1 == 1 for i in range(stop - start)]
            rows.append(row)
    rows.append(np.ones(n, dtype=bool))
    members = np.array(rows)
    members = members[np.argsort(members.sum(axis=1), kind="stable")]
    as_float = members.astype(np.float64)
    forward = _layer_work(costs)
    params = np.diff(costs.param_prefix)
    activation = np.array([layer.activation_bytes for layer in library.layers], dtype=np.float64)
    successors = np.zeros((n, n))
    for layer in library.layers:
        successors[layer.index, list(layer.successors)] = 1.0
    leaves = members & ((1.0 - as_float) @ successors.T > 0)
    sizes = as_float.sum(axis=1)
    overlap = as_float @ as_float.T
    return DownSets(
        members=members,
        work=as_float @ forward,
        params=as_float @ params,
        out_bytes=leaves.astype(np.float64) @ activation,
        out_tensors=leaves.sum(axis=1),
        strict_subset=(overlap == sizes[:, None]) & (sizes[:, None] < sizes[None, :]),
        whole_blocks=tuple(whole),
    )
