"""Profiling: the layer library of a model (cached by its inputs), and its record in MLflow."""

from __future__ import annotations

import hashlib
import json
import platform
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.context import TaskRunContext

from reports import runs
from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary
from tapp_core.profiler import profile_model
from tasks.progress import StageProgress
from tasks.tracking import ExperimentTags, RunRef, TrackedRun, tracked_run

PROFILER_SOURCE = Path(__file__).resolve().parent.parent / "tapp_core" / "profiler.py"


def profile_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """Same model, batch, device, threads and repeats on the same host, torch and profiler = same library.

    A model given as ``file.py:callable`` also keys on the file's content, so editing the model re-profiles it.
    """
    spec = str(parameters["model"])
    source, _, _ = spec.rpartition(":")
    model_file = Path(source) if source.endswith(".py") else None
    key = {
        **{k: parameters[k] for k in ("model", "batch_size", "device", "threads", "repeats")},
        "model_file": _digest(model_file) if model_file and model_file.is_file() else "",
        "host": platform.node(),
        "torch": torch.__version__,
        "profiler": _digest(PROFILER_SOURCE),
    }
    return "profile-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def profiling_threads(cluster: Cluster) -> int:
    """Profile with the threads of the cluster's fastest CPU device (the cost model scales from there)."""
    cpus = [d for d in cluster.devices if d.kind == "cpu"]
    return max(cpus, key=lambda d: d.speed).threads if cpus else 1


@task(name="profile", cache_key_fn=profile_cache_key, cache_expiration=timedelta(days=30))
def profile_layers(
    model: str, batch_size: int, device: str = "cpu", threads: int = 1, repeats: int = 5
) -> LayerLibrary:
    """The layer library of ``model`` at ``batch_size`` on a ``device``-kind device with ``threads`` threads."""
    return profile_model(model, batch_size, device=device, threads=threads, repeats=repeats)


def record_library(run: TrackedRun, library: LayerLibrary) -> None:
    """Log the library's files (``layer_library/``), its size and its whole-model time."""
    with tempfile.TemporaryDirectory(prefix="tapp-library-") as folder:
        library.save(folder)
        run.log_dir(folder, "layer_library")
    run.log_params(
        {
            "library_device": library.device,
            "library_threads": library.threads,
            "library_batch_size": library.batch_size,
            "layers": len(library.layers),
        }
    )
    run.log_metrics(
        {
            "whole_model_s": library.whole_model_s,
            "layer_time_sum_s": library.layer_time_sum_s,
            "layer_sum_ratio": library.layer_time_sum_s / library.whole_model_s if library.whole_model_s else None,
            "param_bytes": library.param_bytes,
        }
    )


def profile_stage(parent: RunRef, tags: ExperimentTags, cluster: Cluster, repeats: int = 5) -> LayerLibrary:
    """The profile stage's nested run: the (cached) layer library of the experiment's model, logged."""
    progress = StageProgress("profile", 1, f"profiling {tags.model} at batch {tags.batch_size}")
    with tracked_run("profile", tags.child(parent, runs.STAGE_RUN, stage="profile"), parent=parent) as run:
        started = time.perf_counter()
        library = profile_layers(tags.model, tags.batch_size, "cpu", profiling_threads(cluster), repeats)
        record_library(run, library)
        run.log_metrics({"wall_s": time.perf_counter() - started})
    progress.update(1, f"{len(library.layers)} layers")
    return library
