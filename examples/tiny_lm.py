"""A tiny causal language model over integer token ids: token and position embeddings, one pre-norm block of
causal self-attention and an MLP, and an output head, with a cross-entropy loss over every position (the next
token), trained with AdamW.

Its ``workload`` says the input is SEQUENCE token ids below VOCAB and the targets are the next tokens. TAPP's
synthetic data for it are counting sequences (a random start, then +1 modulo the vocabulary), which the model can
learn; a real-text GPT is a later task.

    tapp profile --model examples/tiny_lm.py:build --batch-size 16
"""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQUENCE, WIDTH, HEADS = 64, 16, 32, 2

workload = {
    "inputs": [{"shape": [SEQUENCE], "dtype": "int64", "high": VOCAB}],
    "targets": "next_token",
    "loss": "cross_entropy",
    "optimizer": {"name": "AdamW", "lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.95]},
    "data": "synthetic",
}


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", torch.tril(torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool)))

    def heads(self, x):
        return x.reshape(-1, SEQUENCE, HEADS, WIDTH // HEADS).transpose(1, 2)  # (batch, heads, SEQUENCE, width)

    def forward(self, x):
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        scores = (q @ k.transpose(-2, -1)) / (WIDTH // HEADS) ** 0.5
        attention = F.softmax(scores.masked_fill(~self.mask, float("-inf")), dim=-1)
        return self.out((attention @ v).transpose(1, 2).reshape(-1, SEQUENCE, WIDTH))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.zeros(SEQUENCE, WIDTH))
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attention = CausalSelfAttention()
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.norm_out = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions
        x = x + self.attention(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.head(self.norm_out(x))  # (batch, SEQUENCE, VOCAB): a prediction at every position


def build() -> nn.Module:
    return TinyLM()
