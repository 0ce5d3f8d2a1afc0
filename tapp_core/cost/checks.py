"""The checks of a whole plan against a run's context: ``validate`` (every check) and ``check_memory``, and the
least activation recomputation that makes a plan fit (``recomputing_where_needed``).

They take the ``CostContext`` (the library and the cluster of the run) like the estimator, so they sit on the cost
floor beside it; each check of one aspect (``check_shape``, ``check_devices``, ``check_signatures``...) is the plan
floor's, in ``tapp_core.plan.plan``.
"""

from __future__ import annotations

import dataclasses

from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import (
    OutOfMemory,
    Plan,
    PlanError,
    StageShares,
    check_devices,
    check_groups,
    check_shape,
    optimizer_unshardable,
    stage_memory_bytes,
    stage_memory_terms,
)
from tapp_core.plan.rule import ModelFacts, check_runs


def check_memory(plan: Plan, context: CostContext) -> None:
    """Every device has the memory its stage needs (``stage_memory_terms``); the message of one that lacks it says
    "out of memory on DEVICE" and names the terms, largest first."""
    shared = StageShares.of(plan, context.library)
    for stage in range(plan.n_stages):
        for name, terms in stage_memory_terms(plan, context.library, stage, context.optimizer_state, shared).items():
            need, have = int(sum(terms.values())), context.plan_memory[name]
            if need > have:
                named = ", ".join(f"{term} {_size(n)}" for term, n in sorted(terms.items(), key=lambda t: -t[1]) if n)
                raise OutOfMemory(
                    f"out of memory on device {name!r}: stage {stage} needs {_size(need)} ({named}), "
                    f"the device has {_size(have)}{_beside_the_rank(context, name)}"
                )


def _beside_the_rank(context: CostContext, device: str) -> str:
    """How the device's memory for a plan comes about, where its rank holds some of it before the plan."""
    whole = context.cluster.device(device).memory
    rank = whole - context.plan_memory[device]
    return f" for a plan ({_size(whole)} less its rank's own {_size(rank)})" if rank else ""


def recomputing_where_needed(plan: Plan, context: CostContext, shared: StageShares | None = None) -> Plan:
    """``plan`` with activation recomputation turned on for exactly the stages whose devices lack the memory to
    keep their activations (``Plan.recompute``), where they may recompute (no split signature).

    Of the plans that differ from ``plan`` only in which stages recompute, this is the fastest that fits, if any
    does: a stage's memory depends on its own choice alone, and recomputing only adds time (a forward more)."""
    needed = set(plan.recompute)
    shared = shared or StageShares.of(plan, context.library)
    for stage in range(plan.n_stages):
        if stage in needed or plan.runs_split(stage):
            continue
        if not _fits(plan, context, stage, shared):
            needed.add(stage)
    if len(needed) == len(plan.recompute):
        return plan
    return dataclasses.replace(plan, recompute=tuple(sorted(needed)))


def memory_choices_where_needed(plan: Plan, context: CostContext) -> Plan:
    """``plan`` with the least memory-saving choices that make each stage fit: a stage whose devices lack the
    memory shards its optimiser state first, where it may (``Plan.shard_optimizer``: no extra compute), and
    recomputes its activations only if that is not enough (``recomputing_where_needed``). A stage that fits is left
    as it is: what it would gain by sharding is left to the searches that toggle it."""
    sharded = set(plan.shard_optimizer)
    shared = StageShares.of(plan, context.library)
    for stage in range(plan.n_stages):
        if stage in sharded or optimizer_unshardable(plan, stage) is not None:
            continue
        if not _fits(plan, context, stage, shared):
            sharded.add(stage)
    if len(sharded) > len(plan.shard_optimizer):
        plan = dataclasses.replace(plan, shard_optimizer=tuple(sorted(sharded)))
    return recomputing_where_needed(plan, context, shared)


def _fits(plan: Plan, context: CostContext, stage: int, shared: StageShares) -> bool:
    needs = stage_memory_bytes(plan, context.library, stage, context.optimizer_state, shared)
    return all(need <= context.plan_memory[name] for name, need in needs.items())


def validate(plan: Plan, context: CostContext) -> None:
    """Raise ``PlanError`` naming the first problem that would stop ``plan`` running on the context's cluster:
    every check: the runtime's rule (``tapp_core.plan.rule.check_runs``), the devices, the groups and the memory."""
    library = context.library
    if plan.model != library.model:
        raise PlanError(f"plan is for model {plan.model!r} but the layer library is for {library.model!r}")
    check_shape(plan)
    check_devices(plan, context.cluster)
    check_groups(plan)
    check_runs(plan, ModelFacts.of_library(library))
    check_memory(plan, context)


def _size(n_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1 (``1.50 GiB``, ``812.00 KiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"
