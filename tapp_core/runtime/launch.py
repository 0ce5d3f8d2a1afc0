"""The runtime's front door: ``measure`` a plan, or ``train`` it for real, on a cluster's MPI workers.

Both start a ``WorkerPool`` (one mpiexec job, one rank per cluster device) unless given one, so a search that
measures many plans passes its pool and pays process start once.
"""

from __future__ import annotations

import contextlib
import os

from tapp_core.cluster import Cluster
from tapp_core.metrics import DEFAULT_WARMUP, Measurement
from tapp_core.plan import Plan
from tapp_core.runtime.optim import OptimizerConfig
from tapp_core.runtime.pool import DEFAULT_STEPS, WorkerPool, mpiexec_command
from tapp_core.runtime.results import TrainResult

__all__ = ["measure", "mpiexec_command", "train"]


def measure(
    plan: Plan,
    cluster: Cluster,
    model: str | None = None,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    *,
    seed: int = 0,
    emulate: bool | None = None,
    timeout_s: float = 600.0,
    optimizer: OptimizerConfig | None = None,
    pool: WorkerPool | None = None,
) -> Measurement:
    """Run ``steps`` training steps of ``plan`` (synthetic data) on ``cluster`` and measure them.

    ``model`` overrides ``plan.model`` (a registry name or ``module:callable``). Emulation of the cluster's
    heterogeneity is on when the cluster says ``emulated`` unless ``emulate`` says otherwise. A failing plan
    gives a Measurement with ``error`` set; a pool that cannot start raises ``PoolError``.
    """
    with _given_or_own(pool, cluster) as workers:
        return workers.measure(
            plan,
            model,
            steps=steps,
            warmup=warmup,
            seed=seed,
            emulate=emulate,
            timeout_s=timeout_s,
            optimizer=optimizer,
        )


def train(
    plan: Plan,
    cluster: Cluster,
    model: str | None = None,
    *,
    dataset: str = "cifar10",
    data_dir: str | os.PathLike[str] | None = None,
    epochs: int = 1,
    seed: int = 0,
    optimizer: OptimizerConfig | None = None,
    emulate: bool | None = None,
    steps_per_epoch: int | None = None,
    augment: bool = False,
    timeout_s: float = 24 * 3600.0,
    pool: WorkerPool | None = None,
) -> TrainResult:
    """Train ``plan`` on ``dataset`` for ``epochs`` epochs; ``TrainResult.test_accuracy`` is after the last."""
    with _given_or_own(pool, cluster) as workers:
        return workers.train(
            plan,
            model,
            dataset=dataset,
            data_dir=data_dir,
            epochs=epochs,
            seed=seed,
            optimizer=optimizer,
            emulate=emulate,
            steps_per_epoch=steps_per_epoch,
            augment=augment,
            timeout_s=timeout_s,
        )


def _given_or_own(pool: WorkerPool | None, cluster: Cluster) -> contextlib.AbstractContextManager[WorkerPool]:
    """``pool`` as it is (left running), else a new pool of ``cluster`` closed on leaving."""
    return contextlib.nullcontext(pool) if pool is not None else WorkerPool(cluster)
