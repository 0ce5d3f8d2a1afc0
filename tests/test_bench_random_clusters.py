"""The random clusters of issue 14's benchmark: deterministic, within the issue's ranges, written and read back
exactly; hetero8 replicated for the scale runs."""

from pathlib import Path

from bench.random_clusters import (
    BETWEEN_ISLANDS_MBIT,
    DOMINANT_RATIO,
    ISOLATED_MBIT,
    MEMORY_GIB,
    SMALL_MEMORY_GIB,
    SPEEDS,
    cluster_data,
    describe,
    random_cluster_data,
    random_clusters,
    replicated,
    write_cluster,
)
from tapp_core.platform.cluster import Cluster, load_cluster

GIB = 2**30
MBIT = 1e6 / 8  # bytes per second


def test_deterministic_for_count_and_seed() -> None:
    assert random_clusters(6, 1) == random_clusters(6, 1)
    assert random_clusters(3, 1) == random_clusters(12, 1)[:3], "cluster i must not depend on how many are drawn"
    assert random_clusters(6, 1) != random_clusters(6, 2)
    assert len({c.name for c in random_clusters(12, 1)}) == 12


def _links_mbit(cluster: Cluster) -> list[float]:
    return [cluster.link(a, b).bandwidth / MBIT for a, b in cluster.pairs()]


def test_clusters_cover_the_ranges_of_the_issue() -> None:
    clusters = random_clusters(200, 7)
    assert {len(c.devices) for c in clusters} == set(range(3, 9))
    speeds = [d.speed for c in clusters for d in c.devices]
    assert SPEEDS[0] <= min(speeds) and max(speeds) <= SPEEDS[1]
    assert min(speeds) < 0.1 and max(speeds) > 10, "speeds should span the log-uniform range"
    memory = [d.memory / GIB for c in clusters for d in c.devices]
    assert MEMORY_GIB[0] <= min(memory) and max(memory) <= MEMORY_GIB[1] + 1e-3
    assert any(m < 1.23 for m in memory), "some device must be too small for Inception-V3 alone (1.23 GiB)"
    links = [mbit for c in clusters for mbit in _links_mbit(c)]
    assert 10 <= min(links) < 20 and 50_000 < max(links) <= 100_000
    assert all(d.kind == "cpu" and d.threads == 1 for c in clusters for d in c.devices)


def _ranked(cluster: Cluster) -> list[float]:
    return sorted((d.speed for d in cluster.devices), reverse=True)


def test_some_clusters_have_a_dominant_device_and_some_do_not() -> None:
    dominant = [_ranked(c)[0] >= DOMINANT_RATIO[0] * _ranked(c)[1] * 0.99 for c in random_clusters(60, 3)]
    assert 10 < sum(dominant) < 55


def test_some_clusters_isolate_their_fastest_device() -> None:
    isolated = 0
    for cluster in random_clusters(60, 3):
        fastest = max(cluster.devices, key=lambda d: d.speed).name
        out = [cluster.link(fastest, d).bandwidth / MBIT for d in cluster.device_names if d != fastest]
        if max(out) <= ISOLATED_MBIT[1] and max(_links_mbit(cluster)) > BETWEEN_ISLANDS_MBIT[1]:
            isolated += 1
    assert isolated >= 5


def test_small_devices_exist_and_islands_have_slow_links_between_them() -> None:
    small = [d for c in random_clusters(60, 4) for d in c.devices if d.memory <= SMALL_MEMORY_GIB[1] * GIB]
    assert small
    spread = [max(_links_mbit(c)) / min(_links_mbit(c)) for c in random_clusters(60, 4) if len(c.devices) > 3]
    assert max(spread) > 100, "islands: fast links inside, slow links between"


def test_device_count_can_be_fixed_for_the_scale_runs() -> None:
    clusters = random_clusters(2, 5, devices=16)
    assert [len(c.devices) for c in clusters] == [16, 16]
    assert clusters[0].name.endswith("-n16")
    assert random_cluster_data(5, 0, 16)["name"] != random_cluster_data(5, 0)["name"]


def test_written_clusters_read_back_exactly(tmp_path: Path) -> None:
    for cluster in [*random_clusters(20, 1), replicated(load_cluster("hetero8"), 2), load_cluster("hetero4")]:
        path = write_cluster(cluster, tmp_path)
        assert path == tmp_path / f"{cluster.name}.yaml"
        assert load_cluster(path) == cluster
        assert path.read_text().startswith(f"# {describe(cluster)}")
    text = (tmp_path / "hetero4.yaml").read_text()
    assert "memory: 16384MiB" in text and "bandwidth: 100Mbit/s" in text and "latency: 50us" in text


def test_cluster_data_keeps_units_only_where_exact() -> None:
    cluster = random_clusters(1, 1)[0]
    data = cluster_data(cluster)
    assert all(str(d["memory"]).endswith("MiB") for d in data["devices"])
    assert all(str(o["bandwidth"]).endswith("Mbit/s") for o in data["links"]["overrides"])


def test_hetero8_replicated_keeps_its_groups() -> None:
    hetero8 = load_cluster("hetero8")
    doubled = replicated(hetero8, 2)
    assert doubled.name == "hetero8x2" and len(doubled.devices) == 16
    assert doubled.link("fast0-0", "fast1-1") == hetero8.link("fast0", "fast1")
    assert doubled.link("fast0-0", "fast0-1") == hetero8.link("fast0", "fast1")
    assert doubled.link("fast0-1", "mid1-0") == hetero8.link("fast0", "mid1")
    assert doubled.device("slow3-1").speed == hetero8.device("slow3").speed
    assert len(replicated(hetero8, 4).devices) == 32


def test_describe_names_a_dominant_and_isolated_fastest_device() -> None:
    data = {
        "name": "t",
        "devices": [
            {"name": "fast", "speed": 10, "memory": "8GiB"},
            {"name": "a", "speed": 1, "memory": "1GiB"},
            {"name": "b", "speed": 1, "memory": "2GiB"},
        ],
        "links": {
            "bandwidth": "10Gbit/s",
            "latency": "50us",
            "overrides": [{"between": ["fast", "a"], "bandwidth": "50Mbit/s", "latency": "50us"}],
        },
    }
    text = describe(Cluster.model_validate(data))
    assert "dominant fast (10.0x the next)" in text
    assert "out of fastest fast 50 Mbit/s-10 Gbit/s" in text
    assert "memory 1.00-8 GiB" in text


def test_drawn_thread_counts_leave_speeds_memory_and_links_as_they_are(tmp_path: Path) -> None:
    plain, kinds = random_clusters(30, 5), random_clusters(30, 5, threads=(1, 2))
    for one, other in zip(plain, kinds, strict=True):
        assert other.name == f"{one.name}-t1-2"
        assert [(d.name, d.speed, d.memory) for d in one.devices] == [
            (d.name, d.speed, d.memory) for d in other.devices
        ]
        assert one.links == other.links
        assert load_cluster(write_cluster(other, tmp_path)) == other
    drawn = [d.threads for c in kinds for d in c.devices]
    assert set(drawn) == {1, 2} and 0.3 < drawn.count(2) / len(drawn) < 0.7
    assert "threads 1: " in describe(next(c for c in kinds if len({d.threads for d in c.devices}) > 1))


def test_drawn_kinds_are_costed_from_their_own_committed_library() -> None:
    from bench.planners import LIBRARIES, library_for
    from tapp_core.profile.device_libraries import device_library
    from tapp_core.profile.library import PROFILE_VERSION, LayerLibrary

    for threads in (1, 2):  # committed and current, so that library_for reads them and profiles nothing
        committed = LayerLibrary.load(LIBRARIES / f"alexnet_b64-t{threads}")
        assert committed.extra.get("profile_version") == PROFILE_VERSION and committed.threads == threads
    one = library_for("alexnet", 64)
    both = library_for("alexnet", 64, (1, 2))
    assert list(one.kind_libraries) == ["cpu-t1"] and set(both.kind_libraries) == {"cpu-t1", "cpu-t2"}
    cluster = next(c for c in random_clusters(10, 4, threads=(1, 2)) if len({d.threads for d in c.devices}) > 1)
    for device in cluster.devices:
        chosen = device_library(both, cluster, device.name)
        assert chosen.own and chosen.library.threads == device.threads and chosen.speed_applies
    t1, t2 = (both.kind_libraries[k].layers for k in ("cpu-t1", "cpu-t2"))
    ratios = [a.forward_s / b.forward_s for a, b in zip(t1, t2, strict=True) if b.forward_s > 0]
    assert max(ratios) / min(ratios) > 1.2, "two kinds whose per-layer ratio is one number would add nothing"
