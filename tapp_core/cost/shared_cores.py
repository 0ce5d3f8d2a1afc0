"""The shared-core fixed point: where a host's ranks want more threads than it has cores, each compute operation
lasts what its work takes at the pace the other operations computing at the same time leave it
(``tapp_core.cost.formulas.sharing_stretch``). Those durations and the timeline depend on each other, so the
simulation is repeated until they settle (``settle_sharing``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np

from tapp_core.cost.calibration import KindCalibration
from tapp_core.cost.estimate import COMPUTE_KINDS, UPDATE
from tapp_core.cost.formulas import DeviceTerms, SharedHost, sharing_excess, sharing_stretch

OpKey = tuple[int, str, int]
"""(device, kind, global micro-batch or iteration): one operation of a simulation."""


Record = tuple[int, str, float, float, int, int]
"""(device, kind, start, end, global micro-batch or iteration, peer device or bucket or NO_PEER): a TimelineOp in
the making, kept as a plain tuple because building thousands of frozen dataclasses would dominate the run time."""


class Simulated(Protocol):
    """A finished simulation, as the fixed point reads it."""

    @property
    def records(self) -> Sequence[Record]: ...


class Replica(Protocol):
    """A simulated device, as the fixed point reads it."""

    @property
    def device(self) -> str: ...

    @property
    def duration(self) -> Mapping[str, float]: ...

    @property
    def update_s(self) -> float: ...


_Run = TypeVar("_Run", bound=Simulated)

SHARING_ROUNDS = 32
SHARING_TOLERANCE = 1e-4
"""The operations' shared-core durations have settled when none changes by more than this share in a round."""


def settle_sharing(
    run: Callable[[Mapping[OpKey, float]], _Run],
    replicas: Sequence[Replica],
    hosts: Sequence[SharedHost],
    terms: Mapping[str, DeviceTerms],
) -> _Run:
    """Simulate with every compute operation on a shared host lasting what its work takes at the pace the other
    replicas' operations leave it (``formulas.sharing_stretch``), until the durations settle: they are a fixed point,
    since an operation that lasts longer overlaps others more. Each round takes the durations the last timeline
    implies; once a round changes them more than the round before (the iteration oscillates), each round moves
    only half way."""
    durations: dict[OpKey, float] = {}
    simulation = run(durations)
    step, last_change = 1.0, math.inf
    for _ in range(SHARING_ROUNDS):
        implied = _shared_durations(simulation.records, replicas, hosts, terms)
        change = max(
            (abs(seconds / durations[key] - 1.0) if key in durations else math.inf for key, seconds in implied.items()),
            default=0.0,
        )
        if change <= SHARING_TOLERANCE:
            break
        if change > last_change:
            step = 0.5
        last_change = change
        durations = {
            key: durations.get(key, seconds) + step * (seconds - durations.get(key, seconds))
            for key, seconds in implied.items()
        }
        simulation = run(durations)
    return simulation


def _shared_durations(
    records: Sequence[Record],
    replicas: Sequence[Replica],
    hosts: Sequence[SharedHost],
    terms: Mapping[str, DeviceTerms],
) -> dict[OpKey, float]:
    """Per compute operation of a replica on a shared host, from when it started in ``records``: how long its
    work takes while the other replicas' operations compute as they did there."""
    durations: dict[OpKey, float] = {}
    for host in hosts:
        ops = [
            (r, kind, start, end, number)
            for r, kind, start, end, number, _ in records
            if kind in COMPUTE_KINDS and end > start and replicas[r].device in host.threads
        ]
        for r in sorted({op[0] for op in ops}):
            replica = replicas[r]
            others = [(host.threads[replicas[o[0]].device], o[2], o[3]) for o in ops if o[0] != r]
            pace = _Pace(others, host.threads[replica.device], host, terms[replica.device].figures)
            for _, kind, start, _, number in (op for op in ops if op[0] == r):
                work = replica.update_s if kind == UPDATE else replica.duration[kind]
                durations[(r, kind, number)] = pace.finish(start, work) - start
    return durations


class _Pace:
    """How fast one replica's work progresses on its shared host while other replicas' operations compute:
    ``progress`` is the work (in seconds alone) it could have done from the first of ``times`` to each. Before
    the first and after the last of the others' operations it computes as alone (``sharing_excess`` 0)."""

    def __init__(
        self, others: Sequence[tuple[int, float, float]], own: int, host: SharedHost, figures: KindCalibration
    ) -> None:
        """``others``: (threads, start, end) of the other replicas' operations; ``own``: this replica's threads."""
        if not others:
            self.times = self.progress = np.zeros(1)
            return
        table = np.array(others, dtype=float)
        threads = table[:, 0]
        times = np.concatenate([table[:, 1], table[:, 2]])
        order = np.argsort(times, kind="stable")
        self.times = times[order]
        active = own + np.cumsum(np.concatenate([threads, np.negative(threads)])[order])[:-1]
        rate = 1.0 / sharing_stretch(figures, sharing_excess(active, own, host))
        self.progress = np.concatenate([[0.0], np.cumsum(rate * np.diff(self.times))])

    def finish(self, start: float, work: float) -> float:
        """When work of ``work`` seconds alone, started at ``start``, is done."""
        times, progress = self.times, self.progress
        if start <= times[0]:
            target = progress[0] - (times[0] - start) + work
        elif start >= times[-1]:
            target = progress[-1] + (start - times[-1]) + work
        else:
            target = np.interp(start, times, progress) + work
        if target <= progress[0]:
            return float(times[0] - (progress[0] - target))
        if target >= progress[-1]:
            return float(times[-1] + (target - progress[-1]))
        return float(np.interp(target, progress, times))
