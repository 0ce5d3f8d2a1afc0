"""A small Vision Transformer (ViT) for CIFAR-10: 4x4 patches, a class token, a learned position embedding, pre-norm
encoder blocks.

Written the way such models usually are, so that the whole system must cope with it: shapes are read from the
input (batch and tokens), and the class token and the position embedding are parameters of the model itself, read
through torch.fx ``get_attr`` nodes rather than through a layer. Attention has separate query, key, value and
output-projection ``nn.Linear`` layers and an explicit split into heads (``view`` + ``transpose``), so that each
can be split Megatron-style (q/k/v by heads, the projection by its input features); the shapes of the heads'
split and merge are read from the tensors split and merged, the heads counted from them
(``view(batch, tokens, -1, head_dim)``), so that a device holding some heads, or some samples, runs the same code.
The MLP is two ``nn.Linear`` with a GELU between. No dropout: pipelined training must match one device.

``vit`` (the registered model): width 256, 8 blocks of 8 heads, MLP 1024, about 6.3 M parameters.
``tiny_vit``: the same code at width 32, 2 blocks of 4 heads, for tests.
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention: q, k, v projections, heads split out, scaled dot-product, heads merged, projection.
    ``causal_tokens``: causal attention over sequences of that many tokens (a token attends to itself and the tokens
    before it), as a language model's; None: every token attends to every token."""

    def __init__(self, dim: int, heads: int, causal_tokens: int | None = None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.causal = causal_tokens is not None
        if causal_tokens is not None:
            future = torch.ones(causal_tokens, causal_tokens, dtype=torch.bool).triu(diagonal=1)
            self.register_buffer("future", future)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        attention = (q @ k.transpose(-2, -1)) * self.scale
        if self.causal:
            attention = attention.masked_fill(self.future, float("-inf"))
        attention = attention.softmax(dim=-1)
        merged = self.merge_heads(attention @ v)
        out: torch.Tensor = self.proj(merged)
        return out

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, features) -> (batch, heads, tokens, head_dim). The shape is read from the tensor itself
        and the heads counted from it (-1), so that the same code runs where a device holds only some of the heads
        (q, k and v split Megatron-style by their output features) or only some of the samples."""
        batch, tokens, _ = x.shape
        return x.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, tokens, head_dim) -> (batch, tokens, heads * head_dim), the shape read likewise."""
        x = x.transpose(1, 2)
        batch, tokens, _, _ = x.shape
        return x.reshape(batch, tokens, -1)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class Block(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)); with ``causal_tokens``, a decoder's block (a
    GPT's)."""

    def __init__(self, dim: int, heads: int, mlp_hidden: int, causal_tokens: int | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal_tokens)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class ViT(nn.Module):
    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        dim: int = 256,
        depth: int = 8,
        heads: int = 8,
        mlp_hidden: int = 1024,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch_size}")
        patches = (image_size // patch_size) ** 2
        # A convolution with stride = kernel = patch size is the usual linear patch embedding.
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, dim))
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_hidden) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (batch, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        logits: torch.Tensor = self.head(x[:, 0])
        return logits


def vit(num_classes: int = 10) -> ViT:
    return ViT(num_classes)


def tiny_vit(num_classes: int = 10) -> ViT:
    return ViT(num_classes, dim=32, depth=2, heads=4, mlp_hidden=64)
