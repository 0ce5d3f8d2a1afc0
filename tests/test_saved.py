"""What autograd keeps of each layer's forward (``tapp_core.profile.saved``), against what each op is known to save."""

from __future__ import annotations

import torch
from torch import nn

from tapp_core.model.graph import layer_index, trace_model
from tapp_core.profile.saved import SavedFacts, saved_facts

SAMPLES, WIDTH = 8, 16
FLOAT = 4


class Mixed(nn.Module):
    """Ops whose saved tensors differ: a Linear keeps its input, an add nothing, a softmax its output, a dropout its
    mask (on a CPU as wide as its input), a max pool its input and its indices."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.5)
        self.pool = nn.MaxPool1d(2, return_indices=False)
        self.head = nn.Linear(WIDTH // 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = h + x
        s = torch.softmax(y, -1)
        d = self.drop(s)
        p = self.pool(d.unsqueeze(1)).squeeze(1)
        return self.head(p)


def facts_of(model: nn.Module, inputs: torch.Tensor) -> tuple[dict[str, int], SavedFacts]:
    traced = trace_model(model.train(), name="mixed")
    index = layer_index(traced)
    return {node.name: i for node, i in index.items()}, saved_facts(traced, index, (inputs,))


def test_each_op_keeps_what_its_backward_reads() -> None:
    names, facts = facts_of(Mixed(), torch.randn(SAMPLES, WIDTH))
    saved = {name: facts.output_saved[i] for name, i in names.items()}
    extra = {name: facts.saved_bytes[i] for name, i in names.items()}
    # The Linear's output feeds an add, which keeps nothing: it is freed; the add's feeds a softmax, which keeps
    # its own output.
    assert not saved["fc"] and not saved["add"] and saved["softmax"]
    # The dropout's output is read by the pool (through a view); its mask is a float an element on a CPU.
    assert saved["drop"] and extra["drop"] == WIDTH * FLOAT
    # The pool keeps its indices (int64, one per output element) beside its input; its output, read by the head
    # through a view, is kept too.
    assert saved["pool"] and extra["pool"] == (WIDTH // 2) * 8
    # The head's output is the model's: nothing of this graph's reads it. Parameters and the input are left out.
    assert not saved["head"] and extra["fc"] == extra["head"] == extra["add"] == 0


def test_a_frozen_prefix_keeps_nothing() -> None:
    model = Mixed()
    for param in model.fc.parameters():
        param.requires_grad_(False)
    model.head.requires_grad_(False)
    _, facts = facts_of(model, torch.randn(SAMPLES, WIDTH))
    assert not any(facts.output_saved) and not any(facts.saved_bytes)


def test_an_in_place_relu_s_output_is_the_convolution_s_kept_once() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3, padding=1))
    names, facts = facts_of(model, torch.randn(SAMPLES, 3, 8, 8))
    first, relu, last = names["_0"], names["_1"], names["_2"]
    # The ReLU writes into the convolution's output and keeps it: one storage, charged to the layer that made it.
    assert facts.output_saved[first] and not facts.output_saved[relu] and not facts.output_saved[last]
    assert facts.saved_bytes == (0, 0, 0)
