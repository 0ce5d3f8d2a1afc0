"""Bad inputs, as a user gives them: every one must end in one line and exit status 2 (bar: 0 tracebacks, 0 other
exits), and none may start an MPI worker.

    .venv/bin/python bench/bad_inputs.py [--jobs 2] [--only SUBSTRING] [--timeout 120]

Each case runs the ``tapp`` executable of this Python's environment in a private temporary folder (its own
``TMPDIR``, ``PREFECT_HOME``, ``TAPP_CACHE_DIR``), with the files it needs written there: broken cluster and plan
files, models that misbehave, corrupt or malicious data and checkpoints, paths that cannot be written, a
read-only working folder. Per case it prints the exit status, the seconds it took and the first line of output;
then the count of tracebacks, of user errors that did not exit 2, of cases that started an MPI process
(``mpiexec`` or a rank among the command's descendants), of cases whose extra check failed (a file a malicious
payload would create, a store ``tapp report`` must not create), and of cases that took longer than ``--slow``.

A read-only folder is a read-only tmpfs mount when this runs as root (for whom permission bits do not count),
else a folder of mode 0555; where neither can be made, those cases are skipped and say so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAPP = str(Path(sys.executable).parent / "tapp")
BIG_LIBRARY = ROOT / "bench" / "libraries" / "alexnet_b64"
MARKER = "pwned"
"""The file a malicious payload would create in the case's folder."""

GOOD_CLUSTER = """name: small
devices:
  - {name: cpu0, memory: 4GiB}
  - {name: cpu1, memory: 4GiB}
links: {bandwidth: 1Gbit/s, latency: 100us}
"""


def cluster_with(device: str, links: str = "{bandwidth: 1Gbit/s, latency: 100us}") -> str:
    return f"name: bad\ndevices:\n  - {device}\nlinks: {links}\n"


@dataclass
class Case:
    name: str
    args: list[str]
    files: dict[str, str | bytes | Callable[[Path], None]] = field(default_factory=dict)
    """Written in the case's folder first: text, bytes, or a function of the folder."""
    expect: int = 2
    """2 for a user error; 0 for a case that must succeed (a corrupt cache entry is rebuilt)."""
    check: Callable[[Path], str | None] | None = None
    """After the run: why the case failed beyond its exit status, or None."""
    read_only: bool = False
    """Run in a read-only working folder."""
    plan: bool = False
    """Copy the valid tiny_cnn plan (plan.json) and its cached library into the case's folder first."""


@dataclass
class Outcome:
    case: Case
    code: int | None
    seconds: float
    first_line: str
    output: str
    traceback: bool
    started_mpi: bool
    problem: str | None
    skipped: str | None = None


# --- files the cases use --------------------------------------------------------------------------------------


def plan_text(**changes: object) -> str:
    """The valid tiny_cnn plan (one stage on cpu0), with fields changed (and no id, which would then differ)."""
    plan: dict[str, object] = {
        "model": "tiny_cnn",
        "batch_size": 8,
        "micro_batches": 1,
        "schedule": "gpipe",
        "stage_of_layer": [0] * 7,
        "stage_devices": [["cpu0"]],
    }
    plan.update(changes)
    return json.dumps(plan)


def raw_plan(batch_size: str) -> str:
    """A plan whose batch size is written as given (JSON numbers Python reads as inf, or huge)."""
    return plan_text().replace('"batch_size": 8', f'"batch_size": {batch_size}')


def cifar_folder(bad_file: str | None = None, payload: bytes | None = None) -> Callable[[Path], None]:
    """A small CIFAR-10 folder (16 images per batch); ``bad_file`` holds ``payload`` instead."""
    import numpy as np

    def write(folder: Path) -> None:
        data = folder / "cifar" / "cifar-10-batches-py"
        data.mkdir(parents=True)
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        for name in names:
            batch = {b"data": np.zeros((16, 3072), np.uint8), b"labels": list(range(10)) + [0] * 6}
            (data / name).write_bytes(pickle.dumps(batch))
        meta = {b"label_names": [f"class{i}".encode() for i in range(10)]}
        (data / "batches.meta").write_bytes(pickle.dumps(meta))
        if bad_file is not None:
            (data / bad_file).write_bytes(payload if payload is not None else b"\x80\x04garbage")

    return write


def malicious_pickle(folder_marker: str) -> bytes:
    """A pickle that, if loaded without restriction, creates ``folder_marker``."""

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {folder_marker}",))

    return pickle.dumps(Payload())


def malicious_checkpoint(folder: Path) -> None:
    (folder / "ck").mkdir()
    (folder / "ck" / "search.pt").write_bytes(malicious_pickle(str(folder / MARKER)))


def malicious_cifar(folder: Path) -> None:
    cifar_folder("data_batch_3", malicious_pickle(str(folder / MARKER)))(folder)


def no_marker(folder: Path) -> str | None:
    return f"{MARKER} was created: the payload ran" if (folder / MARKER).exists() else None


def no_store(folder: Path) -> str | None:
    return "mlflow.db was created" if (folder / "mlflow.db").exists() else None


def fashion_folder(folder: Path) -> None:
    (folder / "fm").mkdir()
    (folder / "fm" / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")


def empty_store(folder: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from mlflow import MlflowClient; MlflowClient('sqlite:///mlflow.db').search_experiments()",
        ],
        cwd=folder,
        check=True,
        capture_output=True,
    )


def big_cluster(folder: Path) -> None:
    devices = "\n".join(f"  - {{name: d{i}, memory: 4GiB}}" for i in range(1000))
    (folder / "big.yaml").write_text(f"name: big\ndevices:\n{devices}\nlinks: {{bandwidth: 1Gbit/s, latency: 0}}\n")


def corrupt_cached_library(folder: Path) -> None:
    for entry in (folder / ".tapp" / "libraries").iterdir():
        (entry / "library.json").write_text("{}")


def subdir(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).mkdir()


MODELS = {
    "wrong_shape.py": "from torch import nn\ndef make():\n    return nn.Sequential(nn.Flatten(), nn.Linear(10, 2))\n",
    "exits.py": "import sys\ndef make():\n    sys.exit(0)\n",
    "exits_on_import.py": "import sys\nsys.exit(3)\n",
    "raises.py": "def make():\n    raise RuntimeError('no GPU here')\n",
    "not_module.py": "def make():\n    return 42\n",
    "syntax.py": "def make(:\n",
}

SMALL = ["--model", "tiny_cnn", "--batch-size", "8"]
SIM = ["simulate", "--model", "tiny_cnn", "--plan"]
MEASURE = ["measure", "--model", "tiny_cnn", "--cluster", "small.yaml", "--plan"]
TRAIN = ["train", "--model", "tiny_cnn", "--cluster", "small.yaml", "--plan", "plan.json", "--steps-per-epoch", "1"]
RUN = ["run", "--model", "tiny_cnn", "--estimate-only", "--rounds", "2", "--methods", "tapp,even"]


def cases() -> list[Case]:
    """The bad inputs, by kind."""
    c = Case
    plan_case = [
        c("plan: batch_size 1e999", [*SIM, "p.json"], {"p.json": raw_plan("1e999")}),
        c("plan: batch_size 10^9", [*SIM, "p.json"], {"p.json": raw_plan("1000000000")}),
        c("plan: batch_size 64.7", [*SIM, "p.json"], {"p.json": raw_plan("64.7")}),
        c("plan: batch_size -8", [*SIM, "p.json"], {"p.json": plan_text(batch_size=-8)}),
        c("plan: batch_size true", [*SIM, "p.json"], {"p.json": plan_text(batch_size=True)}),
        c(
            "plan: micro_batches NaN",
            [*SIM, "p.json"],
            {"p.json": plan_text().replace('"micro_batches": 1', '"micro_batches": NaN')},
        ),
        c("plan: micro_batches 0", [*SIM, "p.json"], {"p.json": plan_text(micro_batches=0)}),
        c("plan: stage 1.5", [*SIM, "p.json"], {"p.json": plan_text(stage_of_layer=[0] * 6 + [1.5])}),
        c("plan: short stage_of_layer", [*SIM, "p.json"], {"p.json": plan_text(stage_of_layer=[0] * 3)}),
        c("plan: unknown schedule", [*SIM, "p.json"], {"p.json": plan_text(schedule="zigzag")}),
        c("plan: not JSON", [*SIM, "p.json"], {"p.json": "{model: tiny_cnn"}),
        c("plan: binary file", [*SIM, "p.json"], {"p.json": bytes(range(256))}),
        c("plan: a directory", [*SIM, "pdir"], {"pdir": subdir("pdir")}),
        c("plan: missing file", [*SIM, "nowhere.json"]),
        c(
            "plan: backward edge",
            [*SIM, "p.json"],
            {"p.json": plan_text(stage_of_layer=[1] + [0] * 6, stage_devices=[["cpu0"], ["cpu1"]])},
        ),
    ]
    cluster_case = [
        c("cluster: binary file", ["plan", *SMALL, "--cluster", "bin.yaml"], {"bin.yaml": bytes(range(256)) * 4}),
        c(
            "cluster: latin-1 text",
            ["plan", *SMALL, "--cluster", "l1.yaml"],
            {"l1.yaml": "name: caf\xe9\n".encode("latin-1")},
        ),
        c(
            "cluster: memory .inf",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: .inf}")},
        ),
        c(
            "cluster: memory 1e400",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 1e400}")},
        ),
        c(
            "cluster: memory '1e400GiB'",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 1e400GiB}")},
        ),
        c(
            "cluster: memory -1GiB",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: -1GiB}")},
        ),
        c(
            "cluster: memory 0.5 B",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 0.5}")},
        ),
        c(
            "cluster: speed .inf",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB, speed: .inf}")},
        ),
        c(
            "cluster: speed .nan",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB, speed: .nan}")},
        ),
        c(
            "cluster: slowdown 0",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB, slowdown: 0}")},
        ),
        c(
            "cluster: slowdown .inf",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB, slowdown: .inf}")},
        ),
        c(
            "cluster: threads 1.5",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB, threads: 1.5}")},
        ),
        c(
            "cluster: bandwidth .inf",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB}", "{bandwidth: .inf, latency: 0}")},
        ),
        c(
            "cluster: latency -1ms",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB}", "{bandwidth: 1Gbit/s, latency: -1ms}")},
        ),
        c(
            "cluster: latency .nan",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB}", "{bandwidth: 1Gbit/s, latency: .nan}")},
        ),
        c(
            "cluster: invalid device kind",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": cluster_with("{name: a, memory: 4GiB, kind: tpu}")},
        ),
        c("cluster: a directory", ["plan", *SMALL, "--cluster", "cdir"], {"cdir": subdir("cdir")}),
        c("cluster: empty file", ["plan", *SMALL, "--cluster", "e.yaml"], {"e.yaml": ""}),
        c(
            "cluster: no devices",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": "name: x\ndevices: []\nlinks: {bandwidth: 1Gbit/s, latency: 0}\n"},
        ),
        c(
            "cluster: python tag",
            ["plan", *SMALL, "--cluster", "x.yaml"],
            {"x.yaml": f"!!python/object/apply:os.system ['touch {MARKER}']\n"},
            check=no_marker,
        ),
        c("cluster: unknown name", ["plan", *SMALL, "--cluster", "nosuchcluster"]),
    ]
    option_case = [
        c("measure --timeout -1", [*MEASURE, "plan.json", "--timeout", "-1"], {"small.yaml": GOOD_CLUSTER}, plan=True),
        c(
            "measure --timeout nan",
            [*MEASURE, "plan.json", "--timeout", "nan"],
            {"small.yaml": GOOD_CLUSTER},
            plan=True,
        ),
        c("plan --out a directory", ["plan", *SMALL, "--planner", "even", "--out", "odir"], {"odir": subdir("odir")}),
        c("plan --out under a file", ["plan", *SMALL, "--planner", "even", "--out", "f.txt/plan.json"], {"f.txt": "x"}),
        c("plan --out read-only", ["plan", *SMALL, "--planner", "even", "--out", "ro/plan.json"], read_only=True),
        c("simulate --gantt a directory", [*SIM, "plan.json", "--gantt", "gdir"], {"gdir": subdir("gdir")}, plan=True),
        c("simulate --gantt read-only", [*SIM, "plan.json", "--gantt", "ro/g.png"], plan=True, read_only=True),
        c("profile --out a file", ["profile", *SMALL, "--repeats", "1", "--out", "f.txt"], {"f.txt": "x"}),
        c("report --out a file", ["report", "--out", "f.txt"], {"f.txt": "x", "store": empty_store}),
        c("plan --planner magic", ["plan", *SMALL, "--planner", "magic"]),
        c("plan --rounds for even", ["plan", *SMALL, "--planner", "even", "--rounds", "3"]),
        c("plan --reward bogus", ["plan", *SMALL, "--planner", "tapp", "--reward", "bogus"]),
        c("run --methods nonsense", [*RUN[:-1], "tapp,nonsense"]),
        c("run --measured-rounds > rounds", ["run", "--model", "tiny_cnn", "--rounds", "2", "--measured-rounds", "3"]),
        c("run --dataset cifar10, no data", [*RUN, "--dataset", "cifar10"]),
    ]
    model_case = [
        c(
            "model: wrong input shape",
            ["profile", "--model", "wrong_shape.py:make", "--repeats", "1"],
            {"wrong_shape.py": MODELS["wrong_shape.py"]},
        ),
        c(
            "model: factory calls sys.exit(0)",
            ["profile", "--model", "exits.py:make", "--repeats", "1"],
            {"exits.py": MODELS["exits.py"]},
        ),
        c(
            "model: sys.exit on import",
            ["profile", "--model", "exits_on_import.py:make", "--repeats", "1"],
            {"exits_on_import.py": MODELS["exits_on_import.py"]},
        ),
        c("model: spec sys:exit", ["profile", "--model", "sys:exit", "--repeats", "1"]),
        c("model: spec os:abort", ["plan", "--model", "os:abort", "--planner", "even"]),
        c(
            "model: factory raises",
            ["profile", "--model", "raises.py:make", "--repeats", "1"],
            {"raises.py": MODELS["raises.py"]},
        ),
        c(
            "model: factory returns 42",
            ["profile", "--model", "not_module.py:make", "--repeats", "1"],
            {"not_module.py": MODELS["not_module.py"]},
        ),
        c(
            "model: syntax error",
            ["profile", "--model", "syntax.py:make", "--repeats", "1"],
            {"syntax.py": MODELS["syntax.py"]},
        ),
        c("model: no such module", ["profile", "--model", "nosuchmodule:make"]),
        c("model: unknown name", ["profile", "--model", "resnet9000"]),
        c(
            "profile --batch-size 10^9",
            ["profile", "--model", "tiny_cnn", "--batch-size", "1000000000", "--repeats", "1"],
        ),
    ]
    planner_case = [
        c(
            "oracle on 1000 devices",
            ["plan", *SMALL, "--planner", "oracle", "--cluster", "big.yaml"],
            {"big.yaml": big_cluster},
        ),
        c("cached library.json {} (rebuilt)", [*SIM, "plan.json"], {"c": corrupt_cached_library}, expect=0, plan=True),
        c("--library missing folder", ["plan", *SMALL, "--library", "nowhere"]),
        c(
            "--library corrupt library.json",
            ["plan", *SMALL, "--library", "lib"],
            {"lib": subdir("lib"), "lib/library.json": "{", "lib/layers.csv": "x\n"},
        ),
        c("--library of another model", ["plan", *SMALL, "--library", str(BIG_LIBRARY)]),
        c("tapp --resume, no checkpoint", ["plan", *SMALL, "--planner", "tapp", "--checkpoint", "ck", "--resume"]),
        c(
            "tapp --resume, malicious checkpoint",
            ["plan", *SMALL, "--planner", "tapp", "--checkpoint", "ck", "--resume"],
            {"ck": malicious_checkpoint},
            check=no_marker,
        ),
        c(
            "tapp --resume, garbage checkpoint",
            ["plan", *SMALL, "--planner", "tapp", "--checkpoint", "ck", "--resume"],
            {"ck": subdir("ck"), "ck/search.pt": b"garbage"},
        ),
        c("--resume without --checkpoint", ["plan", *SMALL, "--planner", "tapp", "--resume"]),
        c("--checkpoint for even", ["plan", *SMALL, "--planner", "even", "--checkpoint", "ck"]),
    ]
    runtime_case = [
        c(
            "measure: over memory",
            [*MEASURE, "plan.json"],
            {"small.yaml": GOOD_CLUSTER.replace("4GiB", "1KiB")},
            plan=True,
        ),
        c(
            "measure: unknown schedule",
            [*MEASURE, "p.json"],
            {"small.yaml": GOOD_CLUSTER, "p.json": plan_text(schedule="zigzag")},
        ),
        c(
            "measure: short stage_of_layer",
            [*MEASURE, "p.json"],
            {"small.yaml": GOOD_CLUSTER, "p.json": plan_text(stage_of_layer=[0] * 3)},
        ),
        c(
            "measure: backward edge",
            [*MEASURE, "p.json"],
            {
                "small.yaml": GOOD_CLUSTER,
                "p.json": plan_text(stage_of_layer=[1] + [0] * 6, stage_devices=[["cpu0"], ["cpu1"]]),
            },
        ),
        c(
            "measure: device not in cluster",
            [*MEASURE, "p.json"],
            {"small.yaml": GOOD_CLUSTER, "p.json": plan_text(stage_devices=[["gpu7"]])},
        ),
        c(
            "train: no data folder",
            [*TRAIN, "--dataset", "cifar10", "--data-dir", "nowhere"],
            {"small.yaml": GOOD_CLUSTER},
            plan=True,
        ),
        c(
            "train: corrupt train batch",
            [*TRAIN, "--data-dir", "cifar"],
            {"small.yaml": GOOD_CLUSTER, "cifar": cifar_folder("data_batch_3")},
            plan=True,
        ),
        c(
            "train: malicious train batch",
            [*TRAIN, "--data-dir", "cifar"],
            {"small.yaml": GOOD_CLUSTER, "cifar": malicious_cifar},
            plan=True,
            check=no_marker,
        ),
        c(
            "train: truncated meta file",
            [*TRAIN, "--data-dir", "cifar"],
            {"small.yaml": GOOD_CLUSTER, "cifar": cifar_folder("batches.meta", b"\x80")},
            plan=True,
        ),
        c(
            "train: corrupt fashion-mnist",
            [*TRAIN, "--dataset", "fashion-mnist", "--data-dir", "fm"],
            {"small.yaml": GOOD_CLUSTER, "fm": fashion_folder},
            plan=True,
        ),
        c("train: unknown dataset", [*TRAIN, "--dataset", "imagenet"], {"small.yaml": GOOD_CLUSTER}, plan=True),
    ]
    store_case = [
        c("run in a read-only folder", RUN, read_only=True),
        c("report in a read-only folder", ["report"], read_only=True),
        c("report with no store", ["report"], check=no_store),
        c("report: unknown experiment", ["report", "--experiment", "nosuch"], {"store": empty_store}),
        c("report: store not a database", ["report"], {"mlflow.db": b"this is not sqlite" * 100}),
        c("report: unreachable server", ["report", "--tracking-uri", "http://127.0.0.1:9"]),
        c("report: store folder missing", ["report", "--tracking-uri", "sqlite:///nowhere/mlflow.db"]),
        c("run: unreachable server", [*RUN, "--tracking-uri", "http://127.0.0.1:9"]),
    ]
    return plan_case + cluster_case + option_case + model_case + planner_case + runtime_case + store_case


# --- running a case -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[bool]:
    """Make the empty ``folder`` read-only for the block (see the module's docstring); yields False if it cannot."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield True
        finally:
            folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def prepare(case: Case, folder: Path, shared: Path) -> None:
    folder.mkdir(parents=True)
    if case.plan:
        shutil.copy(shared / "plan.json", folder / "plan.json")
        shutil.copytree(shared / ".tapp", folder / ".tapp")
    for name, content in case.files.items():
        target = folder / name
        if callable(content):
            content(folder)
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                command = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                command = ""
            found.append((child, command))
            todo.append(child)
    return found


def run_case(case: Case, folder: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    started = time.monotonic()
    process = subprocess.Popen(
        [TAPP, *case.args],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    started_mpi = threading.Event()

    def watch() -> None:
        while process.poll() is None:
            if any("mpiexec" in cmd or "tapp_core.runtime.worker" in cmd for _, cmd in descendants(process.pid)):
                started_mpi.set()
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        output, _ = process.communicate(timeout=timeout_s)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        code = None
    watcher.join()
    seconds = time.monotonic() - started
    text = output.decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    problem = case.check(folder) if case.check is not None else None
    first = lines[0] if lines else "(nothing printed)"
    return Outcome(case, code, seconds, first, text, "Traceback" in text, started_mpi.is_set(), problem)


def attempt(case: Case, index: int, root: Path, shared: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    folder = root / f"case{index:02d}"
    prepare(case, folder, shared)
    if not case.read_only:
        return run_case(case, folder, env, timeout_s)
    # plan --out and simulate --gantt write into a read-only sub-folder; run and report work in one.
    target = folder / "ro" if case.args[0] in {"plan", "simulate"} else folder
    target.mkdir(exist_ok=True)
    with read_only(target) as made:
        if not made:
            return Outcome(case, None, 0.0, "", "", False, False, None, skipped="no read-only folder can be made here")
        return run_case(case, folder, env, timeout_s)


def environment(root: Path) -> dict[str, str]:
    tmp = root / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "TAPP_"))}
    env.update(
        TMPDIR=str(tmp),
        PREFECT_HOME=str(root / "prefect-home"),
        TAPP_CACHE_DIR=".tapp",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        COLUMNS="200",
    )
    return env


def shared_files(root: Path, env: dict[str, str]) -> Path:
    """A valid tiny_cnn plan and its cached library, made once with ``tapp plan`` (what some cases copy)."""
    shared = root / "shared"
    shared.mkdir()
    (shared / "plan.json").write_text(plan_text())
    made = subprocess.run(
        [TAPP, "simulate", "--model", "tiny_cnn", "--plan", "plan.json"],
        cwd=shared,
        env=env,
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        raise SystemExit(f"could not make the shared plan's library: {made.stdout}{made.stderr}")
    return shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--only", default="", help="run the cases whose name holds this")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a case is killed")
    parser.add_argument("--slow", type=float, default=30.0, help="a case slower than this is counted")
    parser.add_argument("--show", action="store_true", help="print each case's whole output")
    options = parser.parse_args()
    chosen = [case for case in cases() if options.only in case.name]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tapp-bad-inputs-") as temporary:
        root = Path(temporary)
        env = environment(root)
        shared = shared_files(root, env)
        with ThreadPoolExecutor(options.jobs) as pool:
            futures = [
                pool.submit(attempt, case, i, root, shared, env, options.timeout) for i, case in enumerate(chosen)
            ]
            outcomes = []
            for future in futures:
                outcome = future.result()
                outcomes.append(outcome)
                report(outcome, options.show)
        # torch makes its compiler cache there (torchinductor_USER) when an optimizer first loads: one folder
        # that every torch program shares and reuses, not something a command leaves.
        leftovers = sorted(p.name for p in (root / "tmp").iterdir() if not p.name.startswith("torchinductor_"))
    summarise(outcomes, options.slow, leftovers, time.monotonic() - started)


def report(outcome: Outcome, show: bool = False) -> None:
    if outcome.skipped:
        print(f"{'skip':>4}  {'':>6}  {outcome.case.name:<36} {outcome.skipped}", flush=True)
        return
    code = "kill" if outcome.code is None else str(outcome.code)
    flags = "".join(
        f" [{flag}]"
        for flag, on in (
            ("TRACEBACK", outcome.traceback),
            ("MPI STARTED", outcome.started_mpi),
            (f"expected {outcome.case.expect}", outcome.code != outcome.case.expect),
            (outcome.problem or "", outcome.problem is not None),
        )
        if on
    )
    print(f"{code:>4}  {outcome.seconds:5.1f}s  {outcome.case.name:<36} {outcome.first_line[:150]}{flags}", flush=True)
    if show:
        print("      | " + outcome.output.rstrip().replace("\n", "\n      | "), flush=True)


def summarise(outcomes: list[Outcome], slow_s: float, leftovers: list[str], seconds: float) -> None:
    ran = [o for o in outcomes if not o.skipped]
    user_errors = [o for o in ran if o.case.expect == 2]
    counts = {
        "cases": len(ran),
        "skipped": len(outcomes) - len(ran),
        "tracebacks": sum(o.traceback for o in ran),
        "user errors not exiting 2": sum(o.code != 2 for o in user_errors),
        "other cases not exiting as expected": sum(o.code != o.case.expect for o in ran if o.case.expect != 2),
        "started MPI": sum(o.started_mpi for o in ran),
        "failed checks": sum(o.problem is not None for o in ran),
        f"slower than {slow_s:.0f} s": sum(o.seconds > slow_s for o in ran),
        "leftovers in TMPDIR": len(leftovers),
    }
    print()
    for name, value in counts.items():
        print(f"{name}: {value}")
    if leftovers:
        print("  " + ", ".join(leftovers))
    print(f"wall time: {seconds:.0f} s")
    print(f"tracebacks: {counts['tracebacks']}, non-2 exits for user errors: {counts['user errors not exiting 2']}")


if __name__ == "__main__":
    main()
