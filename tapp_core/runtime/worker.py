"""The per-rank entry point, run under mpiexec with one rank per cluster device (rank i = device i).

    python -m tapp_core.runtime.worker --connect HOST:PORT --cluster cluster.json

Rank 0 connects to the pool in the parent process and coordinates the jobs (``coordinator``); every rank runs
its share of each (``rank``).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from tapp_core.cluster import Cluster
from tapp_core.runtime.coordinator import coordinate, follow
from tapp_core.runtime.emulation import configure_threads
from tapp_core.runtime.jobs import RankInfo, Ready
from tapp_core.runtime.rank import Rank, warm_up
from tapp_core.runtime.wire import send_message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="HOST:PORT of the pool")
    parser.add_argument("--cluster", required=True, help="the cluster as JSON")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <rank pid>` prints where a rank is stuck
    world = MPI.COMM_WORLD
    cluster = Cluster.model_validate_json(Path(args.cluster).read_text())
    if world.Get_size() != len(cluster.devices):
        print(f"worker: {world.Get_size()} ranks for {len(cluster.devices)} devices", file=sys.stderr)
        return 2
    configure_threads(cluster, world.Get_rank())
    warm_up()
    rank = Rank(world, cluster)
    ranks = world.gather(RankInfo(os.getpid(), socket.gethostname(), tuple(sys.argv)), root=0)
    if world.Get_rank() == 0:
        assert ranks is not None  # the gather's root holds every rank's
        host, _, port = args.connect.rpartition(":")
        with socket.create_connection((host, int(port))) as link:
            send_message(link, Ready(tuple(ranks), torch.__version__))
            coordinate(world, rank, link)
    else:
        follow(world, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
