"""A stage's gradients (``tapp_core.runtime.gradients``): the hooks that start a bucket's reduction."""

from __future__ import annotations

import gc
import weakref
from typing import cast

import pytest
import torch
from mpi4py import MPI
from torch import nn

from tapp_core.plan.program import gradient_buckets
from tapp_core.runtime.gradients import StageGradients
from tapp_core.runtime.transport import Transport


def _gradients(layer: nn.Module) -> StageGradients:
    params = {f"fc.{name}": p for name, p in layer.named_parameters()}
    buckets = gradient_buckets([0], [sum(p.numel() * p.element_size() for p in params.values())])
    # One device's communicator: the hooks are registered as for a stage on several; no message is sent here.
    return StageGradients(params, False, buckets, dict.fromkeys(params, 0), cast(Transport, None), MPI.COMM_SELF, [0])


def test_the_last_backward_starts_a_bucket_once_it_made_all_its_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    monkeypatch.setattr(StageGradients, "start_reduction", lambda self, bucket: started.append(bucket))
    layer = nn.Linear(4, 3)
    gradients = _gradients(layer)
    layer(torch.ones(2, 4)).sum().backward()
    assert started == []  # not the step's last backward
    gradients.final_backward(True)
    layer(torch.ones(2, 4)).sum().backward()
    assert started == [0]


def test_the_hooks_do_not_keep_the_stage_s_parameters() -> None:
    """A hook lives in the tensor's autograd metadata, where the garbage collector does not look: one holding the
    gradients object would keep the parameters it holds, plan after plan, on a rank that runs many."""
    layer = nn.Linear(4, 3)
    gradients = _gradients(layer)
    weight = weakref.ref(layer.weight)
    del layer, gradients
    gc.collect()
    assert weight() is None
