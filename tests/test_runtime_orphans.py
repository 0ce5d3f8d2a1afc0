"""Nothing is left behind: `tapp measure` interrupted at any moment (SIGINT, SIGTERM, SIGKILL) leaves no process
(mpiexec, hydra's proxy, ranks) alive 10 s later and no ``tapp-pool-*`` folder in its temporary directory.

Each run gets a private TMPDIR and a marker in its environment, which mpiexec, hydra and every rank inherit: the
test finds the run's processes by that marker, whatever their names.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tapp_core.plan.plan import Plan
from tapp_core.runtime.guard import ProcessId, start_time
from tapp_core.runtime.pool import mpiexec_path
from tapp_core.runtime.temp_folders import OWNER_FILE, PREFIX, make_pool_folder, sweep_pool_folders

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(300)]

TAPP = Path(sys.executable).parent / "tapp"
MARKER = "TAPP_TEST_MARKER"
GONE_WITHIN_S = 10.0


def marked_processes(marker: str) -> dict[int, str]:
    """Every live process whose environment holds ``MARKER=marker``: pid -> command line."""
    needle = f"{MARKER}={marker}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue  # gone, or not ours
    return found


def wait_until_gone(marker: str, within_s: float) -> dict[int, str]:
    deadline = time.monotonic() + within_s
    while (alive := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


class Run:
    """One command started with a private TMPDIR and a marker; interrupted, then checked."""

    def __init__(self, tmp_path: Path, command: list[str]) -> None:
        self.marker = uuid.uuid4().hex
        self.tmpdir = tmp_path / f"tmp-{self.marker[:8]}"
        self.tmpdir.mkdir()
        env = {**os.environ, "TMPDIR": str(self.tmpdir), MARKER: self.marker, "TAPP_CACHE_DIR": str(tmp_path / "cache")}
        self.log = tmp_path / f"stderr-{self.marker[:8]}.txt"
        with self.log.open("wb") as stderr:
            self.process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr)

    def interrupt(self, sig: signal.Signals, after_s: float) -> dict[int, str]:
        """Send ``sig`` ``after_s`` seconds after the start; the run's processes still alive 10 s later."""
        time.sleep(max(0.0, after_s))
        assert self.process.poll() is None, f"the run ended before {after_s} s: {self.log.read_text()[-2000:]}"
        self.process.send_signal(sig)
        alive = wait_until_gone(self.marker, GONE_WITHIN_S)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
        for pid in alive:  # do not leave them to the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return alive

    def pool_folders(self) -> list[Path]:
        return sorted(self.tmpdir.glob(PREFIX + "*"))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = Plan("mlp", 16, 4, "1f1b", (0, 0, 1, 1, 2, 2), (("cpu0",), ("cpu1",), ("cpu2",)))
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def measure_command(plan_file: Path) -> list[str]:
    """A measurement far longer than the test: it is always interrupted."""
    return [str(TAPP), "measure", "-m", "mlp", "-c", "local", "-p", str(plan_file), "--steps", "1000000"]


@pytest.mark.parametrize(
    ("sig", "after_s"),
    [
        (signal.SIGINT, 1),
        (signal.SIGINT, 3),
        (signal.SIGINT, 6),
        (signal.SIGINT, 10),
        (signal.SIGTERM, 4),
        (signal.SIGTERM, 9),
    ],
    ids=["SIGINT@1s", "SIGINT@3s", "SIGINT@6s", "SIGINT@10s", "SIGTERM@4s", "SIGTERM@9s"],
)
def test_an_interrupted_measure_leaves_nothing_behind(
    tmp_path: Path, plan_file: Path, sig: signal.Signals, after_s: float
) -> None:
    run = Run(tmp_path, measure_command(plan_file))
    alive = run.interrupt(sig, after_s)
    assert not alive, f"still alive {GONE_WITHIN_S:.0f} s after {sig.name}: {alive}"
    assert not run.pool_folders(), run.pool_folders()


@pytest.mark.parametrize("after_s", [4, 9], ids=["SIGKILL@4s", "SIGKILL@9s"])
def test_a_killed_measure_leaves_no_process_and_the_next_pool_sweeps_its_folder(
    tmp_path: Path, plan_file: Path, after_s: float
) -> None:
    run = Run(tmp_path, measure_command(plan_file))
    alive = run.interrupt(signal.SIGKILL, after_s)
    assert not alive, f"still alive {GONE_WITHIN_S:.0f} s after SIGKILL: {alive}"
    left = run.pool_folders()  # SIGKILL runs no clean-up: the folder may stay, until the next pool starts
    assert sorted(sweep_pool_folders(run.tmpdir)) == left
    assert not run.pool_folders()


POOL_IN_A_THREAD = textwrap.dedent(
    """
    import threading, time
    from tapp_core.platform.cluster import load_cluster
    from tapp_core.runtime import WorkerPool

    pool = WorkerPool(load_cluster("local"))
    threading.Thread(target=pool.start).start()
    time.sleep(600)
    """
)


@pytest.mark.parametrize("after_s", [3, 9], ids=["SIGKILL@3s", "SIGKILL@9s"])
def test_ranks_die_with_a_killed_process_that_started_its_pool_from_a_thread(tmp_path: Path, after_s: float) -> None:
    """From a thread, mpiexec gets no parent-death signal: the ranks' own guards must end the job."""
    run = Run(tmp_path, [sys.executable, "-c", POOL_IN_A_THREAD])
    alive = run.interrupt(signal.SIGKILL, after_s)
    assert not alive, f"still alive {GONE_WITHIN_S:.0f} s after SIGKILL: {alive}"


# --- ranks that cannot reach their pool end their MPI job ---------------------------------------------------


def rank_command(port: int, start_timeout_s: float) -> list[str]:
    worker = [sys.executable, "-m", "tapp_core.runtime.worker", "--connect", f"127.0.0.1:{port}"]
    return [mpiexec_path(), "-n", "3", *worker, "--start-timeout", str(start_timeout_s)]


def run_ranks_until_they_end(tmp_path: Path, port: int, start_timeout_s: float) -> tuple[int, str, dict[int, str]]:
    """Start three ranks for a pool at ``port``; their exit status, log, and any process of theirs left after."""
    run = Run(tmp_path, rank_command(port, start_timeout_s))
    code = run.process.wait(timeout=120)  # a rank left waiting would hang here, and fail the test
    return code, run.log.read_text(), wait_until_gone(run.marker, GONE_WITHIN_S)


def test_ranks_whose_pool_is_gone_end_their_job(tmp_path: Path) -> None:
    """Rank 0 cannot connect: it aborts the MPI job rather than leave the others waiting (in MPI_Finalize)."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    code, log, alive = run_ranks_until_they_end(tmp_path, port, start_timeout_s=60)
    assert code != 0
    assert "ConnectionRefusedError" in log and "aborting the MPI job" in log, log[-3000:]
    assert not alive, alive


def test_ranks_that_are_not_accepted_within_the_start_timeout_end_their_job(tmp_path: Path) -> None:
    """A port that takes the connection but never answers: the ranks give up at their start timeout."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections wait in its backlog, unanswered
        code, log, alive = run_ranks_until_they_end(tmp_path, silent.getsockname()[1], start_timeout_s=3)
    assert code != 0
    assert "timed out" in log or "start timeout" in log, log[-3000:]
    assert not alive, alive


# --- pool folders and their owners ------------------------------------------------------------------------


def dead_process() -> ProcessId:
    child = subprocess.Popen(["sleep", "0"])
    started = start_time(child.pid)  # it stays readable until the child is reaped
    child.wait()
    return ProcessId(ProcessId.current().boot, child.pid, started or 1)


def test_a_process_is_told_apart_from_a_later_one_with_its_pid() -> None:
    me = ProcessId.current()
    assert ProcessId.decode(me.encode()) == me
    assert me.alive() is True
    assert ProcessId(me.boot, me.pid, me.start + 1).alive() is False  # same pid, another start: not the same process
    assert dead_process().alive() is False
    assert ProcessId("another-host-or-boot", me.pid, me.start).alive() is None


def test_a_killed_process_its_parent_has_not_reaped_is_gone() -> None:
    """A zombie keeps its /proc entry and start time until its parent waits for it: the ranks' guards must not
    take it for their pool's process still running (a parent that reaps late would keep the ranks alive)."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        owner = ProcessId(ProcessId.current().boot, child.pid, start_time(child.pid) or 1)
        assert owner.alive() is True
        child.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.05)
        assert start_time(child.pid) == owner.start and owner.alive() is False  # a zombie, not yet reaped
    finally:
        child.kill()
        child.wait()


def test_the_sweep_removes_only_folders_whose_owner_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    mine = make_pool_folder()
    orphan = make_pool_folder()
    (orphan / OWNER_FILE).write_text(dead_process().encode())
    earlier_boot = make_pool_folder()
    me = ProcessId.current()
    (earlier_boot / OWNER_FILE).write_text(ProcessId("an-earlier-boot", me.pid, me.start).encode())
    unowned = tmp_path / f"{PREFIX}unowned"  # no owner yet (being made, or from an older version): young, kept
    unowned.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"{PREFIX}link").symlink_to(elsewhere)
    assert sorted(sweep_pool_folders(tmp_path)) == sorted([orphan, earlier_boot])
    assert mine.is_dir() and unowned.is_dir() and elsewhere.is_dir()
