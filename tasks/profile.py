"""Profiling: the layer libraries of a model, one per device kind of the cluster (from the profile cache shared
with the command line), and their record in MLflow."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from reports import schema
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.cache import ProfileCache
from tapp_core.profile.library import LayerLibrary, save_libraries
from tasks.config import ExperimentConfig
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


@dataclass(frozen=True)
class Profiled:
    """The experiment's layer libraries and how long getting them took (from the cache: moments)."""

    library: LayerLibrary
    wall_s: float


def profile_stage(config: ExperimentConfig, repeats: int = 5) -> Profiled:
    """The layer libraries of the experiment's model, one per kind of its cluster (``profile_cluster_layers``).

    It runs before the experiment's first MLflow run: a model that cannot be built or traced fails here, before
    any run exists, and the model is traced only here (once per kind this host profiles; not at all from the
    cache). ``record_profile`` then records it in the experiment's ``profile`` run."""
    progress = StageProgress("profile", 1, f"profiling {config.model} at batch {config.batch_size}")
    started = time.perf_counter()
    library = profile_cluster_layers(config.model, config.batch_size, config.target, repeats)
    progress.update(
        1,
        f"{len(library.layers)} layers, whole model {library.whole_model_s * 1e3:.1f} ms on {library.kind.name}"
        + (f" (kinds {', '.join(library.kind_libraries)})" if library.kinds else ""),
    )
    return Profiled(library, time.perf_counter() - started)


def record_profile(parent: RunRef, tags: ExperimentTags, profiled: Profiled) -> None:
    """The profile stage's nested run: the libraries' files and figures."""
    with tracked_run("profile", tags.child(parent, schema.STAGE_RUN, stage="profile"), parent=parent) as run:
        record_library(run, profiled.library)
        run.log_metrics({"wall_s": profiled.wall_s})
