"""The training checkpoint's format (``runtime.checkpoint``), without MPI: pieces placed by the model's own names and
assembled whole, a manifest written last so that a crash mid-write leaves the previous checkpoint the one read, safe
reading, and bad checkpoints refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from flows.cli import app
from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.model.workload import build_traced_workload, workload_of
from tapp_core.model.zoo import build_model
from tapp_core.runtime.checkpoint import (
    KEEP,
    MANIFEST,
    MODEL_FILE,
    STATE,
    Checkpoint,
    Piece,
    TrainingCheckpointError,
    commit,
    export_model,
    prepare_checkpoints,
    step_folder,
    write_pieces,
)

MODEL = "mlp"
META = {"model": MODEL, "seed": 1, "batch_size": 16, "plan": "p"}


def write_checkpoint(root: Path, step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A checkpoint of mlp as two devices of a split stage write it: fc1.weight by rows (3:1), the rest whole by the
    first; returns the state written."""
    state = {name: tensor * scale for name, tensor in build_model(MODEL, seed=step).state_dict().items()}
    weight = state["fc1.weight"]
    cut = weight.shape[0] * 3 // 4
    first = [Piece(STATE, name, t) for name, t in state.items() if name != "fc1.weight"]
    first.append(Piece(STATE, "fc1.weight", weight[:cut], dim=0, start=0, stop=cut, size=weight.shape[0]))
    first.append(Piece("optimizer.momentum_buffer", "fc2.bias", torch.ones_like(state["fc2.bias"])))
    second = [Piece(STATE, "fc1.weight", weight[cut:], dim=0, start=cut, stop=weight.shape[0], size=weight.shape[0])]
    folder = step_folder(root, step)
    write_pieces(folder, "device-000", first)
    write_pieces(folder, "device-001", second)
    write_pieces(folder, "device-002", [])  # a replica writes nothing but says so
    commit(folder, ["device-000", "device-001", "device-002"], {**META, "step": step, "epoch": 0, "epoch_step": step})
    return state


def test_pieces_are_assembled_whole_under_the_models_names(tmp_path: Path) -> None:
    state = write_checkpoint(tmp_path, 3)
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.position() == (3, 0, 3) and checkpoint.model == MODEL
    assert checkpoint.state_dict().keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(checkpoint.whole(STATE, name), tensor), name
    assert checkpoint.kinds("fc2.bias") == ["optimizer.momentum_buffer", STATE]
    export_model(checkpoint, tmp_path / "out" / "model.safetensors")
    net = build_model(MODEL)
    net.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))  # strict
    assert all(torch.equal(net.state_dict()[name], tensor) for name, tensor in state.items())


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        write_checkpoint(tmp_path, step)
    assert KEEP == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_folder(tmp_path, s).name for s in (6, 8)]
    assert Checkpoint.open(tmp_path).position()[0] == 8


CRASH = """
import os, sys
from pathlib import Path
from tapp_core.runtime import checkpoint
real_replace = os.replace
def dying_replace(source, target):
    if Path(target).name == sys.argv[2]:
        os._exit(9)  # killed: no cleanup, no finally
    real_replace(source, target)
os.replace = dying_replace
from tests.test_checkpoint import write_checkpoint
write_checkpoint(Path(sys.argv[1]), 4, scale=2.0)
"""


@pytest.mark.parametrize("dies_at", [MANIFEST, "device-001.safetensors", "device-000.json"])
def test_a_crash_while_writing_leaves_the_previous_checkpoint_the_one_read(tmp_path: Path, dies_at: str) -> None:
    before = write_checkpoint(tmp_path, 2)
    crashed = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), dies_at], check=False)
    assert crashed.returncode == 9
    assert step_folder(tmp_path, 4).is_dir() and not (step_folder(tmp_path, 4) / MANIFEST).exists()
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.position()[0] == 2
    assert all(torch.equal(checkpoint.whole(STATE, n), t) for n, t in before.items())
    # the next write of step 4 completes over the half-written one
    write_checkpoint(tmp_path, 4, scale=2.0)
    assert Checkpoint.open(tmp_path).position()[0] == 4


def test_a_commit_waits_for_every_writer(tmp_path: Path) -> None:
    folder = step_folder(tmp_path, 1)
    write_pieces(folder, "device-000", [Piece(STATE, "w", torch.zeros(2))])
    with pytest.raises(TrainingCheckpointError, match="device-001"):
        commit(folder, ["device-000", "device-001"], {**META, "step": 1, "epoch": 0, "epoch_step": 1})
    assert not (folder / MANIFEST).exists()


def test_a_file_changed_after_its_manifest_is_refused_unread(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1)
    folder = step_folder(tmp_path, 1)
    (folder / "device-001.safetensors").write_bytes(b"\x80\x04cos\nsystem\n" + b"x" * 100)  # a pickle, not tensors
    with pytest.raises(TrainingCheckpointError, match=r"device-001\.safetensors is not the file"):
        Checkpoint.open(folder)


def corrupt(root: Path, how: str) -> Path:
    if how == "empty folder":
        root.mkdir()
    elif how == "not a folder":
        root.write_text("hello")
    else:
        write_checkpoint(root, 1)
        folder = step_folder(root, 1)
        if how == "missing file":
            (folder / "device-001.safetensors").unlink()
        elif how == "manifest not json":
            (folder / MANIFEST).write_text("{oops")
        elif how == "manifest of something else":
            (folder / MANIFEST).write_text(json.dumps({"format": "other"}))
    return root


BAD = [
    ("empty folder", "holds no complete TAPP checkpoint"),
    ("not a folder", "is not a folder"),
    ("missing file", "names device-001.safetensors, which is missing"),
    ("manifest not json", "is not readable JSON"),
    ("manifest of something else", "is not a TAPP checkpoint's"),
]


@pytest.mark.parametrize(("how", "message"), BAD, ids=[how for how, _ in BAD])
def test_a_bad_checkpoint_is_one_line_naming_it(tmp_path: Path, how: str, message: str) -> None:
    root = corrupt(tmp_path / "ckpt", how)
    with pytest.raises(TrainingCheckpointError, match=message) as raised:
        Checkpoint.open(root)
    assert str(root) in str(raised.value) and "\n" not in str(raised.value)
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(root), "--out", str(tmp_path / "m.safetensors")])
    assert result.exit_code == 2 and result.output.startswith("error: ") and message in " ".join(result.output.split())
    assert not (tmp_path / "m.safetensors").exists()


def test_a_checkpoint_of_another_model_or_batch_size_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1)
    with pytest.raises(TrainingCheckpointError, match="is of model 'mlp', not 'tiny_cnn'"):
        prepare_checkpoints(CheckpointOptions(resume=str(tmp_path)), "tiny_cnn", 16)
    with pytest.raises(TrainingCheckpointError, match="batches of 16, the plan's are 8"):
        prepare_checkpoints(CheckpointOptions(resume=str(tmp_path)), MODEL, 8)
    resolved, seed = prepare_checkpoints(CheckpointOptions(resume=str(tmp_path), every=3), MODEL, 16)
    assert resolved == CheckpointOptions(str(tmp_path), 3, str(step_folder(tmp_path, 1))) and seed == 1
    # An elastic training's segment resumes and stops at its end: the stop survives the resolving (it was dropped,
    # and every resumed segment trained to the end of the epoch).
    segment, _ = prepare_checkpoints(CheckpointOptions(resume=str(tmp_path), every=3, until=6), MODEL, 16)
    assert segment == CheckpointOptions(str(tmp_path), 3, str(step_folder(tmp_path, 1)), until=6)


def test_a_model_with_weights_no_layer_uses_resumes_from_what_its_stages_hold(tmp_path: Path) -> None:
    """An auxiliary head feeding no trained output (or a layer never called) is on no stage, so no checkpoint holds
    it: resuming compares the checkpoint with what the stages hold (it compared with the whole model, and refused
    every such checkpoint as "of model m, not m")."""
    model = "tests.output_models:aux_classifier"
    state = build_traced_workload(workload_of(model)).state_dict()
    folder = step_folder(tmp_path, 1)
    write_pieces(folder, "device-000", [Piece(STATE, name, tensor) for name, tensor in state.items()])
    commit(folder, ["device-000"], {**META, "model": model, "step": 1, "epoch": 0, "epoch_step": 1})
    resolved, _ = prepare_checkpoints(CheckpointOptions(resume=str(tmp_path)), model, 16)
    assert resolved.resume == str(folder)
    older = step_folder(tmp_path / "older", 1)  # the same model as it was before its file changed
    write_pieces(older, "device-000", [Piece(STATE, name, t) for name, t in state.items() if not name.startswith("fc")])
    commit(older, ["device-000"], {**META, "model": model, "step": 1, "epoch": 0, "epoch_step": 1})
    with pytest.raises(TrainingCheckpointError, match=f"is of another '{model}' .they differ in 'fc.bias', 2 names"):
        prepare_checkpoints(CheckpointOptions(resume=str(older)), model, 16)


def test_tapp_export_writes_the_newest_checkpoints_model(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", 1)
    state = write_checkpoint(tmp_path / "ckpt", 2, scale=3.0)
    result = CliRunner().invoke(
        app, ["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / MODEL_FILE)]
    )
    assert result.exit_code == 0, result.output
    exported = load_file(tmp_path / MODEL_FILE)
    assert exported.keys() == state.keys() and all(torch.equal(exported[n], t) for n, t in state.items())


def test_the_flows_training_resumes_its_own_checkpoints_only_when_the_experiment_resumes(tmp_path: Path) -> None:
    from tasks.config import ExperimentConfig
    from tasks.train import training_checkpoints

    config = ExperimentConfig(model=MODEL, checkpoint_dir=str(tmp_path), checkpoint_every=5)
    assert training_checkpoints(config.model_copy(update={"checkpoint_dir": None}), "run1", "tapp", True) is None
    folder = tmp_path / "run1" / "tapp"
    assert training_checkpoints(config, "run1", "tapp", True) == CheckpointOptions(str(folder), 5, None)
    folder.mkdir(parents=True)  # interrupted before its first checkpoint: starts again
    assert training_checkpoints(config, "run1", "tapp", True) == CheckpointOptions(str(folder), 5, None)
    write_checkpoint(folder, 3)
    assert training_checkpoints(config, "run1", "tapp", False) == CheckpointOptions(str(folder), 5, None)
    resumed = CheckpointOptions(str(folder), 5, str(step_folder(folder, 3)))
    assert training_checkpoints(config, "run1", "tapp", True) == resumed


def test_a_training_never_writes_among_another_trainings_checkpoints(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "old", 2)
    with pytest.raises(TrainingCheckpointError, match="holds another training's checkpoints"):
        prepare_checkpoints(CheckpointOptions(str(tmp_path / "old")), MODEL, 16)
    with pytest.raises(TrainingCheckpointError, match="holds another training's checkpoints"):
        prepare_checkpoints(CheckpointOptions(str(tmp_path / "old"), resume=str(write_other(tmp_path))), MODEL, 16)
    resumed, _ = prepare_checkpoints(CheckpointOptions(str(tmp_path / "old"), resume=str(tmp_path / "old")), MODEL, 16)
    assert resumed.resume == str(step_folder(tmp_path / "old", 2))
    assert prepare_checkpoints(CheckpointOptions(str(tmp_path / "new")), MODEL, 16)[0].folder == str(tmp_path / "new")


def write_other(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path / "other", 1)
    return tmp_path / "other"


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("another model", "is of model 'mlp', not 'tiny_cnn'"),
        ("missing file", "names device-001.safetensors, which is missing"),
        ("not a checkpoint", "holds no complete TAPP checkpoint"),
        ("every without a folder", "--checkpoint-every needs --checkpoint-dir"),
    ],
)
def test_tapp_train_refuses_a_bad_checkpoint_in_one_line_before_any_rank_starts(
    work_dir: Path, how: str, message: str
) -> None:
    plan = {"model": "tiny_cnn", "batch_size": 16, "micro_batches": 1, "schedule": "gpipe"}
    (work_dir / "plan.json").write_text(json.dumps({**plan, "stage_of_layer": [0] * 7, "stage_devices": [["cpu0"]]}))
    if how == "not a checkpoint":
        (work_dir / "ckpt").mkdir()
    elif how != "every without a folder":
        write_checkpoint(work_dir / "ckpt", 1)
    if how == "missing file":
        (step_folder(work_dir / "ckpt", 1) / "device-001.safetensors").unlink()
    options = ["--checkpoint-every", "3"] if how == "every without a folder" else ["--resume", "ckpt"]
    args = ["train", "--model", "tiny_cnn", "--plan", "plan.json", "--dataset", "synthetic", *options]
    if how == "missing file":
        args[2] = "mlp"
        (work_dir / "plan.json").write_text(
            json.dumps({**plan, "model": "mlp", "stage_of_layer": [0] * 6, "stage_devices": [["cpu0"]]})
        )
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and output.startswith("error: ") and message in output, result.output
    assert "Traceback" not in output
