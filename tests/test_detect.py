"""``tapp cluster detect``'s parts: the cores split into ranks, the link fit, the cluster file; and a real
detection of this host (its CPU ranks, links measured by an MPI ping-pong under the project's mpiexec)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tapp_core.platform.cluster import ClusterError, load_cluster, parse_cluster
from tapp_core.platform.hosts import Gpu, Host, PairLink, fit_link, this_host
from tapp_core.runtime.detect import (
    MAX_CPU_RANKS,
    DetectError,
    cpu_ranks,
    devices_of,
    links_of,
    read_pairs,
    write_detected_cluster,
)

GIB = 2**30
H100 = Gpu(0, "NVIDIA H100 80GB HBM3", 80 * GIB)


def host(cores: int, gpus: int = 0) -> Host:
    return Host("h", cores, 128 * GIB, tuple(Gpu(i, H100.model, H100.memory_bytes) for i in range(gpus)))


@pytest.mark.parametrize(
    ("cores", "gpus", "threads", "expected"),
    [
        (16, 1, None, (3, 4)),  # the machine: 14 cores left, three 4-thread ranks
        (2, 0, None, (2, 1)),  # this machine
        (8, 0, None, (2, 4)),
        (4, 0, None, (2, 2)),
        (256, 0, None, (MAX_CPU_RANKS, 4)),
        (16, 1, 5, (2, 5)),
        (16, 2, 1, (MAX_CPU_RANKS, 1)),
        (2, 1, None, (0, 1)),  # a GPU and no core to spare: the GPU rank alone
    ],
)
def test_cores_are_split_into_cpu_ranks_beside_the_gpu_ranks(
    cores: int, gpus: int, threads: int | None, expected: tuple[int, int]
) -> None:
    assert cpu_ranks(host(cores, gpus), threads) == expected


def test_impossible_thread_counts_say_why() -> None:
    with pytest.raises(DetectError, match="--threads 15 is more than the 14 core"):
        cpu_ranks(host(16, 1), 15)
    with pytest.raises(DetectError, match="at least 1"):
        cpu_ranks(host(16), 0)
    with pytest.raises(DetectError, match="leave none for CPU ranks"):
        cpu_ranks(host(2, 1), 1)


def test_devices_are_every_gpu_then_the_cpu_ranks_sharing_the_memory() -> None:
    devices = devices_of(host(16, 1))
    cluster = parse_cluster(
        {"name": "t", "emulated": False, "devices": devices, "links": {"bandwidth": 1, "latency": 0}}
    )
    gpu, *cpus = cluster.devices
    assert (gpu.name, gpu.kind, gpu.gpu_index, gpu.gpu_model, gpu.memory) == ("gpu0", "cuda", 0, H100.model, 80 * GIB)
    assert [(d.name, d.kind, d.threads) for d in cpus] == [("cpu0", "cpu", 4), ("cpu1", "cpu", 4), ("cpu2", "cpu", 4)]
    assert sum(d.memory for d in cpus) == pytest.approx(128 * GIB, rel=1e-3)
    assert {d.speed for d in cluster.devices} == {1.0}


def test_link_fit_recovers_latency_and_bandwidth() -> None:
    sizes, latency, bandwidth = (8, 2**20, 2**24), 3e-6, 5e9
    one_way = [latency + n / bandwidth for n in sizes]
    fitted_latency, fitted_bandwidth = fit_link(sizes, one_way)
    assert fitted_latency == pytest.approx(latency, rel=1e-3)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert fit_link(sizes, [1e-5, 1e-5, 1e-5])[1] == float("inf")  # large messages no slower: noise


def pair(a: str, b: str, latency: float, bandwidth: float) -> PairLink:
    return PairLink((a, b), latency, bandwidth, (8, 2**24), (latency, latency + 2**24 / bandwidth))


def test_links_default_to_the_cpu_pairs_and_override_every_gpu_pair() -> None:
    devices = devices_of(host(16, 1))
    pairs = [pair("gpu0", f"cpu{i}", 20e-6, 4e9) for i in range(3)]
    pairs += [pair("cpu0", "cpu1", 1e-6, 9e9), pair("cpu0", "cpu2", 2e-6, 10e9), pair("cpu1", "cpu2", 3e-6, 11e9)]
    links = links_of(devices, pairs)
    cluster = parse_cluster({"name": "t", "emulated": False, "devices": devices, "links": links})
    assert cluster.link("cpu0", "cpu2").bandwidth == pytest.approx(10e9)
    assert cluster.link("cpu1", "cpu2").latency == pytest.approx(2e-6)  # the median, for every CPU pair
    for cpu in ("cpu0", "cpu1", "cpu2"):
        assert cluster.link("gpu0", cpu).bandwidth == pytest.approx(4e9)
        assert cluster.link(cpu, "gpu0").latency == pytest.approx(20e-6)


def test_ping_pong_output_that_is_not_what_it_should_be_is_an_error() -> None:
    assert read_pairs('{"pairs": []}') == []
    with pytest.raises(DetectError, match="ping-pong's output"):
        read_pairs('{"pairs": [{"between": ["a"]}]}')


def test_gpu_model_belongs_to_cuda_devices_only() -> None:
    def cluster(device: dict[str, object]) -> object:
        return parse_cluster({"name": "t", "devices": [device], "links": {"bandwidth": 1, "latency": 0}})

    with pytest.raises(ClusterError, match="gpu_model is for cuda devices; 'c' is a cpu device"):
        cluster({"name": "c", "memory": "1GiB", "gpu_model": "NVIDIA H100"})
    with pytest.raises(ClusterError, match=r"devices\.0\.gpu_model"):
        cluster({"name": "g", "kind": "cuda", "memory": "1GiB", "gpu_model": ""})


def test_shipped_gpubox_is_one_gpu_and_three_real_cpu_ranks() -> None:
    box = load_cluster("gpubox")
    assert not box.emulated
    assert [(d.name, d.kind, d.threads) for d in box.devices[1:]] == [(f"cpu{i}", "cpu", 4) for i in range(3)]
    gpu = box.devices[0]
    assert (gpu.kind, gpu.gpu_index, gpu.gpu_model) == ("cuda", 0, "NVIDIA H100 80GB HBM3")
    assert box.link("cpu0", "cpu1") != box.link("gpu0", "cpu1") == box.link("cpu2", "gpu0")


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_this_host_is_detected_with_measured_links(tmp_path: Path) -> None:
    out = tmp_path / "here.yaml"
    cluster = write_detected_cluster(out, threads=1)
    assert cluster == load_cluster(out) and cluster.name == "here" and not cluster.emulated
    found = this_host()
    assert len([d for d in cluster.devices if d.kind == "cuda"]) == len(found.gpus)
    cpus = [d for d in cluster.devices if d.kind == "cpu"]
    assert cpus and {d.threads for d in cpus} == {1}
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    measured = [line for line in header if " - " in line and "us" in line]
    assert len(measured) == len(cluster.pairs()), header  # one ping-pong line per pair of ranks
    data = yaml.safe_load(out.read_text())
    assert data["links"]["bandwidth"].endswith("MB/s") and data["links"]["latency"].endswith("us")
    for a, b in cluster.pairs():
        link = cluster.link(a, b)
        assert 1e6 < link.bandwidth < 1e13 and 0 < link.latency < 0.1


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_gpu_host_is_detected_with_its_gpus_and_their_links(tmp_path: Path) -> None:
    cluster = write_detected_cluster(tmp_path / "box.yaml")
    gpus = [d for d in cluster.devices if d.kind == "cuda"]
    assert len(gpus) == torch.cuda.device_count()
    assert gpus[0].gpu_model == torch.cuda.get_device_name(0)
    assert gpus[0].memory == torch.cuda.get_device_properties(0).total_memory // 2**20 * 2**20
    cpus = [d for d in cluster.devices if d.kind == "cpu"]
    if cpus:  # the GPU's links are its own, measured with staging through host memory
        overrides = yaml.safe_load((tmp_path / "box.yaml").read_text())["links"]["overrides"]
        assert [gpus[0].name, cpus[0].name] in [o["between"] for o in overrides]
