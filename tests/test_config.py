"""One experiment configuration: built once, validated, carried as JSON, a sweep a list of them; clusters that
remember their file and their computing-power family."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tapp_core.cost.calibration import calibration_path, cluster_calibration
from tapp_core.model.graph import ModelError
from tapp_core.model.workload import OptimizerConfig, workload_of
from tapp_core.planners import PLANNER_NAMES, method_description, method_label
from tapp_core.platform.cluster import Cluster, ClusterError, load_cluster, parse_cluster
from tasks.config import (
    DEFAULT_MEASURED_ROUNDS,
    DEFAULT_RACE_SECONDS,
    NO_DATA,
    ConfigError,
    ExperimentConfig,
    SweepConfig,
    build,
)


def test_a_loaded_cluster_remembers_its_file_and_equals_the_same_fields_from_anywhere() -> None:
    local = load_cluster("local")
    assert local.source is not None and local.source.name == "local.yaml"
    assert calibration_path(local) == local.source.with_name("local.calibration.json")
    copy = parse_cluster(local.model_dump())  # made in code: no file
    assert copy == local and hash(copy) == hash(local) and copy.source is None
    assert cluster_calibration(copy, copy).note == cluster_calibration(local, local).note  # the ideal one, no lookup


def test_a_computing_power_scales_the_slow_half_of_the_devices() -> None:
    hetero4 = load_cluster("hetero4")  # speeds 1, 0.8, 0.5, 0.25: the slow half is cpu2 and cpu3
    assert hetero4.slow_devices() == ("cpu2", "cpu3")
    half = hetero4.scaled(0.5)
    assert half.name == "hetero4@0.5x" and half.source == hetero4.source
    assert [d.speed for d in half.devices] == [1.0, 0.8, 0.25, 0.125]
    assert half.links == hetero4.links
    assert hetero4.scaled(1) is hetero4
    with pytest.raises(ClusterError, match="no slow device to scale"):
        load_cluster("homo4").scaled(0.5)
    with pytest.raises(ClusterError, match="is not emulated"):
        load_cluster("threads12").scaled(0.5)
    with pytest.raises(ClusterError, match="positive number"):
        hetero4.scaled(0)


def test_every_method_has_its_label_and_description_in_the_registry() -> None:
    assert [method_label(m) for m in ("single-cpu", "pipetorch", "bsp", "tapp")] == [
        "SingleCPU", "Pipe-Torch", "BSP", "TAPP",
    ]  # fmt: skip
    assert all(method_description(m) for m in PLANNER_NAMES)
    assert method_label("not-a-method") == "not-a-method"


def test_the_defaults_are_one_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ExperimentConfig(dataset="synthetic")
    assert (config.model, config.target.name, config.batch_size, config.power) == ("alexnet", "local", 64, 1.0)
    assert not {"single-gpu", "even"} & set(config.methods)
    estimated = ("autoddl", "pipeline-cd", "oracle", "tapp-rl")  # estimated, not raced
    assert set(config.methods) | {"single-gpu", "even", *estimated} == set(PLANNER_NAMES)
    assert config.methods == ("tapp", "single-cpu", "bsp", "pipetorch", "pipedream")
    assert config.evaluated_methods[-4:] == estimated == config.estimated_only
    asked = ExperimentConfig(dataset="synthetic", methods=("tapp", "tapp-rl"))
    assert asked.evaluated_methods == ("tapp", "tapp-rl") and asked.estimated_only == ()
    assert (
        config.measured_rounds == DEFAULT_MEASURED_ROUNDS == 1
        and ExperimentConfig(measure=False, dataset="none").measured_rounds == 0
    )
    assert config.training and config.equal_samples and config.train_seconds is None
    assert (config.train_samples, config.optimizer.name, config.learning_rate) == (6_336, "AdamW", 1e-3)
    monkeypatch.setattr("tapp_core.model.data.FASHION_MNIST_ROOT", "/nowhere")
    nothing = ExperimentConfig()  # no real data anywhere: the step times need none, and nothing is trained
    assert nothing.dataset == NO_DATA and not nothing.training
    assert "no real data" in str(nothing.training_skipped) and "apt-get install dataset-fashion-mnist" in str(
        nothing.training_skipped
    )


def test_race_seconds_bound_the_evaluation_race() -> None:
    from flows.experiment import runtime_settings

    assert runtime_settings(ExperimentConfig(dataset="synthetic")).race.budget_s == DEFAULT_RACE_SECONDS == 60.0
    assert runtime_settings(ExperimentConfig(dataset="synthetic", race_seconds=7.5)).race.budget_s == 7.5
    with pytest.raises(ConfigError, match="race_seconds"):
        build(ExperimentConfig, {"race_seconds": 0, "dataset": "synthetic"})


def test_a_configuration_read_back_is_the_one_that_ran(tmp_path: Path) -> None:
    """As JSON (Prefect's parameters, the parent run's config.json): the cluster by its fields and its file, so the
    file is not read again, and a changed file does not change what ran."""
    cluster_file = tmp_path / "mine.yaml"
    cluster_file.write_text(Path(load_cluster("hetero4").source or "").read_text().replace("hetero4", "mine"))
    config = ExperimentConfig(model="tiny_cnn", cluster=str(cluster_file), power=0.5, dataset="synthetic")
    cluster_file.write_text("not: a cluster\n")
    again = ExperimentConfig.from_json(config.to_json(), "config.json")
    assert again == config and again.cluster.source == cluster_file and again.target.name == "mine@0.5x"
    shown = json.loads(config.to_json())
    assert shown["cluster"]["source"] == str(cluster_file) and shown["power"] == 0.5
    params = config.params()
    assert (params["cluster"], params["power"], params["model"]) == ("mine", 0.5, "tiny_cnn")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"methods": ("bsp",)}, "methods: the methods must include 'tapp'"),
        ({"methods": ("tapp", "magic")}, "methods: unknown method(s) magic"),
        ({"schedule": "zigzag"}, "schedule: unknown schedule 'zigzag'"),
        ({"schedules": ("1f1b", "sideways")}, "schedules: schedules must name some of gpipe, 1f1b, async"),
        ({"schedule": "1f1b", "staleness": 2}, "a staleness (2) is for the async schedule"),
        ({"search_rounds": 3, "measured_rounds": 3}, "search rounds (3) must be more than the measured rounds (3)"),
        ({"measure": False, "measured_rounds": 2}, "2 measured round(s) need the runtime"),
        ({"dataset": "imagenet"}, "unknown dataset 'imagenet'"),
        ({"power": -1}, "power: Input should be greater than 0"),
        (
            {"batch_size": 0, "seed": "x"},
            "seed: Input should be a valid integer, unable to parse string as an integer; batch_size: ",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        build(ExperimentConfig, {"dataset": "synthetic", **values}, "tapp run")
    assert str(raised.value).startswith("tapp run: ") and message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_bad_model_or_cluster_is_its_own_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="unknown model 'resnet9000'"):
        build(ExperimentConfig, {"model": "resnet9000", "dataset": "synthetic"})
    with pytest.raises(ModelError, match=r"nowhere\.py does not exist"):
        build(ExperimentConfig, {"model": "nowhere.py:model", "dataset": "synthetic"})
    with pytest.raises(ClusterError, match="unknown cluster 'atlantis'"):
        build(ExperimentConfig, {"cluster": "atlantis", "dataset": "synthetic"})
    with pytest.raises(ClusterError, match="no slow device to scale"):
        build(ExperimentConfig, {"cluster": "homo4", "power": 0.5, "dataset": "synthetic"})


def test_a_sweep_is_a_list_of_configurations_of_the_same_settings() -> None:
    sweep = SweepConfig(
        models=("tiny_cnn", "mlp"), clusters=("hetero4",), powers=(1, 0.5), batch_sizes=(16, 32), measure=False
    )
    configurations = sweep.configurations()
    shapes = [(c.model, c.target.name, c.batch_size) for c in configurations]
    assert shapes[:4] == [
        ("tiny_cnn", "hetero4", 16), ("tiny_cnn", "hetero4", 32),
        ("tiny_cnn", "hetero4@0.5x", 16), ("tiny_cnn", "hetero4@0.5x", 32),
    ]  # fmt: skip
    assert len(configurations) == 8 and shapes[4][0] == "mlp"
    assert all(not c.measure and c.measured_rounds == 0 for c in configurations)
    assert configurations[0].cluster is configurations[7].cluster  # parsed once for the whole sweep
    settings = set(SweepConfig.model_fields) - {"models", "clusters", "batch_sizes", "powers"}
    assert settings == set(ExperimentConfig.model_fields) - {"model", "cluster", "batch_size", "power"}
    assert SweepConfig.from_json(sweep.to_json(), "config.json") == sweep
    with pytest.raises(ClusterError, match="no slow device"):  # every configuration checked when the sweep is made
        build(SweepConfig, {"models": ("mlp",), "clusters": ("hetero4", "homo4"), "powers": (0.5,), "dataset": "none"})


@pytest.mark.parametrize(
    ("settings", "step_time", "plan"),
    [
        ({}, 0.25, (3, 33)),  # 6,336 images of batch 64: 99 steps, in 3 parts of 33, whatever the step time
        ({}, 2.5, (3, 33)),
        ({"train_samples": 640, "accuracy_points": 2}, 0.25, (2, 5)),
        ({"train_seconds": 12.0}, 0.25, (3, 16)),  # a time budget: 48 steps of 0.25 s, in 3 parts of 16
        ({"train_seconds": 1.0}, 0.3, (3, 1)),  # 3 steps: 3 parts of 1
        ({"train_seconds": 1.0}, 5.0, (1, 1)),  # slower than the budget: one step
        ({"train_epochs": 2, "train_steps": 10}, 0.25, (2, 10)),  # whole epochs, each cut to 10 steps
        ({"train_seconds": 10.0, "train_steps": 3}, 0.1, (3, 3)),
    ],
)
def test_the_training_budget_is_the_plans_own_steps(
    settings: dict[str, object], step_time: float, plan: tuple[int, int]
) -> None:
    config = ExperimentConfig(dataset="synthetic", **settings)  # type: ignore[arg-type]
    epochs, steps = config.train_plan(step_time)
    assert (epochs, steps) == plan
    if config.train_seconds is not None:
        assert epochs * (steps or 0) * step_time <= config.train_seconds or (epochs, steps) == (1, 1)
    elif "train_epochs" not in settings:  # every plan the same images, at least those asked for
        assert config.train_samples <= epochs * (steps or 0) * config.batch_size < config.train_samples + 64 * epochs


def test_a_cluster_made_in_code_has_no_file_to_look_beside() -> None:
    made = Cluster.model_validate(load_cluster("local").model_dump())
    config = ExperimentConfig(cluster=made, dataset="synthetic")
    assert config.cluster.source is None and config.target == made


def test_the_training_optimiser_is_the_one_the_memory_model_counts() -> None:
    adamw = ExperimentConfig(train_optimizer="adamw").optimizer
    assert adamw.name == "AdamW" and adamw.state_per_param == 2
    assert ExperimentConfig(train_optimizer="sgd").optimizer.state_per_param == 1


def test_an_experiment_has_one_optimiser_which_its_races_time_and_its_training_uses() -> None:
    gpt = ExperimentConfig(model="gpt", dataset="synthetic")
    declared = workload_of("gpt").optimizer
    assert gpt.optimizer == declared and declared.name == "AdamW" and declared.lr == 3e-3  # the GPT's own
    assert gpt.workload().optimizer == declared  # what the races measure
    assert ExperimentConfig(model="gpt", dataset="synthetic", train_lr=1e-4).optimizer == dataclasses.replace(
        declared, lr=1e-4
    )
    assert ExperimentConfig(model="gpt", dataset="synthetic", train_optimizer="sgd").optimizer.name == "SGD"
    alexnet = ExperimentConfig(dataset="synthetic")  # declares none: AdamW, for the races and the training alike
    assert alexnet.workload().optimizer == alexnet.optimizer == OptimizerConfig(name="AdamW", lr=1e-3)
    assert workload_of("alexnet").optimizer.name == "SGD"  # the workload's own default is untouched elsewhere


def test_a_model_files_declared_optimiser_is_the_experiments(tmp_path: Path) -> None:
    model = tmp_path / "declared.py"
    model.write_text(
        "import torch.nn as nn\n"
        "workload = {'optimizer': {'name': 'Adam', 'lr': 0.002}}\n"
        "def build(num_classes=10):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))\n"
    )
    config = ExperimentConfig(model=f"{model}:build", dataset="synthetic")
    assert (config.optimizer.name, config.optimizer.lr) == ("Adam", 0.002)
    assert config.workload().optimizer == config.optimizer
