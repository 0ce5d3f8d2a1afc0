"""Profiling: the layer libraries of a model, one per device kind of the cluster (from the profile cache shared
with the command line), and their record in MLflow."""

from __future__ import annotations

import tempfile
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from reports import runs
from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary, save_libraries
from tapp_core.profile_cache import ProfileCache
from tasks.progress import StageProgress
from tasks.tracking import ExperimentTags, RunRef, TrackedRun, tracked_run


# Prefect's own result cache would be a second cache with another key: tapp_core's profile cache is the one.
@task(name="profile", task_run_name="profile", cache_policy=NO_CACHE)
def profile_cluster_layers(model: str, batch_size: int, cluster: Cluster, repeats: int = 5) -> LayerLibrary:
    """The layer library of ``model`` at ``batch_size`` for every device kind of ``cluster`` this host has (the
    fastest device's kind as the reference), from the profile cache, profiled and stored there if missing."""
    return ProfileCache().cluster_libraries(model, batch_size, cluster, repeats=repeats)


def record_library(run: TrackedRun, library: LayerLibrary) -> None:
    """Log the libraries' files (``layer_library/``: the library, or a folder per kind), the reference kind's size
    and whole-model time, and the kinds."""
    with tempfile.TemporaryDirectory(prefix="tapp-library-") as folder:
        save_libraries(library, folder)
        run.log_dir(folder, "layer_library")
    run.log_params(
        {
            "library_device": library.device,
            "library_threads": library.threads,
            "library_batch_size": library.batch_size,
            "library_kinds": ",".join(library.kind_libraries),
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
    """The profile stage's nested run: the (cached) layer libraries of the experiment's model, logged."""
    progress = StageProgress("profile", 1, f"profiling {tags.model} at batch {tags.batch_size}")
    with tracked_run("profile", tags.child(parent, runs.STAGE_RUN, stage="profile"), parent=parent) as run:
        started = time.perf_counter()
        library = profile_cluster_layers(tags.model, tags.batch_size, cluster, repeats)
        record_library(run, library)
        run.log_metrics({"wall_s": time.perf_counter() - started})
    progress.update(
        1,
        f"{len(library.layers)} layers, whole model {library.whole_model_s * 1e3:.1f} ms on {library.kind.name}"
        + (f" (kinds {', '.join(library.kind_libraries)})" if library.kinds else ""),
    )
    return library
