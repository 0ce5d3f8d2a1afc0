"""Models that return several outputs, written as their authors publish them, and train on the one their
workload names (``Workload.output``): a dict of logits and features, and an Inception-like classifier with an
auxiliary head that returns torchvision's ``InceptionOutputs`` while training and its logits alone otherwise."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

NUM_CLASSES = 10

workload = {"output": "logits"}


class WithFeatures(nn.Module):
    """A classifier returning ``{"logits": ..., "features": ...}``, as detection and retrieval models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.neck = nn.Linear(128, 32)
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = torch.relu(self.neck(self.body(x)))
        return {"logits": self.head(features), "features": features}


class InceptionOutputs(NamedTuple):
    logits: torch.Tensor
    aux_logits: torch.Tensor | None


class AuxClassifier(nn.Module):
    """torchvision's Inception-V3 in small: an auxiliary classifier on an early block, its logits returned beside
    the main ones while training (``InceptionOutputs``), the main logits alone in evaluation."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.mixed = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.aux = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, NUM_CLASSES))
        self.late = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(16, NUM_CLASSES)
        self.aux_logits = True

    def forward(self, x: torch.Tensor) -> InceptionOutputs | torch.Tensor:
        x = self.mixed(self.stem(x))
        aux = self.aux(x) if self.training and self.aux_logits else None
        x = self.fc(torch.flatten(self.late(x), 1))
        if self.training and self.aux_logits:
            return InceptionOutputs(x, aux)
        return x


def with_features() -> WithFeatures:
    return WithFeatures()


def aux_classifier() -> AuxClassifier:
    return AuxClassifier()


OUTPUT_MODELS = ("tests.output_models:with_features", "tests.output_models:aux_classifier")
