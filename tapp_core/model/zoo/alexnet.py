"""AlexNet adapted to CIFAR-10: five 3x3 convolutions and three fully connected layers.

The ImageNet stem (11x11 stride 4) would shrink a 32x32 image to nothing, so the first convolution is 3x3 with
stride 2 and the three max-pools bring 16x16 down to 2x2 before the classifier, as in the usual CIFAR ports.
"""

from __future__ import annotations

import torch
from torch import nn


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=3, stride=2, padding=1),  # 32 -> 16
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),  # 16 -> 8
            nn.Conv2d(64, 192, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),  # 8 -> 4
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2),  # 4 -> 2
        )
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(256 * 2 * 2, 4096),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        logits: torch.Tensor = self.classifier(x)
        return logits


def alexnet(num_classes: int = 10) -> AlexNet:
    return AlexNet(num_classes)
