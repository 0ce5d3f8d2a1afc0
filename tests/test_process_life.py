"""Nothing is left behind, and interrupted work resumes (issue 15), with real ``tapp`` processes.

- ``tapp run`` interrupted with SIGINT, SIGTERM or SIGKILL: no process of it is alive 10 s later (its Prefect
  server included), no run stays RUNNING once the next run has opened the store, and its private temporary
  directory holds nothing of TAPP's. The run after a SIGKILL resumes the killed one (``tapp run --resume last``)
  from the round its search logged.
- Two first runs in an empty folder at once both finish (the store's creation is serialised).
- A TAPP search killed at round k (SIGKILL of ``tapp plan``) and resumed from the command line ends exactly as the
  search that was not interrupted: same plan, same rounds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow import MlflowClient

from reports import schema
from tapp_core.plan.plan import Plan
from tapp_core.planners.tapp.search import CheckpointError, read_checkpoint
from tapp_core.runtime.guard import ProcessId, start_time

TAPP = str(Path(sys.executable).parent / "tapp")
LIBRARY = Path(__file__).resolve().parent.parent / "bench" / "libraries" / "alexnet_b64"
# 4 plans a search round: the rounds these tests wait for come sooner
RUN = ["run", "--model", "tiny_cnn", "--estimate-only", "--methods", "tapp,even", "--samples-per-round", "4", "-v"]
GONE_WITHIN_S = 10.0
TORCH_CACHE = "torchinductor_"
"""torch's compiler cache (``/tmp/torchinductor_USER``), made by torch when the optimizer first loads: one shared
folder that every torch program reuses, not something a TAPP run leaves."""


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Prefect home for the module's runs: a new one migrates its database on the first start."""
    return tmp_path_factory.mktemp("prefect-home")


def environment(tmp: Path, prefect_home: Path) -> dict[str, str]:
    """This session's environment without its MLflow, Prefect and TAPP settings, but with the suite's ideal cost
    model (``conftest``): measuring a calibration (``tapp plan``'s on first use) is none of these tests' business."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API", "TAPP_"))}
    tmp.mkdir(exist_ok=True)
    return env | {
        "TAPP_NO_CALIBRATE": "1",
        "TMPDIR": str(tmp),
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "COLUMNS": "200",
    }


class Command:
    """A ``tapp`` command in the background, its output collected as it comes."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [TAPP, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.process.poll() is None, f"the command ended early:\n{self.output[-3000:]}"
            assert time.monotonic() < deadline, f"timed out:\n{self.output[-3000:]}"
            time.sleep(0.05)

    def finish(self, timeout_s: float = 600) -> int:
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code


def descendants(root: int) -> list[ProcessId]:
    """Every process below ``root``, as ``ProcessId`` (so that a reused pid does not count as alive)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            started = start_time(child)
            if started is not None:
                found.append(ProcessId(ProcessId.current().boot, child, started))
            todo.append(child)
    return found


def statuses(store: Path) -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return {run.info.run_id: run.info.status for run in client.search_runs(experiments, max_results=1000)}


def tapp_entries(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith(TORCH_CACHE))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_an_interrupted_run_ends_its_runs_and_leaves_no_process_or_folder(
    tmp_path: Path, prefect_home: Path, signum: signal.Signals
) -> None:
    env = environment(tmp_path / "tmp", prefect_home)
    command = Command([*RUN, "--rounds", "400"], tmp_path, env)
    family = _interrupt(command, signum, "search rounds 3/400")  # TAPP's own progress line
    assert command.finish(timeout_s=120) in {signal.SIGINT: {1, 130}, signal.SIGTERM: {143}}[signum], command.output
    assert alive_after(family, GONE_WITHIN_S) == []
    left = statuses(tmp_path)
    assert "KILLED" in left.values() and set(left.values()) <= {"FINISHED", "KILLED"}
    assert tapp_entries(tmp_path / "tmp") == []


def alive_after(family: list[ProcessId], within_s: float) -> list[int]:
    """The pids of ``family`` still alive ``within_s`` seconds from now (returns as soon as none is)."""
    deadline = time.monotonic() + within_s
    while (alive := [p.pid for p in family if p.alive()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _interrupt(command: Command, signum: signal.Signals, when: str) -> list[ProcessId]:
    """Send ``signum`` once the output says ``when``; returns the processes the command had started by then (its
    Prefect server among them)."""
    command.wait_for(lambda: when in command.output)
    family = descendants(command.process.pid)
    assert any("uvicorn" in Path(f"/proc/{p.pid}/cmdline").read_text(errors="replace") for p in family)
    command.process.send_signal(signum)
    return family


@pytest.mark.slow
def test_a_killed_run_is_failed_by_the_next_which_resumes_it(tmp_path: Path, prefect_home: Path) -> None:
    env = environment(tmp_path / "tmp", prefect_home)
    killed = Command([*RUN, "--rounds", "24", "--seed", "5"], tmp_path, env)
    family = _interrupt(killed, signal.SIGKILL, "search rounds 8/24")
    assert killed.finish() == -signal.SIGKILL
    assert alive_after(family, GONE_WITHIN_S) == []
    running = sorted(run for run, status in statuses(tmp_path).items() if status == "RUNNING")
    assert running  # a process killed outright cannot end its runs: the next run does

    resumed = Command(["run", "--resume", "last", "--verbose"], tmp_path, env)
    assert resumed.finish() == 0, resumed.output[-3000:]
    assert f"marked {len(running)} run(s) FAILED" in resumed.output
    now = statuses(tmp_path)
    assert "RUNNING" not in now.values() and all(now[run] == "FAILED" for run in running)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    reason = client.get_run(running[0]).data.tags[schema.ERROR]
    assert f"its process {killed.process.pid} on" in reason and "is gone" in reason
    assert tapp_entries(tmp_path / "tmp") == []  # the search folder SIGKILL left was swept

    (experiment,) = [e.experiment_id for e in client.search_experiments() if e.name == "tapp"]
    parents = client.search_runs([experiment], f"tags.{schema.KIND} = '{schema.EXPERIMENT}'", order_by=["start_time"])
    assert [p.info.status for p in parents] == ["FAILED", "FINISHED"]
    assert parents[1].data.tags["resumed_from"] == parents[0].info.run_id
    assert parents[1].data.params["seed"] == "5" and parents[1].data.params["search_rounds"] == "24"
    query = f"tags.{schema.EXPERIMENT_RUN} = '{parents[1].info.run_id}' and tags.{schema.STAGE} = 'search'"
    (search,) = client.search_runs([experiment], query)
    resumed_at = int(search.data.params["resumed_at_round"])
    assert 8 <= resumed_at < 24
    assert min(m.step for m in client.get_metric_history(search.info.run_id, "reward_mean")) == resumed_at + 1


@pytest.mark.slow
def test_two_first_runs_in_an_empty_folder_both_finish(tmp_path: Path, prefect_home: Path) -> None:
    env = environment(tmp_path / "tmp", prefect_home)
    both = [Command([*RUN, "--rounds", "2", "--out", f"out{i}"], tmp_path, env) for i in range(2)]
    codes = [command.finish() for command in both]
    assert codes == [0, 0], "\n\n".join(command.output[-3000:] for command in both)
    assert list(statuses(tmp_path).values()).count("FINISHED") >= 2 * 6  # two parents with their stages


def _round_of(checkpoint: Path) -> int:
    try:
        return int(read_checkpoint(checkpoint)["round"])
    except CheckpointError:
        return 0  # not written yet


@pytest.mark.slow
def test_a_search_killed_at_round_k_and_resumed_gives_the_uninterrupted_plan(tmp_path: Path) -> None:
    plan = ["plan", "--model", "alexnet", "--library", str(LIBRARY), "--cluster", "hetero4", "--planner", "tapp"]
    plan += ["--rounds", "8", "--seed", "3"]  # within the search's default time limit, even on a loaded host
    env = environment(tmp_path / "tmp", tmp_path / "prefect")

    whole = Command([*plan, "--checkpoint", "whole", "--out", "whole.json"], tmp_path, env)
    assert whole.finish() == 0, whole.output

    killed = Command([*plan, "--checkpoint", "cut", "--out", "cut.json"], tmp_path, env)
    killed.wait_for(lambda: _round_of(tmp_path / "cut" / "search.pt") >= 3)
    killed.process.kill()
    assert killed.finish() == -signal.SIGKILL
    cut_at = _round_of(tmp_path / "cut" / "search.pt")
    assert 3 <= cut_at < 8 and not (tmp_path / "cut.json").exists()

    resume = ["plan", "--model", "alexnet", "--library", str(LIBRARY), "--cluster", "hetero4", "--planner", "tapp"]
    resumed = Command([*resume, "--checkpoint", "cut", "--resume", "--out", "cut.json"], tmp_path, env)
    assert resumed.finish() == 0, resumed.output
    first, second = Plan.load(tmp_path / "whole.json"), Plan.load(tmp_path / "cut.json")
    assert second == first and second.notes["rounds"] == 8
    rounds = [read_checkpoint(tmp_path / name / "search.pt")["history"] for name in ("whole", "cut")]
    shown = ("mean_reward", "entropy", "best_step_time_s", "evaluations")
    assert [[r[k] for k in shown] for r in rounds[0]] == [[r[k] for k in shown] for r in rounds[1]]
