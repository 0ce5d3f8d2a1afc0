"""Stages on a GPU: a CUDA device's stage runs on the GPU and its tensors travel through pinned host memory
(unless TAPP_MPI_CUDA_AWARE=1), and it trains like one device whatever its place in the pipeline, its schedule,
or the plans its pool ran before. Skipped on machines without a GPU.

The GPU computes in a different order than the CPU reference, so parameters are compared with a looser
tolerance than the CPU correctness tests use.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tapp_core.measure.metrics import run_length
from tapp_core.model.zoo import build_model
from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.runtime import WorkerPool, train
from tapp_core.runtime.batches import DeviceBatches, IteratorBatches, SyntheticBatches
from tests.test_runtime_correctness import (
    BATCH,
    MICRO_BATCHES,
    OPTIMIZER,
    SEED,
    STEPS,
    async_reference,
    reference,
    stages_by_cuts,
)

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

RTOL, ATOL = 1e-3, 1e-4
BRANCHY_CUTS = (3, 8)
"""tiny_branchy in three stages; a tensor skips the middle stage (0 -> 2)."""


def gpu_cluster() -> Cluster:
    return parse_cluster(
        {
            "name": "gpu-cpu",
            "emulated": False,
            "devices": [
                {"name": "gpu0", "kind": "cuda", "gpu_index": 0, "memory": "8GiB"},
                {"name": "cpu0", "memory": "8GiB"},
                {"name": "cpu1", "memory": "8GiB"},
            ],
            "links": {"bandwidth": "10Gbit/s", "latency": "0us"},
        }
    )


@pytest.fixture(scope="module")
def gpu_pool() -> Iterator[WorkerPool]:
    with WorkerPool(gpu_cluster()) as pool:
        yield pool


def with_gpu_at(position: int, n_stages: int) -> tuple[tuple[str, ...], ...]:
    """One device per stage: the GPU at ``position``, the CPU ranks elsewhere."""
    cpus = iter(("cpu0", "cpu1"))
    return tuple(("gpu0",) if s == position else (next(cpus),) for s in range(n_stages))


def assert_trains_like(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(want) <= set(got), f"missing parameters: {sorted(set(want) - set(got))}"
    for name, tensor in want.items():
        assert got[name].device.type == "cpu"
        torch.testing.assert_close(got[name], tensor, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def run(pool: WorkerPool, plan: Plan) -> tuple[dict[str, torch.Tensor], list[float], dict[str, int]]:
    measurement, parameters = pool.run_steps(
        plan, steps=STEPS, warmup=1, seed=SEED, optimizer=OPTIMIZER, collect_parameters=True
    )
    assert measurement.ok, measurement.error
    ran, _, drain = run_length(plan.pipeline_schedule, plan.n_stages, plan.micro_batches, STEPS, 1)  # async: fill
    assert len(measurement.step_times_s) == ran - drain and measurement.step_time_s > 0  # the drain is not timed
    return parameters, measurement.extra["losses"], measurement.peak_memory_bytes


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("gpu_stage", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_gpu_stage_anywhere_trains_like_one_device(gpu_pool: WorkerPool, schedule: str, gpu_stage: int) -> None:
    stage_of_layer = stages_by_cuts("tiny_branchy", BRANCHY_CUTS)
    plan = Plan("tiny_branchy", BATCH, MICRO_BATCHES, schedule, stage_of_layer, with_gpu_at(gpu_stage, 3))
    parameters, losses, peaks = run(gpu_pool, plan)
    want, want_losses = reference("tiny_branchy", MICRO_BATCHES)
    assert_trains_like(parameters, want)
    assert losses == pytest.approx(want_losses, rel=RTOL)
    assert peaks["gpu0"] > 0


@pytest.mark.parametrize("gpu_stage", [0, 1, 2], ids=["first", "middle", "last"])
def test_async_with_a_gpu_stage_uses_the_weights_of_each_forward(gpu_pool: WorkerPool, gpu_stage: int) -> None:
    stage_of_layer = stages_by_cuts("tiny_branchy", BRANCHY_CUTS)
    plan = Plan("tiny_branchy", BATCH, MICRO_BATCHES, "async", stage_of_layer, with_gpu_at(gpu_stage, 3))
    parameters, _, _ = run(gpu_pool, plan)
    ran, _, _ = run_length(plan.pipeline_schedule, plan.n_stages, MICRO_BATCHES, STEPS, 1)
    assert_trains_like(parameters, async_reference("tiny_branchy", BRANCHY_CUTS, 3, None, ran))


def test_a_gpu_replica_in_bsp_trains_like_one_device(gpu_pool: WorkerPool) -> None:
    plan = Plan("tiny_cnn", BATCH, MICRO_BATCHES, "gpipe", (0,) * 7, (("gpu0", "cpu0"),))
    parameters, _, _ = run(gpu_pool, plan)
    assert_trains_like(parameters, reference("tiny_cnn", MICRO_BATCHES)[0])


def test_a_gpu_replica_in_a_replicated_stage_trains_like_one_device(gpu_pool: WorkerPool) -> None:
    plan = Plan("tiny_cnn", BATCH, MICRO_BATCHES, "1f1b", (0, 0, 0, 1, 1, 1, 1), (("cpu0",), ("gpu0", "cpu1")))
    parameters, _, _ = run(gpu_pool, plan)
    assert_trains_like(parameters, reference("tiny_cnn", MICRO_BATCHES)[0])


def test_different_plans_one_after_the_other_in_one_pool() -> None:
    """The GPU rank builds a stage of a new split after stages of other splits ran on its GPU (issue 12's
    failure 2: the cached model had been moved to the GPU and the next split could not be traced)."""
    plans = [
        Plan("tiny_cnn", BATCH, MICRO_BATCHES, "gpipe", (0, 0, 0, 0, 1, 1, 1), (("gpu0",), ("cpu0",))),
        Plan("tiny_cnn", BATCH, MICRO_BATCHES, "1f1b", (0, 0, 1, 1, 1, 1, 1), (("cpu0",), ("gpu0",))),
        Plan("tiny_cnn", BATCH, MICRO_BATCHES, "gpipe", (0,) * 7, (("gpu0",),)),
        Plan("tiny_cnn", BATCH, MICRO_BATCHES, "gpipe", (0,) * 7, (("cpu1",),)),
    ]
    want = reference("tiny_cnn", MICRO_BATCHES)[0]
    with WorkerPool(gpu_cluster()) as pool:
        for plan in plans:
            parameters, _, _ = run(pool, plan)
            assert_trains_like(parameters, want)
        assert pool.restarts == 0


def test_peak_gpu_memory_is_reported(gpu_pool: WorkerPool) -> None:
    plan = Plan("tiny_cnn", BATCH, 1, "gpipe", (0,) * 7, (("gpu0",),))
    _, _, peaks = run(gpu_pool, plan)
    param_bytes = sum(p.numel() * p.element_size() for p in build_model("tiny_cnn").parameters())
    # Parameters, their gradients and the momentum buffers are all on the GPU at the update.
    assert peaks["gpu0"] >= 3 * param_bytes
    assert peaks["gpu0"] < torch.cuda.get_device_properties(0).total_memory
    assert set(peaks) == {"gpu0"}


def test_training_with_gpu_stages_reads_its_batches_from_a_loader() -> None:
    plan = Plan("tiny_cnn", 24, 2, "1f1b", (0, 0, 0, 1, 1, 1, 1), (("gpu0",), ("cpu0", "cpu1")))
    result = train(plan, gpu_cluster(), dataset="synthetic", epochs=2, steps_per_epoch=6, optimizer=OPTIMIZER)
    assert result.ok, result.error
    assert result.test_samples == 512
    assert result.test_accuracy > 0.2  # separable synthetic classes: a few steps beat chance (10%)
    assert result.epoch_losses[1] < result.epoch_losses[0]


def test_device_batches_are_the_sources_batches_on_the_gpu() -> None:
    device = torch.device("cuda", 0)
    source = SyntheticBatches(8, seed=1)
    batches = DeviceBatches(SyntheticBatches(8, seed=1), device, steps=5)
    try:
        for step in range(5):
            for _ in range(2):  # every micro-batch of a step asks
                x, y = batches.get(step)
                assert x.device == device and y.device == device
                torch.testing.assert_close(x.cpu(), source.get(step)[0], rtol=0, atol=0)
                torch.testing.assert_close(y.cpu(), source.get(step)[1], rtol=0, atol=0)
    finally:
        batches.close()
    labels_only = DeviceBatches(SyntheticBatches(8, seed=1), device, steps=2, inputs=False)
    try:
        x, y = labels_only.get(1)
        assert x.device.type == "cpu" and y.device == device
        torch.testing.assert_close(y.cpu(), source.get(1)[1], rtol=0, atol=0)
    finally:
        labels_only.close()
    # An iterator of exactly ``steps`` batches is read in order and never past its end.
    loader = [(torch.full((4, 2), float(i)), torch.full((4,), i)) for i in range(3)]
    from_loader = DeviceBatches(IteratorBatches(loader, 4), device, steps=3)
    try:
        assert [int(from_loader.get(step)[1][0]) for step in range(3)] == [0, 1, 2]
    finally:
        from_loader.close()


def test_a_gpu_tensor_sent_through_host_memory_arrives_whole() -> None:
    from mpi4py import MPI

    from tapp_core.runtime.emulation import Emulation
    from tapp_core.runtime.transport import DATA_TAG_BASE, Control, Transport

    comm = MPI.COMM_SELF
    control = Control(comm.Dup(), deadline=float("inf"))
    transport = Transport(comm.Dup(), comm.Dup(), comm.Dup(), control, Emulation(enabled=False))
    source = torch.randn(64, 1000, device="cuda")
    buffers = [torch.empty(64, 1000, pin_memory=True) for _ in range(3)]
    receipts = [transport.irecv(buffer, 0, DATA_TAG_BASE + i) for i, buffer in enumerate(buffers)]
    for i in range(3):
        transport.isend(source * (i + 1), 0, DATA_TAG_BASE + i)  # the only reference to each product
    transport.wait(receipts)
    transport.flush()
    for i, buffer in enumerate(buffers):
        torch.testing.assert_close(buffer, (source * (i + 1)).cpu(), rtol=0, atol=0)


def test_a_received_tensor_goes_to_the_gpu_on_its_own_stream() -> None:
    from mpi4py import MPI

    from tapp_core.runtime.emulation import Emulation
    from tapp_core.runtime.transport import Control, Transport

    comm = MPI.COMM_SELF
    control = Control(comm.Dup(), deadline=float("inf"))
    transport = Transport(comm.Dup(), comm.Dup(), comm.Dup(), control, Emulation(enabled=False))
    device = torch.device("cuda", 0)
    received = torch.randn(256, 1024, pin_memory=True)
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(20):  # compute queued on the current stream before the copy
        busy = busy @ busy / 2048
    moved = transport.to_device(received, device)
    (side,) = transport._receive_streams.values()
    assert side != torch.cuda.current_stream(device), "the copy must not queue behind the compute stream"
    doubled = moved * 2  # on the current stream, which waits for the copy on the GPU
    torch.testing.assert_close(doubled.cpu(), received * 2, rtol=0, atol=0)
    assert transport.to_device(received, torch.device("cpu")) is received
