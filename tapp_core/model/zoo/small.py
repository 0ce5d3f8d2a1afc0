"""Small CIFAR-shaped models for tests: cheap to run, deterministic, no dropout and no BatchNorm.

They exist so that the pipeline runtime can be checked bit for bit against single-device training, which
dropout (random masks) and BatchNorm (statistics over a micro-batch, not the batch) would make impossible.
``TinyBranchy`` has the graph shapes a partitioner must handle: parallel branches joined by ``torch.cat``, and
a skip connection consumed several layers later, so a stage cut can have a tensor jump over it.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(
        self, num_classes: int = 10, in_features: int = 3 * 32 * 32, hidden: tuple[int, int] = (128, 64)
    ) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(in_features, hidden[0])
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(hidden[1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.fc1(self.flatten(x)))
        x = self.relu2(self.fc2(x))
        logits: torch.Tensor = self.fc3(x)
        return logits


class TinyCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, kernel_size=3, stride=2, padding=1)  # 32 -> 16
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=4)  # 16 -> 4
        self.fc = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.conv1(x))
        x = self.pool(self.relu2(self.conv2(x)))
        logits: torch.Tensor = self.fc(torch.flatten(x, 1))
        return logits


class TinyBranchy(nn.Module):
    """stem -> (1x1 branch | 3x3 branch) -> cat -> mix -> + stem (skip) -> pool -> fc."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1)  # 32 -> 16
        self.stem_relu = nn.ReLU()
        self.branch_a = nn.Conv2d(8, 8, kernel_size=1)
        self.branch_a_relu = nn.ReLU()
        self.branch_b = nn.Conv2d(8, 8, kernel_size=3, padding=1)
        self.branch_b_relu = nn.ReLU()
        self.mix = nn.Conv2d(16, 8, kernel_size=3, padding=1)
        self.mix_relu = nn.ReLU()
        self.refine = nn.Conv2d(8, 8, kernel_size=3, padding=1)
        self.pool = nn.AvgPool2d(kernel_size=4)  # 16 -> 4
        self.fc = nn.Linear(8 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem_relu(self.stem(x))
        a = self.branch_a_relu(self.branch_a(skip))
        b = self.branch_b_relu(self.branch_b(skip))
        h = self.mix_relu(self.mix(torch.cat([a, b], 1)))
        h = self.refine(h)
        h = torch.relu(h + skip)
        h = self.pool(h)
        logits: torch.Tensor = self.fc(torch.flatten(h, 1))
        return logits


def mlp(num_classes: int = 10) -> MLP:
    return MLP(num_classes)


def tiny_cnn(num_classes: int = 10) -> TinyCNN:
    return TinyCNN(num_classes)


def tiny_branchy(num_classes: int = 10) -> TinyBranchy:
    return TinyBranchy(num_classes)
