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
momentum has no velocity to predict along (only the rate applies).

Weight prediction knows SGD (its momentum buffer) and Adam and AdamW (their bias-corrected first moment over the
root of the second, the direction they step along); any other ``torch.optim`` class runs with the rate
compensation only, and an asynchronous plan of one says so in one warning line (``compensation_warning``): it
trains as plain weight stashing at the lowered rate, which is correct, only less stable at long delays. ``OptimizerConfig.stale_compensation`` turns
both off (plain PipeDream weight stashing). ``bench/async_accuracy.py`` prints both; spike compensation (moving a
late gradient at once by what momentum missed) was tried and trained worse than prediction alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from tapp_core.model.workload import OptimizerConfig, Workload, optimizer_class

__all__ = [
    "PREDICTED_OPTIMIZERS",
    "OptimizerConfig",
    "compensation_warning",
    "make_optimizer",
    "micro_batch_loss",
    "predicted_weights",
    "stage_lr",
]

PREDICTED_OPTIMIZERS = ("SGD", "Adam", "AdamW")
"""The optimisers whose forwards the stale-weight compensation predicts; every other runs with the rate only."""


def stage_lr(config: OptimizerConfig, delay: int) -> float:
    """The learning rate of a stage whose gradients are applied ``delay`` updates after its forwards ran:
    ``lr / (delay + 1)`` with the stale-gradient compensation, ``lr`` without it or at delay 0."""
    return config.lr / (delay + 1) if config.stale_compensation else config.lr


FUSED_OPTIMIZERS = ("Adam", "AdamW")
"""The optimisers built with ``fused=True`` (one kernel over all the parameters, on the CPU as on a GPU), unless
the configuration's options say otherwise: on one CPU thread AlexNet's AdamW step takes 0.06 s fused against 0.4 s
in PyTorch's loop over the parameters, more than its forward and backward share of a training step."""


def make_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig, delay: int = 0) -> torch.optim.Optimizer:
    """``config``'s optimiser over ``params`` at ``stage_lr(config, delay)`` (``delay``: the stage's,
    ``PipelineSchedule.delay``); fused where it is one of ``FUSED_OPTIMIZERS``."""
    fused = {"fused": True} if config.name in FUSED_OPTIMIZERS else {}
    return optimizer_class(config.name)(list(params), **{**fused, **config.kwargs(lr=stage_lr(config, delay))})


def compensation_warning(config: OptimizerConfig, asynchronous: bool) -> str | None:
    """The one line that says an asynchronous plan's optimiser runs without weight prediction (None if it has it,
    or needs none); also logged as a warning."""
    if not (asynchronous and config.stale_compensation) or config.name in PREDICTED_OPTIMIZERS:
        return None
    line = (
        f"warning: weight prediction supports {', '.join(PREDICTED_OPTIMIZERS)}; {config.name} runs this "
        "asynchronous plan with the staleness-aware rate only"
    )
    logging.getLogger("tapp").warning(line)
    return line


def predicted_weights(
    optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter], delay: int
) -> dict[str, torch.Tensor]:
    """Each parameter extrapolated ``delay`` updates of ``optimizer`` ahead along the step it keeps taking:
    ``w - delay * lr * v``, ``v`` SGD's momentum velocity or Adam's bias-corrected ``m / (sqrt(v) + eps)`` (the
    step changes slowly). New tensors, not linked to the parameters; a parameter without a step to predict along
    (before the first update, SGD without momentum, another optimiser) is copied as it is."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    predicted = {}
    with torch.no_grad():
        for name, param in params.items():
            group = group_of[id(param)]
            direction = _step_direction(optimizer, param, group) if delay > 0 else None
            if direction is None:
                predicted[name] = param.detach().clone()
            else:
                predicted[name] = param.detach() - (delay * group["lr"]) * direction
    return predicted


def _step_direction(
    optimizer: torch.optim.Optimizer, param: nn.Parameter, group: Mapping[str, object]
) -> torch.Tensor | None:
    state = optimizer.state.get(param, {})
    if isinstance(optimizer, torch.optim.SGD):
        velocity: torch.Tensor | None = state.get("momentum_buffer")
        return velocity
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and "exp_avg" in state:
        betas: tuple[float, float] = group["betas"]  # type: ignore[assignment]
        eps: float = group["eps"]  # type: ignore[assignment]
        step = float(state["step"])
        first: torch.Tensor = state["exp_avg"] / (1 - betas[0] ** step)
        second: torch.Tensor = state["exp_avg_sq"] / (1 - betas[1] ** step)
        return first / (second.sqrt() + eps)
    return None


def micro_batch_loss(
    logits: torch.Tensor, labels: torch.Tensor, batch_size: int, workload: Workload | None = None
) -> torch.Tensor:
    """This slice's share of the mini-batch loss (``Workload.loss_of``; cross-entropy over classes without a
    workload): summed over its samples, divided by the batch size.

    Summing these shares over micro-batches and replicas gives the mean over the whole mini-batch, so
    accumulated gradients (and a SUM allreduce among replicas) equal the gradient of one big batch.
    Labels of -1 (padding in evaluation) are ignored.
    """
    return (workload or _CLASSES).loss_of(logits, labels, batch_size)


_CLASSES = Workload("classes")
