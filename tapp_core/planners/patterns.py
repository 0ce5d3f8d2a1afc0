"""Signature patterns: the ways a stage on several devices splits its layers, as whole-stage choices.

One layer's split alone rarely pays (it exchanges a tensor before and after it); a pair, a column-split layer
feeding a row-split one, exchanges one (Megatron). The patterns, over a stage's split-capable layers (Linear,
Conv2d: ``placement.SIGNATURES``) in order:

``data``      every layer data parallel;
``col``       every layer column-split;
``pairs``     column, row, column, row, ... (Megatron's pairs);
``heaviest``  the layer with the most weights row-split and the split-capable layer before it column-split (or,
              when it is the first, it and the next as a pair), the others data parallel.

AutoDDL's descent (``autoddl``) tries them as moves; TAPP's policy samples one per group of several devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tapp_core.library import LayerLibrary
from tapp_core.placement import COLUMN, DATA, ROW, SIGNATURES

PATTERNS: tuple[str, ...] = ("data", "col", "pairs", "heaviest")


def splittable(library: LayerLibrary) -> list[int]:
    """The layers that may run a split signature."""
    return [x.index for x in library.layers if x.op in SIGNATURES]


def pattern_signatures(name: str, layers: Sequence[int], weights: Mapping[int, int]) -> dict[int, str]:
    """The signature ``name`` gives each of one stage's split-capable ``layers`` (in order), ``weights`` their
    parameter bytes."""
    if name == "data" or not layers:
        return dict.fromkeys(layers, DATA)
    if name == "col":
        return dict.fromkeys(layers, COLUMN)
    if name == "pairs":
        return {x: (COLUMN if i % 2 == 0 else ROW) for i, x in enumerate(layers)}
    if name != "heaviest":
        raise ValueError(f"unknown signature pattern {name!r}; choose one of {', '.join(PATTERNS)}")
    heaviest = max(range(len(layers)), key=lambda i: weights[layers[i]])
    chosen = dict.fromkeys(layers, DATA)
    if heaviest > 0:
        chosen[layers[heaviest - 1]], chosen[layers[heaviest]] = COLUMN, ROW
    elif len(layers) > 1:
        chosen[layers[0]], chosen[layers[1]] = COLUMN, ROW
    return chosen


def with_signatures(signatures: tuple[tuple[int, str], ...], changes: Mapping[int, str]) -> tuple[tuple[int, str], ...]:
    """``signatures`` with ``changes`` applied (``data`` removes a layer's entry), sorted by layer."""
    merged = {**dict(signatures), **changes}
    return tuple(sorted((x, sig) for x, sig in merged.items() if sig != DATA))
