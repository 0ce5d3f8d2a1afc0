"""The messages between the pool and its ranks: the pool's setup for the ranks, rank 0's greeting, and the jobs
(rank 0's reply to each job is ``results.Reply``).

Once rank 0 has proven the pool's key (``wire``), the pool sends it a ``RankSetup``, which rank 0 hands to every
rank; rank 0 answers ``Ready`` when every rank is up. The pool then sends a job at a time; rank 0 hands each to the
other ranks over MPI, and every rank dispatches on the job's type. The types are plain data (plans, numbers,
strings), pickled over the authenticated link only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from tapp_core.model.workload import RunSpec, Workload
from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import Cluster


@dataclass(frozen=True, kw_only=True)
class PrepareJob:
    """Build and trace ``model``'s workload on every rank, ahead of its first plan."""

    id: int
    model: str | Workload
    seed: int
    timeout_s: float


@dataclass(frozen=True, kw_only=True)
class PlanSetup:
    """What every rank needs to set up its share of a plan, whatever the job then does with it."""

    plan: Plan
    spec: RunSpec
    """The workload (its model: ``plan.model`` unless the caller named another), the seed and the training."""
    emulate: bool


@dataclass(frozen=True, kw_only=True)
class MeasureJob:
    """Train ``steps`` steps on synthetic batches and time them; the first ``warmup`` steps and the last ``tail``
    are not counted (``metrics.run_length``)."""

    id: int
    timeout_s: float
    setup: PlanSetup
    steps: int
    warmup: int
    tail: int = 0
    collect_parameters: bool = False
    """Send every parameter and buffer back after the last step."""


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """Train as ``setup.spec`` says (its epochs on its workload's data, writing and resuming its checkpoints) and
    evaluate on the test set after each."""

    id: int
    timeout_s: float
    setup: PlanSetup


@dataclass(frozen=True)
class StopJob:
    """Shut every rank down."""


PlanJob: TypeAlias = MeasureJob | TrainJob
WorkJob: TypeAlias = PrepareJob | PlanJob
"""A job every rank runs and answers."""
Job: TypeAlias = WorkJob | StopJob
JOB_TYPES = (PrepareJob, MeasureJob, TrainJob, StopJob)


@dataclass(frozen=True)
class RankSetup:
    """What every rank needs before its first job: the cluster, and the pool's devices (rank i runs ``devices[i]``)."""

    cluster: Cluster
    devices: tuple[str, ...]


@dataclass(frozen=True)
class RankInfo:
    pid: int
    host: str
    argv: tuple[str, ...]
    boot: str = ""
    """The boot of the kernel it runs on (``guard.boot_id``): equal to the pool's, its pid is a process here."""
    bounded_memory: bool = False
    """Whether its C allocator gives every large block back when freed (``allocator.bound_freed_memory``): it runs
    under a memory limit no higher than its device's memory."""


@dataclass(frozen=True)
class Ready:
    """Rank 0's first message: every rank is up."""

    ranks: tuple[RankInfo, ...]
    torch: str
