"""Models written the way their authors publish them, not for TAPP: CIFAR-shaped (3x32x32 in, 10 logits out) and
small, for the tests and the fuzz of random cuts (``bench/fuzz_cuts.py``). Each is built as
``tests.wild_models:NAME``.

- ``mobilenet``: MobileNetV2's inverted residuals (``nn.Sequential`` subclasses, ``ReLU6(inplace=True)``, a residual
  chosen at construction), ``adaptive_avg_pool2d`` and ``torch.flatten``;
- ``densenet``: dense blocks that concatenate a growing list of features in a loop, and transitions;
- ``senet``: squeeze-and-excitation blocks (``x * w.sigmoid()`` broadcast over the image), an in-place residual
  ``out += identity`` and ``F.relu(..., inplace=True)``;
- ``convmixer``: a ``Residual`` wrapper module, depthwise convolutions, a ``Sequential`` built from a comprehension;
- ``timm_vit``: timm's attention (``qkv.reshape(...).permute(2, 0, 3, 1, 4).unbind(0)``,
  ``F.scaled_dot_product_attention``), a class token expanded over the batch, a learned position embedding;
- ``torch_encoder``: ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer`` (batch first, pre-norm), learned
  positions looked up by ``torch.arange(n, device=x.device)``;
- ``lstm_rows``: a two-layer ``nn.LSTM`` over the image's rows, unpacked as ``out, (h, c) = self.lstm(x)``;
- ``recurrent``: one block applied three times (its weights shared across depth, as ALBERT shares them), input
  normalised by buffers;
- ``finetune``: a frozen backbone (``requires_grad = False``) under a trained head, its logits scaled by a learned
  temperature (``self.logit_scale.exp()``, a value of a weight alone);
- ``mixer_mha``: ``nn.MultiheadAttention`` unpacked as ``mixed, _ = attn(x, x, x, need_weights=False)``, a
  weight-normed ``Linear`` (``nn.utils.parametrizations.weight_norm``), ``torch.stack`` of token statistics;
- ``nano_gpt``: nanoGPT's model over the image's rows: positions looked up by ``torch.arange``, a causal mask kept
  as a buffer, sliced and applied with ``masked_fill``;
- ``frozen_tied``: a frozen weight read by two layers, the first of which has a trained bias;
- ``unet``: a U-Net's long skips (``torch.cat`` of an early feature map with a late one), ``GroupNorm`` and ``SiLU``,
  ``ConvTranspose2d`` and ``F.interpolate`` upsampling;
- ``llama_like``: Llama's blocks over patches: an ``RMSNorm`` module, a SwiGLU made with ``chunk``, attention with
  ``torch.einsum``, blocks in an ``nn.ModuleList`` of ``nn.ModuleDict``;
- ``convnext``: ConvNeXt's blocks: depthwise convolutions, ``permute`` to channels-last and back around
  ``LayerNorm`` and ``Linear``, a layer-scale weight (``self.gamma * x``), stochastic depth off at rate 0;
- ``shift_mixer``: Swin's shifted tokens (``torch.roll``), ``F.pad`` (reflect), ``PixelShuffle``, ``InstanceNorm2d``,
  ``torch.where`` and ``clamp``, ``F.adaptive_max_pool2d``;
- ``bottleneck_resnet``: torchvision's bottleneck ResNet: an ``nn.Identity`` shortcut, ``nn.Dropout(0.0)``,
  ``out += identity`` and ``x.view(x.size(0), -1)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 10


class ConvBNReLU(nn.Sequential):
    def __init__(self, inp: int, out: int, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(inp, out, 3, stride, 1, groups=groups, bias=False),
            nn.BatchNorm2d(out),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.use_res_connect = stride == 1 and inp == out
        self.conv = nn.Sequential(
            ConvBNReLU(inp, hidden, stride, groups=1),
            ConvBNReLU(hidden, hidden, 1, groups=hidden),
            nn.Conv2d(hidden, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        out: torch.Tensor = self.conv(x)
        return out


class MobileNet(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        settings = [(8, 1, 1), (12, 2, 2), (12, 1, 2), (16, 2, 2)]
        layers: list[nn.Module] = [ConvBNReLU(3, 8, stride=2)]
        channels = 8
        for out, stride, expand in settings:
            layers.append(InvertedResidual(channels, out, stride, expand))
            channels = out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        x = torch.flatten(x, 1)
        logits: torch.Tensor = self.classifier(x)
        return logits


class DenseLayer(nn.Module):
    def __init__(self, inp: int, growth: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(1, inp)
        self.conv = nn.Conv2d(inp, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.conv(F.relu(self.norm(torch.cat(features, 1))))
        return out


class DenseBlock(nn.Module):
    def __init__(self, layers: int, inp: int, growth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(inp + i * growth, growth) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self, growth: int = 4, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.block1 = DenseBlock(3, 8, growth)
        self.transition = nn.Sequential(nn.Conv2d(8 + 3 * growth, 8, 1, bias=False), nn.AvgPool2d(2))
        self.block2 = DenseBlock(2, 8, growth)
        self.fc = nn.Linear(8 + 2 * growth, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.transition(self.block1(self.stem(x)))
        x = F.relu(self.block2(x))
        logits: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return logits


class SEBlock(nn.Module):
    def __init__(self, channels: int, reduction: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = F.relu(self.conv1(x), inplace=True)
        out = self.conv2(out)
        w = out.mean((2, 3), keepdim=True)
        w = self.fc2(F.relu(self.fc1(w)))
        out = out * w.sigmoid()
        out += identity
        return F.relu(out, inplace=True)


class SENet(nn.Module):
    def __init__(self, channels: int = 8, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(SEBlock(channels), nn.MaxPool2d(2), SEBlock(channels))
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        logits: torch.Tensor = self.head(x.view(x.size(0), x.size(1), -1).mean(-1))
        return logits


class Residual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fn(x) + x
        return out


def convmixer(dim: int = 16, depth: int = 3, kernel_size: int = 5, patch_size: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size),
        nn.GELU(),
        nn.GroupNorm(1, dim),
        *[
            nn.Sequential(
                Residual(nn.Sequential(nn.Conv2d(dim, dim, kernel_size, groups=dim, padding="same"), nn.GELU())),
                nn.Conv2d(dim, dim, kernel_size=1),
                nn.GELU(),
            )
            for _ in range(depth)
        ],
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(dim, NUM_CLASSES),
    )


class TimmAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 2) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        out: torch.Tensor = self.proj(x)
        return out


class TimmBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TimmAttention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class TimmViT(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2, patch: int = 8) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (32 // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        x = self.norm(self.blocks(x))
        logits: torch.Tensor = self.head(x[:, 0])
        return logits


class TorchEncoder(nn.Module):
    def __init__(self, dim: int = 16, patch: int = 8) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.positions = nn.Embedding((32 // patch) ** 2, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).permute(0, 2, 1)
        tokens = tokens + self.positions(torch.arange(tokens.size(1), device=tokens.device))
        logits: torch.Tensor = self.head(self.encoder(tokens).mean(dim=1))
        return logits


class LSTMRows(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3 * 32, hidden, num_layers=2, batch_first=True)
        self.fc = nn.Linear(2 * hidden, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.permute(0, 2, 1, 3).reshape(x.size(0), 32, -1)
        out, (h, c) = self.lstm(rows)
        logits: torch.Tensor = self.fc(torch.cat([out.mean(dim=1), h[0] + c[-1]], dim=1))
        return logits


class Recurrent(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.49, 0.48, 0.45]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.25, 0.24, 0.26]).view(1, 3, 1, 1))
        self.embed = nn.Linear(3 * 8 * 8, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / self.std
        h = self.embed(F.avg_pool2d(x, 4).flatten(1))
        for _ in range(3):
            h = h + self.block(h)
        logits: torch.Tensor = self.head(h)
        return logits


class Finetune(nn.Module):
    """A classifier fine-tuned on a frozen backbone, its logits scaled by a learned temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU()
        )
        for parameter in self.backbone.parameters():
            parameter.requires_grad = False
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)
        self.logit_scale = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        logits: torch.Tensor = self.fc2(torch.relu(self.fc1(x))) * self.logit_scale.exp()
        return logits


class MixerMHA(nn.Module):
    """Patches mixed by ``nn.MultiheadAttention``, a weight-normed projection, token statistics stacked with
    ``torch.stack``, and the tanh GELU."""

    def __init__(self, dim: int = 16, patch: int = 8) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.utils.parametrizations.weight_norm(nn.Linear(dim, dim))
        self.head = nn.Linear(3 * dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2).contiguous()
        mixed, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        tokens = self.norm(tokens + mixed)
        tokens = F.gelu(self.proj(tokens), approximate="tanh")
        stats = torch.stack([tokens.mean(1), tokens.amax(1), tokens[:, 0]], dim=1)
        logits: torch.Tensor = self.head(stats.flatten(1))
        return logits


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused projection split by ``.split``, heads by ``view(...).transpose(1, 2)``, and a
    causal mask kept as a buffer, sliced to the sequence and applied with ``masked_fill``."""

    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.n_head, self.n_embd = heads, dim
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        out: torch.Tensor = self.c_proj(y)
        return out


class NanoGPT(nn.Module):
    """nanoGPT's model over an image's rows as tokens: token and position embeddings (``self.wpe(pos)``, with
    ``pos = torch.arange(0, t, dtype=torch.long, device=device)``), pre-norm blocks, a head on the last token."""

    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 2, block: int = 32) -> None:
        super().__init__()
        self.wte = nn.Linear(3 * 32, dim)
        self.wpe = nn.Embedding(block, dim)
        self.h = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln_1": nn.LayerNorm(dim),
                    "attn": CausalSelfAttention(dim, heads, block),
                    "ln_2": nn.LayerNorm(dim),
                    "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
                }
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, NUM_CLASSES, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = x.permute(0, 2, 1, 3).flatten(2)
        device = idx.device
        _, t, _ = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        h = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            h = h + block["attn"](block["ln_1"](h))
            h = h + block["mlp"](block["ln_2"](h))
        logits: torch.Tensor = self.lm_head(self.ln_f(h)[:, -1, :])
        return logits


class FrozenTied(nn.Module):
    """A frozen weight read by two layers (as a frozen embedding tied to its output head): the first use is a
    ``Linear`` whose bias trains, the second ``F.linear`` on the same weight, trained layers between."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 4, 4)
        self.proj = nn.Linear(512, 32)
        self.proj.weight.requires_grad = False
        self.mid = nn.Linear(32, 512)
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.flatten(self.stem(x), 1))
        h = torch.relu(self.mid(h))
        h = F.linear(h, self.proj.weight)
        logits: torch.Tensor = self.head(h)
        return logits


class DoubleConv(nn.Module):
    def __init__(self, inp: int, out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(inp, out, 3, padding=1), nn.GroupNorm(4, out), nn.SiLU(),
            nn.Conv2d(out, out, 3, padding=1), nn.GroupNorm(4, out), nn.SiLU(),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inc = DoubleConv(3, 8)
        self.down1 = DoubleConv(8, 16)
        self.down2 = DoubleConv(16, 16)
        self.up1 = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.conv1 = DoubleConv(32, 8)
        self.conv2 = DoubleConv(16, 8)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(F.max_pool2d(x1, 2))
        x3 = self.down2(F.max_pool2d(x2, 2))
        u = self.up1(x3)
        u = self.conv1(torch.cat([u, x2], dim=1))
        u = F.interpolate(u, scale_factor=2, mode="bilinear", align_corners=False)
        u = self.conv2(torch.cat([x1, u], dim=1))
        logits: torch.Tensor = self.head(u.mean(dim=(2, 3)))
        return logits


class GLU(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.out(a * F.silu(b))
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return norm * self.weight


class LlamaLike(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.patch = nn.Conv2d(3, dim, 8, 8)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "norm1": RMSNorm(dim),
                        "qkv": nn.Linear(dim, 3 * dim, bias=False),
                        "o": nn.Linear(dim, dim, bias=False),
                        "norm2": RMSNorm(dim),
                        "mlp": GLU(dim),
                    }
                )
            )
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        b, n, d = h.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](h)).split(d, dim=-1)
            q = q.view(b, n, self.heads, d // self.heads)
            k = k.view(b, n, self.heads, d // self.heads)
            v = v.view(b, n, self.heads, d // self.heads)
            att = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d // self.heads) ** -0.5
            att = att.softmax(dim=-1)
            mixed = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, n, d)
            h = h + block["o"](mixed)
            h = h + block["mlp"](block["norm2"](h))
        logits: torch.Tensor = self.head(self.norm(h).mean(1))
        return logits


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, drop_path: float = 0.0, layer_scale: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim)) if layer_scale > 0 else None
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.dwconv(x)
        x = x.permute(0, 2, 3, 1)
        x = self.pwconv2(self.act(self.pwconv1(self.norm(x))))
        if self.gamma is not None:
            x = self.gamma * x
        x = x.permute(0, 3, 1, 2)
        if self.drop_path > 0.0 and self.training:
            keep = torch.rand(x.shape[0], 1, 1, 1, device=x.device) >= self.drop_path
            x = x * keep / (1 - self.drop_path)
        return shortcut + x


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (16, 32)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        stages = []
        for i, dim in enumerate(dims):
            layers: list[nn.Module] = []
            if i > 0:
                layers += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, 2)]
            layers += [ConvNeXtBlock(dim), ConvNeXtBlock(dim)]
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        logits: torch.Tensor = self.head(self.norm(x.mean([-2, -1])))
        return logits


class ShiftMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.InstanceNorm2d(16, affine=True)
        self.shrink = nn.Conv2d(16, 16, 2, 2)
        self.expand = nn.Conv2d(16, 32, 1)
        self.shuffle = nn.PixelShuffle(2)
        self.mix = nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x))
        h = h + torch.roll(h, shifts=(1, 1), dims=(2, 3))
        h = self.shuffle(self.expand(F.gelu(self.shrink(h))))
        h = torch.where(h > 0, h, 0.1 * h).clamp(-3.0, 3.0)
        h = self.mix(F.pad(h, (1, 1, 1, 1), mode="reflect"))
        logits: torch.Tensor = self.head(F.adaptive_max_pool2d(h, 1).flatten(1))
        return logits


class Bottleneck(nn.Module):
    expansion = 2

    def __init__(self, inp: int, planes: int, stride: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inp, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(dropout)
        self.downsample: nn.Module = (
            nn.Identity()
            if stride == 1 and inp == out
            else nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out = self.dropout(out)
        out += identity
        activated: torch.Tensor = self.relu(out)
        return activated


class BottleneckResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Bottleneck(8, 4), Bottleneck(8, 4))
        self.layer2 = nn.Sequential(Bottleneck(8, 8, 2), Bottleneck(16, 8))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        x = self.avgpool(x)
        x = x.view(x.size(0), -1)
        logits: torch.Tensor = self.fc(x)
        return logits


def mobilenet() -> MobileNet:
    return MobileNet()


def densenet() -> DenseNet:
    return DenseNet()


def senet() -> SENet:
    return SENet()


def timm_vit() -> TimmViT:
    return TimmViT()


def torch_encoder() -> TorchEncoder:
    return TorchEncoder()


def lstm_rows() -> LSTMRows:
    return LSTMRows()


def recurrent() -> Recurrent:
    return Recurrent()


def finetune() -> Finetune:
    return Finetune()


def mixer_mha() -> MixerMHA:
    return MixerMHA()


def nano_gpt() -> NanoGPT:
    return NanoGPT()


def frozen_tied() -> FrozenTied:
    return FrozenTied()


def unet() -> UNet:
    return UNet()


def llama_like() -> LlamaLike:
    return LlamaLike()


def convnext() -> ConvNeXt:
    return ConvNeXt()


def shift_mixer() -> ShiftMixer:
    return ShiftMixer()


def bottleneck_resnet() -> BottleneckResNet:
    return BottleneckResNet()


WILD_MODELS = tuple(
    f"tests.wild_models:{name}"
    for name in (
        "mobilenet",
        "densenet",
        "senet",
        "convmixer",
        "timm_vit",
        "torch_encoder",
        "lstm_rows",
        "recurrent",
        "finetune",
        "mixer_mha",
        "nano_gpt",
        "frozen_tied",
        "unet",
        "llama_like",
        "convnext",
        "shift_mixer",
        "bottleneck_resnet",
    )
)
WITH_BATCH_NORM = ("tests.wild_models:mobilenet", "tests.wild_models:bottleneck_resnet")
