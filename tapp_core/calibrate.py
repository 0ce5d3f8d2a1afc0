"""``tapp calibrate``: the cost model's calibration, measured on the machine itself with short runs.

For a cluster and the layer libraries of its kinds (``ProfileCache.cluster_libraries``), ``calibrate``:

1. runs ``tapp_core.runtime.probe`` on the cluster's ranks (one mpiexec job, one rank per device): per kind,
   the optimiser's step (a fixed part and a part per parameter byte) and, on a GPU, the staging copies to and
   from pinned host memory (fixed part per copy, part per byte each way); per pair of ranks, the one-way time of
   one message through the runtime's transport, over the cluster's emulated links when it is emulated; and, on a
   real cluster whose ranks want more threads than this host has cores, each kind's step of the model while every
   rank computes at once against its step alone (``KindCalibration.shared_cores_factor``, with ``host_cores``);
2. measures, on the worker pool with emulation off, three single-device plans on the first device of every kind
   (the batch in 1 and in ``MICRO_BATCHES`` micro-batches, a quarter of it in 1) and fits the kind's compute
   scale against its library, its fixed cost per operation and its fixed cost per step (``fit_compute``);
3. returns a ``Calibration`` with those figures per kind and the per-message cost, recording what it was made
   for (``costs.MadeFor``), so that it is refused on another machine or library
   (``tapp_core.calibration``).

The cost model multiplies a device's compute and update by its slowdown where its ``speed`` applies
(``tapp_core.kinds``). Measured with emulation off, a kind's figures are what the kind does itself, so where the
cluster is not emulated and a device's ``speed`` still applies (its kind costed from another kind's library) they
are stored divided by that slowdown; on an emulated cluster the slowdown is the emulation's, on top of the kind.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from tapp_core.calibration import ProbeResult, SharingProbe
from tapp_core.cluster import Cluster
from tapp_core.costs import (
    DEFAULT_CALIBRATION,
    Calibration,
    KindCalibration,
    MadeFor,
    device_terms,
    shared_hosts,
    transfer_s,
)
from tapp_core.errors import TappError
from tapp_core.hosts import host_cpus
from tapp_core.kinds import cluster_kinds, device_kind
from tapp_core.library import PROFILE_VERSION, LayerLibrary
from tapp_core.metrics import DEFAULT_WARMUP, MIN_STEPS
from tapp_core.plan import single_stage_plan
from tapp_core.runtime.pool import PROJECT_ROOT, WorkerPool, mpiexec_command

MICRO_BATCHES = 8
"""A plan with this many micro-batches times the fixed cost of an operation (it has that many more)."""
SMALL_BATCH_DIVISOR = 4
"""A plan at this fraction of the batch times the compute per sample."""


class CalibrationRunError(TappError):
    """A calibration run that failed; the message says which and why."""


@dataclass(frozen=True)
class StepPoint:
    """One single-device plan, measured: its batch size, micro-batch count and median step time."""

    batch_size: int
    micro_batches: int
    step_s: float


@dataclass(frozen=True)
class KindSteps:
    """One kind's single-device plans on its first device."""

    kind: str
    device: str
    points: tuple[StepPoint, ...]


def run_probe(
    cluster: Cluster,
    timeout_s: float = 600.0,
    python: str = sys.executable,
    sharing: LayerLibrary | None = None,
) -> ProbeResult:
    """``tapp_core.runtime.probe`` on ``cluster``'s ranks (messages over emulated links when it is emulated); with
    ``sharing``, also how the ranks slow each other computing that library's model and batch at once."""
    with tempfile.TemporaryDirectory(prefix="tapp-probe-") as workdir:
        cluster_file, out = Path(workdir) / "cluster.json", Path(workdir) / "probe.json"
        cluster_file.write_text(cluster.model_dump_json())
        program = [python, "-m", "tapp_core.runtime.probe", "--cluster", str(cluster_file), "--out", str(out)]
        if cluster.emulated:
            program.append("--emulate")
        if sharing is not None:
            program += ["--model", sharing.model, "--batch-size", str(sharing.batch_size)]
        paths = (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", ""))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        try:
            done = subprocess.run(
                mpiexec_command(cluster, program), env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise CalibrationRunError(f"the calibration probe on {cluster.name!r} ran past {timeout_s:.0f} s") from None
        if done.returncode != 0 or not out.is_file():
            tail = (done.stdout + done.stderr)[-2000:]
            raise CalibrationRunError(f"the calibration probe on {cluster.name!r} failed ({done.returncode}):\n{tail}")
        return ProbeResult.from_json(out.read_text())


def measure_kinds(
    pool: WorkerPool,
    library: LayerLibrary,
    cluster: Cluster,
    steps: int = MIN_STEPS,
    warmup: int = DEFAULT_WARMUP,
    rounds: int = 2,
) -> list[KindSteps]:
    """Per kind of ``cluster``, three single-device plans on its first device, measured with emulation off: the
    batch in one micro-batch, in ``MICRO_BATCHES``, and a ``SMALL_BATCH_DIVISOR``-th of it in one. They run in
    turns (A B C A B C...) for ``rounds`` rounds; each point is the median of its rounds."""
    batch = library.batch_size
    shapes = [(batch, 1), (batch, MICRO_BATCHES), (max(1, batch // SMALL_BATCH_DIVISOR), 1)]
    found = []
    for kind in cluster_kinds(cluster):
        device = next(d.name for d in cluster.devices if device_kind(d).name == kind)
        plans = [single_stage_plan(library, [device], micro_batches=m, batch_size=b) for b, m in shapes]
        times: list[list[float]] = [[] for _ in plans]
        for _ in range(rounds):
            for plan, measured_times in zip(plans, times, strict=True):
                measured = pool.measure(plan, steps=steps, warmup=warmup, emulate=False)
                if not measured.ok:
                    raise CalibrationRunError(f"measuring plan {plan.id} on {device} failed: {measured.error}")
                measured_times.append(measured.step_time_s)
        points = tuple(StepPoint(b, m, statistics.median(t)) for (b, m), t in zip(shapes, times, strict=True))
        found.append(KindSteps(kind, device, points))
    return found


@dataclass(frozen=True)
class ComputeFit:
    compute_scale: float
    per_operation_s: float
    per_step_s: float
    """Everything a step costs that neither its compute nor its operations explain (the update included)."""


def fit_compute(library: LayerLibrary, points: Sequence[StepPoint], slowdown: float = 1.0) -> ComputeFit:
    """A kind's compute scale, fixed cost per operation and fixed cost per step from its single-device plans.

    A plan of ``b`` samples in ``M`` micro-batches does ``M F + P b`` seconds of ``library`` work (``F``: the
    layers' fixed parts, ``P``: their time per sample), times ``slowdown``, in ``2 M`` operations; its step is
    ``scale * slowdown * (M F + P b) + 2 M per_operation + per_step``. Least squares over the points; a negative
    per-operation or per-step cost (noise) is pinned to 0 and the rest refitted."""
    fixed = sum(layer.forward_fixed_s + layer.backward_fixed_s for layer in library.layers)
    per_sample = (library.layer_time_sum_s - fixed) / library.batch_size
    rows = np.array(
        [[slowdown * (p.micro_batches * fixed + per_sample * p.batch_size), 2 * p.micro_batches, 1.0] for p in points]
    )
    y = np.array([p.step_s for p in points])
    free = [0, 1, 2]
    while True:
        solution = np.zeros(3)
        solution[free] = np.linalg.lstsq(rows[:, free], y, rcond=None)[0]
        negative = [i for i in free[1:] if solution[i] < 0]
        if not negative:
            break
        free.remove(negative[0])
    return ComputeFit(max(float(solution[0]), 1e-3), float(solution[1]), float(solution[2]))


def per_message_s(probe: ProbeResult, cluster: Cluster, figures: Mapping[str, KindCalibration]) -> float:
    """The runtime's cost of one message beyond the link's latency and bandwidth (as the cluster file gives them,
    and as the emulation delays a message): the median over the pairs of their one-way time, less the link's time
    for the message and the staging copies of GPU ends."""
    residuals = []
    for pair in probe.pairs:
        a, b = (cluster.device(name) for name in pair.between)
        link_s = transfer_s(cluster.link(a.name, b.name), 4, 1, DEFAULT_CALIBRATION)
        staging = sum(figures[device_kind(d).name].staging_per_copy_s for d in (a, b) if d.kind == "cuda") / 2
        residuals.append(pair.one_way_s - link_s - staging)
    return max(0.0, statistics.median(residuals)) if residuals else 0.0


def shared_cores_factors(probes: Sequence[SharingProbe]) -> dict[str, float]:
    """Per kind, the median over its devices of their step while every rank computed over their step alone; at
    least 1 (less is noise)."""
    by_kind: dict[str, list[float]] = {}
    for probe in probes:
        by_kind.setdefault(probe.kind, []).append(probe.together_s / probe.alone_s)
    return {kind: max(1.0, statistics.median(ratios)) for kind, ratios in by_kind.items()}


def _speed_slowdowns(library: LayerLibrary, cluster: Cluster) -> dict[str, float]:
    """Per kind, what the model's slowdown will multiply its measured figures by beyond the emulation: 1 on an
    emulated cluster, else its first device's slowdown (1 unless its speed applies)."""
    terms = device_terms(library, cluster, DEFAULT_CALIBRATION)
    out: dict[str, float] = {}
    for device in cluster.devices:
        kind = device_kind(device).name
        out.setdefault(kind, 1.0 if cluster.emulated else terms[device.name].slowdown)
    return out


def calibrate(
    cluster: Cluster,
    library: LayerLibrary,
    steps: int = MIN_STEPS,
    warmup: int = DEFAULT_WARMUP,
    log: Callable[[str], None] = print,
) -> Calibration:
    """Measure ``cluster``'s calibration on this machine with ``library`` (one library per kind, as costed)."""
    cores = host_cpus()
    # Emulated ranks sleep most of their slowdown away: how they share the cores is the emulation's business.
    shared = [] if cluster.emulated else shared_hosts(cluster, cores)
    log(f"probing {len(cluster.devices)} rank(s): optimiser, staging, messages" + (", sharing" if shared else ""))
    probe = run_probe(cluster, sharing=library if shared else None)
    sharing = shared_cores_factors(probe.sharing)
    for kind, factor in sharing.items():
        log(f"{kind}: computes {factor:.2f}x slower while every rank computes ({cores} cores shared)")
    kinds = {k.kind: k for k in probe.kinds}
    slowdowns = _speed_slowdowns(library, cluster)
    terms = device_terms(library, cluster, DEFAULT_CALIBRATION)
    figures: dict[str, KindCalibration] = {}
    first_of_kind = [next(d.name for d in cluster.devices if device_kind(d).name == k) for k in cluster_kinds(cluster)]
    with WorkerPool(cluster, devices=first_of_kind) as pool:
        pool.prepare(library.model)
        for measured in measure_kinds(pool, library, cluster, steps, warmup):
            found = kinds[measured.kind]
            slowdown = slowdowns[measured.kind]
            fit = fit_compute(terms[measured.device].library, measured.points, slowdown)
            update_per_byte = found.update.per_byte_s / slowdown
            per_step = max(0.0, fit.per_step_s - found.update.per_byte_s * library.param_bytes)
            log(
                f"{measured.kind} ({measured.device}): steps "
                + ", ".join(f"{p.step_s:.4f} s (batch {p.batch_size}/{p.micro_batches})" for p in measured.points)
                + f"; compute scale {fit.compute_scale:.3f}, {fit.per_operation_s * 1e3:.3f} ms per operation, "
                f"{per_step * 1e3:.2f} ms per step beyond the update"
            )
            figures[measured.kind] = KindCalibration(
                compute_scale=fit.compute_scale,
                per_micro_batch_s=fit.per_operation_s,
                update_s_per_param_byte=update_per_byte,
                per_step_s=per_step,
                d2h_s_per_byte=found.d2h.per_byte_s if found.d2h else 0.0,
                h2d_s_per_byte=found.h2d.per_byte_s if found.h2d else 0.0,
                staging_per_copy_s=(found.d2h.fixed_s + found.h2d.fixed_s) / 2 if found.d2h and found.h2d else 0.0,
                shared_cores_factor=sharing.get(measured.kind, 1.0),
            )
    message = per_message_s(probe, cluster, figures)
    log(f"per message: {message * 1e6:.1f} us beyond the link")
    return Calibration(
        per_message_s=message,
        host_cores=float(cores) if sharing else 0.0,
        kinds=figures,
        cuda_aware_mpi=probe.cuda_aware_mpi,
        made_for=MadeFor(
            host=platform.node(),
            cluster=cluster.name,
            kinds=tuple(cluster_kinds(cluster)),
            torch_version=torch.__version__,
            profiler_version=PROFILE_VERSION,
            model=library.model,
            batch_size=library.batch_size,
            cuda_aware_mpi=probe.cuda_aware_mpi,
            date=datetime.now(UTC).isoformat(timespec="seconds"),
        ),
        note=f"measured by tapp calibrate on {platform.node()} for cluster {cluster.name} "
        f"({library.model}, batch {library.batch_size}, {steps} steps after {warmup})",
    )


__all__ = [
    "MICRO_BATCHES",
    "CalibrationRunError",
    "ComputeFit",
    "KindSteps",
    "StepPoint",
    "calibrate",
    "fit_compute",
    "measure_kinds",
    "run_probe",
    "shared_cores_factors",
]
