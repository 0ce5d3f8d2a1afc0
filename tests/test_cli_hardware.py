"""The commands for a machine of several device kinds, run as a user runs them: ``tapp profile --cluster``, the
calibration ``tapp plan`` and ``tapp simulate`` pick up beside the cluster file (or refuse), and ``tapp calibrate``
on real MPI workers."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tapp_core.cost.calibration import (
    CALIBRATIONS_FOLDER,
    NO_CALIBRATE_VARIABLE,
    Calibration,
    MadeFor,
    SharingProbe,
    cached_calibration_path,
    cluster_calibration,
    shared_cores_factors,
)
from tapp_core.platform.cluster import load_cluster, parse_cluster
from tapp_core.platform.hosts import host_cpus
from tapp_core.profile.library import PROFILE_VERSION, load_libraries
from tapp_core.profile.profiler import ProfileRequest, profile_model

MODEL = ["--model", "tiny_cnn", "--batch-size", "8"]
TWO_THREAD_COUNTS = """name: unequal
emulated: false
devices:
  - {name: t1, kind: cpu, threads: 1, memory: 1GiB}
  - {name: t2, kind: cpu, threads: 2, memory: 1GiB}
links: {bandwidth: 10Gbit/s, latency: 10us}
"""


def tapp(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == exit_code, result.output
    return result.output


@pytest.fixture
def cluster_file(work_dir: Path) -> Path:
    path = work_dir / "unequal.yaml"
    path.write_text(TWO_THREAD_COUNTS)
    return path


def test_profile_cluster_profiles_every_kind_of_the_cluster(work_dir: Path, cluster_file: Path) -> None:
    output = tapp("profile", *MODEL, "--cluster", str(cluster_file), "--out", "libs", "--repeats", "1")
    library = load_libraries(work_dir / "libs")
    assert sorted(library.kind_libraries) == ["cpu-t1", "cpu-t2"]
    assert {lib.threads for lib in library.kind_libraries.values()} == {1, 2}
    assert all(lib.host == platform.node() for lib in library.kind_libraries.values())
    assert "tiny_cnn on cpu-t1" in output and "tiny_cnn on cpu-t2" in output
    assert len(list((work_dir / ".tapp" / "libraries").iterdir())) == 2  # cached, one entry per kind

    tapp("profile", *MODEL, "--threads", "2", "--out", "one", "--repeats", "1")  # one kind, not cached
    only = load_libraries(work_dir / "one")
    assert list(only.kind_libraries) == ["cpu-t2"]
    assert len(list((work_dir / ".tapp" / "libraries").iterdir())) == 2
    elsewhere = work_dir / "elsewhere.yaml"
    elsewhere.write_text(TWO_THREAD_COUNTS.replace("memory: 1GiB}", "memory: 1GiB, host: another-host}"))
    output = tapp("profile", *MODEL, "--cluster", str(elsewhere), exit_code=2)
    assert "this host has none of the device kinds of cluster 'unequal' (cpu-t1, cpu-t2)" in output


def test_plan_and_simulate_cost_each_kind_and_pick_up_the_calibration(work_dir: Path, cluster_file: Path) -> None:
    tapp("plan", *MODEL, "--cluster", str(cluster_file), "--planner", "pipetorch", "--out", "plan.json")
    assert len(list((work_dir / ".tapp" / "libraries").iterdir())) == 2  # both kinds profiled for the plan
    simulate = ("simulate", "--model", "tiny_cnn", "--cluster", str(cluster_file), "--plan", "plan.json")
    ideal = json.loads(tapp(*simulate, "--json"))
    assert ideal["calibration"]["made_for"] is None

    beside = work_dir / "unequal.calibration.json"
    measured = Calibration(per_step_s=0.5, made_for=_made_for(platform.node()))
    measured.save(beside)
    calibrated = json.loads(tapp(*simulate, "--json"))
    assert calibrated["calibration"]["per_step_s"] == 0.5
    assert calibrated["step_time_s"] == pytest.approx(ideal["step_time_s"] + 0.5)

    Calibration(per_step_s=0.5, made_for=_made_for("a-gpu-box")).save(beside)
    output = tapp(*simulate, exit_code=2)
    assert output.startswith("error: ") and "measured on host 'a-gpu-box'" in output and "tapp calibrate" in output


def _made_for(host: str) -> MadeFor:
    import torch

    return MadeFor(host, "unequal", ("cpu-t1", "cpu-t2"), torch.__version__, PROFILE_VERSION, "tiny_cnn", 8, False)


@pytest.mark.mpi
@pytest.mark.slow
def test_calibrate_measures_every_kind_on_the_workers(work_dir: Path, cluster_file: Path) -> None:
    output = tapp("calibrate", "--cluster", str(cluster_file), *MODEL, "--steps", "2", "--warmup", "1")
    assert "cpu-t1 (t1)" in output and "cpu-t2 (t2)" in output and "per message" in output
    assert "MiB before a plan" in output
    calibration = Calibration.load(work_dir / "unequal.calibration.json")
    assert calibration.made_for is not None and calibration.made_for.host == platform.node()
    assert set(calibration.made_for.kinds) == {"cpu-t1", "cpu-t2"} == set(calibration.kinds)
    for figures in calibration.kinds.values():
        assert figures.compute_scale > 0 and figures.update_s_per_param_byte > 0
        assert figures.d2h_s_per_byte == 0.0  # no GPU, nothing staged
        assert 100 * 2**20 < figures.runtime_memory_bytes < 2 * 2**30  # interpreter, torch, MPI, the model
    assert calibration.per_message_s >= 0
    # t1 and t2 want 3 threads: on fewer cores, how they slow each other is measured (CI's host has 2).
    if host_cpus() < 3:
        assert calibration.host_cores == host_cpus() and "while every rank computes" in output
        assert all(figures.shared_cores_factor >= 1.0 for figures in calibration.kinds.values())
    else:
        assert calibration.host_cores == 0
        assert all(figures.shared_cores_factor == 1.0 for figures in calibration.kinds.values())
    # Picked up from beside the cluster file from now on.
    tapp("plan", *MODEL, "--cluster", str(cluster_file), "--planner", "single", "--out", "plan.json")
    simulated = json.loads(tapp("simulate", "--model", "tiny_cnn", "--cluster", str(cluster_file), "--json"))
    assert simulated["calibration"]["made_for"]["host"] == platform.node()


def test_each_kinds_shared_cores_factor_is_its_devices_median_slowdown_and_at_least_one() -> None:
    probes = [
        SharingProbe("a", "cpu-t4", alone_s=1.0, together_s=2.0),
        SharingProbe("b", "cpu-t4", alone_s=1.0, together_s=3.0),
        SharingProbe("c", "cpu-t4", alone_s=1.0, together_s=6.0),
        SharingProbe("d", "cpu-t1", alone_s=1.0, together_s=0.97),  # noise: faster while sharing
    ]
    assert shared_cores_factors(probes) == {"cpu-t4": 3.0, "cpu-t1": 1.0}


@pytest.mark.mpi
@pytest.mark.slow
def test_the_first_command_that_needs_a_calibration_measures_it_and_later_ones_keep_it(
    work_dir: Path, cluster_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NO_CALIBRATE_VARIABLE)
    plan = ("plan", *MODEL, "--cluster", str(cluster_file), "--planner", "single", "--out", "plan.json")
    first = tapp(*plan)
    assert "calibrating the cost model for cluster unequal" in first and "on first use" in first
    kept = list((work_dir / ".tapp" / CALIBRATIONS_FOLDER).iterdir())
    assert kept == [cached_calibration_path(load_cluster(cluster_file), "tiny_cnn", work_dir / ".tapp")]
    assert not (work_dir / "unequal.calibration.json").exists()  # kept in the cache, not beside the cluster file

    simulate = ("simulate", "--model", "tiny_cnn", "--cluster", str(cluster_file), "--plan", "plan.json")
    again = tapp(*simulate)
    assert "calibrating" not in again and f"kept in {kept[0]}" in again
    assert json.loads(tapp(*simulate, "--json"))["calibration"]["made_for"]["host"] == platform.node()
    assert "calibration: ideal (--no-calibrate)" in tapp(*simulate, "--no-calibrate")


def test_a_kept_calibration_is_keyed_by_the_cluster_the_model_and_this_host(tmp_path: Path, cluster_file: Path) -> None:
    cluster = load_cluster(cluster_file)
    path = cached_calibration_path(cluster, "tiny_cnn", tmp_path)
    same = cached_calibration_path(load_cluster(cluster_file), "tiny_cnn", tmp_path)
    assert path == same  # the same cluster and model, the same key
    slower = parse_cluster(yaml.safe_load(TWO_THREAD_COUNTS.replace("threads: 2", "threads: 2, speed: 0.5")))
    assert cached_calibration_path(slower, "tiny_cnn", tmp_path) != path  # a changed cluster is measured afresh
    # another model too: its compute scale and cost per operation are fitted to its own steps
    assert cached_calibration_path(cluster, "alexnet", tmp_path) != path
    with pytest.MonkeyPatch.context() as patch:  # one kept before a calibration measured more is measured afresh
        patch.setattr("tapp_core.cost.calibration.CALIBRATION_VERSION", 1)
        assert cached_calibration_path(cluster, "tiny_cnn", tmp_path) != path
    measured = Calibration(per_step_s=0.5, made_for=_made_for(platform.node()), note="kept")
    measured.save(path)
    library = profile_model(ProfileRequest("tiny_cnn", 8, repeats=1, warmup=0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TAPP_CACHE_DIR", str(tmp_path))
        assert cluster_calibration(cluster_file, cluster, library).per_step_s == 0.5
        assert cluster_calibration(cluster_file, cluster, library, kept=False) == Calibration()
        other = profile_model(ProfileRequest("mlp", 8, repeats=1, warmup=0))
        assert cluster_calibration(cluster_file, cluster, other) == Calibration()  # none kept for this model
        Calibration(per_step_s=0.5, made_for=_made_for("a-gpu-box")).save(path)
        refused = cluster_calibration(cluster_file, cluster, library)
        assert refused == Calibration()  # refused: measured afresh where allowed
