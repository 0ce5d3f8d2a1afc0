"""MPI's progress while a rank computes (``tapp_core.runtime.progress``): a large send posted before a long compute
or a gradient allreduce started before it reach the other rank during the compute, not after it, whether the
compute runs modules (poked from their hooks) or none (an optimiser's step, poked from a thread beside it).

The MPI test forces MPICH's network path on this one host (``MPIR_CVAR_NOLOCAL=1``: no shared memory between the
ranks), where a large message goes by rendezvous, as between two hosts. Without the pokes it shows the defect
they mend: the receive waits for the sender's whole compute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tapp_core.paths import PROJECT_ROOT
from tapp_core.runtime.pool import mpiexec_path
from tapp_core.runtime.progress import Pacer, progress_during


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_a_pacer_pokes_at_most_once_per_interval() -> None:
    counter = Counter()
    slow = Pacer(counter, interval_s=3600.0)
    for _ in range(100):
        slow()
    assert counter.calls == 1
    every = Pacer(counter, interval_s=0.0)
    for _ in range(5):
        every()
    assert counter.calls == 6


def test_computes_under_progress_during_poke_in_every_forward_and_backward_and_not_after() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 2))
    counter = Counter()
    pacer = Pacer(counter, interval_s=0.0)
    with progress_during(pacer):
        loss = model(torch.randn(3, 4)).sum()
    after_forward = counter.calls
    assert after_forward >= 3  # each layer's and the container's forward
    with progress_during(pacer):
        loss.backward()
    assert counter.calls >= after_forward + 2  # the gradients of the layers' outputs
    assert model[0].weight.grad is not None
    done = counter.calls
    model(torch.randn(3, 4)).sum().backward()
    assert counter.calls == done
    with torch.no_grad(), progress_during(pacer):
        model(torch.randn(3, 4))
    assert counter.calls > done


RANKS = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np, torch
    from mpi4py import MPI
    from tapp_core.runtime.emulation import Emulation
    from tapp_core.runtime.progress import Pacer, progress_beside, progress_during
    from tapp_core.runtime.transport import Control, Transport

    how, compute_s, what = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    world = MPI.COMM_WORLD
    data, headers = world.Dup(), world.Dup()
    transport = Transport(data, headers, world, Control(data, time.monotonic() + 120.0), Emulation(enabled=False))
    tensor = torch.ones(4 * 1024 * 1024)  # 16 MiB: far above any eager limit
    world.Barrier()
    start = time.monotonic()
    me = world.Get_rank()
    if what == "reduce":
        reductions = [transport.start_allreduce(tensor, world, [1 - me])]
    if me == 0:
        if what == "send":
            transport.isend(tensor, 1, 7)
        layer, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
        if how == "beside":  # no module runs: an optimiser's step
            with progress_beside(transport.poke):
                while time.monotonic() - start < compute_s:
                    torch.mm(x, layer.weight)
        while time.monotonic() - start < compute_s:
            if how == "during":
                with progress_during(Pacer(transport.poke)):
                    layer(x)
            else:
                layer(x)
        transport.flush()
    elif what == "send":
        transport.wait([transport.irecv(torch.empty_like(tensor), 0, 7)])
    if what == "reduce":
        transport.finish_reductions(reductions)
        assert torch.equal(tensor, torch.full_like(tensor, 2.0))
    if me == 1:
        print(json.dumps({"received_s": time.monotonic() - start}), flush=True)
    """
)


def received_after(tmp_path: Path, what: str, how: str, compute_s: float) -> float:
    """When rank 1 had rank 0's data (``what``: a send, or both ranks' allreduce), rank 0 computing ``compute_s``
    after posting its part: ``how`` still (no pokes), during (``progress_during``) or beside (``progress_beside``)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {**os.environ, "MPIR_CVAR_NOLOCAL": "1", "PYTHONPATH": str(PROJECT_ROOT)}
    mode = [how, str(compute_s), what]
    command = [mpiexec_path(), "-n", "2", sys.executable, str(script), *mode]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(json.loads(done.stdout.strip().splitlines()[-1])["received_s"])


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("what", "how"), [("send", "during"), ("reduce", "during"), ("send", "beside")])
def test_a_large_transfer_reaches_its_peer_while_its_sender_computes(tmp_path: Path, what: str, how: str) -> None:
    compute_s = 1.5
    if how == "during":
        assert received_after(tmp_path, what, "still", compute_s) >= 0.9 * compute_s  # the defect, shown
    assert received_after(tmp_path, what, how, compute_s) < 0.5 * compute_s
