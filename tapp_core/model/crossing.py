"""How a layer's output crosses a cut: as one tensor whose first dimension is the samples.

A cut value is split into micro-batches and rows along its first dimension, and sent as one tensor. A layer's
output is often not that: a tuple (``torch.chunk``, ``tensor.split``, an ``nn.GRU``'s ``(out, h)``), a tensor with
its samples along another dimension (a GRU's last state, ``(layers, batch, hidden)``; a permuted ``qkv``), or with
several rows per sample (a language model's ``(batch * positions, channels)``). Its *layout* (``Layout``) says how
to pack it into one such tensor (``pack``) on the producing stage and unpack it (``unpack``) on each consuming one,
so that the stages compute what the model does. An output that cannot be packed has a *refusal*, the reason why,
which the rule of what the runtime runs (``tapp_core.plan.rule``) reads so that no plan puts a cut after it.

Both are found once per model (``cut_facts``), by running it in eval mode on 5 samples and on two parts of them
(2 and 3), and by following its data flow from the input: the profiler records the refusals in the layer library,
the runtime reads the same facts from the traced model, and cuts the stages with the layouts.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tapp_core.model.graph import ModelError, layer_index

Layout = tuple[Any, ...]
"""Plain nested tuples (a traced graph writes them as constants): ``("tensor", dim, rows, rest, dtype)`` for a
tensor with ``rows`` rows per sample along dimension ``dim``, the other dimensions ``rest`` and ``dtype`` (its
name in ``torch``); ``("const", value)`` for a number, a string or None; ``(kind, items)`` for a ``"tuple"``, a ``"list"`` or another
sequence type, named ``"module:qualname"`` (``x.max(dim=1)``'s ``torch.return_types.max``, a named tuple)."""

CARRIER = torch.float64
"""What a tuple of tensors of several dtypes crosses as: it holds every float32, float16 and bfloat16 value, and
every integer below 2**53 (indices, token ids), exactly."""

PLAIN_ROWS = 1
CUT_SAMPLES = 5
"""The samples of the input ``cut_facts`` reads a model on."""
_COUNTS = (2, 3)
"""Two parts of a 5-sample batch, run apart and whole: the sizes follow the samples, and the rows are each sample's."""


@dataclass(frozen=True)
class CutFacts:
    """Per layer whose output holds a tensor, how it crosses a cut (``layouts``) or why it cannot (``refusals``)."""

    layouts: dict[int, Layout]
    refusals: dict[int, str]
    sample_free: frozenset[int] = frozenset()
    """The layers whose output no sample's data reaches (refused as ``SAMPLE_FREE``)."""


def is_plain(layout: Layout) -> bool:
    """Whether the output already is a tensor with one row per sample along its first dimension."""
    return bool(layout[0] == "tensor" and layout[1] == 0 and layout[2] == PLAIN_ROWS)


SAMPLE_FREE = "it is computed from weights and shapes alone: it has no sample dimension to split into micro-batches"
"""The refusal of a tensor that no sample's data reaches (a weight read by ``get_attr``, a position table looked up
by ``torch.arange(x.size(1))``): every device of a stage holds it whole (``LayerSpec.sample_free``)."""
SAMPLE_FREE_REFUSALS = frozenset(
    {SAMPLE_FREE, "it is computed from weights alone: it has no sample dimension to split into micro-batches"}
)
"""``SAMPLE_FREE`` and what libraries made before it say of a weight read alone: how a library written before
``Layer.sample_free`` was a column tells such layers."""


def cut_facts(graph_module: torch.fx.GraphModule, sample: torch.Tensor) -> CutFacts:
    """The layouts and refusals of ``graph_module``'s layers, from ``sample``: an input of 5 samples."""
    whole = _run(graph_module, sample)
    parts = [_run(graph_module, part) for part in torch.split(sample, list(_COUNTS))]
    from_input = _reads_sample_data(graph_module, whole)
    layouts: dict[int, Layout] = {}
    refusals: dict[int, str] = {}
    sample_free: set[int] = set()
    for node, i in layer_index(graph_module).items():
        value = whole.get(node)
        if not _holds_tensor(value):
            continue  # numbers, such as a shape read from a tensor: rebuilt on each stage that needs them
        try:
            layouts[i] = _layout(value, [part[node] for part in parts])
        except _Refused as exc:  # a class token expanded to x.size(0) has samples that no data reached
            if node not in from_input:
                sample_free.add(i)
            refusals[i] = SAMPLE_FREE if node not in from_input else str(exc)
    return CutFacts(layouts, refusals, frozenset(sample_free))


class _Refused(Exception):
    pass


def _run(graph_module: torch.fx.GraphModule, inputs: torch.Tensor) -> dict[torch.fx.Node, Any]:
    values: dict[torch.fx.Node, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            values[n] = super().run_node(n)
            return values[n]

    was_training = graph_module.training
    graph_module.eval()
    try:
        with torch.no_grad():
            Recorder(graph_module).run(inputs)
    except Exception as exc:  # whatever the model raises on this many samples
        raise ModelError(f"running the model on {inputs.shape[0]} samples failed: {type(exc).__name__}: {exc}") from exc
    finally:
        graph_module.train(was_training)
    return values


def _reads_sample_data(graph_module: torch.fx.GraphModule, values: dict[torch.fx.Node, Any]) -> set[torch.fx.Node]:
    """The nodes whose value the input's data reaches through the graph's data flow: through tensors, not through
    the numbers read from their shapes (``torch.arange(x.size(1))`` is the same for every sample)."""
    reached: set[torch.fx.Node] = set()
    for node in graph_module.graph.nodes:
        reads_samples = any(arg in reached and _holds_tensor(values.get(arg)) for arg in node.all_input_nodes)
        if node.op == "placeholder" or reads_samples:
            reached.add(node)
    return reached


def _holds_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, tuple | list) and any(_holds_tensor(item) for item in value)


def _layout(whole: Any, parts: list[Any]) -> Layout:
    """``whole``'s layout, checked against its value on the parts (``_COUNTS``); ``_Refused`` says why none fits."""
    layout = _shape_of(whole, parts, "it")
    if any(leaf.is_complex() for leaf in _tensors(layout, whole)):
        raise _Refused("it holds a complex tensor, which no cut carries")
    packed = [pack(part, layout) for part in parts]
    if not _close(pack(whole, layout), torch.cat(packed)):
        raise _Refused("its rows do not follow the samples (a micro-batch's part of it is not its rows)")
    return layout


def _shape_of(whole: Any, parts: list[Any], what: str) -> Layout:
    if isinstance(whole, torch.Tensor):
        return _tensor_layout(whole, parts, what)
    if isinstance(whole, tuple | list):
        if not all(type(part) is type(whole) and len(part) == len(whole) for part in parts):
            raise _Refused(f"{what} changes its structure with the number of samples")
        kind = _kind(type(whole))
        items = tuple(_shape_of(item, [part[i] for part in parts], f"its item {i}") for i, item in enumerate(whole))
        return (kind, items)
    if (whole is None or isinstance(whole, bool | int | float | str)) and all(part == whole for part in parts):
        return ("const", whole)
    raise _Refused(f"{what} is a {type(whole).__name__} that changes with the number of samples")


def _tensor_layout(whole: torch.Tensor, parts: list[Any], what: str) -> Layout:
    if not all(isinstance(part, torch.Tensor) and part.dim() == whole.dim() for part in parts):
        raise _Refused(f"{what} changes its number of dimensions with the number of samples")
    grown = [d for d in range(whole.dim()) if any(part.shape[d] != whole.shape[d] for part in parts)]
    if not grown:
        raise _Refused(f"{what} has no dimension that follows the number of samples (the same for any micro-batch)")
    if len(grown) > 1:
        raise _Refused(f"{what} has {len(grown)} dimensions that follow the number of samples, not one")
    (dim,) = grown
    rows = parts[0].shape[dim] // _COUNTS[0]
    sizes = [whole.shape[dim], *(part.shape[dim] for part in parts)]
    if rows < 1 or sizes != [rows * sum(_COUNTS), *(rows * count for count in _COUNTS)]:
        raise _Refused(f"{what}'s dimension {dim} is not a whole number of rows per sample")
    rest = tuple(size for d, size in enumerate(whole.shape) if d != dim)
    return ("tensor", dim, rows, rest, str(whole.dtype).removeprefix("torch."))


def _tensors(layout: Layout, value: Any) -> list[torch.Tensor]:
    if layout[0] == "tensor":
        return [value]
    if layout[0] == "const":
        return []
    return [tensor for item, part in zip(layout[1], value, strict=True) for tensor in _tensors(item, part)]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    scale = max(1.0, float(a.detach().abs().max())) if a.numel() else 1.0
    return bool(torch.allclose(a, b, rtol=1e-3, atol=1e-4 * scale))


def pack(value: Any, layout: Layout) -> torch.Tensor:
    """``value`` (of ``layout``) as one tensor, samples first: a lone tensor keeps its other dimensions (after its
    rows per sample), the tensors of a tuple are flattened per sample and put side by side."""
    if layout[0] == "tensor":
        return _samples_first(value, layout)
    leaves = [
        _samples_first(leaf, item) for leaf, item in zip(_tensors(layout, value), _leaf_layouts(layout), strict=True)
    ]
    carrier = _carrier(layout)
    return torch.cat([leaf.reshape(leaves[0].shape[0], -1).to(carrier) for leaf in leaves], dim=1)


def _carrier(layout: Layout) -> torch.dtype:
    dtypes = {leaf[4] for leaf in _leaf_layouts(layout)}
    return getattr(torch, dtypes.pop()) if len(dtypes) == 1 else CARRIER


def _samples_first(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    _, dim, rows, _, _ = layout
    moved = tensor.movedim(dim, 0)
    return moved if rows == PLAIN_ROWS else moved.reshape(-1, rows, *moved.shape[1:])


def _leaf_layouts(layout: Layout) -> list[Layout]:
    if layout[0] == "tensor":
        return [layout]
    if layout[0] == "const":
        return []
    return [leaf for item in layout[1] for leaf in _leaf_layouts(item)]


def unpack(packed: torch.Tensor, layout: Layout) -> Any:
    """What ``pack`` packed: ``packed``'s samples may be fewer (a micro-batch, a device's rows)."""
    if layout[0] == "tensor":
        return _back(packed, layout)
    leaves = _leaf_layouts(layout)
    sizes = [leaf[2] * math.prod(leaf[3]) for leaf in leaves]
    pieces = iter(
        _back(
            piece.reshape(packed.shape[0], leaf[2], *leaf[3]).flatten(0, 1).to(getattr(torch, leaf[4])), leaf, flat=True
        )
        for piece, leaf in zip(torch.split(packed, sizes, dim=1), leaves, strict=True)
    )
    return _rebuilt(layout, pieces)


def _back(tensor: torch.Tensor, layout: Layout, flat: bool = False) -> torch.Tensor:
    _, dim, rows, _, _ = layout
    rows_first = tensor if flat or rows == PLAIN_ROWS else tensor.flatten(0, 1)
    return rows_first.movedim(0, dim)


def _rebuilt(layout: Layout, pieces: Any) -> Any:
    if layout[0] == "tensor":
        return next(pieces)
    if layout[0] == "const":
        return layout[1]
    items = [_rebuilt(item, pieces) for item in layout[1]]
    if layout[0] in ("list", "tuple"):
        return items if layout[0] == "list" else tuple(items)
    cls = _sequence_type(layout[0])
    return cls(*items) if hasattr(cls, "_fields") else cls(items)


def _kind(cls: type) -> str:
    if cls in (list, tuple):
        return cls.__name__
    kind = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = _sequence_type(kind)
    except (ImportError, AttributeError):
        found = None
    if found is not cls:
        raise _Refused(f"it is a {cls.__qualname__}, a type the consuming stage cannot import to rebuild it")
    return kind


def _sequence_type(kind: str) -> Any:
    """The type ``_kind`` named: a tuple's subclass (``hasattr(cls, "_fields")``: a named tuple, built from its
    items; else a structseq such as ``torch.return_types.max``, built from their sequence)."""
    module, _, qualname = kind.partition(":")
    return functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
