"""Training a method's plan for real, for the accuracy table and the time-to-accuracy figure: one nested MLflow
run per method.

How long a plan trains is the configuration's (``ExperimentConfig.train_plan``): on the defaults a time budget per
method (``train_seconds`` of the plan's own step time, so a faster plan takes more steps in the same time), in a
few parts, each ended by a test evaluation on the first ``test_samples`` test images; or whole epochs. Each
evaluation is a point of the accuracy curve: the test accuracy against the training time spent until then.
"""

from __future__ import annotations

import itertools

from prefect import task
from prefect.cache_policies import NO_CACHE

from tapp_core import schema
from tapp_core.plan import Plan
from tapp_core.runtime import TrainResult
from tasks.config import ExperimentConfig
from tasks.measure import pool_for
from tasks.tracking import ExperimentTags, RunRef, TrackedRun, tracked_run


class TrainingFailed(RuntimeError):
    """A plan whose training failed on the workers; its MLflow run is FAILED."""


@task(name="train", task_run_name="train-{method}", cache_policy=NO_CACHE)
def train_method(
    method: str,
    plan: Plan,
    step_time_s: float,
    config: ExperimentConfig,
    parent: RunRef,
    tags: ExperimentTags,
    shared: tuple[str, TrainResult] | None = None,
) -> TrainResult:
    """Train ``plan`` (whose step time is ``step_time_s``) on the experiment's dataset and log the accuracy curve.
    ``shared`` is (method, result) of an earlier method with the same plan: its training is recorded again, not
    repeated."""
    epochs, steps = config.train_plan(step_time_s)
    with tracked_run(schema.train_name(method), tags.child(parent, schema.TRAIN, method=method), parent=parent) as run:
        params = {
            "plan_id": plan.id,
            "plan_schedule": plan.schedule,
            "plan_staleness": getattr(plan, "staleness", None),  # asynchronous plans' bound, where plans have one
            "epochs": epochs,
            "steps_per_epoch": steps,
            "train_budget_s": config.train_seconds if config.train_epochs is None else None,
            "test_samples": config.test_samples,
        }
        run.log_params({k: v for k, v in params.items() if v is not None})
        if shared is not None:
            run.set_tags({schema.TRAINED_AS: shared[0]})
            result = shared[1]
        else:
            result = pool_for(config.target).train(
                plan,
                config.model,
                dataset=config.dataset,
                data_dir=config.data_dir,
                epochs=epochs,
                seed=config.seed,
                steps_per_epoch=steps,
                test_samples=config.test_samples,
            )
        run.log_dict(result.to_dict(), "train.json")
        if not result.ok:
            raise TrainingFailed(f"{method}: training plan {plan.id} failed: {result.error}")
        record_curve(run, result, steps)
    return result


def record_curve(run: TrackedRun, result: TrainResult, steps_per_epoch: int | None) -> None:
    """Per test evaluation (step = its number): the test accuracy, the training time and steps until then, the
    training loss; then the final accuracy, time and steps."""
    times = list(itertools.accumulate(result.epoch_times_s))
    for point, (loss, seconds, accuracy) in enumerate(
        zip(result.epoch_losses, times, result.epoch_test_accuracy, strict=True), start=1
    ):
        done = {schema.CURVE_ACCURACY: accuracy, schema.CURVE_TIME: seconds, "train_loss": loss}
        if steps_per_epoch is not None:
            done[schema.CURVE_STEPS] = point * steps_per_epoch
        run.log_metrics(done, step=point)
    run.log_metrics(
        {
            schema.TEST_ACCURACY: result.test_accuracy,
            schema.TRAIN_TIME: times[-1] if times else 0.0,
            schema.TRAIN_STEPS: result.epochs * steps_per_epoch if steps_per_epoch is not None else None,
            "test_loss": result.test_loss,
            "test_samples": result.test_samples,
            "epochs": result.epochs,
        }
    )
