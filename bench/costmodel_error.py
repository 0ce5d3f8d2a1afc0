"""Predicted against measured: the cost model's error on the even-split plans of AlexNet, VGG-16 and Inception-V3.

    .venv/bin/python bench/costmodel_error.py [--fit] [--batch-size 64 --micro-batches 4 --cluster local]

Each model is profiled at the batch size with one thread (the local devices' threads), as the experiments
profile it (so micro-batches are costed by the library's fixed and per-sample parts), split into stages of equal
profiled time, one stage per device (the ``even`` planner), and measured on the cluster's MPI workers (emulated
slowdowns 1, 2, 3; 1 Gbit/s, 100 us links). The same splits under other schedules and micro-batch counts are
held out of the fit. The cost model predicts every plan with the ideal
constants and with the fitted calibration (``tapp_core/calibration.json``); the last line is the median absolute
error of the calibrated model (bar: < 15%).

``--fit`` derives the calibration from these runs and writes it: the optimiser's cost per parameter byte is timed
directly; the compute scale comes from a least-squares fit (through the origin) of the measured per-stage
compute; the fixed per-message cost from the measured communication wait; the fixed per-step cost is
the median step time still unexplained.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cluster import Cluster, load_cluster  # noqa: E402
from tapp_core.costmodel import Estimate, estimate  # noqa: E402
from tapp_core.costs import Calibration  # noqa: E402
from tapp_core.library import LayerLibrary, LibraryError  # noqa: E402
from tapp_core.metrics import Measurement  # noqa: E402
from tapp_core.plan import Plan  # noqa: E402
from tapp_core.planners import get_planner  # noqa: E402
from tapp_core.profiler import PROFILE_VERSION, profile_model  # noqa: E402
from tapp_core.runtime import WorkerPool  # noqa: E402
from tapp_core.runtime.calibration import FITTED_CALIBRATION_PATH, load_fitted_calibration  # noqa: E402
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer  # noqa: E402

MODELS = ("alexnet", "vgg16", "inception_v3")


def library_for(model: str, batch_size: int, threads: int, cache: Path) -> LayerLibrary:
    folder = cache / f"{model}_b{batch_size}_t{threads}_v{PROFILE_VERSION}"
    try:
        return LayerLibrary.load(folder)
    except LibraryError:
        library = profile_model(model, batch_size=batch_size, threads=threads, repeats=5, warmup=2)
        library.save(folder)
        return library


def update_seconds_per_param_byte(threads: int) -> float:
    """Time of one SGD-with-momentum step per parameter byte, on this host with ``threads`` threads."""
    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(torch.randn(4 * 2**20)) for _ in range(4)]  # 64 MiB of parameters
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = make_optimizer(params, OptimizerConfig())
    times = []
    for _ in range(7):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) / sum(p.numel() * p.element_size() for p in params)


def fit(runs: list[tuple[Plan, LayerLibrary, Measurement]], cluster: Cluster, update_per_byte: float) -> Calibration:
    base = Calibration(update_s_per_param_byte=update_per_byte)
    # Per-stage compute: measured = compute_scale * (profiled fwd+bwd, slowed down) + update. The library's fixed
    # per-call parts already carry what a micro-batch costs whatever its size, so there is no intercept to fit
    # (fitting one per micro-batch made it soak up the slow devices' contention: 43 ms per call, worse held out).
    predicted, targets = [], []
    for plan, library, measurement in runs:
        ideal = estimate(plan, library, cluster, base)
        no_update = estimate(plan, library, cluster, dataclasses.replace(base, update_s_per_param_byte=0.0))
        for stage, devices in enumerate(plan.stage_devices):
            device = devices[0]
            update = ideal.compute[device] - no_update.compute[device]
            predicted.append(no_update.compute[device])
            targets.append(measurement.stage_compute_s[stage] - update)
    x, y = np.array(predicted), np.array(targets)
    scale = float(x @ y / (x @ x))
    calibration = dataclasses.replace(base, compute_scale=max(scale, 0.05))
    # Per message: the smallest fixed cost whose predicted communication reaches the measured wait.
    measured_wait = sum(sum(m.device_wait_s.values()) for _, _, m in runs)
    per_message = 0.0
    for candidate in np.linspace(0.0, 2e-3, 81):
        trial = dataclasses.replace(calibration, per_message_s=float(candidate))
        predicted_wait = sum(sum(estimate(p, lib, cluster, trial).communication.values()) for p, lib, _ in runs)
        per_message = float(candidate)
        if predicted_wait >= measured_wait:
            break
    calibration = dataclasses.replace(calibration, per_message_s=per_message)
    residuals = [m.step_time_s - estimate(p, lib, cluster, calibration).step_time for p, lib, m in runs]
    return dataclasses.replace(
        calibration,
        per_step_s=max(0.0, statistics.median(residuals)),
        note=f"fitted by bench/costmodel_error.py on {cluster.name}: even-split plans of {', '.join(lib.model for _, lib, _ in runs)}, "
        f"batch {runs[0][0].batch_size}, {runs[0][0].micro_batches} micro-batches, {runs[0][0].schedule}",
    )


def error(predicted: Estimate, measured: Measurement) -> float:
    return (predicted.step_time - measured.step_time_s) / measured.step_time_s


def report(
    runs: list[tuple[Plan, LayerLibrary, Measurement]], cluster: Cluster, calibration: Calibration, title: str
) -> list[float]:
    """Print measured against predicted for ``runs``; returns the calibrated model's absolute errors."""
    print(f"\n{title}")
    header = f"{'model':13s} {'sched':5s} {'mb':>3s} {'measured':>9s} {'ideal':>9s} {'error':>7s} {'calibr.':>9s} {'error':>7s}"
    print(header + "   per-stage compute measured/calibrated (s)")
    errors = []
    for plan, library, measurement in runs:
        ideal = estimate(plan, library, cluster)
        fitted = estimate(plan, library, cluster, calibration)
        errors.append(abs(error(fitted, measurement)))
        stages = " ".join(
            f"{measured:.3f}/{fitted.compute[devices[0]]:.3f}"
            for measured, devices in zip(measurement.stage_compute_s, plan.stage_devices, strict=True)
        )
        print(
            f"{library.model:13s} {plan.schedule:5s} {plan.micro_batches:3d} {measurement.step_time_s:9.3f} {ideal.step_time:9.3f} "
            f"{error(ideal, measurement):+7.1%} {fitted.step_time:9.3f} {error(fitted, measurement):+7.1%}   {stages}"
        )
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--library-dir", type=Path, default=ROOT / "out" / "costmodel-libraries")
    parser.add_argument("--fit", action="store_true", help=f"fit the calibration and write {FITTED_CALIBRATION_PATH}")
    parser.add_argument(
        "--holdout-schedules",
        nargs="*",
        default=["1f1b", "async"],
        help="also measure the same splits under these schedules: runs the calibration was not fitted on",
    )
    parser.add_argument(
        "--holdout-micro-batches",
        nargs="*",
        type=int,
        default=[2, 8],
        help="also measure the same splits (fitted schedule) with these micro-batch counts: held out too",
    )
    args = parser.parse_args()

    cluster = load_cluster(args.cluster)
    threads = cluster.devices[0].threads
    planner = get_planner(
        "even", by="time", batch_size=args.batch_size, micro_batches=(args.micro_batches,), schedule=args.schedule
    )
    runs: list[tuple[Plan, LayerLibrary, Measurement]] = []
    holdout: list[tuple[Plan, LayerLibrary, Measurement]] = []
    with WorkerPool(cluster) as pool:
        for model in args.models:
            library = library_for(model, args.batch_size, threads, args.library_dir)
            plan = planner.plan(library, cluster)
            pool.prepare(model)
            variants = [(args.schedule, args.micro_batches)]
            variants += [(schedule, args.micro_batches) for schedule in args.holdout_schedules]
            variants += [(args.schedule, m) for m in args.holdout_micro_batches if args.batch_size % m == 0]
            for schedule, micro_batches in variants:
                variant = dataclasses.replace(plan, schedule=schedule, micro_batches=micro_batches)
                measurement = pool.measure(variant, steps=args.steps, warmup=args.warmup, timeout_s=900)
                if not measurement.ok:
                    print(f"{model}: measuring plan {variant.id} failed: {measurement.error}", file=sys.stderr)
                    return 1
                fitted_on = (schedule, micro_batches) == variants[0]
                (runs if fitted_on else holdout).append((variant, library, measurement))
                layers = [len(plan.stage_layers(s)) for s in range(plan.n_stages)]
                print(
                    f"{model} {schedule} x{micro_batches}: plan {variant.id}, stages of {layers} layers, "
                    f"measured {measurement.step_time_s:.3f} s",
                    flush=True,
                )

    if args.fit:
        calibration = fit(runs, cluster, update_seconds_per_param_byte(threads))
        calibration.save(FITTED_CALIBRATION_PATH)
        print(f"wrote {FITTED_CALIBRATION_PATH}: {calibration.to_dict()}")
    calibration = load_fitted_calibration()

    print(f"calibration: {', '.join(f'{k}={v:.3g}' for k, v in calibration.to_dict().items() if k != 'note')}")
    if holdout:
        held = report(
            holdout, cluster, calibration, "held out (same splits, other schedules or micro-batches; not fitted on)"
        )
        print(f"median absolute error on the held-out runs: {statistics.median(held):.1%}")
    errors = report(
        runs, cluster, calibration, f"even-split plans ({args.schedule}, {args.micro_batches} micro-batches)"
    )
    print(f"median absolute error of the calibrated cost model: {statistics.median(errors):.1%} (bar < 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
