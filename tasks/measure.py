"""Measuring on the cluster's MPI workers: plans raced in interleaved rounds on the flow's worker pool.

Starting mpiexec and importing torch on every rank costs seconds, so a flow owns one ``WorkerPool`` of its
cluster for all its measurements and training (sampling, the final evaluation, training; it starts on first use)
and closes it at the end; the tasks are given it. Plans that are compared are raced (``tapp_core.measure.races``): a plan that fails on the
workers comes back as a failed Measurement and the race goes on; a pool that cannot start raises ``PoolError``,
which is worth a retry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State

from tapp_core.errors import TappError
from tapp_core.measure.races import RaceOptions, RaceResult, RoundSteps, rounds_count
from tapp_core.measure.step import TIMED_STEPS, WARMUP_STEPS
from tapp_core.model.workload import Workload
from tapp_core.plan.plan import Plan
from tapp_core.runtime import PoolError, WorkerPool
from tapp_core.runtime.pool_race import race
from tasks.config import DEFAULT_RACE_SECONDS
from tasks.progress import StageProgress

EVALUATION_RACE = RaceOptions(min_rounds=5, max_rounds=15, budget_s=DEFAULT_RACE_SECONDS)
"""The final evaluation's race: a verdict from 5 rounds (a 94 % interval), at most 15, no new round after
``DEFAULT_RACE_SECONDS`` (an experiment's ``race_seconds``)."""


@dataclass(frozen=True)
class RuntimeSettings:
    """How plans are measured: raced (``race``) in rounds of ``steps`` training steps per plan, the first ``warmup``
    of them not counted."""

    enabled: bool = True
    steps: int = TIMED_STEPS + WARMUP_STEPS
    """Per plan and round, warm-up included. A round's value is the median of its timed steps; the interval comes
    from the rounds, which the interleaving makes comparable across plans (30 steps in a row were not)."""
    warmup: int = WARMUP_STEPS
    timeout_s: float = 600.0
    """Per plan and round: a guard against hangs, not a speed limit; a plan past it is failed."""
    seed: int = 0
    race: RaceOptions = field(default_factory=lambda: EVALUATION_RACE)

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.steps <= self.warmup:
            raise TappError(f"measuring needs more steps ({self.steps}) than warm-up steps ({self.warmup})")

    def round_steps(self) -> RoundSteps:
        return RoundSteps(self.steps - self.warmup, self.warmup, self.timeout_s, self.seed)

    def with_race(self, **options: Any) -> RuntimeSettings:
        return dataclasses.replace(self, race=dataclasses.replace(self.race, **options))


def pool_failed(task: object, task_run: object, state: State[Any]) -> bool:
    """Retry only when the pool itself failed; a failing plan is an answer, not an accident."""
    try:
        state.result()
    except PoolError:
        return True
    except Exception:
        return False
    return False


@task(
    name="race",
    task_run_name="race",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=pool_failed,
    cache_policy=NO_CACHE,
)
def race_plans(plans: list[Plan], pool: WorkerPool, model: str | Workload, settings: RuntimeSettings) -> RaceResult:
    """Race ``plans`` on the flow's worker pool (identical plans once); failed plans come back with ``error`` set."""
    options = settings.race
    progress = StageProgress("race", options.max_rounds, f"race of {len(plans)} plans: rounds")

    def report(number: int, so_far: RaceResult) -> None:
        best = so_far.best()
        status = f"best {best.id} {so_far.measurement(best.id).step_time_s:.4f} s" if best is not None else ""
        progress.update(number, status)

    result = race(pool, plans, model, options, settings.round_steps(), on_round=report)
    progress.update(options.max_rounds, f"{rounds_text(result)}, {result.stop}")
    return result


def rounds_text(result: RaceResult) -> str:
    """How many rounds the race's plans ran: ``7 rounds each``, or ``up to 7 rounds per plan (5–7)`` when plans
    left the race early (their intervals already clear of the best's)."""
    rounds = [m.rounds for m in result.measurements if m.ok] or [result.rounds]
    if min(rounds) == max(rounds):
        return f"{rounds_count(rounds[0])} each"
    return f"up to {max(rounds)} rounds per plan ({min(rounds)}–{max(rounds)})"
