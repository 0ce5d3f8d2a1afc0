"""The per-rank entry point, run under mpiexec with one rank per pool device (rank i runs the pool's device i).

    TAPP_POOL_KEY=<hex> python -m tapp_core.runtime.worker --connect HOST:PORT --owner BOOT/PID/START \\
        --start-timeout SECONDS --pool TOKEN

Every rank first starts its guard (``guard``: it dies with the pool's process), then loads MPI and torch. Rank 0
connects to the pool, proves the pool's key (``wire``) and receives the ``RankSetup`` (the cluster and the pool's
devices), which it hands to every rank; every rank warms up, rank 0 answers ``Ready`` and then coordinates the
jobs (``coordinator``) while every rank runs its share of each (``rank``). A rank that fails aborts the whole MPI
job, so that no rank is left waiting for the others (in ``MPI_Finalize`` or for a job).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

from tapp_core.runtime.guard import ProcessId, RankGuard, boot_id
from tapp_core.runtime.wire import KEY_VARIABLE, Link, connect_pool

if TYPE_CHECKING:
    from mpi4py import MPI

FAILED_EXIT = 4
ABORT_GRACE_S = 0.5
"""Seconds a failed rank waits after writing why, before it aborts the job."""


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="HOST:PORT of the pool")
    parser.add_argument("--owner", default="", help="the pool's process (guard.ProcessId), which the ranks outlive not")
    parser.add_argument("--start-timeout", type=float, default=180.0, help="seconds for the pool to accept rank 0")
    parser.add_argument("--pool", default="", help="the pool's token (it finds its ranks by it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    guard = RankGuard.start(ProcessId.decode(args.owner) if args.owner else None, args.start_timeout)
    key = bytes.fromhex(os.environ.pop(KEY_VARIABLE, ""))  # not handed on to anything this rank starts
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <rank pid>` prints where a rank is stuck
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        serve(world, args, key, guard)
    except BaseException as exc:
        # One write, then a moment before the abort: mpiexec forwards a rank's output asynchronously, and the abort
        # kills its proxies, which could drop all but the first line of the traceback.
        why = f"worker: rank {world.Get_rank()} failed ({exc!r}); aborting the MPI job\n"
        sys.stderr.write(traceback.format_exc() + why)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        world.Abort(FAILED_EXIT)
        return FAILED_EXIT
    return 0


def _quiet_barrier(world: MPI.Intracomm) -> None:
    """A barrier that sleeps between its tests. MPICH's blocking collectives spin: a rank waiting in one for a rank
    that is still starting takes the core that rank needs (a pool of 3 ranks on 2 cores started with 18 s of CPU)."""
    from tapp_core.runtime.transport import poll

    poll([world.Ibarrier()], lambda: None)


def serve(world: MPI.Intracomm, args: argparse.Namespace, key: bytes, guard: RankGuard) -> None:
    """Rank 0 links to the pool and coordinates; the others follow."""
    import torch

    from tapp_core.platform.hosts import configure_threads, pin_rank
    from tapp_core.runtime.allocator import bound_freed_memory
    from tapp_core.runtime.coordinator import coordinate, follow
    from tapp_core.runtime.jobs import RankInfo, RankSetup, Ready
    from tapp_core.runtime.rank import Rank, warm_up

    link: Link | None = None
    setup: RankSetup | None = None
    if world.Get_rank() == 0:
        host, _, port = args.connect.rpartition(":")
        link = connect_pool((host, int(port)), key, args.start_timeout)
        received = link.recv()
        if not isinstance(received, RankSetup):
            raise TypeError(f"the pool sent a {type(received).__name__}, not a RankSetup")
        setup = received
    _quiet_barrier(world)  # the others wait here for rank 0's link to the pool, asleep
    setup = world.bcast(setup, root=0)
    guard.started()
    assert setup is not None  # the broadcast's root holds it
    if world.Get_size() != len(setup.devices):
        raise RuntimeError(f"{world.Get_size()} ranks for the pool's {len(setup.devices)} devices")
    devices = [setup.cluster.device(name) for name in setup.devices]
    own = devices[world.Get_rank()]
    configure_threads(own)
    bounded = own.kind != "cuda" and bound_freed_memory(own.memory)
    pin_rank(devices, world.Get_rank())
    warm_up()
    rank = Rank(world, setup.cluster, setup.devices)
    _quiet_barrier(world)  # and here for the slowest to warm up
    ranks = world.gather(RankInfo(os.getpid(), os.uname().nodename, tuple(sys.argv), boot_id(), bounded), root=0)
    if link is None:
        follow(world, rank)
    else:
        assert ranks is not None  # the gather's root holds every rank's
        try:
            link.send(Ready(tuple(ranks), torch.__version__))
            coordinate(world, rank, link)
        finally:
            link.close()
    _quiet_barrier(world)  # then MPI_Finalize, which waits for every rank too


def finish(code: int) -> None:
    """End the rank: MPI first, then the process without the interpreter's teardown, which frees torch's modules
    one by one (~0.9 s of CPU a rank, on the cores the next pool or the planner needs). Nothing of a rank's is left
    to an exit handler: its files are closed where they are written."""
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    finish(main())
