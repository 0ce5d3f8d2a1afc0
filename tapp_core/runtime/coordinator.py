"""How the ranks share jobs: rank 0 takes each job from the pool, hands it to the other ranks, runs its own share,
gathers every rank's result and answers the pool with one Reply; the other ranks follow.

A rank that does not answer within the job's time limit (plus a grace period) makes rank 0 ask the pool for a
restart. If the pool's link closes, rank 0 takes every rank down with it: between jobs with a StopJob, during one
by aborting the MPI job.
"""

from __future__ import annotations

import select
import sys
import threading
import time
from collections.abc import Sequence

from mpi4py import MPI

from tapp_core.runtime.emulation import now
from tapp_core.runtime.faults import rank_name
from tapp_core.runtime.jobs import JOB_TYPES, Job, StopJob, WorkJob
from tapp_core.runtime.rank import Rank, describe
from tapp_core.runtime.results import RankResult, Reply, assemble_reply
from tapp_core.runtime.transport import doze, poll
from tapp_core.runtime.wire import ConnectionClosed, Link

JOB_TAG = 11
RESULT_TAG = 12
RESULT_GRACE_S = 5.0
"""How long past a job's time limit rank 0 waits for the other ranks before it asks for a restart."""
_IDLE_POLL_S = 0.5e-3
_IDLE_POLL_MAX_S = 20e-3
"""A rank waiting for its next job, or rank 0 for the others' results, sleeps between probes as a transfer's wait
does (``transport.doze``), within these bounds: a job handed out right after the last starts at once, and an idle pool
(between searches, beside a planner or another pool on the same cores) costs its host ~1 % of a core rather than
~15 % (a pool of 3 ranks, measured)."""


def _reply(job: WorkJob, results: Sequence[RankResult], silent: Sequence[int], rank: Rank) -> Reply:
    if silent:
        names = ", ".join(rank_name(rank.cluster, rank.devices, r) for r in silent)
        error = f"{names} did not finish the plan within its time limit"
        return Reply(id=job.id, restart=True, error=error)
    try:
        return assemble_reply(job, results)
    except Exception as exc:
        return Reply(id=job.id, error=f"assembling the results failed: {describe(exc)}")


def _next_job(link: Link) -> Job:
    try:
        job = link.recv()
    except (ConnectionClosed, OSError):
        return StopJob()  # the pool's process is gone: take every rank down with us
    if not isinstance(job, JOB_TYPES):
        raise TypeError(f"the pool sent a {type(job).__name__}, not a job")
    return job


def _wait_for_job(world: MPI.Intracomm) -> Job:
    start = time.perf_counter()
    while True:
        message = world.improbe(source=0, tag=JOB_TAG)
        if message is not None:
            job: Job = message.recv()
            return job
        doze(start, _IDLE_POLL_S, _IDLE_POLL_MAX_S)


def _collect(world: MPI.Intracomm, job: WorkJob, own: RankResult) -> tuple[list[RankResult], list[int]]:
    """Every rank's result for ``job``; also the ranks that did not answer in time."""
    results = {0: own}
    deadline = now() + job.timeout_s + RESULT_GRACE_S
    waiting = set(range(1, world.Get_size()))
    start = time.perf_counter()
    while waiting and now() < deadline:
        for rank in sorted(waiting):
            message = world.improbe(source=rank, tag=RESULT_TAG)
            if message is None:
                continue
            result: RankResult = message.recv()
            if result.job == job.id:  # answers to an earlier, abandoned job are dropped
                results[rank] = result
                waiting.discard(rank)
        if waiting:
            doze(start, _IDLE_POLL_S, _IDLE_POLL_MAX_S)
    return [results[r] for r in sorted(results)], sorted(waiting)


def _send_all(world: MPI.Intracomm, job: Job) -> None:
    requests = [world.isend(job, rank, JOB_TAG) for rank in range(1, world.Get_size())]
    poll(requests, lambda: None)


def _watch_pool(link: Link, busy: threading.Event) -> None:
    """Abort the whole MPI job if the pool's link closes while a job runs (no orphaned ranks)."""
    while True:
        readable, _, _ = select.select([link], [], [], 0.5)
        if not readable:
            continue
        if busy.is_set() and link.peer_gone():
            print("worker: the pool's link closed during a job; aborting the MPI job", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(3)
        time.sleep(0.05)  # a message or a closed link between jobs: the main thread reads it


def coordinate(world: MPI.Intracomm, rank: Rank, link: Link) -> None:
    """Rank 0: serve the pool's jobs until it sends a StopJob or goes away."""
    busy = threading.Event()
    threading.Thread(target=_watch_pool, args=(link, busy), daemon=True).start()
    while True:
        job = _next_job(link)
        _send_all(world, job)
        if isinstance(job, StopJob):
            return
        busy.set()
        own = rank.run(job)
        results, silent = _collect(world, job, own)
        busy.clear()
        link.send(_reply(job, results, silent, rank))


def follow(world: MPI.Intracomm, rank: Rank) -> None:
    """Every other rank: run each job rank 0 hands out and send it the result, until a StopJob."""
    while True:
        job = _wait_for_job(world)
        if isinstance(job, StopJob):
            return
        result = rank.run(job)
        poll([world.isend(result, 0, RESULT_TAG)], lambda: None)
