"""The pool's watch of its ranks on this machine: the first to end, seen as it ended (real processes, no MPI)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tapp_core.runtime.faults import witness
from tapp_core.runtime.rank_watch import RankWatch
from tests.test_runtime_faults import CLUSTER, HYDRA, RANKS


@contextmanager
def sleepers(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    processes = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def wait_for(watch: RankWatch, timeout_s: float = 10.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    while watch.first is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return watch.first


def test_the_rank_that_ends_alone_is_seen_first() -> None:
    with sleepers(3) as processes:
        watch = RankWatch([p.pid for p in processes], lambda pid: True)
        try:
            time.sleep(0.2)
            assert watch.first is None
            processes[1].kill()
            assert wait_for(watch) == 1
            processes[0].kill()
            processes[2].kill()
            time.sleep(0.2)
            assert watch.first == 1  # the first stays the first
        finally:
            watch.close()


def test_ranks_not_ours_or_not_here_are_not_watched() -> None:
    with sleepers(2) as processes:
        watch = RankWatch([None, processes[1].pid], lambda pid: pid != processes[1].pid)
        try:
            processes[1].kill()
            assert wait_for(watch, 1.0) is None
        finally:
            watch.close()


def test_a_watch_closed_before_any_end_names_nobody() -> None:
    with sleepers(1) as processes:
        watch = RankWatch([processes[0].pid], lambda pid: True)
        watch.close()
        processes[0].kill()
        time.sleep(0.2)
        assert watch.first is None


def test_the_rank_seen_first_is_believed_before_hydra() -> None:
    # Hydra names rank 1 (pid 202); the pool saw rank 0 end first.
    fault = witness(HYDRA, RANKS, CLUSTER.model_copy(update={"ssh": "true"}), ("a", "b"), seen_first=0)
    assert fault.devices == ("a",)
    assert fault.report == "\nrank 0 (a on host 10.9.0.10) ended first (seen ending by the pool)"
    assert witness(HYDRA, RANKS, CLUSTER.model_copy(update={"ssh": "true"}), ("a", "b")).devices == ("b",)
