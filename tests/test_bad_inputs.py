"""Bad inputs end in one line and exit status 2, before any work they would spoil (issue 15).

The commands run in-process through Typer's runner; ``bench/bad_inputs.py`` runs the same kinds of input (and more)
through the ``tapp`` executable. Nothing here starts MPI: every case must fail before the pool would.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from tapp_core.cost.context import CostContext
from tapp_core.model.data import DataError, check_dataset
from tapp_core.planners import PlannerError, get_planner
from tapp_core.planners.tapp.search import CheckpointError, read_checkpoint
from tapp_core.platform.cluster import load_cluster, parse_cluster
from tapp_core.profile.library import LayerLibrary
from tasks.tracking import TrackingError, check_tracking

LIBRARY = Path(__file__).resolve().parent.parent / "bench" / "libraries" / "alexnet_b64"
MARKER = "payload-ran"
TINY = ["--model", "tiny_cnn", "--batch-size", "8"]
PLAN = {
    "model": "tiny_cnn",
    "batch_size": 8,
    "micro_batches": 1,
    "schedule": "gpipe",
    "stage_of_layer": [0] * 7,
    "stage_devices": [["cpu0"]],
}
TWO_DEVICES = "name: small\ndevices:\n  - {name: cpu0, memory: MEM}\n  - {name: cpu1, memory: MEM}\nlinks: {bandwidth: 1Gbit/s, latency: 0}\n"


def tapp_fails(*args: str) -> str:
    """Run ``tapp ARGS``: it must exit 2 with one line, ``error: ...``, and no traceback; returns that line."""
    result = CliRunner().invoke(app, list(args))
    output = result.output.strip()
    assert result.exit_code == 2, output
    assert output.startswith("error: ") and "\n" not in output, output
    assert "Traceback" not in output
    return " ".join(output.split())  # rich wraps long lines at the terminal's width


def device(fields: str) -> str:
    return f"name: bad\ndevices:\n  - {{{fields}}}\nlinks: {{bandwidth: 1Gbit/s, latency: 100us}}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (device("name: a, memory: .inf"), "devices.0.memory: expected a finite size"),
        (device("name: a, memory: 1e400"), "devices.0.memory: expected a finite size"),
        (device("name: a, memory: 1e400GiB"), "devices.0.memory: expected a finite size"),
        (device("name: a, memory: 4GiB, speed: .inf"), "devices.0.speed: Input should be a finite number"),
        (device("name: a, memory: 4GiB, slowdown: .inf"), "slowdown must be a positive finite number"),
        (device("name: a, memory: 4GiB, threads: 1.5"), "devices.0.threads"),
        (device("name: a, memory: 4GiB").replace("1Gbit/s", ".inf"), "links.bandwidth: expected a finite bandwidth"),
        (device("name: a, memory: 4GiB").replace("100us", ".nan"), "links.latency: expected a finite duration"),
        (b"\x00\x01\xff\xfe" * 64, "not a text file"),
    ],
)
def test_a_cluster_with_a_value_out_of_range_is_one_line(work_dir: Path, text: str | bytes, message: str) -> None:
    path = work_dir / "bad.yaml"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    assert message in tapp_fails("plan", *TINY, "--cluster", "bad.yaml")


def test_an_invalid_device_is_reported_once_without_a_false_empty_list(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"devices\.0\.kind") as info:
        parse_cluster(
            {
                "name": "x",
                "devices": [{"name": "a", "memory": "1GiB", "kind": "tpu"}],
                "links": {"bandwidth": 1, "latency": 0},
            }
        )
    assert "at least 1 item" not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(Exception, match=r"devices: .*at least 1 item"):  # an empty list is still named
        parse_cluster({"name": "x", "devices": [], "links": {"bandwidth": 1, "latency": 0}})


def test_a_folder_given_as_a_cluster_file_is_called_a_folder(tmp_path: Path) -> None:
    (tmp_path / "clusters.yaml").mkdir()
    with pytest.raises(Exception, match="is a folder"):
        load_cluster(tmp_path / "clusters.yaml")


@pytest.mark.parametrize(
    ("batch_size", "message"),
    [
        ("64.7", "batch_size must be an integer, got 64.7"),
        ("1e999", "batch_size must be an integer, got inf"),
        ("true", "batch_size must be an integer, got True"),
    ],
)
def test_a_plan_batch_size_that_is_not_an_integer_is_refused(work_dir: Path, batch_size: str, message: str) -> None:
    (work_dir / "plan.json").write_text(json.dumps(PLAN).replace('"batch_size": 8', f'"batch_size": {batch_size}'))
    assert message in tapp_fails("simulate", "--model", "tiny_cnn", "--plan", "plan.json")


def test_plan_files_that_are_folders_or_binary_are_named(work_dir: Path) -> None:
    (work_dir / "folder.json").mkdir()
    assert "is a folder" in tapp_fails("simulate", "--model", "tiny_cnn", "--plan", "folder.json")
    (work_dir / "binary.json").write_bytes(bytes(range(256)))
    assert "not a text file" in tapp_fails("simulate", "--model", "tiny_cnn", "--plan", "binary.json")


def test_output_paths_are_checked_before_the_work(work_dir: Path) -> None:
    (work_dir / "folder").mkdir()
    (work_dir / "file.txt").write_text("x")
    assert "--out folder is a folder" in tapp_fails("plan", *TINY, "--planner", "even", "--out", "folder")
    assert "is a file, not a folder" in tapp_fails("plan", *TINY, "--planner", "even", "--out", "file.txt/plan.json")
    assert "--out file.txt is a file" in tapp_fails("profile", *TINY, "--out", "file.txt")
    (work_dir / "plan.json").write_text(json.dumps(PLAN))
    assert "--gantt folder is a folder" in tapp_fails(
        "simulate", "--model", "tiny_cnn", "--plan", "plan.json", "--gantt", "folder"
    )
    assert not (work_dir / ".tapp").exists()  # refused before anything was profiled


@pytest.mark.parametrize("timeout", ["-1", "nan", "0"])
def test_measure_refuses_a_timeout_that_is_not_positive(work_dir: Path, timeout: str) -> None:
    (work_dir / "plan.json").write_text(json.dumps(PLAN))
    assert "--timeout must be a positive number" in tapp_fails("measure", "--model", "tiny_cnn", "--timeout", timeout)


def test_measure_checks_memory_against_the_profiled_library_before_any_rank(work_dir: Path) -> None:
    (work_dir / "plan.json").write_text(json.dumps(PLAN))
    (work_dir / "small.yaml").write_text(TWO_DEVICES.replace("MEM", "1KiB"))
    started = time.monotonic()
    line = tapp_fails("measure", "--model", "tiny_cnn", "--cluster", "small.yaml")
    assert "out of memory on device 'cpu0'" in line and "the device has 1.00 KiB" in line
    assert (work_dir / ".tapp" / "libraries").is_dir()  # the library came from the profile cache
    assert time.monotonic() - started < 60


def _cifar(folder: Path, bad_file: str | None = None, content: bytes = b"") -> Path:
    data = folder / "cifar-10-batches-py"
    data.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": np.zeros((10, 3072), np.uint8), b"labels": list(range(10))}
        (data / name).write_bytes(pickle.dumps(batch))
    (data / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"c"] * 10}))
    if bad_file is not None:
        (data / bad_file).write_bytes(content)
    return folder


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_every_data_file_is_checked_before_training_starts(work_dir: Path) -> None:
    check_dataset("cifar10", str(_cifar(work_dir / "good")))  # a whole folder passes
    with pytest.raises(DataError, match="data_batch_4: corrupt CIFAR-10 file"):
        check_dataset("cifar10", str(_cifar(work_dir / "truncated", "data_batch_4", b"\x80\x04")))
    payload = pickle.dumps(_Payload(work_dir / MARKER))
    _cifar(work_dir / "malicious", "data_batch_2", payload)
    (work_dir / "plan.json").write_text(json.dumps(PLAN))
    line = tapp_fails("train", "--model", "tiny_cnn", "--data-dir", "malicious", "--steps-per-epoch", "1")
    assert "data_batch_2: corrupt CIFAR-10 file" in line
    assert not (work_dir / MARKER).exists()


def test_a_named_dataset_that_is_not_there_is_refused_even_without_training(
    work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--dataset cifar10`` with no CIFAR-10 folder: one line and exit 2, though an estimate-only run trains
    nothing, and no store is created."""
    monkeypatch.delenv("TAPP_DATA_DIR", raising=False)
    run = ["run", *TINY, "--estimate-only", "--rounds", "2", "--methods", "tapp,even", "--tracking-uri"]
    line = tapp_fails(*run, f"sqlite:///{work_dir / 'mlflow.db'}", "--dataset", "cifar10")
    assert "CIFAR-10 needs its data folder" in line and not (work_dir / "mlflow.db").exists()
    line = tapp_fails(*run, f"sqlite:///{work_dir / 'mlflow.db'}", "--dataset", "cifar10", "--data-dir", "nowhere")
    assert "CIFAR-10 data folder does not exist" in line


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        ("import sys\ndef make():\n    sys.exit(0)\n", "m.py:make", "it called sys.exit(0)"),
        ("import sys\nsys.exit(3)\n", "m.py:make", "importing model file 'm.py' failed: it called sys.exit(3)"),
        (None, "sys:exit", "'exit' is a built-in function, not a model factory"),
        (None, "os:abort", "'abort' is a built-in function"),
        (
            "from torch import nn\ndef make():\n    return nn.Linear(10, 2)\n",
            "m.py:make",
            "fails on a batch of 8 inputs shaped 3x32x32",
        ),
        (
            "from torch import nn\nclass M(nn.Module):\n    def forward(self, a, b):\n        return a + b\n"
            "def make():\n    return M()\n",
            "m.py:make",
            "takes 2 inputs and its workload gives 1 (float32[3, 32, 32]): give its inputs",
        ),
        (
            "workload = {'inputs': [[8]], 'loss': 'hinge'}\nfrom torch import nn\ndef make():\n    return nn.Linear(8, 2)\n",
            "m.py:make",
            "loss 'hinge' is not one of cross_entropy, mse",
        ),
    ],
)
def test_models_that_exit_or_take_another_shape_are_errors(
    work_dir: Path, source: str | None, spec: str, message: str
) -> None:
    if source is not None:
        (work_dir / "m.py").write_text(source)
    assert message in tapp_fails("profile", "--model", spec, "--batch-size", "8", "--repeats", "1")


def test_a_batch_too_large_to_allocate_is_an_error() -> None:
    assert "for its input alone" in tapp_fails("profile", "--model", "tiny_cnn", "--batch-size", str(10**9))


def test_the_oracle_refuses_a_cluster_beyond_its_reach() -> None:
    devices = [{"name": f"d{i}", "memory": "4GiB"} for i in range(1000)]
    cluster = parse_cluster({"name": "big", "devices": devices, "links": {"bandwidth": 1e9, "latency": 0}})
    started = time.monotonic()
    with pytest.raises(PlannerError, match=r"1000 devices .* beyond the oracle's exhaustive search"):
        get_planner("oracle").plan(CostContext(LayerLibrary.load(LIBRARY), cluster))
    assert time.monotonic() - started < 30


def test_a_crafted_checkpoint_is_refused_and_runs_nothing(work_dir: Path) -> None:
    (work_dir / "ck").mkdir()
    (work_dir / "ck" / "search.pt").write_bytes(pickle.dumps(_Payload(work_dir / MARKER)))
    line = tapp_fails("plan", *TINY, "--planner", "tapp", "--checkpoint", "ck", "--resume")
    assert "refused by the safe loader" in line and "nothing in it was run" in line
    torch.save({"config": _Payload(work_dir / MARKER)}, work_dir / "zipped.pt")  # torch's own format
    with pytest.raises(CheckpointError, match="refused by the safe loader"):
        read_checkpoint(work_dir / "zipped.pt")
    assert not (work_dir / MARKER).exists()


def test_checkpoint_options_are_checked(work_dir: Path) -> None:
    assert "--resume needs --checkpoint" in tapp_fails("plan", *TINY, "--planner", "tapp", "--resume")
    assert "--checkpoint is for the tapp planner" in tapp_fails("plan", *TINY, "--planner", "even", "--checkpoint", "c")
    assert "holds no saved search" in tapp_fails("plan", *TINY, "--planner", "tapp", "--checkpoint", "c", "--resume")
    torch.save({"not": "a search"}, work_dir / "c.pt")
    (work_dir / "c").mkdir()
    (work_dir / "c.pt").rename(work_dir / "c" / "search.pt")
    assert "not a TAPP search checkpoint" in tapp_fails(
        "plan", *TINY, "--planner", "tapp", "--checkpoint", "c", "--resume"
    )


def test_report_without_a_store_creates_none(work_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert "no MLflow store at" in tapp_fails("report")
    assert not (work_dir / "mlflow.db").exists()
    (work_dir / "mlflow.db").write_bytes(b"not a database" * 100)
    assert "cannot be opened: file is not a database" in tapp_fails("report")


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` (empty) made read-only: mode 0555, or for root (whom modes do not bind) a read-only tmpfs."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("no read-only folder can be made here (root without mount)")
    try:
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_store_folder_fails_in_a_moment(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        started = time.monotonic()
        with pytest.raises(TrackingError, match="cannot be written"):
            check_tracking(f"sqlite:///{folder}/mlflow.db")
        assert time.monotonic() - started < 5
        with pytest.raises(TrackingError, match="no MLflow store at"):  # reading: nothing there to read
            check_tracking(f"sqlite:///{folder}/mlflow.db", existing=True)
