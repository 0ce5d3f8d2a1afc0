"""A small GPT in nanoGPT's shape: token and position embeddings, pre-norm decoder blocks of causal self-attention
and an MLP, a final LayerNorm, and an output head tied to the token embedding (the logits are the hidden states
times the embedding's weight, so one weight is used at both ends of the model).

The blocks are the ViT's (``vit.Block`` with ``causal_tokens``): separate q, k, v and projection ``nn.Linear``
layers with the heads split out explicitly, so that Megatron's attention and MLP splits apply to them alike. No
dropout and no biases left out: pipelined training must match one device.

It reads bytes: its vocabulary is the 256 byte values (``tapp_core.model.data.ByteText``), so that any text is
its data without a tokenizer to ship. ``gpt`` (the registered model): context 64 bytes, width 128, 4 blocks of 4
heads, MLP 512, 0.83 M parameters. Its workload (``GPT_WORKLOAD``): next-byte cross-entropy at every position,
AdamW, on the text of Debian's ``fortunes`` package.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tapp_core.model.zoo.vit import Block

VOCABULARY = 256
"""Byte values: the text is read as UTF-8 bytes, one token each."""
CONTEXT = 64
"""Tokens per sample: the sequence the model reads and predicts, one next byte per position."""

GPT_WORKLOAD: dict[str, object] = {
    "inputs": [{"shape": [CONTEXT], "dtype": "int64", "high": VOCABULARY}],
    "targets": "next_token",
    "loss": "cross_entropy",
    "optimizer": {"name": "AdamW", "lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.95]},
    "data": "fortunes",
}
"""The registered GPT's workload (``tapp_core.model.workload.workload_of`` reads it as it reads a model file's)."""


class GPT(nn.Module):
    def __init__(
        self,
        vocabulary: int = VOCABULARY,
        context: int = CONTEXT,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_hidden: int = 512,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, dim)
        self.positions = nn.Parameter(torch.zeros(1, context, dim))
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_hidden, causal_tokens=context) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, context) token ids -> (batch, context, vocabulary) logits: at each position, the next token's."""
        x = self.tokens(tokens) + self.positions
        x = self.norm(self.blocks(x))
        return F.linear(x, self.tokens.weight)  # the head tied to the token embedding


def gpt() -> GPT:
    return GPT()
