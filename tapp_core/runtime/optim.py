"""The training rule every runtime path shares: the optimiser and the loss scaling.

Single-device reference training in the tests uses these same two functions, so "the same training" means the
same code, not a copy of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class OptimizerConfig:
    """SGD with momentum: the one optimiser of the runtime."""

    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def make_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def micro_batch_loss(logits: torch.Tensor, labels: torch.Tensor, batch_size: int) -> torch.Tensor:
    """This slice's share of the mini-batch loss: cross-entropy summed over its samples, divided by the batch size.

    Summing these shares over micro-batches and replicas gives the mean over the whole mini-batch, so
    accumulated gradients (and a SUM allreduce among replicas) equal the gradient of one big batch.
    Labels of -1 (padding in evaluation) are ignored.
    """
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=-1) / batch_size
