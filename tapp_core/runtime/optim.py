"""The training rule every runtime path shares: the optimiser, the loss scaling and the stale-weight compensation.

Single-device reference training in the tests uses these same functions, so "the same training" means the same
code, not a copy of it.

Stale-gradient compensation (asynchronous schedules). Under weight stashing a stage's gradient is computed on the
weights its forward ran on and applied ``d`` updates later, ``d`` being the stage's delay
(``PipelineSchedule.delay``: 2, 1, 0 on the stages of a 3-stage pipeline with one micro-batch per step; at most the
staleness bound K, below it where the pipeline is shallower). With momentum, such delayed gradients push past the
minimum they were aimed at and training oscillates or diverges (the earlier stages, with the longest delays, the
most): on a quadratic, the largest stable lr * curvature of SGD with momentum 0.9 falls from 3.8 at delay 0 to
about 0.1 at delay 1 and 0.05 at delay 2. The compensation has two parts, both a function of ``d`` alone:

- staleness-aware learning rate (Zhang et al. 2016, "Staleness-aware async-SGD", which divides the rate by the
  staleness): the stage updates at ``lr / (d + 1)`` (``stage_lr``), d + 1 being the weight versions a gradient
  spans from its forward to its update;
- weight prediction (SpecTrain, Chen et al. 2018; PipeMare's discrepancy correction, Yang et al. 2021): a forward
  whose gradient will be applied ``d`` updates from now runs on its weights extrapolated ``d`` updates ahead along
  the momentum velocity, ``w - d * lr' * v`` (``predicted_weights``, ``lr'`` the stage's rate), and its backward
  computes the gradient there, close to the weights it is applied to. On the same quadratic this alone raises the
  stable range 2-3x.

Every stage of a synchronous schedule, and the last stage of an asynchronous one, has d = 0: unchanged. SGD without
momentum has no velocity to predict along (only the rate applies). ``OptimizerConfig.stale_compensation`` turns
both off (plain PipeDream weight stashing). ``bench/async_accuracy.py`` prints both; spike compensation (moving a
late gradient at once by what momentum missed) was tried and trained worse than prediction alone.
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
    """Asynchronous schedules: a stage with delay d updates with ``stage_lr`` (lr / (d + 1)) and runs each forward
    on its weights predicted d updates ahead (``predicted_weights``). False: plain weight stashing, every stage
    at ``lr``. Synchronous schedules (d = 0 on every stage) are never affected."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def stage_lr(config: OptimizerConfig, delay: int) -> float:
    """The learning rate of a stage whose gradients are applied ``delay`` updates after its forwards ran:
    ``lr / (delay + 1)`` with the stale-gradient compensation, ``lr`` without it or at delay 0."""
    return config.lr / (delay + 1) if config.stale_compensation else config.lr


def make_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig, delay: int = 0) -> torch.optim.Optimizer:
    """SGD over ``params`` at ``stage_lr(config, delay)`` (``delay``: the stage's, ``PipelineSchedule.delay``)."""
    return torch.optim.SGD(
        list(params), lr=stage_lr(config, delay), momentum=config.momentum, weight_decay=config.weight_decay
    )


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
