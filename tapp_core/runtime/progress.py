"""MPI's progress while a rank computes.

Between hosts MPI moves a large message by rendezvous: its data goes only while both of its ranks call into MPI. A
rank that posts a send and then computes for seconds holds the transfer, and its receiver waits, until that compute
ends; a pipeline whose stages each send while computing the next micro-batch then runs nearly one stage at a time
(Inception-V3's asynchronous plan on the testbed of ``hetero4`` waited 4.2 s of each 9.8 s step so; driving MPI's
progress from inside the computes, as here, it waited 0.6 s of 4.7). On one host MPI's shared memory needs no
such help, which is why the emulated clusters (one host each) never showed it, and why their emulated sleeps do not
poke.

``progress_during(pacer)`` calls its ``Pacer``'s poke (``Transport.poke``: tests of the rank's pending transfers)
from inside the forwards and backwards run under it: after every module's forward, and in the backward as each
module's output gets its gradient, at most once per ``PROGRESS_INTERVAL_S``. The engine runs every forward and
backward so. An optimiser's step runs no module: ``progress_beside(poke)`` pokes from a thread of its own every
``PROGRESS_INTERVAL_S`` while it runs (the rank's thread, in torch's kernels, does not touch the transport then).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

PROGRESS_INTERVAL_S = 0.002
"""The least time between two pokes while a rank computes: far below a 16 MiB transfer's time on a
gigabit link (130 ms), far above a test's cost (microseconds)."""


class Pacer:
    """``poke`` called at most once per ``interval_s`` however often the pacer is."""

    def __init__(self, poke: Callable[[], None], interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.poke = poke
        self.interval_s = interval_s
        self._last = -math.inf  # the first call pokes, however long this host has been up

    def __call__(self) -> None:
        t = time.perf_counter()
        if t - self._last >= self.interval_s:
            self._last = t
            self.poke()


@contextlib.contextmanager
def progress_during(pacer: Pacer) -> Iterator[None]:
    """Call ``pacer`` after every module's forward run in this block and, for each such output that needs a gradient,
    when the backward of the operation that made it has run, in a backward run in it; both in this thread only (a
    GPU's backward runs on autograd's own threads, which must not call into this rank's MPI: there the host waits
    for the GPU, unpoked, at the end of the compute)."""
    owner = threading.get_ident()

    def on_gradient(_inputs: Sequence[torch.Tensor | None], _outputs: Sequence[torch.Tensor | None]) -> None:
        if threading.get_ident() == owner:
            pacer()

    def after_forward(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        if threading.get_ident() != owner:
            return
        pacer()
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            output.grad_fn.register_hook(on_gradient)

    handle = torch.nn.modules.module.register_module_forward_hook(after_forward)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def progress_beside(poke: Callable[[], None]) -> Iterator[None]:
    """Call ``poke`` every ``PROGRESS_INTERVAL_S`` from a thread of its own while the block runs. Only for a block that
    calls no MPI and leaves the transport alone (an optimiser's step): the thread is the transport's only user then.
    """
    stop = threading.Event()

    def keep_poking() -> None:
        while not stop.wait(PROGRESS_INTERVAL_S):
            poke()

    thread = threading.Thread(target=keep_poking, name="tapp-mpi-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
