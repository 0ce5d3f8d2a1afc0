"""One experiment's configuration: built once, from the command line or a deployment's parameters, and carried to
every flow and task.

``ExperimentConfig`` holds the loaded cluster (which remembers its file), the model, the batch size, the methods,
the schedules, the search budget, the runtime's measurement, the data and the training. It is frozen and validated:
a bad value is a ``ConfigError`` naming it, before any run exists. The cluster is parsed when the configuration is
built, never again: a flow or task that needs it asks ``config.target`` (the cluster, its slow devices scaled by
``power``). ``SweepConfig`` is the same settings (``ExperimentSettings``) with lists of models, clusters, batch
sizes and powers in place of one of each: its ``configurations()`` are the sweep's experiments, in order.

The configuration travels as JSON (``model_dump(mode="json")``): Prefect's flow-run parameters, the parent run's
``config.json`` in MLflow, and from there a resumed experiment (``ExperimentConfig.model_validate``). The cluster
travels as its fields and its source file, so a configuration read back is the one that ran, whatever has
happened to the file since.

This module imports no prefect, mlflow or torch at import time (the command line builds its options from it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from reports import schema
from tapp_core.cost.calibration import calibrate_by_default
from tapp_core.errors import TappError
from tapp_core.measure.step import TIMED_STEPS, WARMUP_STEPS
from tapp_core.model.data import DATASET_NAMES
from tapp_core.model.workload import OptimizerConfig
from tapp_core.plan.schedules import SCHEDULES
from tapp_core.planners.base import PLANNER_NAMES
from tapp_core.platform.cluster import Cluster, load_cluster

if TYPE_CHECKING:
    from tapp_core.model.workload import Workload

NO_DATA = "none"
"""The dataset when there is no real one: the step times need none (they are measured on synthetic batches), and
nothing is trained."""
DATASETS: tuple[str, ...] = (*DATASET_NAMES, NO_DATA)
DEFAULT_SIMULATED_ROUNDS = 30
"""TAPP's rounds rewarded by the cost model on the defaults."""
DEFAULT_MEASURED_ROUNDS = 1
"""TAPP's rounds rewarded by measurements on the defaults, after the others: the TAPP planner's own default
(``SearchOptions.measured_rounds``, which imports torch; a test checks that they agree)."""
DEFAULT_SAMPLES_PER_ROUND = 16
"""Plans each policy of TAPP's search samples per round: the TAPP planner's own default
(``SearchOptions.samples_per_round``; a test checks that they agree)."""
DEFAULT_TRAIN_SAMPLES = 6_336
"""Training images per method on the defaults (99 steps of 64, in three equal parts): every method trains the same
samples. An asynchronous pipeline learns later than a synchronous plan: with AdamW at 1e-3, AlexNet on Fashion-MNIST
(1,000 test images, ±3 points) on ``make run``'s asynchronous plan of three stages measured 11.6 % after 33 steps
(chance is 10 %), 39 % after 66 and 60 % after 99; its one-device plan 39 % after 33 and 65 % after 99
(2026-11-29). SGD at 0.01 is still near chance after 150."""
TrainOptimizer = Literal["adamw", "sgd"]
"""The training's optimisers, by the ``torch.optim`` class each names (``TRAIN_OPTIMIZERS``)."""
TRAIN_OPTIMIZERS: dict[str, str] = {"adamw": "AdamW", "sgd": "SGD"}
"""Each training optimiser's ``torch.optim`` class: the ``name`` of its ``tapp_core.model.workload.OptimizerConfig``
(the stale-weight compensation predicts both)."""
DEFAULT_LEARNING_RATES: dict[str, float] = {"adamw": 1e-3, "sgd": 0.01}
DEFAULT_TRAIN_OPTIMIZER: TrainOptimizer = "adamw"
"""The experiment's optimiser for a model whose workload declares none."""
DEFAULT_RACE_SECONDS = 60.0
"""The evaluation race starts no new round after this many seconds: on the defaults 3 or 4 rounds, within
``make run``'s five minutes (its verdict needs 5, a 94 % interval; fewer give the rounds' range, whose coverage the
interval says)."""
DEFAULT_TEST_SAMPLES = 1_000
DEFAULT_ACCURACY_POINTS = 3
"""Test evaluations during a budgeted training: the points of the time-to-accuracy curve."""


class ConfigError(TappError):
    """A configuration that cannot run; the message names the setting and the problem."""


def _cluster_value(value: object) -> object:
    """A loaded cluster as it is; a name or YAML file loaded (the one parse); a mapping (a configuration read back
    as JSON) validated, with its ``source`` file remembered."""
    if isinstance(value, Cluster):
        return value
    if isinstance(value, str | os.PathLike):
        return load_cluster(value)
    if isinstance(value, dict) and "devices" in value:
        fields = dict(value)
        source = fields.pop("source", None)
        return Cluster.model_validate(fields).from_file(source)
    return value


def _cluster_json(cluster: Cluster) -> dict[str, Any]:
    return {**cluster.model_dump(mode="json"), "source": str(cluster.source) if cluster.source else None}


LoadedCluster = Annotated[
    Cluster,
    BeforeValidator(_cluster_value),
    PlainSerializer(_cluster_json),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "description": "a cluster name (deployments/clusters) or YAML file"},
                {"type": "object", "description": "a cluster's fields and its source file"},
            ]
        }
    ),
]


NOT_BY_DEFAULT = ("single-gpu", "even")
"""Registry methods an experiment evaluates only when asked (``--methods``): SingleGPU is added on a cluster with a
GPU (``evaluated_methods``); Even split is a sanity baseline of no paper, whose slow plan would cost the default
run's race a sixth of its time."""


ESTIMATED_UNLESS_ASKED = ("autoddl", "pipeline-cd", "oracle", "tapp-rl")
"""Registry methods every experiment on the default methods plans and estimates, and races only when asked
(``--methods``), or where one's plan is a raced method's: TAPP's RL alone, shown beside the full TAPP, and the peers
that no paper's table compares with. The default race is the paper's comparison (TAPP, SingleCPU, BSP, Pipe-Torch)
and TAPP's strongest peer on the main job (PipeDream): each plan more costs every round of it, in ``make run``'s
five minutes."""


def default_methods() -> tuple[str, ...]:
    """Every method of the planners' registry but those in ``NOT_BY_DEFAULT`` and ``ESTIMATED_UNLESS_ASKED``."""
    return tuple(name for name in PLANNER_NAMES if name not in NOT_BY_DEFAULT + ESTIMATED_UNLESS_ASKED)


class ExperimentSettings(BaseModel):
    """What an experiment does, whatever it runs on: shared by ``ExperimentConfig`` and ``SweepConfig``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    methods: tuple[str, ...] = Field(default_factory=default_methods, description="methods to evaluate, tapp first")
    schedule: str | None = Field(
        default=None,
        description="pipeline schedule every planner plans with: gpipe | 1f1b | async (default: each planner's)",
    )
    schedules: tuple[str, ...] | None = Field(
        default=None,
        description="schedules each planner may choose among, the fastest kept (default: schedule)",
    )
    staleness: int | None = Field(
        default=None, ge=0, description="async: weight versions a stage may lag by (default: as deep as the pipeline)"
    )
    search_rounds: int = Field(
        default=DEFAULT_SIMULATED_ROUNDS + DEFAULT_MEASURED_ROUNDS,
        ge=1,
        description="TAPP's search rounds in all, measured ones included",
    )
    samples_per_round: int = Field(
        default=DEFAULT_SAMPLES_PER_ROUND, ge=1, description="plans sampled per search round"
    )
    measured_rounds: int | None = Field(
        default=None,
        ge=0,
        description=f"last rounds rewarded by measurements (default: {DEFAULT_MEASURED_ROUNDS} when measuring, else 0)",
    )
    measured_per_round: int | None = Field(
        default=None, ge=1, description="plans measured per policy and measured round"
    )
    measure: bool = Field(
        default=True, description="race the plans on the MPI runtime (else cost-model step times only)"
    )
    calibrate: bool = Field(
        default_factory=calibrate_by_default,
        description="measure the cost model's calibration on first use and keep it (else the ideal one, where none "
        "was measured)",
    )
    race_seconds: float = Field(
        default=DEFAULT_RACE_SECONDS,
        gt=0,
        allow_inf_nan=False,
        description="the evaluation race starts no new round after this many seconds",
    )
    steps: int = Field(default=TIMED_STEPS, ge=1, description="timed training steps per plan and race round")
    warmup: int = Field(default=WARMUP_STEPS, ge=0, description="warm-up steps per plan and race round, not counted")
    dataset: str = Field(
        default="",
        description="cifar10 | fashion-mnist | synthetic | fortunes | none (default: the real data found for the "
        "model's workload, else none)",
    )
    data_dir: str | None = Field(
        default=None, description="the dataset's folder (CIFAR-10: the one holding its batches)"
    )
    train_samples: int = Field(
        default=DEFAULT_TRAIN_SAMPLES,
        ge=0,
        description="training images per method, the same for every method (0: no training)",
    )
    train_seconds: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="a time budget per method instead of train_samples: a faster plan trains more samples (0: none)",
    )
    train_optimizer: TrainOptimizer | None = Field(
        default=None,
        description="the experiment's optimiser, which the races time and the training uses: adamw | sgd (default: "
        "the one the model's workload declares, else adamw)",
    )
    train_lr: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="its learning rate (default: the declared optimiser's, else adamw 1e-3, sgd 0.01)",
    )
    train_epochs: int | None = Field(
        default=None, ge=1, description="whole epochs of training instead of a time budget"
    )
    train_steps: int | None = Field(default=None, ge=1, description="at most this many training steps per epoch")
    test_samples: int | None = Field(
        default=DEFAULT_TEST_SAMPLES,
        ge=1,
        description="test images each accuracy is measured on (None: the whole test set)",
    )
    checkpoint_dir: str | None = Field(
        default=None,
        description="write each method's training checkpoints and trained model under this folder "
        "(<folder>/<experiment run id>/<method>); a resumed experiment's training resumes from them",
    )
    checkpoint_every: int = Field(
        default=0, ge=0, description="a training checkpoint every this many steps (0: at the end)"
    )
    elastic: bool = Field(
        default=False,
        description="train elastically: re-plan on the devices left when one dies, and move when one slows "
        "(tapp_core.runtime.elastic); needs checkpoint_dir and checkpoint_every",
    )
    accuracy_points: int = Field(
        default=DEFAULT_ACCURACY_POINTS, ge=1, description="test evaluations during a budgeted training"
    )
    seed: int = Field(default=0, description="the planners' sampling, the weights and the data order")

    @field_validator("methods", mode="after")
    @classmethod
    def _known_methods(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in methods if m not in PLANNER_NAMES]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(PLANNER_NAMES)}")
        if "tapp" not in methods:
            raise ValueError("the methods must include 'tapp': it is what the experiment evaluates")
        return tuple(dict.fromkeys(methods))

    @field_validator("schedule", mode="after")
    @classmethod
    def _known_schedule(cls, schedule: str | None) -> str | None:
        if schedule is not None and schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        return schedule

    @field_validator("schedules", mode="after")
    @classmethod
    def _known_schedules(cls, schedules: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if schedules is None:
            return None
        unknown = [s for s in schedules if s not in SCHEDULES]
        if unknown or not schedules:
            raise ValueError(
                f"schedules must name some of {', '.join(SCHEDULES)}; got {', '.join(schedules) or 'none'}"
            )
        return tuple(dict.fromkeys(schedules))

    @model_validator(mode="before")
    @classmethod
    def _resolved(cls, data: Any) -> Any:
        """The data found where none was named; the search's defaults where none were given (so that Prefect's
        parameters say what MLflow records)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if not data.get("dataset"):
            data["dataset"], data["data_dir"] = found_dataset(data.get("data_dir"), data.get("model"))
        if data.get("measured_rounds") is None:
            data["measured_rounds"] = DEFAULT_MEASURED_ROUNDS if data.get("measure", True) else 0
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSettings:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        measured = self.measured_rounds or 0
        if measured and not self.measure:
            raise ValueError(f"{measured} measured round(s) need the runtime: measure, or ask for 0 measured rounds")
        if self.search_rounds <= measured:
            raise ValueError(
                f"search rounds ({self.search_rounds}) must be more than the measured rounds ({measured}): the rounds "
                "before the measured ones are rewarded by the cost model"
            )
        if self.elastic and (self.checkpoint_dir is None or self.checkpoint_every <= 0):
            raise ValueError("an elastic training needs checkpoints: set checkpoint_dir and checkpoint_every")
        asked = (self.schedule, *(self.schedules or ())) if self.schedule or self.schedules else ()
        if self.staleness is not None and asked and "async" not in asked:
            raise ValueError(
                f"a staleness ({self.staleness}) is for the async schedule, which is not among those asked"
            )
        return self

    @property
    def training(self) -> bool:
        """Whether the experiment trains each method's plan (``training_skipped`` says why not)."""
        return self.training_skipped is None

    @property
    def training_skipped(self) -> str | None:
        """Why the plans are not trained (None: they are)."""
        if self.dataset == NO_DATA:
            return no_data_reason(getattr(self, "model", None))
        if not self.measure:
            return "estimate-only: there is no runtime to train on"
        if self.train_epochs is None and self.train_seconds == 0:
            return "training is off (a time budget of 0 s and no epochs)"
        if self.train_epochs is None and self.train_seconds is None and self.train_samples == 0:
            return "training is off (0 training samples and no epochs)"
        return None

    @property
    def equal_samples(self) -> bool:
        """Whether every method trains the same samples (``train_samples`` or whole epochs, not a time budget)."""
        return self.train_epochs is not None or self.train_seconds is None


def found_dataset(data_dir: str | None, model: object = None) -> tuple[str, str | None]:
    """(dataset, folder) when none is named. A ``model`` whose workload takes no images: the data it declares
    (``Workload.data``), if there; else CIFAR-10 in ``data_dir`` (or ``$TAPP_DATA_DIR``) when one is given, else
    Fashion-MNIST where Debian's ``dataset-fashion-mnist`` put it; else ``none``."""
    from tapp_core.model.data import data_installed, find_dataset

    workload = _own_data_workload(model)
    if workload is not None:
        return (workload.data if data_installed(workload.data, data_dir) else NO_DATA), data_dir
    found = find_dataset(data_dir)
    return found if found is not None else (NO_DATA, data_dir)


def no_data_reason(model: object = None) -> str:
    from tapp_core.model.data import FASHION_MNIST_ROOT, missing_data_reason

    workload = _own_data_workload(model)
    if workload is not None:
        return f"no real data: {missing_data_reason(workload.data)}"
    return (
        f"no real data: no CIFAR-10 folder given (--data-dir), and Fashion-MNIST is not in {FASHION_MNIST_ROOT} "
        "(apt-get install dataset-fashion-mnist)"
    )


def _own_data_workload(model: object) -> Workload | None:
    """The workload of ``model`` (a model spec) when it takes no images: it brings its own data (text, synthetic
    samples of its inputs), which no image dataset can replace."""
    if not isinstance(model, str) or not model.strip():
        return None
    from tapp_core.model.workload import workload_of

    workload = workload_of(model)
    return None if workload.images else workload


class ExperimentConfig(ExperimentSettings):
    """One experiment: a model on a cluster at a batch size, with the settings."""

    model: str = Field(
        default="alexnet", min_length=1, description="a registry name, module:callable or file.py:callable"
    )
    cluster: LoadedCluster = Field(default_factory=lambda: load_cluster("local"), description="the cluster")
    batch_size: int = Field(default=64, ge=1, description="mini-batch size")
    power: float = Field(default=1.0, gt=0, allow_inf_nan=False, description="factor on the speed of the slow devices")
    _target: Cluster = PrivateAttr()
    _declared: tuple[Workload, OptimizerConfig | None] | None = PrivateAttr(default=None)

    @field_validator("model", mode="after")
    @classmethod
    def _model_spec(cls, model: str) -> str:
        check_model_spec(model)
        return model

    def model_post_init(self, context: Any) -> None:
        self._target = self.cluster.scaled(self.power)

    @property
    def learning_rate(self) -> float:
        """The experiment's learning rate: ``train_lr``, else its optimiser's."""
        return self.optimizer.lr

    @property
    def optimizer(self) -> OptimizerConfig:
        """The experiment's one optimiser: the one every race times, every method's plan trains with, and whose
        state the memory model counts. ``train_optimizer`` when given; else the one the model's workload declares
        (the GPT's AdamW); else AdamW, which trains a classifier well within ``make run``'s samples. ``train_lr``
        replaces its rate."""
        declared = self._declared_workload()[1] if self.train_optimizer is None else None
        if declared is not None:
            return declared if self.train_lr is None else dataclasses.replace(declared, lr=self.train_lr)
        name = self.train_optimizer or DEFAULT_TRAIN_OPTIMIZER
        lr = self.train_lr if self.train_lr is not None else DEFAULT_LEARNING_RATES[name]
        return OptimizerConfig(name=TRAIN_OPTIMIZERS[name], lr=lr)

    def workload(self) -> Workload:
        """The model's workload with the experiment's optimiser: what the races measure."""
        return dataclasses.replace(self._declared_workload()[0], optimizer=self.optimizer)

    def _declared_workload(self) -> tuple[Workload, OptimizerConfig | None]:
        """The model's workload and the optimiser it declares, read once (a model file is imported to read them)."""
        if self._declared is None:
            from tapp_core.model.workload import declared_workload

            self._declared = declared_workload(self.model)
        return self._declared

    @property
    def target(self) -> Cluster:
        """The cluster the experiment runs on: ``cluster`` with its slow devices scaled by ``power``."""
        return self._target

    def train_plan(self, step_time_s: float) -> tuple[int, int | None]:
        """(epochs, steps per epoch) for a plan of ``step_time_s`` per step: whole epochs (``train_epochs``, each cut
        to ``train_steps``); else ``train_samples`` in batches, or ``train_seconds`` of the plan's steps, in
        ``accuracy_points`` parts each ended by a test evaluation (at least one step per part). Samples give every
        plan the same steps; a time budget gives a faster plan more."""
        if self.train_epochs is not None:
            return self.train_epochs, self.train_steps
        if self.train_seconds is None:
            total = math.ceil(self.train_samples / self.batch_size)
        else:
            total = math.floor(self.train_seconds / step_time_s) if step_time_s > 0 else self.accuracy_points
        points = max(1, min(self.accuracy_points, total))
        per_point = max(1, math.ceil(total / points) if self.train_seconds is None else total // points)
        if self.train_steps is not None:
            per_point = min(per_point, self.train_steps)
        return points, per_point

    @property
    def evaluated_methods(self) -> tuple[str, ...]:
        """The methods, with SingleGPU after the paper's when the cluster has a GPU, then those estimated only."""
        chosen = list(self.methods)
        if any(d.kind == "cuda" for d in self.target.devices) and "single-gpu" not in chosen:
            paper = ("tapp", "single-cpu", "bsp", "pipetorch")
            chosen.insert(len([m for m in chosen if m in paper]), "single-gpu")
        return (*chosen, *self.estimated_only)

    @property
    def estimated_only(self) -> tuple[str, ...]:
        """The methods planned and estimated but not raced: ``ESTIMATED_UNLESS_ASKED``, where ``methods`` are the
        default ones (an experiment given other methods evaluates those; an estimate-only experiment races nothing
        anyway)."""
        if self.methods != default_methods():
            return ()
        return tuple(m for m in ESTIMATED_UNLESS_ASKED if m not in self.methods)

    def tags(self) -> dict[str, str]:
        """The experiment's own tags, beside ``ExperimentTags``' (model, cluster, batch, seed, dataset)."""
        tags = {schema.BASE_CLUSTER: self.cluster.name, schema.POWER: f"{self.power:g}"}
        if self.schedule is not None:
            tags[schema.SCHEDULE] = self.schedule
        if self.staleness is not None:
            tags[schema.STALENESS] = str(self.staleness)
        return tags

    def params(self) -> dict[str, object]:
        """The MLflow parameters: every setting, flat (the whole configuration is ``config.json`` beside them)."""
        shown = self.model_dump(mode="json", exclude={"cluster"})
        shown["cluster"] = self.cluster.name
        shown["methods"] = ",".join(self.evaluated_methods)
        if self.schedules is not None:
            shown["schedules"] = ",".join(self.schedules)
        return shown

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> ExperimentConfig:
        return build(cls, json.loads(text), source)


def check_model_spec(model: str) -> None:
    """A registry name, or ``module:callable`` / ``file.py:callable`` whose file exists (building and tracing it is
    the profile's: it fails there, before any run exists)."""
    from tapp_core.model.graph import ModelError

    if model in model_names():
        return
    module, _, function = model.partition(":")
    if not function:
        raise ModelError(f"unknown model {model!r}; known models: {', '.join(model_names())}, or module:callable")
    if module.endswith(".py") and not Path(module).is_file():
        raise ModelError(f"model spec {model!r}: file {module} does not exist")


def model_names() -> tuple[str, ...]:
    from tapp_core.model.zoo.registry import MODEL_NAMES

    return MODEL_NAMES


class SweepConfig(ExperimentSettings):
    """A sweep: every combination of models, clusters, powers and batch sizes, with the same settings."""

    models: tuple[str, ...] = Field(default=("alexnet", "vgg16", "inception_v3"), min_length=1)
    clusters: tuple[LoadedCluster, ...] = Field(default_factory=lambda: (load_cluster("local"),), min_length=1)
    batch_sizes: tuple[int, ...] = Field(default=(64,), min_length=1)
    powers: tuple[float, ...] = Field(default=(1.0,), min_length=1)

    @model_validator(mode="after")
    def _every_configuration(self) -> SweepConfig:
        self.configurations()  # every combination checked before the first runs
        return self

    def configurations(self) -> list[ExperimentConfig]:
        """The sweep's experiments, in order: per model, per cluster, per power, per batch size."""
        settings = self.model_dump(exclude={"models", "clusters", "batch_sizes", "powers"})
        return [
            ExperimentConfig(**settings, model=model, cluster=cluster, power=power, batch_size=batch)
            for model in self.models
            for cluster in self.clusters
            for power in self.powers
            for batch in self.batch_sizes
        ]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> SweepConfig:
        return build(cls, json.loads(text), source)


C = TypeVar("C", bound=ExperimentSettings)


def build(kind: type[C], values: object, source: str = "the configuration") -> C:
    """``kind`` validated from ``values``; every problem in one ``ConfigError`` line naming the setting (a cluster
    or model that cannot be read raises its own error)."""
    try:
        return kind.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors()
        own = errors[0].get("ctx", {}).get("error") if len(errors) == 1 else None
        if isinstance(own, TappError):
            raise own from None  # one bad cluster or model: its own error, as loading it alone would raise
        problems = []
        for error in errors:
            where = ".".join(str(part) for part in error["loc"]) or "(top level)"
            problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None
