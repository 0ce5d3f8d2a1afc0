"""What autograd keeps of each layer's forward for the backward, measured on one forward of the traced model.

A layer's output is not always kept: an ``add`` or a ``masked_fill`` saves nothing of its inputs, a ``softmax``
keeps its output, a ``Linear`` its input, a dropout its mask (on a CPU as wide as its input), a layer norm two
statistics a row. So "every output the backward reads" (``LayerLibrary.read_by_backward``) counts too much: the
GPT's activations 51 % more than autograd keeps. Here every tensor autograd saves (``saved_tensors_hooks``) is
found by its storage: one that a layer output is that layer's output kept, any other (made inside a layer's
forward and never its output) is charged to the layer whose forward saved it. Each storage counts once, whole,
since a view keeps all of it. Parameters, buffers and the model's inputs are left out: the memory model counts
them apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tapp_core.model.flops import tensors_in


@dataclass(frozen=True)
class SavedFacts:
    """Per layer (by library index): whether the backward keeps its output, and the bytes per sample it keeps of
    what the layer's forward made besides its output."""

    output_saved: tuple[bool, ...]
    saved_bytes: tuple[int, ...]


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the memory ``tensor`` lives in; None for a tensor without one of its own (meta, opaque)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None


class _SavingInterpreter(torch.fx.Interpreter):
    """Runs the graph with autograd on, noting which layer made each storage and which layer's forward saved it."""

    def __init__(self, graph_module: torch.fx.GraphModule, index: dict[torch.fx.Node, int]) -> None:
        super().__init__(graph_module)
        self.index = index
        self.current: int | None = None
        self.made_by: dict[int, int] = {}
        self.saved: dict[int, tuple[int | None, int]] = {}
        self.alive: list[object] = []
        """Every output, held through the pass: a freed storage's address, given again, would be misread."""

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = self.index.get(n)
        out = super().run_node(n)
        self.alive.append(out)
        if self.current is not None:
            for tensor in tensors_in(out):
                found = _storage(tensor)
                if found is not None:
                    self.made_by.setdefault(found[0], self.current)
        self.current = None
        return out

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        found = _storage(tensor)
        if found is not None:
            self.saved.setdefault(found[0], (self.current, found[1]))
        return tensor


def _output_layer(graph_module: torch.fx.GraphModule, index: dict[torch.fx.Node, int]) -> int | None:
    """The layer whose output the model returns (the first, where it returns several)."""
    returned = next(n for n in graph_module.graph.nodes if n.op == "output").all_input_nodes
    return next((index[n] for n in returned if n in index), None)


def _addresses(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {found[0] for found in map(_storage, tensors) if found is not None}


def saved_facts(
    graph_module: torch.fx.GraphModule,
    index: dict[torch.fx.Node, int],
    inputs: tuple[torch.Tensor, ...],
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> SavedFacts:
    """``SavedFacts`` of ``graph_module``'s layers (``index``: node to layer) from one forward on ``inputs``
    (a batch: the bytes are per sample of its first dimension). ``loss`` (of the model's output), where given,
    runs too: what it keeps (a cross-entropy's log-probabilities, as large as the logits) is charged to the layer
    whose output it reads, on whose stage it runs."""
    samples = max(inputs[0].shape[0], 1) if inputs and inputs[0].dim() else 1
    interpreter = _SavingInterpreter(graph_module, index)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(interpreter.pack, lambda t: t):
        output = interpreter.run(*inputs)
        if loss is not None:
            interpreter.current = _output_layer(graph_module, index)
            interpreter.alive.append(loss(output))
    apart = _addresses([*graph_module.parameters(), *graph_module.buffers(), *inputs])
    output_saved = [False] * len(index)
    extra = [0] * len(index)
    for address, (saver, nbytes) in interpreter.saved.items():
        if address in apart:
            continue
        maker = interpreter.made_by.get(address)
        if maker is not None:
            output_saved[maker] = True
        elif saver is not None:
            extra[saver] += nbytes
    return SavedFacts(tuple(output_saved), tuple(math.ceil(b / samples) for b in extra))
