"""Tied parameters: a parameter used by layers on several stages of a plan, and what such a plan needs.

A parameter several layers use (``graph.SharedParameter``: a language model's token embedding read again by its
output head) is *tied* in a plan that puts its users on several stages. Each of those stages (its *holders*) keeps
a copy, initialised identically (every stage is cut from the same model at the same seed); every step, before the
update, every device of every holder stage sums its gradient of the copy with all the others' (one allreduce among
them: the program's ``tie`` action, ``tapp_core.plan.program``), so that every copy takes the same update and the
copies stay equal, as DeepSpeed's ``TiedLayerSpec`` and Megatron's embedding group do. On a holder stage of several
devices the tied gradient is left out of the stage's buckets: the tie's allreduce already sums every device's.

The first layer that uses the parameter is charged its bytes in a layer library (``graph.layer_parameters``); the
other holder stages hold a copy more (``tied_copy_bytes``), which the memory check counts.

What a tie needs of a plan (``tapp_core.plan.rule.check_ties``):

- a synchronous schedule. The asynchronous pipeline updates each stage at its own time, each on the weights it
  stashed: the holders would apply each step's summed gradient at different moments of the pipeline, which is
  neither the single-process asynchronous replay nor a copy of any one stage's weights;
- holder stages whose layers run no split signature (a sharded copy on one stage and a whole one on another would
  need a layout change inside the tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.model.graph import SharedParameter


@dataclass(frozen=True, slots=True)
class Tie:
    """Parameter ``name`` of ``nbytes``, held by ``stages`` (ascending); ``owner`` is the layer charged its bytes."""

    index: int
    name: str
    owner: int
    stages: tuple[int, ...]
    nbytes: int


def plan_ties(stage_of_layer: Sequence[int], shared: Sequence[SharedParameter]) -> tuple[Tie, ...]:
    """The trained shared parameters whose users ``stage_of_layer`` puts on more than one stage, in ``shared``'s
    order (a frozen one's copies never change: nothing to sum)."""
    trained = [parameter for parameter in shared if parameter.trained]
    return tuple(
        Tie(index, parameter.name, parameter.layers[0], stages, parameter.nbytes)
        for index, (parameter, stages) in enumerate(_parted(stage_of_layer, trained))
    )


def _parted(
    stage_of_layer: Sequence[int], shared: Sequence[SharedParameter]
) -> list[tuple[SharedParameter, tuple[int, ...]]]:
    """The shared parameters whose users ``stage_of_layer`` puts on more than one stage, with those stages."""
    spans = [(p, tuple(sorted({int(stage_of_layer[layer]) for layer in p.layers}))) for p in shared]
    return [(parameter, stages) for parameter, stages in spans if len(stages) > 1]


def tied_copy_bytes(
    stage_of_layer: Sequence[int], n_stages: int, shared: Sequence[SharedParameter], trained: bool | None = None
) -> np.ndarray:
    """Per stage, the bytes of the shared parameters it holds a copy of beyond those its layers are charged (frozen
    ones too: each stage holds its copy); ``trained`` True or False: only the trained, or the frozen, ones."""
    extra = np.zeros(n_stages, dtype=np.int64)
    for parameter, stages in _parted(stage_of_layer, shared):
        if trained is not None and parameter.trained != trained:
            continue
        for stage in stages:
            if stage != stage_of_layer[parameter.layers[0]]:
                extra[stage] += parameter.nbytes
    return extra


def untied_param_bytes(
    stage_of_layer: Sequence[int], param_bytes: Sequence[int] | np.ndarray, shared: Sequence[SharedParameter]
) -> np.ndarray:
    """``param_bytes`` per layer less the tied parameters' (which their ties reduce, not the stages' buckets)."""
    out = np.array(param_bytes, dtype=np.int64)
    for tie in plan_ties(stage_of_layer, shared):
        out[tie.owner] -= tie.nbytes
    return out
