"""A CIFAR-shaped classifier written the usual way: no workload declared, so TAPP feeds it one 3x32x32 image per
sample and trains it with cross-entropy over 10 classes and SGD with momentum (the default workload).

    tapp profile --model examples/cifar_classifier.py:build --batch-size 32
"""

from torch import nn


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x):
        return self.head(self.features(x))


def build() -> nn.Module:
    return SmallConvNet()
