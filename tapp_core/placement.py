"""Placement: how the devices of one stage hold each tensor, and what it costs to change how they hold it.

The devices of a stage form a *group*; each device takes a *share* of the group's work (``shares``, fractions
that sum to 1; equal unless a plan says otherwise, e.g. in proportion to each device's speed). A tensor is held
by the group in one of three layouts (OneFlow's SBP, as AutoDDL uses them):

``Split(dim)``
    each device holds a contiguous slice of the tensor along ``dim``, its share of it (``split_ranges``);
``Broadcast``
    every device holds the whole tensor;
``PartialSum``
    every device holds a tensor of the full shape, and the tensor is their sum.

Data-parallel replicas are one case: every layer's input and output ``Split(0)`` (each device its share of the
samples), its weights ``Broadcast``, and the weights' gradients ``PartialSum`` until the update allreduces them.

A layout change is a collective among the group (``conversion``): Split to Broadcast is an allgather, PartialSum
to Broadcast an allreduce, PartialSum to Split a reduce-scatter, Split along one dimension to Split along another
an all-to-all, and Broadcast to Split or to PartialSum is local (each device keeps its slice, or one device keeps
the tensor and the others zeros). ``traffic`` says what a collective moves: the bytes each device sends over its
link and the number of message rounds, on the bandwidth-optimal ring algorithms (AutoDDL's cost table). The time
this takes on a cluster's links is ``tapp_core.costs``' business.

Between stages, every tensor crosses as ``Split(0)`` on both sides: each device of the receiving stage gets its
share of the samples from the devices of the sending stage that hold them (``row_routes``).

This module imports no other module of the project: the plan, the memory check, the cost model, the runtime and
the planners all ask it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Split:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Broadcast:
    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True, slots=True)
class PartialSum:
    def __str__(self) -> str:
        return "P"


Layout = Split | Broadcast | PartialSum
SAMPLES = Split(0)
"""Split along the samples: how data-parallel replicas hold activations, and how every tensor crosses a cut."""
BROADCAST = Broadcast()
PARTIAL_SUM = PartialSum()


class PlacementError(ValueError):
    """Shares or layouts that cannot describe a group; the message names the problem."""


# ---------------------------------------------------------------------------------------------------------------
# Shares: how a group divides its work

SHARE_DIGITS = 6
"""Shares are rounded to this many decimals, so that a plan's id does not depend on float noise."""


def even_shares(devices: int) -> tuple[float, ...]:
    return tuple(1.0 / devices for _ in range(devices))


def normalized_shares(weights: Sequence[float]) -> tuple[float, ...]:
    """``weights`` scaled to sum to 1 and rounded (``SHARE_DIGITS``); the last takes the rounding's rest."""
    if not weights or min(weights) <= 0 or not all(math.isfinite(w) for w in weights):
        raise PlacementError(f"shares must be positive numbers, got {list(weights)}")
    total = sum(weights)
    rounded = [round(w / total, SHARE_DIGITS) for w in weights[:-1]]
    return (*rounded, round(1.0 - sum(rounded), SHARE_DIGITS))


def check_shares(shares: Sequence[float], devices: int) -> None:
    """One positive share per device, summing to 1 (to the rounding of ``SHARE_DIGITS``)."""
    if len(shares) != devices:
        raise PlacementError(f"{len(shares)} shares for {devices} devices")
    if min(shares) <= 0 or not all(math.isfinite(s) for s in shares):
        raise PlacementError(f"shares must be positive, got {list(shares)}")
    if abs(sum(shares) - 1.0) > 10 ** (1 - SHARE_DIGITS) * devices:
        raise PlacementError(f"shares must sum to 1, got {list(shares)} (sum {sum(shares):.6g})")


def split_sizes(total: int, shares: Sequence[float]) -> tuple[int, ...]:
    """``total`` items divided by ``shares``: each device's exact share rounded down, and the items left over one each
    to the devices whose shares lost most to the rounding (ties: the first). Even shares of a divisible total give
    equal sizes."""
    exact = [total * s for s in shares]
    sizes = [math.floor(x + 1e-9) for x in exact]
    left = total - sum(sizes)
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: max(0, left)]:
        sizes[i] += 1
    return tuple(sizes)


def split_ranges(total: int, shares: Sequence[float]) -> tuple[tuple[int, int], ...]:
    """Each device's contiguous range ``[start, stop)`` of ``total`` items (``split_sizes``), in device order."""
    ranges = []
    start = 0
    for size in split_sizes(total, shares):
        ranges.append((start, start + size))
        start += size
    return tuple(ranges)


@dataclass(frozen=True, slots=True)
class RowRoute:
    """Rows ``[lo, hi)`` of a micro-batch that device ``sender`` of one group holds and device ``receiver`` of
    another needs (indices are the devices' positions in their groups)."""

    sender: int
    receiver: int
    lo: int
    hi: int


def row_routes(rows: int, sender_shares: Sequence[float], receiver_shares: Sequence[float]) -> tuple[RowRoute, ...]:
    """How a tensor of ``rows`` samples held ``Split(0)`` by one group reaches another group that holds it
    ``Split(0)``: every overlap of a sender's rows with a receiver's, in sender then receiver order."""
    routes = []
    for p, (p_lo, p_hi) in enumerate(split_ranges(rows, sender_shares)):
        for q, (q_lo, q_hi) in enumerate(split_ranges(rows, receiver_shares)):
            lo, hi = max(p_lo, q_lo), min(p_hi, q_hi)
            if lo < hi:
                routes.append(RowRoute(p, q, lo, hi))
    return tuple(routes)


# ---------------------------------------------------------------------------------------------------------------
# Layout changes and what they move

Collective = Literal["none", "slice", "zero", "allgather", "allreduce", "reduce_scatter", "all_to_all"]
LOCAL_COLLECTIVES: frozenset[Collective] = frozenset({"none", "slice", "zero"})
"""Layout changes that each device makes on its own, with no traffic."""


def conversion(source: Layout, target: Layout) -> Collective:
    """The collective that turns a tensor held as ``source`` by a group into one held as ``target`` (same shares)."""
    if source == target:
        return "none"
    if isinstance(source, Broadcast):
        return "slice" if isinstance(target, Split) else "zero"
    if isinstance(source, PartialSum):
        return "allreduce" if isinstance(target, Broadcast) else "reduce_scatter"
    if isinstance(target, Broadcast):
        return "allgather"
    if isinstance(target, Split):
        return "all_to_all"
    return "zero"  # Split -> PartialSum: each device pads its slice with zeros


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one collective costs each device: the bytes it sends over its link, and the message rounds (each a
    latency) it waits through."""

    bytes_per_device: float
    rounds: int

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes_per_device + other.bytes_per_device, self.rounds + other.rounds)


NO_TRAFFIC = Traffic(0.0, 0)


def traffic(collective: Collective, tensor_bytes: float, shares: Sequence[float]) -> Traffic:
    """The traffic of ``collective`` on a tensor of ``tensor_bytes`` (its whole size) among a group with ``shares``,
    on ring algorithms, for the busiest device (unequal shares: the one whose slice is smallest receives most).

    allgather ``(1 - min share) T`` in ``k - 1`` rounds; reduce-scatter the same; allreduce (a reduce-scatter then an
    allgather) ``2 (k - 1) / k T`` in ``2 (k - 1)`` rounds; all-to-all ``max share (1 - min share) T`` (each device
    sends its slice's parts that others hold) in ``k - 1`` rounds. With equal shares these are AutoDDL's costs.
    """
    k = len(shares)
    if k == 1 or collective in LOCAL_COLLECTIVES:
        return NO_TRAFFIC
    low, high = min(shares), max(shares)
    if collective in ("allgather", "reduce_scatter"):
        return Traffic((1.0 - low) * tensor_bytes, k - 1)
    if collective == "allreduce":
        return Traffic(2.0 * (k - 1) / k * tensor_bytes, 2 * (k - 1))
    return Traffic(high * (1.0 - low) * tensor_bytes, k - 1)
