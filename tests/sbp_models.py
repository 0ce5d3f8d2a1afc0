"""A small Conv-heavy model for the operator-parallel (SBP) runtime tests, built as ``tests.sbp_models:tiny_sbp``.

It has what ``tiny_cnn`` and ``mlp`` lack: a BatchNorm2d between convolutions (exact under a channel split, where
each device normalises its channels over the whole micro-batch), a Linear straight after a convolution and a
flatten (a row convolution's partial sum reaches a col Linear: an allreduce), and a head on one token per sample,
(N, 1, F) as a Transformer's, whose single token makes a partial sum before a nonlinearity an allreduce to
Broadcast (and so a layer that runs replicated, and a stage output leaving from Broadcast). No dropout.
"""

from __future__ import annotations

import torch
from torch import nn


class TinySBP(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, kernel_size=3, stride=2, padding=1)  # 32 -> 16
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(6, 8, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=4)  # 16 -> 4
        self.conv3 = nn.Conv2d(8, 6, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(6 * 4 * 4, 24)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(24, 12)
        self.relu4 = nn.ReLU()
        self.fc3 = nn.Linear(12, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.conv1(x))
        x = self.pool(self.relu2(self.bn2(self.conv2(x))))
        x = self.fc1(torch.flatten(self.conv3(x), 1))
        tokens = self.relu3(x).unsqueeze(1)  # (N, 1, 24): one token per sample
        tokens = self.relu4(self.fc2(tokens))
        return torch.flatten(self.fc3(tokens), 1)


def tiny_sbp() -> TinySBP:
    return TinySBP()


TINY_SBP = "tests.sbp_models:tiny_sbp"
