"""Device kinds: which library and which speed each device is costed with, the per-kind cost terms (worked by
hand), the GPU's staging, per-kind calibrations and the refusal of a calibration made elsewhere.

Units: bandwidth in bytes/s, times in seconds, memory in bytes.
"""

from __future__ import annotations

import dataclasses
import platform
import warnings
from pathlib import Path

import pytest

from tapp_core.cost.calibration import (
    Calibration,
    CalibrationError,
    KindCalibration,
    MadeFor,
    calibration_path,
    check_calibration,
    cluster_calibration,
)
from tapp_core.cost.context import CostContext
from tapp_core.cost.estimate import Estimate
from tapp_core.cost.simulation import estimate
from tapp_core.plan.plan import Plan, single_stage_plan
from tapp_core.platform.cluster import Cluster, load_cluster
from tapp_core.platform.kinds import DeviceKind, cluster_kinds, device_kind
from tapp_core.profile import device_libraries
from tapp_core.profile.device_libraries import device_library
from tapp_core.profile.library import PROFILE_VERSION, LayerLibrary, LibraryError, load_libraries, save_libraries
from tests.factories import chain_library, make_cluster

HERE = platform.node()
TOL = 1e-9


def two_kinds(host: str = HERE) -> LayerLibrary:
    """Two layers at batch 4. On a 1-thread CPU: forward 1 + 3, backward 2 + 6 s; on a 2-thread CPU layer 0 is
    slower and layer 1 faster: forward 2 + 1, backward 4 + 2 s. Parameters 100 + 300 B, activations 10 B/sample."""
    t1 = chain_library(2, [1.0, 3.0], [2.0, 6.0], [100, 300], [10, 10], batch_size=4, threads=1, host=host)
    t2 = chain_library(2, [2.0, 1.0], [4.0, 2.0], [100, 300], [10, 10], batch_size=4, threads=2, host=host)
    return t1.with_kinds([t2])


def cluster_of(kinds: list[dict[str, object]], speeds: list[float], emulated: bool = False) -> Cluster:
    return make_cluster(speeds, memory="1GiB", bandwidth=100.0, kinds=kinds, emulated=emulated)


def plan(stage_of_layer: list[int], stage_devices: list[list[str]], micro_batches: int = 1) -> Plan:
    return Plan(
        model="toy",
        batch_size=4,
        micro_batches=micro_batches,
        schedule="gpipe",
        stage_of_layer=tuple(stage_of_layer),
        stage_devices=tuple(tuple(d) for d in stage_devices),
    )


T1, T2 = {"threads": 1}, {"threads": 2}


def test_a_kind_is_a_cpu_with_its_threads_or_a_gpu_with_its_model() -> None:
    cluster = cluster_of([T1, T2, {"kind": "cuda", "gpu_model": "NVIDIA H100 80GB HBM3", "threads": 4}], [1, 1, 1])
    assert [device_kind(d).name for d in cluster.devices] == ["cpu-t1", "cpu-t2", "cuda-NVIDIA H100 80GB HBM3"]
    assert list(cluster_kinds(cluster)) == ["cpu-t1", "cpu-t2", "cuda-NVIDIA H100 80GB HBM3"]
    assert DeviceKind("cuda:1", 8, "").name == "cuda" and DeviceKind("cuda", 8, "A100").label == "cuda-A100-t8"
    with pytest.raises(ValueError, match="gpu_model is for cuda devices"):
        cluster_of([{"threads": 1, "gpu_model": "X"}], [1])


def test_each_device_is_costed_from_its_own_kind_and_its_speed_is_ignored() -> None:
    # Real (not emulated) devices of kinds profiled here: speeds 0.5 and 0.25 must not matter.
    library, cluster = two_kinds(), cluster_of([T1, T2], [0.5, 0.25])
    on_t1 = estimate(single_stage_plan(library, ["d0"]), CostContext(library, cluster))
    on_t2 = estimate(single_stage_plan(library, ["d1"]), CostContext(library, cluster))
    assert on_t1.step_time_s == pytest.approx(1 + 3 + 2 + 6, abs=TOL)
    assert on_t2.step_time_s == pytest.approx(2 + 1 + 4 + 2, abs=TOL)
    # Layer 0 on d0, layer 1 on d1: F0 [0,1], 40 B over 100 B/s = 0.4, F1 [1.4,2.4], B1 [2.4,4.4], 0.4,
    # B0 [4.8,6.8]. One library scaled by a speed could not make layer 1 the cheap one on d1.
    split = estimate(plan([0, 1], [["d0"], ["d1"]]), CostContext(library, cluster))
    assert split.step_time_s == pytest.approx(6.8, abs=TOL)
    assert split.compute_s == pytest.approx({"d0": 3.0, "d1": 3.0}, abs=TOL)


def test_speed_applies_on_emulated_clusters_and_for_libraries_from_elsewhere() -> None:
    cluster = cluster_of([T1, T2], [0.5, 0.25], emulated=True)
    library = two_kinds()
    assert estimate(single_stage_plan(library, ["d1"]), CostContext(library, cluster)).step_time_s == pytest.approx(
        9 / 0.25
    )
    elsewhere = two_kinds(host="another-machine")
    real = cluster_of([T1, T2], [0.5, 0.25])
    assert device_library(elsewhere, real, "d1").speed_applies
    assert estimate(single_stage_plan(elsewhere, ["d1"]), CostContext(elsewhere, real)).step_time_s == pytest.approx(
        9 / 0.25
    )
    unrecorded = two_kinds(host="")
    assert device_library(unrecorded, real, "d0").speed_applies
    own = device_library(library, real, "d0")
    assert own.own and not own.speed_applies and own.library.kind.name == "cpu-t1"


def test_a_kind_without_a_library_takes_the_nearest_scaled_by_speed_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_libraries, "_warned", set())
    library = two_kinds()
    cluster = cluster_of([T1, {"threads": 3}, {"threads": 3}], [1.0, 2.0, 2.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = device_library(library, cluster, "d1")
        device_library(library, cluster, "d2")
    assert chosen.library.kind.name == "cpu-t2" and not chosen.own and chosen.speed_applies
    assert [str(w.message).split(":")[0] for w in caught] == [
        "no layer library of kind cpu-t3 (device d1 of cluster 'test')"
    ]
    # The 2-thread library at speed 2: 9 s of work in 4.5 s.
    assert estimate(single_stage_plan(library, ["d1"]), CostContext(library, cluster)).step_time_s == pytest.approx(4.5)
    gpu = cluster_of([{"kind": "cuda", "threads": 1}], [8.0])
    with pytest.warns(UserWarning, match="no layer library of kind cuda"):
        assert device_library(library, gpu, "d0").library.kind.name == "cpu-t2"  # no GPU library: most threads


def test_one_library_gives_the_numbers_of_one_library_scaled_by_speed() -> None:
    # Every device of the library's kind on an emulated cluster: the model before kinds existed, bit for bit.
    alone = chain_library(2, [1.0, 3.0], [2.0, 6.0], [100, 300], [10, 10], batch_size=4)
    with_other = alone.with_kinds([dataclasses.replace(alone, threads=2)])
    cluster = cluster_of([T1, T1], [1.0, 0.5], emulated=True)
    calibration = Calibration(per_message_s=0.01, per_micro_batch_s=0.1, update_s_per_param_byte=1e-3, per_step_s=0.2)
    p = plan([0, 1], [["d0"], ["d1"]], micro_batches=2)
    for lib in (alone, with_other):
        result = estimate(p, CostContext(lib, cluster, calibration))
        # d1 (speed 0.5) runs layer 1: forward 3 s * 2/4 samples / 0.5 + 0.1 = 3.1 per micro-batch.
        assert result.step_time_s == estimate(p, CostContext(alone, cluster, calibration)).step_time_s
        assert ops_of(result, "d1", "forward") == pytest.approx([3.1, 3.1])


def ops_of(result: Estimate, device: str, kind: str) -> list[float]:
    return [op.duration for op in result.timeline if op.device == device and op.kind == kind]


def test_per_kind_figures_compute_scale_per_call_and_update() -> None:
    library, cluster = two_kinds(), cluster_of([T1, T2], [1.0, 1.0])
    calibration = Calibration(
        compute_scale=10.0,  # not used: both kinds have figures of their own
        kinds={
            "cpu-t1": KindCalibration(update_s_per_param_byte=0.01, per_step_s=0.5),
            "cpu-t2": KindCalibration(compute_scale=2.0, per_micro_batch_s=0.25),
        },
    )
    result = estimate(plan([0, 1], [["d0"], ["d1"]]), CostContext(library, cluster, calibration))
    # d0: forward 1, backward 2; update 0.01 * 100 B + 0.5 = 1.5.  d1: forward 1 * 2 + 0.25, backward 2 * 2 + 0.25.
    assert ops_of(result, "d0", "forward") == pytest.approx([1.0])
    assert ops_of(result, "d0", "update") == pytest.approx([1.5])
    assert ops_of(result, "d1", "forward") == pytest.approx([2.25])
    assert ops_of(result, "d1", "backward") == pytest.approx([4.25])
    assert ops_of(result, "d1", "update") == pytest.approx([0.0])
    # F0 [0,1] +0.4, F1 [1.4,3.65], B1 [3.65,7.9] +0.4, B0 [8.3,10.3], update [10.3,11.8].
    assert result.step_time_s == pytest.approx(11.8, abs=TOL)


def gpu_case(cuda_aware: bool = False) -> tuple[LayerLibrary, Cluster, Calibration]:
    cpu = chain_library(2, [1.0, 1.0], [1.0, 1.0], [100, 100], [10, 10], batch_size=4, host=HERE)
    gpu = chain_library(2, [0.5, 0.5], [0.5, 0.5], [100, 100], [10, 10], batch_size=4, gpu_model="X", host=HERE)
    cluster = cluster_of([T1, {"kind": "cuda", "gpu_model": "X"}, {"kind": "cuda", "gpu_model": "X"}], [1, 1, 1])
    staging = KindCalibration(d2h_s_per_byte=0.001, h2d_s_per_byte=0.002, staging_per_copy_s=0.1)
    return cpu.with_kinds([gpu]), cluster, Calibration(kinds={"cuda-X": staging}, cuda_aware_mpi=cuda_aware)


def test_tensors_crossing_to_and_from_a_gpu_are_staged_through_host_memory() -> None:
    library, cluster, calibration = gpu_case()
    result = estimate(plan([0, 1], [["d0"], ["d1"]]), CostContext(library, cluster, calibration))
    # F0 on the CPU [0,1]; 40 B: link 0.4 + the GPU receiver's copy 0.1 + 40 * 0.002 = 0.58; F1 on the GPU
    # [1.58,2.08], B1 [2.08,2.58]; back: 0.4 + the GPU sender's copy 0.1 + 40 * 0.001 = 0.54; B0 [3.12,4.12].
    assert result.step_time_s == pytest.approx(4.12, abs=TOL)
    direct = estimate(
        plan([0, 1], [["d0"], ["d1"]]),
        CostContext(library, cluster, dataclasses.replace(calibration, cuda_aware_mpi=True)),
    )
    assert direct.step_time_s == pytest.approx(1 + 0.4 + 0.5 + 0.5 + 0.4 + 1, abs=TOL)


def test_gpu_replicas_stage_their_gradients_for_the_allreduce() -> None:
    library, cluster, calibration = gpu_case()
    # BSP on the two GPUs, 200 B of parameters: ring 2 * 1/2 * 200 / 100 = 2 s, plus one replica's staging
    # 2 * 0.1 + 200 * (0.001 + 0.002) = 0.8. Each replica computes 2 samples: (0.5 + 0.5) * 2/4 = 0.5 per pass.
    result = estimate(single_stage_plan(library, ["d1", "d2"]), CostContext(library, cluster, calibration))
    assert ops_of(result, "d1", "allreduce") == pytest.approx([2.8])
    assert result.step_time_s == pytest.approx(0.5 + 0.5 + 2.8, abs=TOL)


def test_device_terms_name_the_library_and_figures_of_each_device() -> None:
    library, cluster, calibration = gpu_case()
    terms = CostContext(library, cluster, calibration).terms
    assert terms["d0"].kind == "cpu-t1" and terms["d0"].library is library and not terms["d0"].cuda
    assert terms["d1"].kind == "cuda-X" and terms["d1"].library.gpu_model == "X" and terms["d1"].cuda
    assert terms["d1"].figures.staging_per_copy_s == 0.1 and terms["d0"].figures == KindCalibration()


def test_libraries_of_other_layers_are_refused_and_a_set_saves_and_loads(tmp_path: Path) -> None:
    library = two_kinds()
    other = chain_library(3, threads=4)
    with pytest.raises(LibraryError, match="does not match"):
        library.with_kinds([other])
    save_libraries(library, tmp_path / "libs")
    loaded = load_libraries(tmp_path / "libs")
    assert list(loaded.kind_libraries) == ["cpu-t1", "cpu-t2"]
    assert loaded.kind_libraries["cpu-t2"].layers == library.kind_libraries["cpu-t2"].layers
    assert loaded.host == HERE
    save_libraries(chain_library(2), tmp_path / "one")
    assert (tmp_path / "one" / "layers.csv").is_file() and not load_libraries(tmp_path / "one").kinds


def made_for(
    host: str = HERE,
    kinds: tuple[str, ...] = ("cpu-t1", "cpu-t2"),
    torch_version: str = "2.0.0",
    profiler_version: int = PROFILE_VERSION,
    cuda_aware_mpi: bool = False,
) -> Calibration:
    made = MadeFor(host, "test", kinds, torch_version, profiler_version, "toy", 4, cuda_aware_mpi)
    return Calibration(per_message_s=1e-4, made_for=made)


def test_a_calibration_saves_and_loads_with_its_kinds_and_what_it_was_made_for(tmp_path: Path) -> None:
    calibration = dataclasses.replace(
        made_for(), kinds={"cpu-t2": KindCalibration(compute_scale=1.5, d2h_s_per_byte=1e-9)}
    )
    assert Calibration.load(calibration.save(tmp_path / "c.json")) == calibration
    assert calibration.for_kind("cpu-t2").compute_scale == 1.5
    assert calibration.for_kind("cpu-t9") == KindCalibration()
    with pytest.raises(CalibrationError, match=r"kinds\.compute_scale must be > 0"):
        Calibration.from_dict({"kinds": {"cpu-t1": {"compute_scale": 0}}})
    with pytest.raises(CalibrationError, match=r"unknown field.*speed"):
        Calibration.from_dict({"kinds": {"cpu-t1": {"speed": 2}}})
    with pytest.raises(CalibrationError, match="made_for has no 'kinds'"):
        Calibration.from_dict({"made_for": {"cluster": "x"}})


@pytest.mark.parametrize(
    ("calibration", "message"),
    [
        (Calibration(per_message_s=1e-4), "does not record what it was made for"),
        (made_for(host="gpu-box-7"), "measured on host 'gpu-box-7'"),
        (made_for(kinds=("cpu-t1",)), "also has cpu-t2"),
        (made_for(torch_version="1.0.0"), "made with torch 1.0.0"),
        (made_for(profiler_version=PROFILE_VERSION - 1), f"profiler version {PROFILE_VERSION - 1}"),
        (made_for(cuda_aware_mpi=True), "TAPP_MPI_CUDA_AWARE=1"),
    ],
)
def test_a_calibration_made_for_another_set_up_is_refused(calibration: Calibration, message: str) -> None:
    library = two_kinds()
    for lib in library.kind_libraries.values():
        lib.torch_version, lib.extra["profile_version"] = "2.0.0", PROFILE_VERSION
    with pytest.raises(CalibrationError, match=message) as refused:
        check_calibration(calibration, cluster_of([T1, T2], [1, 1]), library, "c.json")
    assert "tapp calibrate" in str(refused.value)


def test_the_calibration_beside_a_cluster_file_is_picked_up(tmp_path: Path) -> None:
    cluster_file = tmp_path / "box.yaml"
    cluster_file.write_text(
        "devices:\n  - {name: d0, threads: 1, memory: 1GiB}\nlinks: {bandwidth: 1Gbit/s, latency: 0}\n"
    )
    cluster, library = load_cluster(cluster_file), chain_library(2)
    assert calibration_path(cluster_file) == tmp_path / "box.calibration.json"
    assert cluster_calibration(cluster_file, cluster, library) == Calibration()  # none there: the ideal one
    made_for(kinds=("cpu-t1",), torch_version="").save(tmp_path / "box.calibration.json")
    assert cluster_calibration(cluster_file, cluster, library).per_message_s == 1e-4
    made_for(host="elsewhere").save(tmp_path / "box.calibration.json")
    with pytest.raises(CalibrationError, match="elsewhere"):
        cluster_calibration(cluster_file, cluster, library)
