"""The ``tapp`` commands that need no Prefect or MLflow, run as a user runs them (through Typer's runner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tapp_core.plan.plan import Plan
from tapp_core.profile.library import LayerLibrary

MODEL = ["--model", "tiny_cnn", "--batch-size", "8"]
SMALL_CLUSTER = "name: small\ndevices:\n  - {name: other, memory: 1GiB}\nlinks: {bandwidth: 1Gbit/s, latency: 0}\n"


def tapp(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == exit_code, result.output
    return result.output


def test_profile_writes_the_library(work_dir: Path) -> None:
    output = tapp("profile", *MODEL, "--out", "lib", "--repeats", "1", "--threads", "1")
    library = LayerLibrary.load(work_dir / "lib")
    assert (library.model, library.batch_size, library.threads, len(library)) == ("tiny_cnn", 8, 1, 7)
    assert "sum-of-layers / whole-model ratio" in output
    assert not (work_dir / ".tapp").exists()  # an explicit profile is not cached


def test_plan_then_simulate_share_the_cached_library(work_dir: Path) -> None:
    tapp("plan", *MODEL, "--planner", "even", "--out", "plan.json")
    (entry,) = (work_dir / ".tapp" / "libraries").iterdir()
    plan = Plan.load(work_dir / "plan.json")
    assert (plan.model, plan.batch_size, plan.planner) == ("tiny_cnn", 8, "even")

    printed = json.loads(tapp("simulate", "--model", "tiny_cnn", "--plan", "plan.json", "--json"))
    assert printed["step_time_s"] > 0
    tapp("simulate", "--plan", "plan.json", "--gantt", "g.png")  # the model: the one the plan names
    assert (work_dir / "g.png").stat().st_size > 0
    assert [p.name for p in (work_dir / ".tapp" / "libraries").iterdir()] == [entry.name]  # profiled once


def test_a_corrupt_cached_library_is_profiled_again(work_dir: Path) -> None:
    tapp("plan", *MODEL, "--planner", "bsp", "--out", "plan.json")
    (entry,) = (work_dir / ".tapp" / "libraries").iterdir()
    (entry / "library.json").write_text("{}")
    tapp("plan", *MODEL, "--planner", "bsp", "--out", "plan.json")
    assert LayerLibrary.load(entry).model == "tiny_cnn"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("plan", *MODEL, "--planner", "magic"), "magic"),
        (("plan", "--model", "resnet9000"), "unknown model 'resnet9000'"),
        (("simulate", "--model", "mlp", "--plan", "plan.json"), "is for model 'tiny_cnn', not 'mlp'"),
        (("measure", "--model", "tiny_cnn", "--plan", "plan.json", "--cluster", "small.yaml"), "that cluster"),
        (("plan", *MODEL, "--library", "nowhere"), "has no layers.csv"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(work_dir: Path, args: tuple[str, ...], message: str) -> None:
    Plan.from_dict(_tiny_plan()).save(work_dir / "plan.json")
    (work_dir / "small.yaml").write_text(SMALL_CLUSTER)
    output = tapp(*args, exit_code=2)
    assert output.startswith("error: ") and message in output
    assert "Traceback" not in output


def _tiny_plan() -> dict[str, object]:
    """A one-stage plan of tiny_cnn (7 layers) on the local cluster's cpu0."""
    return {
        "model": "tiny_cnn",
        "batch_size": 8,
        "stage_of_layer": [0] * 7,
        "stage_devices": [["cpu0"]],
        "micro_batches": 1,
        "schedule": "gpipe",
    }


@pytest.mark.mpi
@pytest.mark.slow
def test_measure_prints_the_measurement(work_dir: Path) -> None:
    Plan.from_dict(_tiny_plan()).save(work_dir / "plan.json")
    output = tapp("measure", "--plan", "plan.json", "--steps", "2", "--warmup", "1")  # the plan's model
    measured = json.loads(output[output.index("{") :])
    assert measured["error"] is None and measured["step_time_s"] > 0
    assert measured["rounds"] == 5 and measured["interval_low_s"] <= measured["step_time_s"]  # a race of one plan


@pytest.mark.mpi
@pytest.mark.slow
def test_measure_races_several_plans(work_dir: Path) -> None:
    one_stage = Plan.from_dict(_tiny_plan())
    two_stages = Plan.from_dict(
        {**_tiny_plan(), "stage_of_layer": [0, 0, 0, 1, 1, 1, 1], "stage_devices": [["cpu0"], ["cpu1"]]}
    )
    for name, plan in (("a.json", one_stage), ("b.json", two_stages), ("same_as_a.json", one_stage)):
        plan.save(work_dir / name)
    args = ["--min-rounds", "2", "--max-rounds", "2", "--steps", "1", "--json", "race.json"]
    output = tapp("measure", "--model", "tiny_cnn", "-p", "a.json", "-p", "b.json", "-p", "same_as_a.json", *args)
    assert "| plan | devices | median s | interval s | rounds | |" in output and " ± " not in output
    assert "| a.json = same_as_a.json | cpu0 |" in output and "| b.json | cpu0 \\| cpu1 |" in output
    race = json.loads((work_dir / "race.json").read_text())
    assert race["rounds"] == 2 and [p["plan_id"] for p in race["plans"]] == [one_stage.id, two_stages.id]
    assert all(m["rounds"] == 2 and m["interval_low_s"] <= m["step_time_s"] for m in race["measurements"])
    assert race["winner"] in (one_stage.id, two_stages.id)
    tapp("measure", "--model", "tiny_cnn", "-p", "a.json", "-p", "b.json", "--min-rounds", "3", "--max-rounds", "2",
         exit_code=2)  # fmt: skip


def test_every_option_of_every_command_has_help() -> None:
    """Typer's command model: the group, every command and every option (typer's own click, typer.core)."""
    import typer.main
    from typer.core import TyperGroup, TyperOption

    command = typer.main.get_command(app)
    assert isinstance(command, TyperGroup)
    assert command.help and "The ``tapp`` command line" not in command.help
    commands = {}
    for name, sub in command.commands.items():  # a group of commands (tapp cluster) by its commands
        assert sub.help, f"tapp {name} has no help"
        group = sub.commands if isinstance(sub, TyperGroup) else {"": sub}
        commands.update({f"{name} {part}".strip(): leaf for part, leaf in group.items()})
    assert len(commands) == 13  # with tapp sweep, tapp export, tapp cluster detect, tapp testbed up, testbed down
    missing = []
    for name, sub in commands.items():
        assert sub.help, f"tapp {name} has no help"
        options = [p for p in sub.params if isinstance(p, TyperOption)]
        assert options and len(options) == len(sub.params), f"tapp {name} takes arguments that are not options"
        missing += [f"tapp {name} {option.opts[0]}" for option in options if not option.help]
    missing += [f"tapp {option.opts[0]}" for option in command.params if not option.help]
    assert missing == []


def test_version() -> None:
    output = tapp("--version")
    assert output.startswith("tapp 0.1.0")


def test_one_vocabulary_and_the_same_defaults_across_commands() -> None:
    """Method names as the planners' registry has them; every command's defaults the flows' own."""
    import typer.main

    from flows.cli import common, experiments
    from tapp_core.planners import PLANNER_NAMES
    from tapp_core.planners.tapp import SearchOptions
    from tasks.config import (
        DEFAULT_MEASURED_ROUNDS,
        DEFAULT_SAMPLES_PER_ROUND,
        DEFAULT_SIMULATED_ROUNDS,
        ESTIMATED_UNLESS_ASKED,
        NOT_BY_DEFAULT,
        ExperimentConfig,
        default_methods,
    )
    from tasks.measure import RuntimeSettings
    from tasks.search import SearchBudget

    assert set(default_methods()) | set(NOT_BY_DEFAULT) | set(ESTIMATED_UNLESS_ASKED) == set(PLANNER_NAMES)
    defaults = ExperimentConfig(dataset="synthetic")
    assert (
        defaults.search_rounds,
        defaults.steps,
        defaults.warmup,
    ) == (experiments.DEFAULT_ROUNDS, common.DEFAULT_STEPS, common.DEFAULT_WARMUP)
    # The configuration's search defaults are the TAPP planner's and the flow's (written twice: one imports torch).
    assert SearchBudget().options.simulated_rounds == DEFAULT_SIMULATED_ROUNDS
    assert SearchOptions.measured_rounds == DEFAULT_MEASURED_ROUNDS
    assert SearchOptions.samples_per_round == defaults.samples_per_round == DEFAULT_SAMPLES_PER_ROUND
    assert (defaults.steps + defaults.warmup, defaults.warmup) == (RuntimeSettings.steps, RuntimeSettings.warmup)
    defaults: dict[str, set[str]] = {}
    reading_a_plan = {"measure", "simulate", "train"}  # their --model defaults to the plan's own (None)
    for sub in typer.main.get_command(app).commands.values():  # type: ignore[attr-defined]
        for parameter in sub.params:
            if sub.name in reading_a_plan and parameter.name == "model":
                assert parameter.default is None, sub.name
            else:
                defaults.setdefault(str(parameter.name), set()).add(str(parameter.default))
            defaults[f"{sub.name} {parameter.name}"] = {str(parameter.default)}
    for name in (
        "model",
        "cluster",
        "batch_size",
        "seed",
        "experiment",
        "steps",
        "warmup",
        "plan_file",
        "tracking_uri",
    ):
        assert len(defaults[name]) == 1, f"--{name} defaults differ between commands: {defaults[name]}"
    assert defaults["run out"] == defaults["report out"] == {"None"}  # out/EXPERIMENT/RUN_ID, out/EXPERIMENT/report
    assert defaults["profile model"] == {"alexnet"}


def test_the_planner_takes_the_method_names(work_dir: Path) -> None:
    tapp("plan", *MODEL, "--planner", "single-cpu", "--out", "single.json")
    assert Plan.load(work_dir / "single.json").planner == "single-cpu"
    tapp("plan", *MODEL, "--planner", "single", "--out", "old.json")  # the old name still works
    assert Plan.load(work_dir / "old.json").stage_devices == Plan.load(work_dir / "single.json").stage_devices
    output = tapp("plan", *MODEL, "--planner", "bsp", "--rounds", "3", exit_code=2)
    assert "--rounds is not an option of planner 'bsp'" in output


def test_tapp_plan_rounds_and_budget(work_dir: Path) -> None:
    """``--rounds`` counts TAPP's rounds; ``--budget`` caps the reward evaluations (the warm start's count too),
    which can end it sooner."""
    args = ("plan", *MODEL, "--planner", "tapp", "--out", "tapp.json")
    tapp(*args, "--rounds", "2")
    assert Plan.load(work_dir / "tapp.json").notes["rounds"] == 2
    tapp(*args, "--rounds", "50", "--budget", "5")
    notes = Plan.load(work_dir / "tapp.json").notes
    assert notes["rounds"] <= 1 and notes["evaluations"] >= 5  # it ends with the round that spent the budget


def test_the_schedule_is_a_choice_of_plan_simulate_and_measure(work_dir: Path) -> None:
    tapp("plan", *MODEL, "--planner", "even", "--schedule", "gpipe", "--out", "gpipe.json")
    assert Plan.load(work_dir / "gpipe.json").schedule == "gpipe"
    default = json.loads(tapp("simulate", "--model", "tiny_cnn", "--plan", "gpipe.json", "--json"))
    overridden = json.loads(
        tapp("simulate", "--model", "tiny_cnn", "--plan", "gpipe.json", "--schedule", "1f1b", "--json")
    )
    assert default["step_time_s"] > 0 and overridden["step_time_s"] > 0
    tapp("plan", *MODEL, "--planner", "even", "--schedule", "async", "--staleness", "1", "--out", "async.json")
    bounded = Plan.load(work_dir / "async.json")
    assert (bounded.schedule, bounded.staleness) == ("async", 1)
    as_gpipe = json.loads(
        tapp("simulate", "--model", "tiny_cnn", "--plan", "async.json", "--schedule", "gpipe", "--json")
    )
    assert as_gpipe["step_time_s"] > 0  # its staleness dropped: gpipe takes none
    output = tapp("plan", *MODEL, "--planner", "even", "--schedule", "sideways", exit_code=2)
    assert "schedule: unknown schedule 'sideways'" in output
    output = tapp("plan", *MODEL, "--planner", "even", "--schedule", "1f1b", "--staleness", "2", exit_code=2)
    assert "a staleness (2) is for the async schedule" in output
    output = tapp("simulate", "--model", "tiny_cnn", "--plan", "gpipe.json", "--schedule", "zigzag", exit_code=2)
    assert "zigzag" in output and output.startswith("error: ")


def test_list_options_take_several_values_after_one_flag() -> None:
    """``tapp sweep --power 1 0.5 0.25`` as the issue writes it, and ``--model a --model b`` as click does."""
    import typer.main

    sweep = typer.main.get_command(app).commands["sweep"]  # type: ignore[attr-defined]
    args = ["--model", "mlp", "tiny_cnn", "--model", "vgg16", "--power", "1", "0.5", "0.25", "--batch-sizes", "16"]
    context = sweep.make_context("sweep", [*args, "--estimate-only", "--seed", "3"])
    assert context.params["models"] == ["mlp", "tiny_cnn", "vgg16"]
    assert context.params["powers"] == [1.0, 0.5, 0.25] and context.params["batch_sizes"] == [16]
    assert context.params["estimate_only"] is True and context.params["seed"] == 3
