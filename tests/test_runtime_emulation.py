"""Emulated heterogeneity on one host, end to end: a slow device computes slower, a slow link delivers later,
and the wait shows up as communication in the Measurement, which says it was emulated."""

from __future__ import annotations

import pytest

from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import parse_cluster
from tapp_core.runtime import WorkerPool

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]

LINK_BYTES_PER_S = 1e6  # 8 Mbit/s
MICRO_BATCH = 4
CUT_BYTES_PER_SAMPLE = 8 * 32 * 32 * 4  # tiny_cnn's conv1 output: 8 x 32 x 32 float32


def test_slow_device_and_slow_link_are_emulated_and_measured() -> None:
    cluster = parse_cluster(
        {
            "name": "slow-link",
            "emulated": True,
            "devices": [{"name": "fast", "memory": "2GiB"}, {"name": "slow", "memory": "2GiB", "slowdown": 3}],
            "links": {"bandwidth": "8Mbit/s", "latency": "0us"},
        }
    )
    # conv1 | relu1 conv2 relu2 pool flatten fc: the cut carries conv1's output, 32 kB per sample.
    plan = Plan("tiny_cnn", 4 * MICRO_BATCH, 4, "gpipe", (0, 1, 1, 1, 1, 1, 1), (("fast",), ("slow",)))
    with WorkerPool(cluster) as pool:
        real = pool.measure(plan, steps=4, warmup=1, emulate=False)
        emulated = pool.measure(plan, steps=4, warmup=1)
    assert real.ok and emulated.ok, (real.error, emulated.error)
    assert emulated.emulated and not real.emulated

    transfer_s = MICRO_BATCH * CUT_BYTES_PER_SAMPLE / LINK_BYTES_PER_S  # 0.131 s per micro-batch and direction
    # Four activations go one after another over the link, and four gradients come back: at least 8 transfers.
    assert emulated.step_time_s >= 0.9 * 8 * transfer_s
    assert real.step_time_s < 0.5 * 8 * transfer_s
    assert emulated.communication_s["slow"] >= 0.9 * 3 * transfer_s  # waits for activations 1..3 behind 0
    assert emulated.communication_s["fast"] >= 0.9 * transfer_s  # waits at least for the last gradient
    assert emulated.communication_share > 0.3
    # The slow device's stage is emulated as three times its real compute.
    assert emulated.stage_compute_s[1] > 1.5 * real.stage_compute_s[1]
