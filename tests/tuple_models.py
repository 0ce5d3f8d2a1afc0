"""A model written the way PyTorch users write sequence models, not for TAPP, whose layers output tuples and whose
values cross cuts in many layouts: CIFAR-shaped (3x32x32 in, 10 logits out), small so that tests run fast. Built as
``tests.tuple_models:rows``; ``:awkward`` holds outputs that no cut can carry.

- ``torch.chunk`` of a projection into a gate and a value (a GLU), ``tensor.split(...)`` of a sequence into two
  halves, ``torch.split`` with sizes;
- an ``nn.GRU`` unpacked the usual way, ``out, h = self.gru(x)``: a leaf whose output is a tuple, and whose last
  hidden state has its samples on dimension 1 (``(layers, batch, hidden)``);
- ``x.max(dim=1).values``: a tuple of a float and an integer tensor, read by name;
- a flattened batch x position tensor, ``(B*T, C)``, as a language model's head reads it, then viewed back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRows(nn.Module):
    """An image read row by row: a conv stem, each row a token, a gated projection, a GRU over the rows, and a
    classifier on its last state and the mean of its second half."""

    def __init__(self, channels: int = 4, hidden: int = 12, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, stride=4, padding=1)
        self.proj = nn.Linear(channels * 8, 2 * hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(2 * hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.size(0)
        f = F.relu(self.stem(x))
        rows = f.permute(0, 2, 1, 3).reshape(b, 8, -1)
        value, gate = torch.chunk(self.proj(rows), 2, dim=-1)
        out, h = self.gru(value * torch.sigmoid(gate))
        first, second = out.split(4, dim=1)
        peak = first.max(dim=1).values
        tokens = second.reshape(-1, second.size(-1))
        mixed = torch.tanh(self.mix(tokens)).view(b, 4, -1)
        left, right = torch.split(mixed, [1, 3], dim=1)
        pooled = left.squeeze(1) + right.mean(dim=1) + peak
        logits: torch.Tensor = self.head(torch.cat((pooled, h[-1]), dim=-1))
        return logits


class Awkward(nn.Module):
    """Outputs no cut can carry: a weight read alone, rows in time-major order."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 8)
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x.mean(1).reshape(x.size(0), 4, 8 * 32)[..., :32])
        mixed = h @ self.weight.t()
        time_major = h.transpose(0, 1).reshape(-1, 8)
        return (mixed.flatten(1) + time_major.reshape(4, -1, 8).transpose(0, 1).flatten(1)).sum(-1, keepdim=True)


def rows() -> GatedRows:
    return GatedRows()


def awkward() -> Awkward:
    return Awkward()


TUPLE_MODELS = ("tests.tuple_models:rows",)
"""``awkward`` is not one: some of its cuts cannot run (``tests/test_crossing.py``)."""
