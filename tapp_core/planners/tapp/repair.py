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
    cost = np.zeros((samples, groups))
    # came_from[i, s, g]: group of layer i - 1 on the cheapest path that puts layer i in group g.
    came_from = np.zeros((n, samples, groups), dtype=np.int16)
    rows = np.arange(samples)
    for i in range(n):
        # Cheapest way to reach group g from any group <= g; on ties the lowest such group.
        running = np.minimum.accumulate(cost, axis=1)
        starts_new_min = np.ones_like(cost, dtype=bool)
        starts_new_min[:, 1:] = cost[:, 1:] < running[:, :-1]
        came_from[i] = np.maximum.accumulate(np.where(starts_new_min, choices[None, :], 0), axis=1)
        cost = running + weights[i] * (labels[:, i][:, None] != choices[None, :])
    out = np.zeros((samples, n), dtype=np.int64)
    current = np.argmin(cost, axis=1)
    for i in range(n - 1, -1, -1):
        out[:, i] = current
        current = came_from[i][rows, current]
    return out


def compact(groups: np.ndarray) -> np.ndarray:
    """Renumber each sample's non-empty groups 0..k-1, keeping their order."""
    out = np.empty_like(groups)
    for s, row in enumerate(groups):
        present = np.unique(row)
        out[s] = np.searchsorted(present, row)
    return out
