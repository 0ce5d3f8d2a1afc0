"""Checkpoints on real MPI ranks: the exported model is the single-device training's, and a training resumed from a
checkpoint under another plan (other cuts, devices, replicas, split layers, shares) ends where the uninterrupted
one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from flows.cli import app
from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.model.data import batch_loader, open_dataset
from tapp_core.model.zoo import build_model
from tapp_core.plan.plan import Plan
from tapp_core.runtime import OptimizerConfig, WorkerPool, make_optimizer, micro_batch_loss
from tapp_core.runtime.checkpoint import MODEL_FILE, Checkpoint, step_folder

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

MODEL = "mlp"
BATCH = 16
MICRO_BATCHES = 2
SEED = 5
STEPS = 6
OPTIMIZER = OptimizerConfig(lr=0.05, momentum=0.9)
RTOL, ATOL = 1e-4, 1e-5
# mlp's layers: flatten, fc1, relu1, fc2, relu2, fc3
TWO_STAGES = Plan(MODEL, BATCH, MICRO_BATCHES, "gpipe", (0, 0, 0, 1, 1, 1), (("d0",), ("d1",)))
SPLIT_AND_REPLICATED = Plan(
    MODEL,
    BATCH,
    MICRO_BATCHES,
    "1f1b",
    (0, 0, 0, 0, 0, 1),
    (("d0", "d1"), ("d2",)),
    stage_shares=((0.75, 0.25), (1.0,)),
    signatures=((1, "col"), (3, "row")),
)
REPLICATED_FIRST = Plan(MODEL, BATCH, MICRO_BATCHES, "gpipe", (0, 0, 1, 1, 1, 1), (("d1", "d2"), ("d0",)))
SHARDED_OPTIMIZER = Plan(
    MODEL,
    BATCH,
    MICRO_BATCHES,
    "1f1b",
    (0, 0, 0, 0, 1, 1),
    (("d0", "d2"), ("d1",)),
    stage_shares=((0.75, 0.25), (1.0,)),
    bucket_bytes=4096,
    shard_optimizer=(0,),
)
"""Stage 0 on two devices, each holding its share of the optimiser state of several buckets."""

ALEXNET_LAYERS = 21
DROPOUT = Plan(
    "alexnet",
    BATCH,
    MICRO_BATCHES,
    "1f1b",
    tuple(int(layer >= 16) for layer in range(ALEXNET_LAYERS)),  # classifier_2 on: a dropout on each stage
    (("d0", "d1"), ("d2",)),
)
"""AlexNet's two dropouts, one on each stage, the first stage's on two replicas."""


def run(pool: WorkerPool, plan: Plan, options: CheckpointOptions, epochs: int = 1) -> None:
    result = pool.train(
        plan,
        dataset="synthetic",
        epochs=epochs,
        seed=SEED,
        steps_per_epoch=STEPS,
        augment=True,
        test_samples=64,
        optimizer=OPTIMIZER,
        checkpoints=options,
    )
    assert result.ok, result.error


def single_device(epochs: int = 1) -> torch.nn.Module:
    """The same training on one device: the same batches (order and augmentation), micro-batches accumulated."""
    net = build_model(MODEL, seed=SEED)
    optimizer = make_optimizer(net.parameters(), OPTIMIZER)
    data = open_dataset("synthetic", None, train=True, augment=True)
    size = BATCH // MICRO_BATCHES
    for epoch in range(epochs):
        for step, (x, y) in enumerate(batch_loader(data, BATCH, seed=SEED, epoch=epoch)):
            if step == STEPS:
                break
            for j in range(MICRO_BATCHES):
                part = slice(j * size, (j + 1) * size)
                micro_batch_loss(net(x[part]), y[part], BATCH).backward()
            optimizer.step()
            optimizer.zero_grad()
    return net


def assert_same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=RTOL, atol=ATOL), name


def test_the_exported_model_is_the_single_device_training(pool3: WorkerPool, tmp_path: Path) -> None:
    run(pool3, SPLIT_AND_REPLICATED, CheckpointOptions(str(tmp_path), every=4))
    exported = load_file(tmp_path / MODEL_FILE)
    net = build_model(MODEL)
    net.load_state_dict(exported)  # strict: exactly the model's own names
    reference = single_device()
    assert_same_model(exported, reference.state_dict())
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(net(x), reference(x), rtol=RTOL, atol=ATOL)
    # every 4 steps, and the last: step 4 then step 6; the split stage wrote its shards, its bias once
    assert Checkpoint.open(tmp_path).position() == (STEPS, 1, 0)
    assert Checkpoint.open(step_folder(tmp_path, 4)).position() == (4, 0, 4)
    places = Checkpoint.open(tmp_path).manifest["pieces"]
    fc1 = [(p["dim"], p["start"], p["stop"]) for p in places if p["name"] == "fc1.weight" and p["kind"] == "state"]
    assert len(fc1) == 2 and {d for d, _, _ in fc1} == {0}


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (TWO_STAGES, SPLIT_AND_REPLICATED),
        (SPLIT_AND_REPLICATED, REPLICATED_FIRST),
        (SHARDED_OPTIMIZER, TWO_STAGES),
        (TWO_STAGES, SHARDED_OPTIMIZER),
    ],
    ids=["two-stages-then-split", "split-then-replicated", "sharded-optimizer-then-two-stages", "then-sharded"],
)
def test_a_training_resumed_under_another_plan_ends_as_the_uninterrupted_one(
    pool3: WorkerPool, tmp_path: Path, first: Plan, then: Plan
) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(pool3, first, CheckpointOptions(str(whole), every=2), epochs=2)
    # Stopped after step 10 (4 steps into the second epoch): resumed from there under the other plan.
    run(pool3, then, CheckpointOptions(str(resumed), every=2, resume=str(step_folder(whole, 10))), epochs=2)
    assert Checkpoint.open(resumed).position() == (2 * STEPS, 2, 0)
    assert_same_model(load_file(resumed / MODEL_FILE), load_file(whole / MODEL_FILE))
    assert_same_model(load_file(whole / MODEL_FILE), single_device(epochs=2).state_dict())


def test_tapp_train_stopped_and_resumed_under_another_plan_from_the_command_line(work_dir: Path) -> None:
    devices = "\n".join(f"  - {{name: d{i}, memory: 2GiB}}" for i in range(3))
    (work_dir / "three.yaml").write_text(
        f"name: three\ndevices:\n{devices}\nlinks: {{bandwidth: 1Gbit/s, latency: 0}}\n"
    )
    TWO_STAGES.save(work_dir / "first.json")
    REPLICATED_FIRST.save(work_dir / "then.json")
    common = ["--model", MODEL, "--cluster", "three.yaml", "--dataset", "synthetic", "--steps-per-epoch", "3"]
    common += ["--seed", str(SEED), "--checkpoint-every", "2"]
    tapp("train", *common, "--plan", "first.json", "--checkpoint-dir", "stopped")  # 3 steps: checkpoints at 2, 3
    tapp("train", *common, "--plan", "first.json", "--checkpoint-dir", "whole", "--epochs", "2")
    output = tapp("train", *common, "--plan", "then.json", "--resume", "stopped", "--epochs", "2")
    assert "stopped/model.safetensors" in " ".join(output.split())
    assert Checkpoint.open(work_dir / "stopped").position() == (6, 2, 0)  # steps 4 and 6 written where it resumed
    assert_same_model(load_file(work_dir / "stopped" / MODEL_FILE), load_file(work_dir / "whole" / MODEL_FILE))
    tapp("export", "--checkpoint", "whole", "--out", "exported.safetensors")
    assert_same_model(load_file(work_dir / "exported.safetensors"), load_file(work_dir / "whole" / MODEL_FILE))


def tapp(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_a_training_with_dropout_resumed_under_its_plan_ends_exactly_as_the_uninterrupted_one(
    pool3: WorkerPool, tmp_path: Path
) -> None:
    """Every forward draws its dropout masks by its place in the training (``engine.draw_seed``), not by where its
    job began: the training resumed from step 10 draws in steps 11 and 12 what the uninterrupted one drew."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(pool3, DROPOUT, CheckpointOptions(str(whole), every=2), epochs=2)
    run(pool3, DROPOUT, CheckpointOptions(str(resumed), every=2, resume=str(step_folder(whole, 10))), epochs=2)
    got, want = load_file(resumed / MODEL_FILE), load_file(whole / MODEL_FILE)
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
