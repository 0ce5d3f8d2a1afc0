"""A model of two inputs: a small image and a vector of tabular features, fused to classify into 5 classes.

Its ``workload`` names both inputs (shape per sample, dtype), the targets (one class per sample), the loss and the
optimiser (Adam); it trains on synthetic samples of those inputs.

    tapp profile --model examples/two_inputs.py:build --batch-size 32
"""

import torch
from torch import nn

workload = {
    "inputs": [{"shape": [3, 16, 16]}, {"shape": [8]}],
    "target": {"shape": [], "dtype": "int64", "high": 5},
    "loss": "cross_entropy",
    "optimizer": {"name": "Adam", "lr": 0.002},
    "data": "synthetic",
}


class ImageAndFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.features = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(8 * 2 * 2 + 16, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, image, features):
        return self.head(torch.cat([self.image(image), self.features(features)], dim=1))


def build() -> nn.Module:
    return ImageAndFeatures()
