"""Training a method's plan for real, for the accuracy table: one nested MLflow run per method."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from reports import runs
from tapp_core.cluster import Cluster
from tapp_core.plan import Plan
from tapp_core.runtime import TrainResult
from tasks.measure import pool_for
from tasks.tracking import ExperimentTags, RunRef, tracked_run


class TrainingFailed(RuntimeError):
    """A plan whose training failed on the workers; its MLflow run is FAILED."""


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 1
    steps_per_epoch: int | None = None
    """None: whole epochs; a number caps the steps (quick accuracy checks)."""
    data_dir: str | None = None
    augment: bool = False


@task(name="train", task_run_name="train-{method}", cache_policy=NO_CACHE)
def train_method(
    method: str, plan: Plan, cluster: Cluster, parent: RunRef, tags: ExperimentTags, settings: TrainSettings
) -> TrainResult:
    """Train ``plan`` on the experiment's dataset and log test accuracy (and loss and time per epoch)."""
    with tracked_run(f"train {method}", tags.child(parent, runs.TRAIN, method=method), parent=parent) as run:
        run.log_params(
            {
                "plan_id": plan.id,
                "epochs": settings.epochs,
                "steps_per_epoch": settings.steps_per_epoch,
                "augment": settings.augment,
            }
        )
        result = pool_for(cluster).train(
            plan,
            tags.model,
            dataset=tags.dataset,
            data_dir=settings.data_dir,
            epochs=settings.epochs,
            seed=tags.seed,
            steps_per_epoch=settings.steps_per_epoch,
            augment=settings.augment,
        )
        run.log_dict(result.to_dict(), "train.json")
        if not result.ok:
            raise TrainingFailed(f"{method}: training plan {plan.id} failed: {result.error}")
        for epoch, (loss, seconds, accuracy) in enumerate(
            zip(result.epoch_losses, result.epoch_times_s, result.epoch_test_accuracy, strict=True)
        ):
            run.log_metrics({"train_loss": loss, "epoch_time_s": seconds, "epoch_test_accuracy": accuracy}, step=epoch)
        run.log_metrics(
            {runs.TEST_ACCURACY: result.test_accuracy, "test_loss": result.test_loss, "epochs": result.epochs}
        )
    return result
