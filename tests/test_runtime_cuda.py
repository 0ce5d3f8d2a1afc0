"""Stages on a GPU: a CUDA device's stage runs on the GPU and its tensors travel through host memory (unless
TAPP_MPI_CUDA_AWARE=1). Skipped on machines without a GPU."""

from __future__ import annotations

import pytest
import torch

from tapp_core.cluster import parse_cluster
from tapp_core.plan import Plan
from tapp_core.runtime import WorkerPool
from tests.test_runtime_correctness import BATCH, MICRO_BATCHES, OPTIMIZER, SEED, STEPS, reference

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def test_a_gpu_stage_and_a_cpu_stage_train_like_one_device() -> None:
    cluster = parse_cluster(
        {
            "name": "gpu-cpu",
            "emulated": False,
            "devices": [
                {"name": "gpu0", "kind": "cuda", "gpu_index": 0, "memory": "8GiB"},
                {"name": "cpu0", "memory": "8GiB"},
            ],
            "links": {"bandwidth": "10Gbit/s", "latency": "0us"},
        }
    )
    for schedule in ("gpipe", "1f1b"):
        plan = Plan("tiny_cnn", BATCH, MICRO_BATCHES, schedule, (0, 0, 0, 0, 1, 1, 1), (("gpu0",), ("cpu0",)))
        with WorkerPool(cluster) as pool:
            measurement, parameters = pool.run_steps(
                plan, steps=STEPS, warmup=1, seed=SEED, optimizer=OPTIMIZER, collect_parameters=True
            )
        assert measurement.ok, measurement.error
        assert measurement.peak_memory_bytes["gpu0"] > 0
        want, _ = reference("tiny_cnn", MICRO_BATCHES)
        for name, tensor in want.items():
            torch.testing.assert_close(parameters[name], tensor, rtol=1e-3, atol=1e-4)
