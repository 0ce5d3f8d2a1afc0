"""The runtime's front door: ``measure`` a plan, or ``train`` it for real, on a cluster's MPI workers.

Both check the plan first (``check_before_launch``: a plan that cannot run raises ``PlanError`` before any MPI
process starts), then start a ``WorkerPool`` of the plan's devices only, unless given a pool: a search that
measures many plans passes its pool and pays process start once.
"""

from __future__ import annotations

import contextlib
import os

from tapp_core.cluster import Cluster
from tapp_core.metrics import DEFAULT_WARMUP, Measurement
from tapp_core.models import build_traced_model
from tapp_core.plan import Plan, PlanError, check_signatures
from tapp_core.program import check_programs, plan_programs
from tapp_core.runtime.optim import OptimizerConfig
from tapp_core.runtime.pool import DEFAULT_STEPS, WorkerPool, check_runnable, mpiexec_command
from tapp_core.runtime.results import TrainResult
from tapp_core.runtime.stage import ModelGraph, StageError, check_stage_assignment

__all__ = ["check_before_launch", "measure", "mpiexec_command", "train"]


def check_before_launch(plan: Plan, cluster: Cluster, model: str | None = None) -> None:
    """What can be checked before any rank starts: ``check_runnable`` (schedule, shape, devices), then the plan
    against the model's traced layers (one stage per layer, no edge running backward, every signature one its
    layer may run: ``plan.check_signatures``), then every device's program (``tapp_core.program.check_programs``:
    every send received, no deadlock).

    Raises ``PlanError`` (``ModelError`` if the model cannot be built or traced). Memory needs a layer library:
    ``tapp_core.plan.validate`` checks it.
    """
    check_runnable(plan, cluster)
    graph_module = build_traced_model(model or plan.model)
    try:
        check_stage_assignment(graph_module, plan.stage_of_layer, plan.n_stages)
    except StageError as exc:
        raise PlanError(str(exc)) from None
    graph = ModelGraph.of(graph_module)
    check_signatures(plan, graph.specs)
    warmup, measured, tail = plan.pipeline_schedule.window(plan.n_stages, plan.micro_batches)
    steps = max(2, warmup + measured + tail)
    check_programs(plan_programs(plan, graph.edges, graph.param_bytes, steps, specs=graph.specs))


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
    heterogeneity is on when the cluster says ``emulated`` unless ``emulate`` says otherwise. A plan that cannot
    run raises ``PlanError`` before anything starts (``check_before_launch``); a plan that fails on the workers
    gives a Measurement with ``error`` set; a pool that cannot start raises ``PoolError`` (``PoolRefused`` if this
    host cannot hold its ranks).
    """
    check_before_launch(plan, cluster, model)
    with _given_or_own(pool, cluster, plan) as workers:
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
    test_samples: int | None = None,
    timeout_s: float = 24 * 3600.0,
    pool: WorkerPool | None = None,
) -> TrainResult:
    """Train ``plan`` on ``dataset`` for ``epochs`` epochs (each cut to ``steps_per_epoch`` steps if given),
    evaluating on the test set (its first ``test_samples`` images if given) after each; ``TrainResult.test_accuracy``
    is after the last.

    Raises like ``measure``; a training that fails on the workers (its data, say) gives a result with ``error``.
    """
    check_before_launch(plan, cluster, model)
    with _given_or_own(pool, cluster, plan) as workers:
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
            test_samples=test_samples,
            timeout_s=timeout_s,
        )


def _given_or_own(
    pool: WorkerPool | None, cluster: Cluster, plan: Plan
) -> contextlib.AbstractContextManager[WorkerPool]:
    """``pool`` as it is (left running), else a new pool of the plan's devices, closed on leaving."""
    return contextlib.nullcontext(pool) if pool is not None else WorkerPool(cluster, devices=plan.devices)
