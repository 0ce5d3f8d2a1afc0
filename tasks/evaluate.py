"""Final evaluation of one method: its plan, the cost model's estimate and the runtime's measurement, in one run.

A method is TAPP (its plan comes from the search), SingleCPU / SingleGPU (the whole model on the fastest device
of that kind), or any other planner by name (bsp, pipetorch, even, pipedream, autoddl, oracle). Each method gets
its own nested MLflow run; anything that goes wrong in it (the planner raises, the plan does not fit, the
measurement fails) ends that run FAILED and fails the task, and the flow goes on with the other methods.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from prefect import task

from reports import runs
from tapp_core.cluster import Cluster
from tapp_core.costmodel import Estimate, estimate
from tapp_core.costs import DEFAULT_CALIBRATION, Calibration
from tapp_core.library import LayerLibrary
from tapp_core.metrics import Measurement
from tapp_core.plan import Plan, PlanError, single_stage_plan, validate
from tapp_core.planners import PLANNER_NAMES, PlannerError, get_planner
from tasks.measure import RuntimeSettings, measure_plans
from tasks.tracking import ExperimentTags, RunRef, TrackedRun, tracked_run

PAPER_METHODS: tuple[str, ...] = ("tapp", "single-cpu", "bsp", "pipetorch")
OTHER_METHODS: tuple[str, ...] = ("even", "pipedream", "autoddl", "oracle")
SINGLE_DEVICE = {"single-cpu": "cpu", "single-gpu": "cuda"}
KNOWN_METHODS: tuple[str, ...] = (*PAPER_METHODS, "single-gpu", *OTHER_METHODS)
MEASUREMENT_FROM = "measurement_from"
"""Tag of an evaluation whose plan is another method's: the method whose measurement it shares."""


class EvaluationFailed(RuntimeError):
    """A method that could not be planned, estimated or measured; its MLflow run is FAILED."""


def methods_for(cluster: Cluster, methods: tuple[str, ...]) -> tuple[str, ...]:
    """The methods to evaluate, in order: TAPP and the paper's baselines, SingleGPU if the cluster has a GPU, the rest."""
    chosen = list(dict.fromkeys(methods))
    if any(d.kind == "cuda" for d in cluster.devices) and "single-gpu" not in chosen:
        chosen.insert(len([m for m in chosen if m in PAPER_METHODS]), "single-gpu")
    return tuple(chosen)


def check_methods(methods: tuple[str, ...]) -> None:
    unknown = [m for m in methods if m not in KNOWN_METHODS]
    if unknown:
        raise PlannerError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(KNOWN_METHODS)}")
    if "tapp" not in methods:
        raise PlannerError("the methods must include 'tapp': it is what the experiment evaluates")


def single_device_plan(library: LayerLibrary, cluster: Cluster, kind: str, batch_size: int) -> Plan:
    """The whole model on the fastest device of ``kind`` whose memory holds it."""
    candidates = sorted((d for d in cluster.devices if d.kind == kind), key=lambda d: (-d.speed, -d.threads))
    problems = []
    for device in candidates:
        plan = single_stage_plan(library, [device.name], batch_size=batch_size, planner=f"single-{kind}")
        try:
            validate(plan, library, cluster)
        except PlanError as exc:
            problems.append(str(exc))
            continue
        return plan
    reason = "; ".join(problems) or "it has none"
    raise PlannerError(f"no {kind} device of cluster {cluster.name!r} can train the whole model: {reason}")


def baseline_plan(
    method: str,
    library: LayerLibrary,
    cluster: Cluster,
    batch_size: int,
    seed: int,
    calibration: Calibration = DEFAULT_CALIBRATION,
) -> Plan:
    if method in SINGLE_DEVICE:
        return single_device_plan(library, cluster, SINGLE_DEVICE[method], batch_size)
    if method not in PLANNER_NAMES:
        raise PlannerError(f"unknown method {method!r}")
    return get_planner(method, batch_size=batch_size, seed=seed, calibration=calibration).plan(library, cluster)


@dataclass(frozen=True)
class Evaluation:
    """One method's outcome; ``step_time_s`` is the measured median when measured, else the estimate."""

    method: str
    run_id: str
    plan: Plan
    estimate: Estimate
    measurement: Measurement | None

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
        return measured.step_time_s if measured is not None else self.estimate.step_time

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
        runs.ESTIMATED_STEP_TIME: predicted.step_time,
        runs.ESTIMATED_COMMUNICATION_SHARE: predicted.communication_share,
        "estimated_peak_memory_mib": max(predicted.peak_memory.values(), default=0) / 2**20,
    }


def measurement_metrics(measured: Measurement) -> dict[str, float]:
    return {
        runs.MEASURED_STEP_TIME: measured.step_time_s,
        "measured_step_time_spread_s": measured.step_time_spread_s,
        runs.MEASURED_COMMUNICATION_SHARE: measured.communication_share,
        "measured_peak_memory_mib": max(measured.peak_memory_bytes.values(), default=0) / 2**20,
        "loss": measured.loss,
    }


def record_evaluation(run: TrackedRun, result: Evaluation, details: Mapping[str, float] | None = None) -> None:
    """The final numbers, logged only once everything has succeeded (a FAILED run never looks complete), and
    before the ``details`` (MLflow's compare page plots the metric a run logged first)."""
    run.log_metrics({runs.STEP_TIME: result.step_time_s, runs.COMMUNICATION_SHARE: result.communication_share})
    run.log_metrics(details or {})
    run.set_tags({runs.STEP_TIME_SOURCE: "measured" if result.measured else "estimated"})


@task(name="evaluate", task_run_name="evaluate-{method}")
def evaluate_method(
    method: str,
    library: LayerLibrary,
    cluster: Cluster,
    parent: RunRef,
    tags: ExperimentTags,
    plan: Plan | None = None,
    runtime: RuntimeSettings | None = None,
    calibration: Calibration = DEFAULT_CALIBRATION,
    measured_plans: Mapping[str, tuple[str, Measurement]] | None = None,
) -> Evaluation:
    """Plan (unless ``plan`` is given), estimate and measure ``method``; one nested MLflow run holds it all.

    ``measured_plans`` (plan id -> (method, measurement)) are measurements this experiment already took.
    """
    with tracked_run(method, tags.child(parent, runs.EVALUATION, method=method), parent=parent) as run:
        started = time.perf_counter()
        chosen = plan or baseline_plan(method, library, cluster, tags.batch_size, tags.seed, calibration)
        run.log_params(plan_params(chosen))
        search_wall_s = chosen.notes.get("search_wall_s")
        planning_wall_s = search_wall_s if isinstance(search_wall_s, int | float) else time.perf_counter() - started
        details = {"planning_wall_s": float(planning_wall_s)}  # logged after the step time, or when it fails
        run.log_dict(chosen.to_dict(), runs.PLAN_ARTIFACT)
        validate(chosen, library, cluster)
        predicted = estimate(chosen, library, cluster, calibration)
        run.log_dict(predicted.to_dict(), runs.ESTIMATE_ARTIFACT)
        details.update(estimate_metrics(predicted))
        measured = None
        if runtime is not None and runtime.enabled:
            if measured_plans is not None and chosen.id in measured_plans:
                # The same plan as an earlier method (planners often agree): one measurement serves both.
                source, measured = measured_plans[chosen.id]
                run.set_tags({MEASUREMENT_FROM: source})
            else:
                (measured,) = measure_plans([chosen], cluster, tags.model, runtime)
            run.log_text(measured.to_json(), "measurement.json")
            if not measured.ok:
                run.log_metrics(details)
                raise EvaluationFailed(f"{method}: plan {chosen.id} failed on the runtime: {measured.error}")
            details.update(measurement_metrics(measured))
        result = Evaluation(method, run.run_id, chosen, predicted, measured)
        record_evaluation(run, result, details)
    return result
