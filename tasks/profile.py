"""Profiling: the layer library of a model (from the profile cache shared with the command line), and its record
in MLflow."""

from __future__ import annotations

import tempfile
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from reports import runs
from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary
from tapp_core.profile_cache import ProfileCache, ProfileKey
from tasks.progress import StageProgress
from tasks.tracking import ExperimentTags, RunRef, TrackedRun, tracked_run


def profiling_threads(cluster: Cluster) -> int:
    """Profile with the threads of the cluster's fastest CPU device (the cost model scales from there)."""
    cpus = [d for d in cluster.devices if d.kind == "cpu"]
    return max(cpus, key=lambda d: d.speed).threads if cpus else 1


# Prefect's own result cache would be a second cache with another key: tapp_core's profile cache is the one.
@task(name="profile", task_run_name="profile", cache_policy=NO_CACHE)
def profile_layers(
    model: str, batch_size: int, device: str = "cpu", threads: int = 1, repeats: int = 5
) -> LayerLibrary:
    """The layer library of ``model`` at ``batch_size`` on a ``device``-kind device with ``threads`` threads,
    from the profile cache (``$TAPP_CACHE_DIR``, else ``.tapp``), profiled and stored there if missing."""
    key = ProfileKey.of(model, batch_size, device=device, threads=threads, repeats=repeats)
    return ProfileCache().library(key)


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
    progress.update(
        1, f"{len(library.layers)} layers, whole model {library.whole_model_s * 1e3:.1f} ms on {library.threads} thread(s)"
    )
    return library
