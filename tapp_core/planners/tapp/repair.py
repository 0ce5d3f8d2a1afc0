"""The monotone repair: a deterministic rule that turns any sampled grouping into a valid pipeline.

The partition network samples a group for every layer independently, so a sample can put a layer in an
earlier group than one of its producers. The repair picks, among all labelings that never decrease along the
library's topological order (and so never run backward over any edge of the DAG), the one that disagrees with
the sample on the least layer weight (the layers' compute time, plus a small floor so that free layers still
count): an isotonic regression with the 0/1 loss, solved exactly by dynamic programming over (layer, group).
Isolated outliers are outvoted by their neighbours instead of dragging everything after them into a later
stage, and a sample that is already monotone is left as it is. Ties go to the lower group. Empty groups are then
dropped, so the groups of a repaired sample are its stages 0..k-1.
"""

from __future__ import annotations

import numpy as np

WEIGHT_FLOOR = 0.01
"""Fraction of the mean layer weight every layer weighs at least."""


def repair_weights(work: np.ndarray) -> np.ndarray:
    mean = float(np.mean(work)) if len(work) else 1.0
    return np.maximum(work, WEIGHT_FLOOR * mean) if mean > 0 else np.ones_like(work)


def monotone_groups(labels: np.ndarray, weights: np.ndarray, groups: int) -> np.ndarray:
    """(samples, layers) sampled groups -> the cheapest non-decreasing relabeling of each sample."""
    samples, n = labels.shape
    choices = np.arange(groups)
    mismatch = weights[:, None, None] * (labels.T[:, :, None] != choices[None, None, :])
    # reach[i, s, g]: cheapest labeling of layers < i that lets layer i take group g (its group <= g).
    reach = np.empty((n, samples, groups))
    cost = np.zeros((samples, groups))
    for i in range(n):
        reach[i] = np.minimum.accumulate(cost, axis=1)
        cost = reach[i] + mismatch[i]
    out = np.empty((samples, n), dtype=np.int64)
    current = np.argmin(cost, axis=1)
    for i in range(n - 1, 0, -1):
        out[:, i] = current
        # The previous layer's group: the lowest g' <= current whose path cost is the prefix minimum.
        before = reach[i - 1] + mismatch[i - 1]
        before = np.where(choices[None, :] <= current[:, None], before, np.inf)
        current = np.argmin(before, axis=1)
    out[:, 0] = current
    return out


def compact(groups: np.ndarray) -> np.ndarray:
    """Renumber each sample's non-empty groups 0..k-1, keeping their order."""
    out = np.empty_like(groups)
    for s, row in enumerate(groups):
        present = np.unique(row)
        out[s] = np.searchsorted(present, row)
    return out
