"""Models written the way PyTorch users write them, not for TAPP: CIFAR-shaped (3x32x32 in, 10 logits out), small
so that tests run fast. Built as ``tests.user_models:resnet``, ``:vit`` and ``:tied``.

- ``resnet``: basic blocks (conv-bn-relu-conv-bn, a 1x1 convolution as the shortcut where the shape changes, an
  identity elsewhere), ``F.relu(out + shortcut, inplace=True)`` closing each block, shapes read with ``x.size(0)``.
- ``vit``: one fused ``qkv`` Linear, ``reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)`` and
  ``qkv[0]``, ``qkv[1]``, ``qkv[2]``, every shape read from ``x.shape``, in-place scaling of the scores.
- ``tied``: a weight used at both ends, as language models tie their embedding and output layers:
  ``F.linear(z, self.embed.weight.t())`` at the output.
- ``position_sums`` (not in ``USER_MODELS``): sums with a parameter of the model's own, after split layers.
- ``tied_linear`` (not in ``USER_MODELS``): the other way models tie a weight, an ``nn.Linear`` head given the
  embedding's ``Parameter`` (``self.head.weight = self.embed.weight``), both layers calls of a module.

No dropout, and BatchNorm only in ``resnet`` (whose tests compare a plan that keeps a batch's statistics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + self.shortcut(x)
        return F.relu(out, inplace=True)


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (4, 8, 8), blocks: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers: list[nn.Module] = []
        in_planes = widths[0]
        for i, planes in enumerate(widths):
            for j in range(blocks):
                layers.append(BasicBlock(in_planes, planes, stride=2 if i > 0 and j == 0 else 1))
                in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.avg_pool2d(out, out.size(3))
        out = out.view(out.size(0), -1)
        logits: torch.Tensor = self.linear(out)
        return logits


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        attn *= self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, c)
        out: torch.Tensor = self.proj(x)
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x


class ViT(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2, heads: int = 2, patch: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (32 // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads, 2 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        b = x.shape[0]
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits: torch.Tensor = self.head(x[:, 0])
        return logits


class Tied(nn.Module):
    """Features embedded by ``embed`` and read back through its transposed weight before the classifier."""

    def __init__(self, hidden: int = 24, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.embed = nn.Linear(8 * 4 * 4, hidden, bias=False)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(8 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.flatten(self.pool(F.relu(self.stem(x))), 1)
        z = torch.tanh(self.mid(F.relu(self.embed(h))))
        back = F.linear(z, self.embed.weight.t())
        logits: torch.Tensor = self.out(F.relu(back))
        return logits


class TiedLinear(nn.Module):
    """Features embedded by ``embed`` (a square Linear) and read out by ``head``, a Linear holding the same weight."""

    def __init__(self, hidden: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, stride=4, padding=1)
        self.squeeze = nn.Linear(4 * 8 * 8, hidden)
        self.embed = nn.Linear(hidden, hidden, bias=False)
        self.mid = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, hidden)
        self.head.weight = self.embed.weight
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.squeeze(torch.flatten(F.relu(self.stem(x)), 1)))
        z = torch.tanh(self.mid(torch.tanh(self.embed(h))))
        logits: torch.Tensor = self.out(torch.tanh(self.head(z)))
        return logits


class PositionSums(nn.Module):
    """Sums that add a tensor of the model's own: a position embedding added straight after the patch embedding
    (no class token between), and a learned offset added to a bias-free Linear's output."""

    def __init__(self, dim: int = 16, patch: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (32 // patch) ** 2, dim) * 0.02)
        self.fc = nn.Linear(dim, dim, bias=False)
        self.offset = nn.Parameter(torch.randn(dim) * 0.02)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos
        h = F.gelu(self.fc(h.mean(dim=1)) + self.offset)
        logits: torch.Tensor = self.head(h)
        return logits


def position_sums() -> PositionSums:
    return PositionSums()


def tied_linear() -> TiedLinear:
    return TiedLinear()


def resnet() -> ResNet:
    return ResNet()


def vit() -> ViT:
    return ViT()


def tied() -> Tied:
    return Tied()


USER_MODELS = ("tests.user_models:resnet", "tests.user_models:vit", "tests.user_models:tied")
