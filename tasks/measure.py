"""Runtime sampling: plans measured on the cluster's MPI workers, one worker pool kept up per cluster.

Starting mpiexec and importing torch on every rank costs seconds, so a flow keeps one ``WorkerPool`` per
cluster for all its measurements (sampling, then the final evaluation) and closes it at the end
(``close_pools``). A plan that fails on the workers comes back as a failed Measurement and is not retried; a
pool that cannot start raises ``PoolError``, which is worth a retry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State

from tapp_core.cluster import Cluster
from tapp_core.errors import TappError
from tapp_core.metrics import DEFAULT_WARMUP, Measurement
from tapp_core.plan import Plan
from tapp_core.runtime import PoolError, WorkerPool


@dataclass(frozen=True)
class RuntimeSettings:
    """How plans are measured: ``steps`` training steps, the first ``warmup`` of them not counted."""

    enabled: bool = True
    steps: int = DEFAULT_WARMUP + 30
    """Medians over 30 timed steps: with 5, the same plan measured twice on this 2-core host differed by 10-20%."""
    warmup: int = DEFAULT_WARMUP
    timeout_s: float = 600.0
    """Per plan: a guard against hangs, not a speed limit; a plan past it comes back as a failed Measurement."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.steps <= self.warmup:
            raise TappError(f"measuring needs more steps ({self.steps}) than warm-up steps ({self.warmup})")


_pools: dict[str, WorkerPool] = {}
_pools_lock = threading.Lock()


def pool_for(cluster: Cluster) -> WorkerPool:
    """The running worker pool of ``cluster`` (started on first use, restarted by the pool itself if it dies)."""
    key = cluster.model_dump_json()
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = WorkerPool(cluster)
        pool.start()
        return pool


def close_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


def _pool_failed(task: object, task_run: object, state: State[Any]) -> bool:
    """Retry only when the pool itself failed; a failing plan is an answer, not an accident."""
    try:
        state.result()
    except PoolError:
        return True
    except Exception:
        return False
    return False


@task(name="measure-plans", task_run_name="measure-plans", retries=2, retry_delay_seconds=5, retry_condition_fn=_pool_failed, cache_policy=NO_CACHE)
def measure_plans(plans: list[Plan], cluster: Cluster, model: str, settings: RuntimeSettings) -> list[Measurement]:
    """Measure each plan on the workers, in order; failed plans come back with ``error`` set."""
    pool = pool_for(cluster)
    return [
        pool.measure(
            plan,
            model,
            steps=settings.steps,
            warmup=settings.warmup,
            seed=settings.seed,
            timeout_s=settings.timeout_s,
        )
        for plan in plans
    ]
