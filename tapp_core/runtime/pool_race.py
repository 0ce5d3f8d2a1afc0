"""A race on a worker pool: ``tapp_core.measure.races``' protocol, each round of each plan measured by the pool's ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tapp_core.measure.metrics import Measurement
from tapp_core.measure.races import RaceOptions, RaceResult, RoundSteps, run_race
from tapp_core.model.workload import Workload
from tapp_core.plan.plan import Plan
from tapp_core.platform.hosts import ranks_on_host
from tapp_core.runtime.pool import WorkerPool


def race(
    pool: WorkerPool,
    plans: Sequence[Plan],
    model: str | Workload | None = None,
    options: RaceOptions = RaceOptions(),
    steps: RoundSteps = RoundSteps(),
    *,
    emulate: bool | None = None,
    on_round: Callable[[int, RaceResult], None] | None = None,
) -> RaceResult:
    """Race ``plans`` on ``pool`` (``model`` overrides each plan's own, as in ``WorkerPool.measure``)."""
    return run_race(
        PoolRounds(pool, model, steps, emulate).measure,
        plans,
        options,
        host_ranks=ranks_on_host([pool.cluster.device(d) for d in pool.devices]),
        own_pids=lambda: pool.rank_pids,
        on_round=on_round,
    )


class PoolRounds:
    """One round of one plan on a pool, as a ``Measurer`` (``measure(plan)``): ``steps.warmup + steps.steps``
    training steps. What a search's measured reward races with."""

    def __init__(
        self,
        pool: WorkerPool,
        model: str | Workload | None = None,
        steps: RoundSteps = RoundSteps(),
        emulate: bool | None = None,
    ) -> None:
        self.pool = pool
        self.model = model
        self.steps = steps
        self.emulate = emulate

    @property
    def rank_pids(self) -> list[int]:
        return list(self.pool.rank_pids)

    def measure(self, plan: Plan) -> Measurement:
        return self.pool.measure(
            plan,
            self.model,
            steps=self.steps.warmup + self.steps.steps,
            warmup=self.steps.warmup,
            seed=self.steps.seed,
            emulate=self.emulate,
            timeout_s=self.steps.timeout_s,
        )
