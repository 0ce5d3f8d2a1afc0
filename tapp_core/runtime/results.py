"""Turning what every rank reported into rank 0's Reply to the pool: one Measurement, or one training result."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from tapp_core.measure.metrics import Measurement, step_time, step_time_spread
from tapp_core.measure.step import communication_share
from tapp_core.model.workload import SYNTHETIC, perplexity
from tapp_core.runtime.jobs import MeasureJob, PrepareJob, WorkJob

OUT_OF_MEMORY = "out of memory"


@dataclass
class RankResult:
    """One rank's answer to a job. ``status``: ok, idle (not in the plan) or error."""

    job: int
    rank: int
    device: str
    status: str
    error: str = ""
    error_kind: str = ""
    """exception, out of memory, timeout or aborted (another rank failed first)."""
    stage: int = -1
    replica: int = -1
    step_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    blocked_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    weight_ages: list[int] = field(default_factory=list)
    """Per backward, in order: the updates applied since its forward (``RankRecord.weight_ages``)."""
    peak_memory_bytes: int = 0
    baseline_memory_bytes: int = 0
    """The memory in use when the plan started, before its stage was built (``rank.reset_peak_memory``): part of
    ``peak_memory_bytes``, not of the plan's own."""
    setup_s: float = 0.0
    parameters: dict[str, torch.Tensor] | None = None
    epochs: list[dict[str, float]] = field(default_factory=list)
    """Training jobs: per epoch, loss / time, and on the last stage the test counts."""


def first_error(results: Sequence[RankResult]) -> str | None:
    """The error to report: the root cause, not the ranks that gave up because of it."""
    failed = [r for r in results if r.status == "error"]
    if not failed:
        return None
    rank_order = sorted(failed, key=lambda r: (r.error_kind == "aborted", r.error_kind == "timeout", r.rank))
    cause = rank_order[0]
    where = f"rank {cause.rank} ({cause.device}" + (f", stage {cause.stage})" if cause.stage >= 0 else ")")
    if cause.error_kind == "aborted":
        return cause.error
    if cause.error_kind in (OUT_OF_MEMORY, "timeout"):
        return f"{cause.error_kind} on {where}: {cause.error}"
    return f"{where} failed: {cause.error}"


def assemble_measurement(
    plan_id: str, results: Sequence[RankResult], warmup: int, emulated: bool, plan_stages: int, tail: int = 0
) -> Measurement:
    """One Measurement from every rank's record; the last ``tail`` steps (an asynchronous pipeline's drain) are
    dropped."""
    error = first_error(results)
    if error is not None:
        return Measurement.failed(plan_id, error, emulated=emulated)
    active = [r for r in results if r.status == "ok"]
    n_steps = min(len(r.step_s) for r in active) - tail
    step_times = [max(r.step_s[k] for r in active) for k in range(n_steps)]
    median_step = step_time(step_times, warmup)
    wait = {r.device: statistics.median(r.wait_s[warmup:n_steps]) for r in active}
    compute_by_stage: list[float] = []
    for stage in range(plan_stages):
        replicas = [r for r in active if r.stage == stage]
        compute_by_stage.append(max(statistics.median(r.compute_s[warmup:n_steps]) for r in replicas))
    last = [r for r in active if r.stage == plan_stages - 1]
    losses = [sum(r.loss[k] for r in last) for k in range(n_steps)]
    return Measurement(
        plan_id=plan_id,
        step_time_s=median_step,
        step_time_spread_s=step_time_spread(step_times, warmup),
        step_times_s=step_times,
        communication_share=communication_share(wait, median_step),
        stage_compute_s=compute_by_stage,
        compute_s={r.device: statistics.median(r.compute_s[warmup:n_steps]) for r in active},
        communication_s=wait,
        peak_memory_bytes={r.device: r.peak_memory_bytes for r in active},
        loss=losses[-1] if losses else float("nan"),
        emulated=emulated,
        extra={
            "losses": losses,
            "setup_s": max(r.setup_s for r in active),
            "warmup": warmup,
            "device_blocked_s": {r.device: statistics.median(r.blocked_s[warmup:n_steps]) for r in active},
            "weight_ages": {r.device: list(r.weight_ages) for r in active},
            "baseline_memory_bytes": {r.device: r.baseline_memory_bytes for r in active},
        },
    )


@dataclass
class TrainResult:
    """What ``train`` reports: test accuracy and test loss after the last epoch (a language model's perplexity is
    the exponential of its test loss, the mean cross-entropy per predicted token), and per-epoch loss and time."""

    plan_id: str
    schedule: str
    dataset: str
    synthetic: bool
    epochs: int
    test_accuracy: float = float("nan")
    test_samples: int = 0
    test_loss: float = float("nan")
    epoch_losses: list[float] = field(default_factory=list)
    epoch_times_s: list[float] = field(default_factory=list)
    epoch_test_accuracy: list[float] = field(default_factory=list)
    epoch_test_loss: list[float] = field(default_factory=list)
    emulated: bool = False
    error: str | None = None
    step_times_s: list[float] = field(default_factory=list)
    """Every step's time (its slowest device's), in order."""
    device_compute_s: dict[str, list[float]] = field(default_factory=dict)
    """Per device of the plan: every step's compute seconds (forward, backward, update), in order."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def test_perplexity(self) -> float:
        return perplexity(self.test_loss)

    @property
    def epoch_test_perplexity(self) -> list[float]:
        return [perplexity(loss) for loss in self.epoch_test_loss]

    def quality_text(self, language_model: bool) -> str:
        """The trained model's quality in a few words: a language model's test perplexity, else its test accuracy."""
        if language_model:
            return f"test perplexity {self.test_perplexity:.2f}"
        return f"test accuracy {self.test_accuracy:.1%}"

    def to_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "test_perplexity": self.test_perplexity,
            "epoch_test_perplexity": self.epoch_test_perplexity,
        }


def assemble_training(
    plan_id: str,
    schedule: str,
    dataset: str,
    synthetic: bool,
    epochs: int,
    results: Sequence[RankResult],
    emulated: bool,
    plan_stages: int,
) -> TrainResult:
    result = TrainResult(
        plan_id=plan_id, schedule=schedule, dataset=dataset, synthetic=synthetic, epochs=epochs, emulated=emulated
    )
    error = first_error(results)
    if error is not None:
        result.error = error
        return result
    active = [r for r in results if r.status == "ok"]
    steps = min((len(r.step_s) for r in active), default=0)
    result.step_times_s = [max(r.step_s[k] for r in active) for k in range(steps)]
    result.device_compute_s = {r.device: list(r.compute_s) for r in active}
    last = [r for r in active if r.stage == plan_stages - 1]
    trained = min((len(r.epochs) for r in last), default=0)  # a resumed training starts at its checkpoint's epoch
    for epoch in range(trained):
        correct = sum(r.epochs[epoch]["correct"] for r in last)
        samples = sum(r.epochs[epoch]["samples"] for r in last)
        result.epoch_losses.append(sum(r.epochs[epoch]["train_loss"] for r in last))
        result.epoch_times_s.append(max(r.epochs[epoch]["time_s"] for r in active))
        result.epoch_test_accuracy.append(correct / samples if samples else float("nan"))
        loss_sum = sum(r.epochs[epoch]["test_loss_sum"] for r in last)
        result.epoch_test_loss.append(loss_sum / samples if samples else float("nan"))
        if epoch == trained - 1:
            result.test_samples = int(samples)
            result.test_accuracy = result.epoch_test_accuracy[-1]
            result.test_loss = result.epoch_test_loss[-1]
    return result


@dataclass(frozen=True, kw_only=True)
class Reply:
    """Rank 0's answer to job ``id``: its result, or ``error``.

    ``restart`` asks the pool to restart the MPI job (some rank did not answer). ``setup_s`` answers a PrepareJob,
    ``measurement`` (and ``parameters`` when collected) a MeasureJob, ``train`` a TrainJob.
    """

    id: int
    error: str | None = None
    restart: bool = False
    setup_s: float = 0.0
    measurement: Measurement | None = None
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    train: TrainResult | None = None


def assemble_reply(job: WorkJob, results: Sequence[RankResult]) -> Reply:
    """The pool's answer to ``job`` from every rank's result."""
    if isinstance(job, PrepareJob):
        return Reply(id=job.id, error=first_error(results), setup_s=max(r.setup_s for r in results))
    plan, emulated = job.setup.plan, job.setup.emulate
    if isinstance(job, MeasureJob):
        measurement = assemble_measurement(plan.id, results, job.warmup, emulated, plan.n_stages, job.tail)
        parameters: dict[str, torch.Tensor] = {}
        if job.collect_parameters:
            for r in results:
                parameters.update(r.parameters or {})
        return Reply(id=job.id, measurement=measurement, parameters=parameters)
    spec = job.setup.spec
    dataset = spec.workload.data
    train = assemble_training(
        plan.id, plan.schedule, dataset, dataset == SYNTHETIC, spec.epochs, results, emulated, plan.n_stages
    )
    return Reply(id=job.id, train=train)
