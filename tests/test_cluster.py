from pathlib import Path

import pytest
import yaml

from tapp_core.platform.cluster import ClusterError, load_cluster, parse_cluster
from tapp_core.units import UnitError, parse_bandwidth, parse_bytes, parse_seconds

GIB = 2**30


def write(tmp_path: Path, data: object, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def valid() -> dict:
    return {
        "name": "t",
        "devices": [{"name": "a", "memory": "1GiB"}, {"name": "b", "slowdown": 2, "memory": "1GiB"}],
        "links": {"bandwidth": "1Gbit/s", "latency": "100us"},
    }


def test_units() -> None:
    assert parse_bytes("4GiB") == 4 * GIB
    assert parse_bytes("2MB") == 2_000_000
    assert parse_bytes(512) == 512
    assert parse_bandwidth("1Gbit/s") == pytest.approx(1.25e8)
    assert parse_bandwidth("100Mbit/s") == pytest.approx(1.25e7)
    assert parse_bandwidth("100MB/s") == pytest.approx(1e8)
    assert parse_seconds("100us") == pytest.approx(1e-4)
    assert parse_seconds("2ms") == pytest.approx(2e-3)
    with pytest.raises(UnitError, match="unknown size unit"):
        parse_bytes("4GQ")
    with pytest.raises(UnitError, match="duration"):
        parse_seconds("soon")


def test_shipped_clusters_are_exactly_as_specified() -> None:
    local = load_cluster("local")
    assert [d.slowdown for d in local.devices] == pytest.approx([1, 2, 3])
    assert {d.threads for d in local.devices} == {1}
    assert {d.memory for d in local.devices} == {4 * GIB}
    assert local.link("cpu0", "cpu2").bandwidth == pytest.approx(1e9 / 8)
    assert local.link("cpu0", "cpu2").latency == pytest.approx(100e-6)

    homo = load_cluster("homo4")
    assert len(homo.devices) == 4 and {d.speed for d in homo.devices} == {1.0}
    assert {d.memory for d in homo.devices} == {8 * GIB}
    assert homo.link("cpu0", "cpu3").bandwidth == pytest.approx(10e9 / 8)
    assert homo.link("cpu0", "cpu3").latency == pytest.approx(20e-6)

    het = load_cluster("hetero4")
    assert [d.speed for d in het.devices] == [1.0, 0.8, 0.5, 0.25]
    assert [d.memory // GIB for d in het.devices] == [16, 16, 8, 8]
    assert het.link("cpu2", "cpu3").bandwidth == pytest.approx(100e6 / 8)
    assert het.link("cpu3", "cpu2").bandwidth == pytest.approx(100e6 / 8)
    assert het.link("cpu0", "cpu3").bandwidth == pytest.approx(1e9 / 8)
    assert het.link("cpu1", "cpu2").latency == pytest.approx(50e-6)

    h8 = load_cluster("hetero8")
    assert sorted(d.speed for d in h8.devices) == [0.5] * 4 + [1.0] * 2 + [8.0] * 2
    assert h8.link("fast0", "fast1").bandwidth == pytest.approx(10e9 / 8)
    assert h8.link("slow0", "slow3").bandwidth == pytest.approx(10e9 / 8)
    assert h8.link("fast0", "slow0").bandwidth == pytest.approx(1e9 / 8)
    assert h8.link("mid1", "fast1").bandwidth == pytest.approx(1e9 / 8)
    assert h8.device("fast0").memory == 24 * GIB


def test_load_by_path(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, valid()))
    assert cluster.device("b").speed == pytest.approx(0.5)
    assert cluster.fastest_device().name == "a"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["devices"][0].update(memory="lots"), r"devices\.0\.memory: .*size"),
        (lambda c: c["devices"][0].update(kind="tpu"), r"devices\.0\.kind"),
        (lambda c: c["devices"][1].update(speed=1.0), r"devices\.1: .*'speed' or 'slowdown', not both"),
        (lambda c: c["devices"][0].update(threads=0), r"devices\.0\.threads"),
        (lambda c: c["devices"][1].update(name="a"), r"device names must be unique; repeated: a"),
        (lambda c: c["links"].update(bandwidth="fast"), r"links\.bandwidth: .*bandwidth"),
        (lambda c: c["links"].pop("latency"), r"links\.latency: Field required"),
        (lambda c: c["devices"][0].update(colour="red"), r"devices\.0\.colour: Extra inputs"),
        (lambda c: c.update(devices=[]), r"devices: .*at least 1"),
        (
            lambda c: c["links"].update(overrides=[{"between": ["a", "zz"], "bandwidth": 1, "latency": 0}]),
            r"links\.overrides\.0\.between names unknown device\(s\): zz",
        ),
    ],
)
def test_malformed_cluster_names_file_field_and_problem(tmp_path: Path, mutate, message: str) -> None:
    data = valid()
    mutate(data)
    path = write(tmp_path, data, "broken.yaml")
    with pytest.raises(ClusterError, match=message) as info:
        load_cluster(path)
    assert str(path) in str(info.value)


def test_not_yaml_and_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="not valid YAML"):
        load_cluster(write(tmp_path, "devices: [\n", "bad.yaml"))
    with pytest.raises(ClusterError, match="expected a mapping"):
        load_cluster(write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_unknown_cluster_name_lists_known() -> None:
    with pytest.raises(ClusterError, match=r"unknown cluster 'nowhere'.*hetero4"):
        load_cluster("nowhere")
    with pytest.raises(ClusterError, match="does not exist"):
        load_cluster("missing/file.yaml")


def test_parse_cluster_direct() -> None:
    with pytest.raises(ClusterError, match="<cluster>"):
        parse_cluster({"devices": []})
