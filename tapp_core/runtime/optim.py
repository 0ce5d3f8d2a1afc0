"""The training rule every runtime path shares: the optimiser, the loss scaling and the stale-weight compensation.

Single-device reference training in the tests uses these same functions, so "the same training" means the same
code, not a copy of it.

Stale-gradient compensation (asynchronous schedules). Under weight stashing a stage's gradient is computed on the
weights its forward ran on and applied ``d`` updates later, ``d`` being the stage's delay
(``PipelineSchedule.delay``: 2, 1, 0 on the stages of a 3-stage pipeline with one micro-batch per step; at most the
staleness bound K). With momentum, such delayed gradients push past the minimum they were aimed at and training
oscillates (the earlier stages, with the longest delays, the most). The compensation is weight prediction
(SpecTrain, Chen et al. 2018; PipeMare's discrepancy correction, Yang et al. 2021, is the same idea): a forward
whose gradient will be applied ``d`` updates from now runs on the weights extrapolated ``d`` updates ahead along the
momentum velocity, ``w - d * lr * v`` (``predicted_weights``), and its backward computes the gradient there, so the
gradient is taken close to the weights it is applied to. It changes no hyper-parameter; a stage with delay 0 (every
stage of a synchronous schedule, the last stage of an asynchronous one) and SGD without momentum (no velocity) run
on the weights as they are. ``OptimizerConfig.stale_compensation`` turns it off (plain PipeDream weight stashing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
    stale_compensation: bool = True
    """Asynchronous schedules: each forward of a stage with delay d runs on its weights predicted d updates ahead
    (``predicted_weights``). False: on its weights as they are. Synchronous schedules are never affected."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def make_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def predicted_weights(
    optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter], delay: int
) -> dict[str, torch.Tensor]:
    """Each parameter extrapolated ``delay`` updates of ``optimizer`` (SGD) ahead along its momentum velocity ``v``:
    ``w - delay * lr * v`` (SGD moves ``w`` by ``lr * v`` per update, and ``v`` changes slowly). New tensors, not
    linked to the parameters; a parameter without a velocity yet (before the first update, or SGD without momentum)
    is copied as it is."""
    lr = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    predicted = {}
    with torch.no_grad():
        for name, param in params.items():
            velocity = optimizer.state.get(param, {}).get("momentum_buffer") if delay > 0 else None
            if velocity is None:
                predicted[name] = param.detach().clone()
            else:
                predicted[name] = param.detach() - (delay * lr[id(param)]) * velocity
    return predicted


def micro_batch_loss(logits: torch.Tensor, labels: torch.Tensor, batch_size: int) -> torch.Tensor:
    """This slice's share of the mini-batch loss: cross-entropy summed over its samples, divided by the batch size.

    Summing these shares over micro-batches and replicas gives the mean over the whole mini-batch, so
    accumulated gradients (and a SUM allreduce among replicas) equal the gradient of one big batch.
    Labels of -1 (padding in evaluation) are ignored.
    """
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=-1) / batch_size
