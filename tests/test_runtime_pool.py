"""The worker pool survives bad plans: a plan that raises, runs out of memory or passes its time limit comes
back as a failed Measurement and the next plan runs on the same workers; a killed rank gives a clear error and
a restarted pool; nothing hangs."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.runtime import WorkerPool, measure
from tests.test_runtime_faulty_models import FAULT_LAYER_STAGES, HANG_S, STALL_S

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

FAULTY = "tests.test_runtime_faulty_models"
DEVICES = (("d0",), ("d1",), ("d2",))


def cluster3(emulated: bool = False) -> Cluster:
    devices = [{"name": f"d{i}", "memory": "2GiB", "slowdown": 1 + i} for i in range(3)]
    return parse_cluster(
        {
            "name": "pool3",
            "emulated": emulated,
            "devices": devices,
            "links": {"bandwidth": "1Gbit/s", "latency": "100us"},
        }
    )


def good_plan() -> Plan:
    return Plan("mlp", 16, 4, "1f1b", (0, 0, 1, 1, 2, 2), DEVICES)


def faulty_plan(which: str) -> Plan:
    return Plan(f"{FAULTY}:{which}", 16, 4, "gpipe", FAULT_LAYER_STAGES, DEVICES)


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(cluster3(), grace_s=15.0) as workers:
        yield workers


def assert_pool_goes_on(pool: WorkerPool, restarts: int) -> None:
    measurement = pool.measure(good_plan(), steps=3, warmup=1)
    assert measurement.ok, measurement.error
    assert pool.restarts == restarts


def test_a_plan_that_raises_fails_alone(pool: WorkerPool) -> None:
    restarts = pool.restarts
    measurement = pool.measure(faulty_plan("raising"), steps=3, warmup=1, timeout_s=60)
    assert not measurement.ok
    assert (
        "failed" in measurement.error and "deliberate failure in the middle stage" in measurement.error
    )  # the rank that builds its stage first reports it
    assert_pool_goes_on(pool, restarts)


def test_a_plan_out_of_memory_fails_alone(pool: WorkerPool) -> None:
    restarts = pool.restarts
    measurement = pool.measure(faulty_plan("out_of_memory"), steps=3, warmup=1, timeout_s=60)
    assert not measurement.ok
    assert measurement.error.startswith("out of memory on rank "), (
        measurement.error
    )  # stages trace the whole model when built
    assert_pool_goes_on(pool, restarts)


def test_a_plan_past_its_time_limit_fails_alone(pool: WorkerPool) -> None:
    restarts = pool.restarts
    start = time.monotonic()
    measurement = pool.measure(faulty_plan("stalling"), steps=3, warmup=1, timeout_s=1.5)
    assert not measurement.ok
    assert "timeout" in measurement.error and "time limit" in measurement.error, measurement.error
    # The limit, the stall, and start-up slack for a busy 2-core host (ranks reset their allocator and record a
    # memory baseline before each plan): the pool was not restarted, which would have taken longer.
    assert time.monotonic() - start < 1.5 + STALL_S + 20
    assert_pool_goes_on(pool, restarts)


def test_a_plan_stuck_past_the_grace_period_restarts_the_pool(pool: WorkerPool) -> None:
    restarts, grace = pool.restarts, pool.grace_s
    # The middle rank sleeps HANG_S once it sees a real batch, with no check of its time limit in between. The
    # limit is long enough for a loaded host to build the stages and reach that batch before it passes: a short
    # one let every rank give up while starting and answer in time.
    pool.grace_s = 1.0
    try:
        start = time.monotonic()
        measurement = pool.measure(faulty_plan("hanging"), steps=40, warmup=1, timeout_s=10.0)
        took = time.monotonic() - start
    finally:
        pool.grace_s = grace
    assert not measurement.ok
    assert "timeout: no answer" in measurement.error and "restarted" in measurement.error, measurement.error
    assert took < HANG_S / 2
    assert_pool_goes_on(pool, restarts + 1)


def test_a_killed_rank_between_plans_gives_a_clear_error_and_a_fresh_pool(pool: WorkerPool) -> None:
    restarts = pool.restarts
    old_pids = list(pool.rank_pids)
    os.kill(old_pids[1], signal.SIGKILL)
    measurement = pool.measure(good_plan(), steps=3, warmup=1, timeout_s=30)
    assert not measurement.ok
    assert "a worker rank died" in measurement.error and "the pool was restarted" in measurement.error
    assert pool.restarts == restarts + 1
    assert set(pool.rank_pids).isdisjoint(old_pids)
    assert_pool_goes_on(pool, restarts + 1)


def test_a_rank_killed_during_a_plan_gives_a_clear_error_and_a_fresh_pool(pool: WorkerPool) -> None:
    restarts = pool.restarts
    victim = pool.rank_pids[2]
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    measurement = pool.measure(faulty_plan("stalling"), steps=40, warmup=1, timeout_s=60)
    assert not measurement.ok
    assert "a worker rank died" in measurement.error, measurement.error
    assert "signal 9" in measurement.error or "Killed" in measurement.error, measurement.error
    assert_pool_goes_on(pool, restarts + 1)


def test_invalid_plans_fail_before_reaching_the_workers(pool: WorkerPool) -> None:
    unknown = Plan("mlp", 16, 4, "gpipe", (0,) * 6, (("nowhere",),))
    assert "unknown device 'nowhere'" in (pool.measure(unknown).error or "")
    starved = Plan("mlp", 4, 4, "gpipe", (0,) * 6, (("d0", "d1", "d2"),))
    assert "gets no sample of the micro-batch of 1" in (pool.measure(starved).error or "")
    wrong_layers = Plan("mlp", 16, 4, "gpipe", (0,) * 5, (("d0",),))
    error = pool.measure(wrong_layers, steps=3, warmup=1).error or ""
    assert "plan places 5 layers but the traced model has 6" in error


def test_measure_starts_and_ends_its_own_pool() -> None:
    plan = Plan("mlp", 16, 2, "gpipe", (0, 0, 0, 1, 1, 1), (("d0",), ("d2",)))
    measurement = measure(plan, cluster3(), steps=4, warmup=1)
    assert measurement.ok, measurement.error
    assert not measurement.emulated
    assert len(measurement.step_times_s) == 4 and measurement.step_time_s > 0
    assert 0.0 <= measurement.communication_share <= 1.0
    assert set(measurement.communication_s) == {"d0", "d2"}
    assert all(v > 0 for v in measurement.peak_memory_bytes.values())


def test_measure_on_a_large_cluster_starts_only_the_plans_devices() -> None:
    """A 1000-device cluster on this host: ``measure`` starts the plan's two ranks, each on its own device (rank 0
    runs d3, the cluster's first of the two, which holds the plan's second stage)."""
    devices = [{"name": f"d{i}", "memory": "2GiB"} for i in range(1000)]
    links = {"bandwidth": "1Gbit/s", "latency": "100us"}
    cluster = parse_cluster({"name": "big", "emulated": False, "devices": devices, "links": links})
    plan = Plan("mlp", 16, 2, "gpipe", (0, 0, 0, 1, 1, 1), (("d7",), ("d3",)))
    measurement = measure(plan, cluster, steps=3, warmup=1)
    assert measurement.ok, measurement.error
    assert set(measurement.communication_s) == set(measurement.peak_memory_bytes) == {"d3", "d7"}
    assert len(measurement.stage_compute_s) == 2
