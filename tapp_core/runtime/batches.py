"""Mini-batches for the engine, by step number. Every rank that reads data builds the same source, so the
ranks of a plan see the same batches without sending them (only stages that read the input or the labels do).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from tapp_core.model.workload import TensorSpec, Workload
from tapp_core.model.zoo import INPUT_SHAPE
from tapp_core.platform import gpu

IGNORED_LABEL = -1
"""Label of padding samples: ignored by the loss and by accuracy."""


class BatchSource(Protocol):
    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The mini-batch of ``step``: the workload's feed (B, ...) and its targets (B, ...), on the CPU."""
        ...


class SyntheticBatches:
    """Random inputs and targets of a workload (``Workload.batch``; without one, images of ``input_shape`` and
    labels of ``num_classes`` classes), a pure function of (seed, step): for timing and for correctness tests."""

    def __init__(
        self,
        batch_size: int,
        seed: int = 0,
        input_shape: Sequence[int] = INPUT_SHAPE,
        num_classes: int = 10,
        workload: Workload | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.seed = seed
        self.workload = workload or Workload(
            "synthetic", inputs=(TensorSpec(tuple(input_shape)),), target=TensorSpec((), "int64", high=num_classes)
        )
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Every micro-batch of a step asks; the few steps in flight stay cached.
        if step not in self._cache:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            self._cache[step] = self.workload.batch(self.batch_size, generator)
            self._cache.pop(step - 8, None)
        return self._cache[step]


class DeviceBatches:
    """The batches of ``source`` on a GPU, each made ready while the steps before it run.

    A host thread asks ``source`` for the next steps' batches (``depth`` ahead), pins them and copies them to
    ``device`` on a side stream; ``get`` makes the current stream wait for that copy (on the GPU, not on the
    host). So neither making a batch nor copying it is on a step's critical path, and the values are the
    source's own: a GPU rank sees the same batches as a CPU rank. Without ``inputs`` (a last stage that reads
    only the labels) the inputs stay on the host. Steps must be asked for in increasing order (each as often as
    wanted), below ``steps``. ``close`` stops the thread.
    """

    def __init__(
        self, source: BatchSource, device: torch.device, steps: int, inputs: bool = True, depth: int = 2
    ) -> None:
        self.source = source
        self.device = device
        self.steps = steps
        self.inputs = inputs
        self.depth = depth
        self._stream = gpu.new_stream(device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tapp-batches")
        self._loading: dict[int, Future[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]]] = {}
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._next = 0

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step not in self._ready:
            self._prefetch(step)
            x, y, copied = self._loading.pop(step).result()
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)
            for tensor in (x, y) if self.inputs else (y,):
                tensor.record_stream(current)  # allocated on the side stream, used (and freed) on this one
            self._ready[step] = (x, y)
            self._ready.pop(step - 8, None)
        self._prefetch(step + self.depth)
        return self._ready[step]

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._loading.clear()

    def _prefetch(self, last: int) -> None:
        """Start loading every step up to ``last`` not started yet (in order: the source may be an iterator)."""
        while self._next <= min(last, self.steps - 1):
            self._loading[self._next] = self._executor.submit(self._load, self._next)
            self._next += 1

    def _load(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        x, y = self.source.get(step)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            # The pinned copies may be freed at once: the host allocator keeps them until the copies are done.
            if self.inputs:
                x = x.pin_memory().to(self.device, non_blocking=True)
            y = y.pin_memory().to(self.device, non_blocking=True)
            copied = gpu.recorded_event(stream=self._stream)
        return x, y, copied


class IteratorBatches:
    """The batches of an iterable in order (a data loader), padded to ``batch_size`` with ignored samples.

    Steps must be asked for in increasing order, give or take the few a pipeline keeps in flight.
    """

    def __init__(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], batch_size: int, keep: int = 64) -> None:
        self._iterator: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(batches)
        self.batch_size = batch_size
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._next = 0
        self._keep = keep

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        while self._next <= step:
            x, y = next(self._iterator)
            self._cache[self._next] = pad_batch(x, y, self.batch_size)
            self._cache.pop(self._next - self._keep, None)
            self._next += 1
        return self._cache[step]


def pad_batch(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    missing = batch_size - x.shape[0]
    if missing <= 0:
        return x, y
    x = torch.cat([x, x.new_zeros(missing, *x.shape[1:])])
    y = torch.cat([y, y.new_full((missing, *y.shape[1:]), IGNORED_LABEL)])
    return x, y
