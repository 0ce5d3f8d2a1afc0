"""Every example of ``examples/`` goes through the front door as the README shows: ``tapp profile``, ``tapp plan``,
then ``tapp measure`` and ``tapp train`` on ``local`` (real ``mpiexec``: the language model through the command
line, the others through one pool)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import load_cluster
from tapp_core.runtime import WorkerPool, measure, train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LM = f"{EXAMPLES / 'tiny_lm.py'}:build"
OTHERS = [f"{EXAMPLES / 'cifar_classifier.py'}:build", f"{EXAMPLES / 'two_inputs.py'}:build"]
BATCH = "8"


def tapp(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def profile_and_plan(spec: str, folder: Path) -> Plan:
    output = tapp("profile", "--model", spec, "--batch-size", BATCH, "--repeats", "1", "--threads", "1", "--out", "lib")
    assert output.startswith(f"workload {spec}: inputs "), output
    plan_file = folder / f"{Path(spec.split(':')[0]).stem}.json"
    tapp(
        "plan", "--model", spec, "--batch-size", BATCH, "--library", "lib", "--planner", "even", "--out", str(plan_file)
    )
    return Plan.load(plan_file)


@pytest.mark.parametrize("spec", [*OTHERS, LM])
def test_each_example_profiles_and_plans(work_dir: Path, spec: str) -> None:
    plan = profile_and_plan(spec, work_dir)
    assert plan.model == spec and plan.n_stages >= 2


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_language_model_measures_and_trains_through_the_command_line(work_dir: Path) -> None:
    profile_and_plan(LM, work_dir)
    output = tapp("measure", "--model", LM, "--plan", "tiny_lm.json", "--steps", "3", "--warmup", "1",
                  "--min-rounds", "1", "--max-rounds", "1")  # fmt: skip
    measured = json.loads(output[output.index("{") :])
    assert measured["error"] is None and measured["step_time_s"] > 0 and measured["loss"] > 0
    output = tapp("train", "--model", LM, "--plan", "tiny_lm.json", "--epochs", "2", "--steps-per-epoch", "12")
    losses = [float(line.split("train loss ")[1].split(",")[0]) for line in output.splitlines() if "train loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0]  # counting sequences are learnt: the loss falls


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_other_examples_measure_and_train_on_one_pool(work_dir: Path) -> None:
    plans = [profile_and_plan(spec, work_dir) for spec in OTHERS]
    cluster = load_cluster("local")
    devices = sorted({d for plan in plans for d in plan.devices})
    with WorkerPool(cluster, devices=devices) as pool:
        for plan in plans:
            measured = measure(plan, cluster, plan.model, steps=3, warmup=1, pool=pool)
            assert measured.ok and measured.step_time_s > 0, measured.error
            trained = train(plan, cluster, plan.model, dataset="synthetic", epochs=1, steps_per_epoch=4, pool=pool)
            assert trained.ok and trained.synthetic and len(trained.epoch_losses) == 1, trained.error
