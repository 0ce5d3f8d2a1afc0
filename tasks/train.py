"""Training a method's plan for real, for the accuracy table and the time-to-accuracy figure (a language model's:
the perplexity table and the time-to-perplexity figure): one nested MLflow run per method.

How long a plan trains is the configuration's (``ExperimentConfig.train_plan``): on the defaults the same training
samples for every method (``train_samples``), in a few parts, each ended by a test evaluation on the first
``test_samples`` test images; or whole epochs; or a time budget (``train_seconds``, a faster plan taking more
steps). Each evaluation is a point of the accuracy curve: the test accuracy against the training time spent until
then.

Every synchronous plan computes what one device computes (the runtime's correctness tests prove it: the same
weights after the same steps), so an experiment trains one synchronous plan and records its training for the other
synchronous methods too (``SharedTraining``): the same accuracy after the same steps, on a time axis of their own,
the trained plan's wall time scaled by the ratio of their measured step times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from reports import schema
from reports.figures import method_colour
from tapp_core.cost.context import CostContext
from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.model.workload import RunSpec
from tapp_core.plan.plan import Plan
from tapp_core.runtime import TrainResult, WorkerPool
from tapp_core.runtime.checkpoint import TrainingCheckpointError, newest_complete
from tasks.config import ExperimentConfig
from tasks.elastic import train_elastically
from tasks.tracking import RUN_COLOR_TAG, ExperimentTags, RunRef, TrackedRun, tracked_run


class TrainingFailed(RuntimeError):
    """A plan whose training failed on the workers; its MLflow run is FAILED."""


@dataclass(frozen=True)
class SharedTraining:
    """An earlier method's training that computes what this method's would: its name, its result and its plan's
    step time."""

    method: str
    result: TrainResult
    step_time_s: float

    def time_scale(self, step_time_s: float) -> float:
        """The factor from the trained plan's wall time to a plan of ``step_time_s`` per step."""
        return step_time_s / self.step_time_s if self.step_time_s > 0 and step_time_s > 0 else 1.0


@task(name="train", task_run_name="train-{method}", cache_policy=NO_CACHE)
def train_method(
    method: str,
    plan: Plan,
    step_time_s: float,
    config: ExperimentConfig,
    parent: RunRef,
    tags: ExperimentTags,
    pool: WorkerPool,
    shared: SharedTraining | None = None,
    checkpoints: CheckpointOptions | None = None,
    context: CostContext | None = None,
) -> TrainResult:
    """Train ``plan`` (whose step time is ``step_time_s``) on the experiment's dataset, on the flow's worker pool
    ``pool``, and log the accuracy curve. ``shared``: an earlier method's training of the same computation,
    recorded again (its time scaled to this plan's step time), not repeated. ``checkpoints``: the training's
    (``training_checkpoints``). With ``config.elastic`` and checkpoints, the training is elastic
    (``tasks.elastic``), re-planned on ``context`` (the experiment's)."""
    epochs, steps = config.train_plan(step_time_s)
    optimizer = config.optimizer
    with tracked_run(schema.train_name(method), tags.child(parent, schema.TRAIN, method=method), parent=parent) as run:
        params = {
            "plan_id": plan.id,
            "plan_schedule": plan.schedule,
            "plan_staleness": getattr(plan, "staleness", None),  # asynchronous plans' bound, where plans have one
            "epochs": epochs,
            "steps_per_epoch": steps,
            "train_budget_s": config.train_seconds if config.train_epochs is None else None,
            "train_samples": epochs * steps * config.batch_size if steps is not None else None,
            "test_samples": config.test_samples,
            "optimizer": optimizer.name,
            "lr": optimizer.lr,
        }
        run.log_params({k: v for k, v in params.items() if v is not None})
        run.set_tags({RUN_COLOR_TAG: method_colour(method)})  # the method's colour, as its evaluation run's
        if checkpoints is not None:
            run.set_tags(
                {"checkpoint_dir": checkpoints.folder or "", "resumed_from_checkpoint": checkpoints.resume or ""}
            )
        scale = 1.0
        if shared is not None:
            run.set_tags({schema.TRAINED_AS: shared.method})
            result, scale = shared.result, shared.time_scale(step_time_s)
        else:
            spec = RunSpec.of(
                config.model,
                dataset=config.dataset,
                data_dir=config.data_dir,
                epochs=epochs,
                seed=config.seed,
                steps_per_epoch=steps,
                test_samples=config.test_samples,
                checkpoints=checkpoints,
                optimizer=optimizer,
            )
            if config.elastic and checkpoints is not None and context is not None:
                result = train_elastically(plan, spec, context, run, pool).result
            else:
                result = pool.train(plan, spec)
        run.log_dict(result.to_dict(), "train.json")
        if not result.ok:
            raise TrainingFailed(f"{method}: training plan {plan.id} failed: {result.error}")
        record_curve(run, result, steps, scale, config.workload().language_model)
    return result


def training_checkpoints(
    config: ExperimentConfig, experiment_run: str, method: str, resuming: bool
) -> CheckpointOptions | None:
    """The checkpoints of ``method``'s training in experiment run ``experiment_run`` (the run a resumed experiment
    resumes): ``<checkpoint_dir>/<experiment_run>/<method>``, resumed from there when ``resuming`` and a complete
    checkpoint is there; None when the configuration writes none."""
    if config.checkpoint_dir is None:
        return None
    folder = Path(config.checkpoint_dir) / experiment_run / method
    try:
        resume = str(newest_complete(folder)) if resuming and folder.is_dir() else None
    except TrainingCheckpointError:
        resume = None  # interrupted before its first checkpoint: it starts again
    return CheckpointOptions(str(folder), config.checkpoint_every, resume)


def record_curve(
    run: TrackedRun,
    result: TrainResult,
    steps_per_epoch: int | None,
    time_scale: float = 1.0,
    language_model: bool = False,
) -> None:
    """Per test evaluation (step = its number): the test accuracy (a ``language_model``'s test perplexity), the
    training time (times ``time_scale``) and steps until then, the training loss; then the final accuracy
    (perplexity and test loss), time and steps."""
    times = [t * time_scale for t in itertools.accumulate(result.epoch_times_s)]
    qualities = result.epoch_test_perplexity if language_model else result.epoch_test_accuracy
    curve = schema.CURVE_PERPLEXITY if language_model else schema.CURVE_ACCURACY
    for point, (loss, seconds, quality) in enumerate(zip(result.epoch_losses, times, qualities, strict=True), start=1):
        done = {curve: quality, schema.CURVE_TIME: seconds, "train_loss": loss}
        if steps_per_epoch is not None:
            done[schema.CURVE_STEPS] = point * steps_per_epoch
        run.log_metrics(done, step=point)
    final = (
        {schema.TEST_PERPLEXITY: result.test_perplexity}
        if language_model
        else {schema.TEST_ACCURACY: result.test_accuracy}
    )
    run.log_metrics(
        {
            **final,
            schema.TRAIN_TIME: times[-1] if times else 0.0,
            schema.TRAIN_STEPS: result.epochs * steps_per_epoch if steps_per_epoch is not None else None,
            schema.TEST_LOSS: result.test_loss,
            "test_samples": result.test_samples,
            "epochs": result.epochs,
        }
    )
