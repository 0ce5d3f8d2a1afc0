"""An elastic training's events in MLflow and Prefect (``tapp_core.runtime.elastic`` decides; this records).

Each event is a line of the flow run's log (``prefect_ui.log``; the ``tapp`` logger outside a flow) and, in the
training's MLflow run: the tags ``elastic_event`` (the kinds so far, in order) and ``elastic.<step>.<kind>`` (what
was decided), the metric ``steps_lost`` (at the step of each loss, and in all at the end) and, for a move, the
new plan's estimated step time. The re-planning is TAPP's (``tapp_core.planners.replan``).
"""

from __future__ import annotations

from tapp_core.cost.context import CostContext
from tapp_core.model.workload import RunSpec
from tapp_core.plan.plan import Plan
from tapp_core.planners.replan import replan
from tapp_core.runtime.elastic import LOST, MIGRATED, ElasticEvent, ElasticOptions, ElasticResult, ElasticTraining
from tapp_core.runtime.pool import WorkerPool
from tasks.prefect_ui import log
from tasks.tracking import TrackedRun

EVENT_TAG = "elastic_event"
STEPS_LOST = "steps_lost"


class ElasticRecord:
    """Records an elastic training's events into ``run`` (MLflow; none: the log only) as they come."""

    def __init__(self, run: TrackedRun | None) -> None:
        self.run = run
        self.kinds: list[str] = []
        self.steps_lost = 0

    def __call__(self, event: ElasticEvent) -> None:
        log(f"elastic training: {event.message}")
        self.kinds.append(event.kind)
        self.steps_lost += event.steps_lost
        if self.run is None:
            return
        self.run.set_tags({EVENT_TAG: ",".join(self.kinds), f"elastic.{event.step}.{event.kind}": event.message})
        metrics: dict[str, float | int | None] = {f"elastic_{k}": v for k, v in event.values.items()}
        if event.kind == LOST:
            metrics[STEPS_LOST] = event.steps_lost
        if event.kind in (LOST, MIGRATED):
            metrics["elastic_plan_start_step"] = event.step
        self.run.log_metrics(metrics, step=event.step)

    def finish(self, done: ElasticResult) -> None:
        """The totals: steps lost, plans run, wall time."""
        log(
            f"elastic training: {done.steps_done} of {done.total_steps} steps, {len(done.spans)} plan(s), "
            f"{self.steps_lost} step(s) lost, {done.wall_s:.1f} s"
        )
        if self.run is not None:
            self.run.log_metrics({STEPS_LOST: self.steps_lost, "elastic_plans": len(done.spans)})


def train_elastically(
    plan: Plan,
    spec: RunSpec,
    context: CostContext,
    run: TrackedRun | None,
    pool: WorkerPool | None = None,
    options: ElasticOptions | None = None,
) -> ElasticResult:
    """Train ``plan`` elastically on the context's cluster (starting on ``pool`` if given), re-planning with TAPP's
    ``replan``, every event logged and recorded into ``run``."""
    record = ElasticRecord(run)
    done = ElasticTraining(
        plan,
        spec,
        context,
        lambda running, left: replan(running, left, seed=spec.seed),
        options or ElasticOptions(),
        on_event=record,
        pool=pool,
    ).run()
    record.finish(done)
    return done
