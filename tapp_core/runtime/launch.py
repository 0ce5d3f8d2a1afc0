"""The runtime's front door: ``measure`` a plan, or ``train`` it for real, on a cluster's MPI workers.

Both check the plan first (``check_before_launch``: a plan that cannot run raises ``PlanError`` before any MPI
process starts), then start a ``WorkerPool`` of the plan's devices only, unless given a pool: a search that
measures many plans passes its pool and pays process start once.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tapp_core.measure.metrics import DEFAULT_WARMUP, Measurement
from tapp_core.model.workload import RunSpec, Workload, build_traced_workload
from tapp_core.plan.plan import Plan, PlanError
from tapp_core.plan.program import DeviceProgram, check_programs, plan_programs
from tapp_core.plan.rule import check_runs
from tapp_core.platform.cluster import Cluster
from tapp_core.runtime.checkpoint import prepare_checkpoints
from tapp_core.runtime.engine import check_routes
from tapp_core.runtime.optim import compensation_warning
from tapp_core.runtime.pool import DEFAULT_STEPS, WorkerPool, check_runnable, mpiexec_command
from tapp_core.runtime.results import TrainResult
from tapp_core.runtime.stage import ModelGraph, StageError, StageFactory

__all__ = ["check_before_launch", "measure", "mpiexec_command", "train"]


def check_before_launch(
    plan: Plan,
    cluster: Cluster,
    model: str | Workload | RunSpec | None = None,
    *,
    stages: StageFactory | None = None,
) -> None:
    """What can be checked before any rank starts: ``check_runnable`` (schedule, shape, devices), then the plan
    against the workload's traced layers by the one rule every planner and ``validate`` ask too
    (``tapp_core.plan.rule.check_runs``: one stage per layer, no edge running backward, every signature one its
    layer may run, every tied parameter's needs), then every device's program
    (``tapp_core.plan.program.check_programs``: every send received, every reduction and tie met, no deadlock).

    With ``stages`` (a factory, which caches traced models and splits across plans), also what each rank checks
    when it builds its stage, without starting any: the cut of the traced model into stages (every value crossing
    a cut a tensor with a sample dimension, the output on the last stage: ``stage.split_stages``) and every stage's
    routes (``engine.check_routes``).

    Raises ``PlanError`` (``ModelError`` if the model cannot be built or traced). Memory needs a layer library:
    ``tapp_core.cost.checks.validate`` checks it.
    """
    check_runnable(plan, cluster)
    spec = _spec(plan, model)
    workload = spec.workload
    graph = (
        stages.graph(workload, spec.seed)
        if stages is not None
        else ModelGraph.of(build_traced_workload(workload), workload.feed)
    )
    check_runs(plan, graph.facts())
    warmup, measured, tail = plan.pipeline_schedule.window(plan.n_stages, plan.micro_batches)
    steps = max(2, warmup + measured + tail)
    programs = plan_programs(plan, graph.edges, graph.trained_bytes, steps, specs=graph.specs, shared=graph.shared)
    check_programs(programs)
    if stages is not None:
        _check_stages(plan, spec, stages, programs)
    compensation_warning(workload.optimizer, not plan.pipeline_schedule.synchronous)


def _check_stages(plan: Plan, spec: RunSpec, stages: StageFactory, programs: tuple[DeviceProgram, ...]) -> None:
    """Build every stage of ``plan`` (one per stage, on the CPU) and check its routes against its program."""
    try:
        built = [
            stages.stage(spec.workload, spec.seed, plan.stage_of_layer, plan.n_stages, s, torch.device("cpu"))
            for s in range(plan.n_stages)
        ]
        for program in programs:
            check_routes(program, built[program.stage])
    except StageError as exc:
        raise PlanError(str(exc)) from None


def measure(
    plan: Plan,
    cluster: Cluster,
    model: str | Workload | RunSpec | None = None,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    *,
    emulate: bool | None = None,
    timeout_s: float = 600.0,
    pool: WorkerPool | None = None,
    **options: Any,
) -> Measurement:
    """Run ``steps`` training steps of ``plan`` (synthetic data of its workload) on ``cluster`` and measure them.

    ``model`` is the run spec, a workload or a model spec (a registry name or ``module:callable``; default
    ``plan.model``); ``options`` replace the spec's by name (``RunSpec.with_options``: ``seed``, ``optimizer``...).
    Emulation of the cluster's heterogeneity is on when the cluster says ``emulated`` unless ``emulate`` says
    otherwise. A plan that cannot run raises ``PlanError`` before anything starts (``check_before_launch``); a
    plan that fails on the workers gives a Measurement with ``error`` set; a pool that cannot start raises
    ``PoolError`` (``PoolRefused`` if this host cannot hold its ranks).
    """
    spec = _spec(plan, model, **options)
    check_before_launch(plan, cluster, spec)
    with _given_or_own(pool, cluster, plan) as workers:
        return workers.measure(plan, spec, steps=steps, warmup=warmup, emulate=emulate, timeout_s=timeout_s)


def train(
    plan: Plan,
    cluster: Cluster,
    model: str | Workload | RunSpec | None = None,
    *,
    emulate: bool | None = None,
    timeout_s: float = 24 * 3600.0,
    pool: WorkerPool | None = None,
    **options: Any,
) -> TrainResult:
    """Train ``plan`` as the run spec says: on its workload's data for its ``epochs`` (each cut to
    ``steps_per_epoch`` steps if given), evaluating on the test set (its first ``test_samples`` samples if given)
    after each; ``TrainResult.test_accuracy`` is after the last. ``model`` and ``options`` as ``measure``'s
    (``dataset``, ``data_dir``, ``epochs``, ``optimizer``, ``checkpoints``...).

    The spec's ``checkpoints``: where to write checkpoints, how often, and the one to resume from
    (``runtime.checkpoint``); at the end, the whole model is written into its folder (``checkpoint.MODEL_FILE``).

    Raises like ``measure``, and ``TrainingCheckpointError`` for a checkpoint that cannot be resumed; a training that
    fails on the workers (its data, say) gives a result with ``error``.
    """
    spec = _spec(plan, model, **options)
    check_before_launch(plan, cluster, spec)
    if spec.checkpoints is not None:
        prepare_checkpoints(spec.checkpoints, spec.workload, plan.batch_size)  # before any rank starts
    with _given_or_own(pool, cluster, plan) as workers:
        return workers.train(plan, spec, emulate=emulate, timeout_s=timeout_s)


def _spec(plan: Plan, model: str | Workload | RunSpec | None, **options: Any) -> RunSpec:
    """The run spec: ``model`` as it is or made one (``plan.model``'s by default), ``options`` replacing its fields."""
    spec = model if isinstance(model, RunSpec) else RunSpec.of(model or plan.model)
    return spec.with_options(**options)


def _given_or_own(
    pool: WorkerPool | None, cluster: Cluster, plan: Plan
) -> contextlib.AbstractContextManager[WorkerPool]:
    """``pool`` as it is (left running), else a new pool of the plan's devices, closed on leaving."""
    return contextlib.nullcontext(pool) if pool is not None else WorkerPool(cluster, devices=plan.devices)
