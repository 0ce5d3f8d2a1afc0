"""``tapp calibrate``: the cost model's calibration, measured on the machine itself with short runs.

For a cluster and the layer libraries of its kinds (``ProfileCache.cluster_libraries``), ``calibrate``:

1. runs ``tapp_core.runtime.probe`` on the cluster's ranks (one mpiexec job, one rank per device): per kind,
   the optimiser's step (a fixed part and a part per parameter byte) and, on a GPU, the staging copies to and
   from pinned host memory (fixed part per copy, part per byte each way); per pair of ranks, the one-way time of
   one message through the runtime's transport, over the cluster's emulated links when it is emulated; and, on a
   real cluster whose ranks want more threads than this host has cores, each kind's step of the model while every
   rank computes at once against its step alone (``KindCalibration.shared_cores_factor``, with ``host_cores``);
2. measures, on the worker pool with emulation off, what the first device of every kind holds before a plan's
   first tensor (``runtime_memory``: the memory model's budget for a plan leaves it aside) and three single-device
   plans there (a batch in 1 and in ``MICRO_BATCHES`` micro-batches, a quarter of it in 1; the batch is the
   library's, or less where the whole model does not fit the device: ``fitting_batch``), and fits the kind's compute
   scale against its library, its fixed cost per operation and its fixed cost per step (``fit_compute``);
3. returns a ``Calibration`` with those figures per kind and the per-message cost, recording what it was made
   for (``calibration.MadeFor``), so that it is refused on another machine or library
   (``tapp_core.cost.calibration``).

The cost model multiplies a device's compute and update by its slowdown where its ``speed`` applies
(``tapp_core.platform.kinds``). Measured with emulation off, a kind's figures are what the kind does itself, so where the
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
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from tapp_core.cost.calibration import (
    DEFAULT_CALIBRATION,
    Calibration,
    KindCalibration,
    KindSteps,
    MadeFor,
    ProbeResult,
    StepPoint,
    cached_calibration_path,
    cluster_calibration,
    fit_compute,
    per_message_s,
    shared_cores_factors,
)
from tapp_core.cost.checks import check_memory
from tapp_core.cost.context import CostContext
from tapp_core.cost.formulas import shared_hosts
from tapp_core.errors import TappError
from tapp_core.measure.races import RoundSteps
from tapp_core.model.workload import as_workload
from tapp_core.paths import PROJECT_ROOT
from tapp_core.plan.plan import OutOfMemory, single_stage_plan
from tapp_core.platform.cluster import Cluster
from tapp_core.platform.hosts import host_cpus
from tapp_core.platform.kinds import cluster_kinds, device_kind
from tapp_core.profile.library import PROFILE_VERSION, LayerLibrary
from tapp_core.runtime.pool import WorkerPool, mpiexec_command

MICRO_BATCHES = 8
"""A plan with this many micro-batches times the fixed cost of an operation (it has that many more)."""
SMALL_BATCH_DIVISOR = 4
"""A plan at this fraction of the batch times the compute per sample."""


class CalibrationRunError(TappError):
    """A calibration run that failed; the message says which and why."""


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
    steps: int = RoundSteps.steps,
    warmup: int = RoundSteps.warmup,
    rounds: int = 2,
) -> list[KindSteps]:
    """Per kind of ``cluster``, what its first device's rank holds before a plan (``runtime_memory``) and three
    single-device plans there, measured with emulation off: a batch in one micro-batch, in ``MICRO_BATCHES``, and a
    ``SMALL_BATCH_DIVISOR``-th of it in one. The batch is the library's, or the largest half of it that fits the
    device's memory less the rank's (``fitting_batch``: a device that cannot hold the whole model is measured on a
    smaller batch, not killed). They run in turns (A B C A B C...) for ``rounds`` rounds; each point is the median of
    its rounds."""
    found = []
    ideal = CostContext(library, cluster, optimizer=as_workload(library.model).optimizer)
    for kind in cluster_kinds(cluster):
        device = next(d.name for d in cluster.devices if device_kind(d).name == kind)
        runtime = runtime_memory(pool, library, device)
        batch = fitting_batch(ideal, device, runtime)
        shapes = [(batch, 1), (batch, MICRO_BATCHES), (max(1, batch // SMALL_BATCH_DIVISOR), 1)]
        plans = [single_stage_plan(library, [device], micro_batches=m, batch_size=b) for b, m in shapes]
        times: list[list[float]] = [[] for _ in plans]
        for _ in range(rounds):
            for plan, measured_times in zip(plans, times, strict=True):
                measured = pool.measure(plan, steps=steps, warmup=warmup, emulate=False)
                if not measured.ok:
                    raise CalibrationRunError(f"measuring plan {plan.id} on {device} failed: {measured.error}")
                measured_times.append(measured.step_time_s)
        points = tuple(StepPoint(b, m, statistics.median(t)) for (b, m), t in zip(shapes, times, strict=True))
        found.append(KindSteps(kind, device, points, runtime))
    return found


def runtime_memory(pool: WorkerPool, library: LayerLibrary, device: str) -> int:
    """What ``device``'s rank holds before a plan's first tensor (its baseline), read on one step of the smallest
    single-device plan (a ``SMALL_BATCH_DIVISOR``-th of the batch in ``MICRO_BATCHES``) after the pool's model is
    built: the most likely to fit."""
    batch = max(1, library.batch_size // SMALL_BATCH_DIVISOR)
    plan = single_stage_plan(library, [device], micro_batches=min(MICRO_BATCHES, batch), batch_size=batch)
    measured = pool.measure(plan, steps=1, warmup=0, emulate=False)
    if not measured.ok:
        raise CalibrationRunError(f"measuring plan {plan.id} on {device} failed: {measured.error}")
    baseline = measured.extra.get("baseline_memory_bytes")
    return int(baseline.get(device, 0)) if isinstance(baseline, dict) else 0


def fitting_batch(context: CostContext, device: str, runtime_memory_bytes: int) -> int:
    """The library's batch, halved until the whole model fits ``device`` in one micro-batch beside its rank's
    ``runtime_memory_bytes`` (the context's optimiser state counted); at least ``SMALL_BATCH_DIVISOR`` samples, or
    ``CalibrationRunError`` when even that does not fit."""
    kind = device_kind(context.cluster.device(device)).name
    figures = Calibration(kinds={kind: KindCalibration(runtime_memory_bytes=float(runtime_memory_bytes))})
    context = context.with_calibration(figures)
    batch = context.library.batch_size
    while True:
        try:
            check_memory(single_stage_plan(context.library, [device], batch_size=batch), context)
            return batch
        except OutOfMemory as exc:
            if batch // 2 < SMALL_BATCH_DIVISOR:
                raise CalibrationRunError(f"no batch of the model fits {device} to calibrate it: {exc}") from None
            batch //= 2


def _speed_slowdowns(ideal: CostContext) -> dict[str, float]:
    """Per kind, what the model's slowdown will multiply its measured figures by beyond the emulation: 1 on an
    emulated cluster, else its first device's slowdown (1 unless its speed applies)."""
    cluster, terms = ideal.cluster, ideal.terms
    out: dict[str, float] = {}
    for device in cluster.devices:
        kind = device_kind(device).name
        out.setdefault(kind, 1.0 if cluster.emulated else terms[device.name].slowdown)
    return out


def calibrate(
    cluster: Cluster,
    library: LayerLibrary,
    steps: int = RoundSteps.steps,
    warmup: int = RoundSteps.warmup,
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
    ideal = CostContext(library, cluster)
    slowdowns, terms = _speed_slowdowns(ideal), ideal.terms
    figures: dict[str, KindCalibration] = {}
    first_of_kind = [next(d.name for d in cluster.devices if device_kind(d).name == k) for k in cluster_kinds(cluster)]
    with WorkerPool(cluster, devices=first_of_kind) as pool:
        pool.prepare(library.model)
        for measured in measure_kinds(pool, library, cluster, steps, warmup):
            found = kinds[measured.kind]
            slowdown = slowdowns[measured.kind]
            fit = fit_compute(terms[measured.device].library, measured.points, slowdown)
            update_per_byte = found.update.per_byte_s / slowdown
            trained = sum(layer.trained_bytes for layer in library.layers)
            per_step = max(0.0, fit.per_step_s - found.update.per_byte_s * trained)
            log(
                f"{measured.kind} ({measured.device}): steps "
                + ", ".join(f"{p.step_s:.4f} s (batch {p.batch_size}/{p.micro_batches})" for p in measured.points)
                + f"; compute scale {fit.compute_scale:.3f}, {fit.per_operation_s * 1e3:.3f} ms per operation, "
                f"{per_step * 1e3:.2f} ms per step beyond the update; a rank holds "
                f"{measured.runtime_memory_bytes / 2**20:.0f} MiB before a plan"
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
                runtime_memory_bytes=measured.runtime_memory_bytes,
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


def calibration_on_first_use(
    cluster_name: str | Cluster, cluster: Cluster, library: LayerLibrary, log: Callable[[str], None] = print
) -> Calibration:
    """The cluster's calibration (``cluster_calibration``: given by ``tapp calibrate``, or kept from an earlier
    first use); where there is none yet, measured now on this machine with ``library`` and kept in the cache
    (``cached_calibration_path``), so that only the first run that needs it pays its seconds. A cluster whose ranks
    cannot run here keeps the ideal calibration, and its note says why."""
    found = cluster_calibration(cluster_name, cluster, library)
    if found.made_for is not None:
        return found
    log(f"calibrating the cost model for cluster {cluster.name} (first use on this host; kept for later runs)")
    try:
        measured = calibrate(cluster, library, log=log)
    except TappError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log(f"could not calibrate cluster {cluster.name} here ({first}): the cost model stays ideal")
        return replace(DEFAULT_CALIBRATION, note=f"ideal (calibrating failed: {first})")
    path = cached_calibration_path(cluster, library.model)
    kept = replace(measured, note=measured.note.replace("by tapp calibrate", "on first use", 1) + f", kept in {path}")
    kept.save(path)
    return kept


__all__ = [
    "MICRO_BATCHES",
    "CalibrationRunError",
    "calibrate",
    "calibration_on_first_use",
    "fitting_batch",
    "measure_kinds",
    "run_probe",
    "runtime_memory",
]
