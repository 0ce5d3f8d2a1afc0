"""VGG-16 (configuration D: 13 convolutions) with BatchNorm, for 32x32 inputs.

After five 2x2 max-pools a 32x32 image is 512x1x1, so the classifier keeps VGG's three fully connected layers
and dropout but is 512 wide instead of 4096 (the common CIFAR variant).
"""

from __future__ import annotations

import torch
from torch import nn

# Output channels of each 3x3 convolution; "M" is a 2x2 max-pool.
VGG16_CONFIG: tuple[int | str, ...] = (
    64, 64, "M",
    128, 128, "M",
    256, 256, 256, "M",
    512, 512, 512, "M",
    512, 512, 512, "M",
)  # fmt: skip


def _conv_bn_relu_stack(config: tuple[int | str, ...], in_channels: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for item in config:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        out_channels = int(item)
        layers += [
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        ]
        in_channels = out_channels
    return nn.Sequential(*layers)


class VGG16(nn.Module):
    def __init__(self, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = _conv_bn_relu_stack(VGG16_CONFIG)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        logits: torch.Tensor = self.classifier(x)
        return logits


def vgg16(num_classes: int = 10) -> VGG16:
    return VGG16(num_classes)
