"""Models that fail on purpose once they see a real micro-batch (more than the 2 samples stage building uses):
by raising, by asking for more memory than any machine has, or by stalling. The pool tests measure plans of
them as ``tests.test_runtime_faulty_models:<name>``.
"""

from __future__ import annotations

import time

import torch
import torch.fx
from torch import nn

from tapp_core.model.crossing import CUT_SAMPLES

SAMPLES_WHEN_BUILDING = 2
SAMPLES_WHEN_CUTTING = CUT_SAMPLES
STALL_S = 4.0
HANG_S = 120.0
"""Longer than any time limit and grace the tests give: a rank in it cannot answer."""
FILL_BYTES = 3 * 2**30
"""More than a testbed host of the tests has (2 GiB), less than this machine: only a memory limit stops it."""


def raise_on_real_batch(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > SAMPLES_WHEN_BUILDING:
        raise RuntimeError("deliberate failure in the middle stage")
    return x


def exhaust_memory_on_real_batch(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > SAMPLES_WHEN_BUILDING:
        huge = torch.empty(2**58, dtype=torch.uint8)  # 256 PiB: the allocator refuses
        return x + huge[:1].float()
    return x


def fill_memory_on_real_batch(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > SAMPLES_WHEN_CUTTING:  # every rank runs the whole model on that many when it cuts its stage
        filled = torch.ones(FILL_BYTES, dtype=torch.uint8)  # every page touched: past a memory limit, the kernel kills
        return x + filled[:1].float()
    return x


def stall_on_real_batch(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > SAMPLES_WHEN_BUILDING:
        time.sleep(STALL_S)
    return x


def hang_on_real_batch(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > SAMPLES_WHEN_BUILDING:
        time.sleep(HANG_S)
    return x


for _fault in (
    "raise_on_real_batch",
    "exhaust_memory_on_real_batch",
    "fill_memory_on_real_batch",
    "stall_on_real_batch",
    "hang_on_real_batch",
):
    torch.fx.wrap(_fault)


class FaultyMLP(nn.Module):
    """flatten, fc1, relu1, fault, fc2, relu2, fc3: seven layers, the fault is layer 3."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.fc1 = nn.Linear(3 * 32 * 32, 32)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 16)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu1(self.fc1(torch.flatten(x, 1)))
        if self.fault == "raise":
            h = raise_on_real_batch(h)
        elif self.fault == "memory":
            h = exhaust_memory_on_real_batch(h)
        elif self.fault == "hang":
            h = hang_on_real_batch(h)
        elif self.fault == "fill":
            h = fill_memory_on_real_batch(h)
        else:
            h = stall_on_real_batch(h)
        return self.fc3(self.relu2(self.fc2(h)))


def raising() -> FaultyMLP:
    return FaultyMLP("raise")


def out_of_memory() -> FaultyMLP:
    return FaultyMLP("memory")


def filling() -> FaultyMLP:
    return FaultyMLP("fill")


def stalling() -> FaultyMLP:
    return FaultyMLP("stall")


def hanging() -> FaultyMLP:
    return FaultyMLP("hang")


FAULT_LAYER_STAGES = (0, 0, 0, 1, 1, 2, 2)
"""Three stages with the fault on the middle one."""


def test_faults_trace_as_their_own_layer_and_pass_small_batches() -> None:
    from tapp_core.model.graph import layer_nodes, trace_model

    for build in (raising, out_of_memory, filling, stalling, hanging):
        model = build()
        graph_module = trace_model(model)
        names = [node.name for node in layer_nodes(graph_module)]
        assert len(names) == len(FAULT_LAYER_STAGES)
        assert "on_real_batch" in names[3]
        assert graph_module(torch.randn(SAMPLES_WHEN_BUILDING, 3, 32, 32)).shape == (2, 10)


def test_raising_model_raises_on_a_real_batch() -> None:
    import pytest

    with pytest.raises(RuntimeError, match="deliberate failure"):
        raising()(torch.randn(4, 3, 32, 32))
