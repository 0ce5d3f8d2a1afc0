"""Final evaluation: every method's plan and estimate, one race of all their plans, then one MLflow run per method.

A method is TAPP (its plan comes from the search), SingleCPU / SingleGPU (the whole model on the fastest device
of that kind), or any other planner by name (bsp, pipetorch, even, pipedream, autoddl, oracle). Three steps:

1. ``plan_method``: plan, check and estimate each method (what goes wrong is kept, not raised);
2. ``race_methods``: race every distinct plan together (``tasks.measure.race_plans``): the same conditions for
   every method, each a median over rounds with its interval. Two methods whose plans run the same
   (``tapp_core.plan.plan.same_execution``: the same plan, or one stage and one micro-batch under another schedule
   label; SingleCPU and the oracle, often) are raced once and share that measurement;
3. ``evaluate_method``: each method's nested MLflow run with its plan, estimate and measurement. Anything that
   went wrong for the method (the planner raised, it failed in the race) ends that run FAILED and fails the task,
   and the flow goes on with the other methods. A method none of whose plans fits the cluster's memory (a model
   that fits no single device, for SingleCPU) has not failed: its run ends FAILED with the reason as its
   ``does_not_fit`` tag (it has no step time), the task ends well (``Unfit``), and its row says "does not fit".
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlflow.entities import Metric
from prefect import task
from prefect.cache_policies import NO_CACHE

from reports import schema
from reports.numbers import rounded
from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.estimate import Estimate
from tapp_core.cost.simulation import estimate
from tapp_core.measure.metrics import Measurement
from tapp_core.measure.races import RaceResult
from tapp_core.model.workload import Workload
from tapp_core.plan.plan import OutOfMemory, Plan
from tapp_core.planners import PLANNER_NAMES, PlannerError, get_planner, planner_options
from tapp_core.planners.base import DoesNotFit
from tapp_core.planners.tapp.options import SearchOptions
from tapp_core.runtime import WorkerPool
from tasks.config import ExperimentConfig, ExperimentSettings
from tasks.measure import RuntimeSettings, race_plans
from tasks.tracking import MAX_TAG_LENGTH, ExperimentTags, RunRef, TrackedRun, tracked_run

MEASUREMENT_FROM = schema.MEASUREMENT_FROM


class EvaluationFailed(RuntimeError):
    """A method that could not be planned, estimated or measured; its MLflow run is FAILED."""


def planner_choices(config: ExperimentSettings) -> dict[str, object]:
    """The schedule options every method is planned with (a planner takes those it has: ``schedules`` and
    ``staleness`` only the searching and asynchronous ones)."""
    return {"schedule": config.schedule, "schedules": config.schedules, "staleness": config.staleness}


RL_ALONE = "tapp-rl"
"""TAPP's reinforcement learning alone (``TappRlPlanner``), planned with the rounds TAPP's search has."""


def rl_alone_options(config: ExperimentSettings) -> dict[str, object]:
    """The RL alone's search: the rounds and samples of TAPP's search (its cost-model rounds: the RL alone measures
    nothing) and the same seed, stopped where TAPP's own rounds must stop (``rounds_time_share`` of
    ``time_limit_s``: 63 s on the defaults), so that it adds at most that to an experiment."""
    tapp = SearchOptions()
    limit = round(tapp.time_limit_s * tapp.rounds_time_share, 3) if tapp.time_limit_s is not None else None
    return {
        "rounds": config.search_rounds - (config.measured_rounds or 0),
        "samples_per_round": config.samples_per_round,
        "time_limit_s": limit,
    }


ORACLE = "oracle"


def oracle_options() -> dict[str, object]:
    """The oracle's proofs (of every schedule, together), stopped at the time limit of TAPP's whole search (90 s on
    the defaults): without one, an experiment on a larger model waits minutes for a baseline (the GPT's took 4 min
    on ``local``). Cut short, its plan is the best it found, and the report says it is not proved
    (``tasks.summary.space_sentences``)."""
    return {"time_limit_s": SearchOptions().time_limit_s}


def method_options(method: str, config: ExperimentSettings) -> dict[str, object]:
    """The options ``method`` is planned with in an experiment: the schedule options, and the RL alone's or the
    oracle's own."""
    own = rl_alone_options(config) if method == RL_ALONE else oracle_options() if method == ORACLE else {}
    return planner_choices(config) | own


def check_choices(config: ExperimentConfig) -> None:
    """A schedule option given to an experiment must reach some planner of it: one that none of its methods takes
    is an error naming it, not a setting that silently does nothing."""
    for option, value in planner_choices(config).items():
        if value is None:
            continue
        takers = [m for m in config.evaluated_methods if option in planner_options(m)]
        if not takers:
            methods = ", ".join(config.evaluated_methods)
            raise PlannerError(f"{option}: none of the methods ({methods}) has that option, so it would change nothing")


def baseline_plan(
    method: str,
    context: CostContext,
    batch_size: int,
    seed: int,
    **options: object,
) -> Plan:
    """Method ``method``'s plan (any planner of the registry but TAPP's search, which is the flow's), with the
    ``options`` it accepts among those given."""
    if method not in PLANNER_NAMES:
        raise PlannerError(f"unknown method {method!r}")
    accepted = planner_options(method)
    chosen = {k: v for k, v in options.items() if k in accepted and v is not None}
    planner = get_planner(method, **{**chosen, "batch_size": batch_size, "seed": seed})
    return planner.plan(context)


@dataclass(frozen=True)
class PlannedMethod:
    """One method's plan and estimate, or why it has none (``failure``, raised again in its evaluation run)."""

    method: str
    plan: Plan | None
    estimate: Estimate | None
    planning_wall_s: float
    failure: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and self.plan is not None and self.estimate is not None


@dataclass(frozen=True)
class Unfit:
    """A method none of whose plans fits the cluster's memory (``DoesNotFit``, or its plan ``OutOfMemory``): not a
    failure of the method but a fact of the model and the cluster, which its row says (``reason``)."""

    method: str
    run_id: str
    reason: str


def does_not_fit(failure: Exception | None) -> bool:
    """Whether a method's planning ``failure`` says only that no plan of its space fits the memory."""
    return isinstance(failure, DoesNotFit | OutOfMemory)


@dataclass(frozen=True)
class Evaluation:
    """One method's outcome; ``step_time_s`` is the measured median when measured, else the estimate."""

    method: str
    run_id: str
    plan: Plan
    estimate: Estimate
    measurement: Measurement | None
    planning_wall_s: float = math.nan
    """How long the method took to plan (TAPP: its whole search)."""

    @property
    def ok_measurement(self) -> Measurement | None:
        """The measurement, if there is one and it succeeded."""
        return self.measurement if self.measurement is not None and self.measurement.ok else None

    @property
    def measured(self) -> bool:
        return self.ok_measurement is not None

    @property
    def step_time_s(self) -> float:
        measured = self.ok_measurement
        return measured.step_time_s if measured is not None else self.estimate.step_time_s

    @property
    def communication_share(self) -> float:
        measured = self.ok_measurement
        return measured.communication_share if measured is not None else self.estimate.communication_share


def plan_params(plan: Plan) -> dict[str, object]:
    return {
        "plan_id": plan.id,
        "planner": plan.planner,
        "stages": plan.n_stages,
        "micro_batches": plan.micro_batches,
        "schedule": plan.schedule,
        "stage_devices": " | ".join("+".join(d) for d in plan.stage_devices),
    }


def estimate_metrics(predicted: Estimate) -> dict[str, float]:
    return {
        schema.ESTIMATED_STEP_TIME: predicted.step_time_s,
        schema.ESTIMATED_COMMUNICATION_SHARE: predicted.communication_share,
        "estimated_peak_memory_mib": max(predicted.peak_memory_bytes.values(), default=0) / 2**20,
    }


def measurement_metrics(measured: Measurement) -> dict[str, float]:
    """The measurement's numbers (``measured_step_time_s`` unrounded), the race's interval (rounded as shown: the
    runs list shows it raw) and rounds, and the host's load around the race."""
    return {
        schema.MEASURED_STEP_TIME: measured.step_time_s,
        schema.STEP_TIME_LOW: rounded(measured.interval_low_s),
        schema.STEP_TIME_HIGH: rounded(measured.interval_high_s),
        schema.STEP_TIME_COVERAGE: measured.coverage,
        schema.RACE_ROUNDS: measured.rounds,
        schema.MEASURED_COMMUNICATION_SHARE: measured.communication_share,
        "measured_peak_memory_mib": max(measured.peak_memory_bytes.values(), default=0) / 2**20,
        "loss": measured.loss,
        schema.LOAD_BEFORE: measured.load_before,
        schema.LOAD_AFTER: measured.load_after,
        schema.HOST_CPUS: measured.host_cpus,
        schema.HOST_RANKS: measured.host_ranks,
        schema.HOST_OTHER_CPU: measured.other_cpu_share,
    }


def record_evaluation(run: TrackedRun, result: Evaluation, details: Mapping[str, float] | None = None) -> None:
    """The final numbers, logged only once everything has succeeded (a FAILED run never looks complete), and
    before the ``details`` (MLflow's compare page plots the metric a run logged first). The step time and share
    are rounded as every view shows them (MLflow's runs list shows metrics raw); ``step_time_ms`` is the same step
    time for MLflow's bar chart, whose labels keep two decimals."""
    step_time = rounded(result.step_time_s)
    run.log_metrics(
        {
            schema.STEP_TIME: step_time,
            schema.COMMUNICATION_SHARE: rounded(result.communication_share),
            schema.STEP_TIME_MS: rounded(1000 * step_time),
        }
    )
    run.log_metrics(details or {})
    run.set_tags({schema.STEP_TIME_SOURCE: "measured" if result.measured else "estimated"})


@task(name="plan", task_run_name="plan-{method}", cache_policy=NO_CACHE)
def plan_method(
    method: str,
    context: CostContext,
    config: ExperimentConfig,
    plan: Plan | None = None,
) -> PlannedMethod:
    """Plan (unless ``plan`` is given), check and estimate ``method`` on the configuration's cluster, with its
    schedules; a failure is kept for its evaluation run."""
    started = time.perf_counter()
    chosen: Plan | None = plan
    try:
        options = method_options(method, config)
        chosen = plan or baseline_plan(method, context, config.batch_size, config.seed, **options)
        wall = time.perf_counter() - started
        validate(chosen, context)
        predicted = estimate(chosen, context)
    except Exception as exc:
        return PlannedMethod(method, chosen, None, time.perf_counter() - started, exc)
    search_wall_s = chosen.notes.get("search_wall_s")
    planning_wall_s = search_wall_s if isinstance(search_wall_s, int | float) else wall
    return PlannedMethod(method, chosen, predicted, float(planning_wall_s))


def raced_plan(race: RaceResult | None, plan: Plan) -> Plan | None:
    """The plan of ``race`` that runs the same as ``plan`` (``tapp_core.plan.plan.same_execution``), if it ran one."""
    if race is None:
        return None
    return next((p for p in race.plans if p.execution_id == plan.execution_id), None)


def race_methods(
    planned: Sequence[PlannedMethod],
    pool: WorkerPool,
    model: str | Workload,
    runtime: RuntimeSettings,
    estimated_only: Sequence[str] = (),
) -> tuple[list[PlannedMethod], RaceResult | None]:
    """One race on the flow's worker pool ``pool`` of the plans the methods chose, each way of running once
    (``same_execution``: the first method's plan stands for the others'; a method without a plan, or one of
    ``estimated_only``, is left out). When the race itself fails (the pool would not start), every method that was
    to be raced carries that failure."""
    raced = [p.ok and p.plan is not None and p.method not in estimated_only for p in planned]
    distinct: dict[str, Plan] = {}
    for p, to_race in zip(planned, raced, strict=True):
        if to_race and p.plan is not None:
            distinct.setdefault(p.plan.execution_id, p.plan)
    plans = list(distinct.values())
    if not plans:
        return list(planned), None
    state = race_plans(plans, pool, model, runtime, return_state=True)
    if state.is_completed():
        return list(planned), state.result()
    try:
        state.result()
        failure: Exception = EvaluationFailed("the evaluation race did not finish")
    except Exception as exc:
        failure = EvaluationFailed(f"the evaluation race failed: {type(exc).__name__}: {exc}")
    return [dataclasses.replace(p, failure=failure) if r else p for p, r in zip(planned, raced, strict=True)], None


@task(name="evaluate", task_run_name="evaluate-{planned.method}", cache_policy=NO_CACHE)
def evaluate_method(
    planned: PlannedMethod,
    parent: RunRef,
    tags: ExperimentTags,
    race: RaceResult | None = None,
    measurement_from: str | None = None,
) -> Evaluation | Unfit:
    """One nested MLflow run for a planned method: its plan, estimate and (when ``race`` ran it) measurement; a
    method with no plan that fits the memory is ``Unfit`` (``record_unfit``).

    ``measurement_from`` names an earlier method whose plan runs the same (``same_execution``), whose measurement
    this one shares.
    """
    method = planned.method
    if does_not_fit(planned.failure):
        return record_unfit(planned, parent, tags)
    with tracked_run(method, tags.child(parent, schema.EVALUATION, method=method), parent=parent) as run:
        chosen = planned.plan
        if chosen is not None:
            run.log_params(plan_params(chosen))
            run.log_dict(chosen.to_dict(), schema.PLAN_ARTIFACT)
        details = {"planning_wall_s": planned.planning_wall_s}  # logged after the step time, or when it fails
        if planned.failure is not None:
            run.log_metrics(details)
            raise planned.failure
        assert chosen is not None and planned.estimate is not None
        run.log_dict(planned.estimate.to_dict(), schema.ESTIMATE_ARTIFACT)
        details.update(estimate_metrics(planned.estimate))
        measured = None
        raced = raced_plan(race, chosen)
        if race is not None:
            if raced is None:
                raise EvaluationFailed(f"{method}: plan {chosen.id} was not in the evaluation race")
            measured = race.measurement(raced.id)
            if measurement_from is not None:
                run.set_tags({MEASUREMENT_FROM: measurement_from})
            run.log_text(measured.to_json(), "measurement.json")
            if not measured.ok:
                run.log_metrics(details)
                raise EvaluationFailed(f"{method}: plan {chosen.id} failed on the runtime: {measured.error}")
            details.update(measurement_metrics(measured))
        result = Evaluation(method, run.run_id, chosen, planned.estimate, measured, planned.planning_wall_s)
        record_evaluation(run, result, details)
        if race is not None and measured is not None:
            record_race(run, race, measured)
    return result


def record_unfit(planned: PlannedMethod, parent: RunRef, tags: ExperimentTags) -> Unfit:
    """The run of a method with no plan that fits: FAILED (it has no step time, and no view counts it as measured)
    with its reason as the ``error`` tag and the ``does_not_fit`` one; the task itself ends well."""
    assert planned.failure is not None
    reason = str(planned.failure)
    run_id = ""
    try:
        with tracked_run(planned.method, tags.child(parent, schema.EVALUATION, method=planned.method), parent) as run:
            run_id = run.run_id
            run.set_tags({schema.DOES_NOT_FIT: reason[:MAX_TAG_LENGTH]})
            if planned.plan is not None:
                run.log_dict(planned.plan.to_dict(), schema.PLAN_ARTIFACT)
            raise planned.failure
    except (DoesNotFit, OutOfMemory):
        pass
    return Unfit(planned.method, run_id, reason)


def record_race(run: TrackedRun, race: RaceResult, measured: Measurement) -> None:
    """Each round's step time (step = the race's round number, so two methods' runs pair round by round) and the
    race the measurement came from. Whether the method is in the best group is the experiment's result's to say
    (``tasks.summary``), once every method is evaluated."""
    now = int(time.time() * 1000)
    rounds = [Metric(schema.ROUND_STEP_TIME, t, now, n) for n, t in measured.round_step_times_s.items()]
    run.client.log_batch(run.run_id, metrics=rounds, synchronous=True)
    run.set_tags(
        {schema.RACE_ID: race.id, schema.RACE_STOP: race.stop, schema.HOST_OVERLOADED: str(race.overloaded).lower()}
    )
