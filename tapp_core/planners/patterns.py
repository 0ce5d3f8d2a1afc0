"""Signature patterns: the ways a stage on several devices splits its layers, as whole-stage choices.

One layer's split alone rarely pays (it exchanges a tensor before and after it); a pair, a column-split layer
feeding a row-split one, exchanges one (Megatron). The patterns, over a stage's split-capable layers (Linear,
Conv2d: ``placement.SIGNATURES``) in order:

``data``      every layer data parallel;
``col``       every layer column-split;
``pairs``     column, row, column, row, ... (Megatron's pairs);
``heaviest``  the layer with the most weights row-split and the split-capable layer before it column-split (or,
              when it is the first, it and the next as a pair), the others data parallel;
``megatron``  every layer that reads a feature split carried without a collective from column-split layers (the
              layout pass of ``tapp_core.plan.placement``: through attention's heads, or an activation) row-split, and
              those column-split, the others data parallel: a Transformer's attention (q, k, v col, the projection
              row) and MLP (fc1 col, fc2 row), whatever the layers between.

AutoDDL's descent (``autoddl``) tries them as moves; TAPP's policy samples one per group of several devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tapp_core.model.graph import MODEL_INPUT, LayerSpec
from tapp_core.plan.placement import COLUMN, DATA, ROW, SIGNATURES, Split, feature_dim, stage_layouts
from tapp_core.profile.library import LayerLibrary

PATTERNS: tuple[str, ...] = ("data", "col", "pairs", "heaviest", "megatron")


def splittable(library: LayerLibrary) -> list[int]:
    """The layers that may run a split signature."""
    return [x.index for x in library.layers if x.op in SIGNATURES]


def pattern_signatures(
    name: str, layers: Sequence[int], weights: Mapping[int, int], specs: Sequence[LayerSpec] = ()
) -> dict[int, str]:
    """The signature ``name`` gives each of one stage's split-capable ``layers`` (in order), ``weights`` their
    parameter bytes, ``specs`` the model's layers (``megatron`` needs them; without, it is ``data``)."""
    if name == "data" or not layers or (name == "megatron" and not specs):
        return dict.fromkeys(layers, DATA)
    if name == "megatron":
        return megatron_signatures(specs, layers)
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


def megatron_signatures(specs: Sequence[LayerSpec], layers: Sequence[int]) -> dict[int, str]:
    """``megatron``: with every one of ``layers`` column-split, each layer that reads its input split along its own
    features, carried there from column-split layers of ``layers`` only, is row-split and those column-split."""
    chosen = dict.fromkeys(layers, DATA)
    layouts = stage_layouts(specs, range(len(specs)), dict.fromkeys(layers, COLUMN), 2)
    for row in layers:
        spec = specs[row]
        reads = [v for v in spec.inputs if v != MODEL_INPUT]
        if len(reads) != 1 or layouts.outputs[reads[0]] != Split(feature_dim(spec.op, spec.shape)):
            continue
        origins, todo = set(), [reads[0]]
        while todo:
            value = todo.pop()
            if value in layouts.carried:
                todo.extend(layouts.carried[value][0])
            else:
                origins.add(value)
        if origins <= set(layers) and all(chosen[x] == DATA and specs[x].op in SIGNATURES for x in origins):
            chosen.update(dict.fromkeys(origins, COLUMN))
            chosen[row] = ROW
    return chosen
