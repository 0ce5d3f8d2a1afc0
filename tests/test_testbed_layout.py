"""What a testbed is made of, before anything is made: hosts, addresses, quotas, shaping, control groups (on a
made-up control-group tree), the cluster file it writes, and the refusals. No root needed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.cli.testbed import parse_cores
from tapp_core.platform import testbed
from tapp_core.platform.cluster import load_cluster, parse_cluster
from tapp_core.platform.testbed import plan_testbed, system
from tapp_core.platform.testbed.cgroups import Cgroups, mount_commands
from tapp_core.platform.testbed.layout import PERIOD_US, host_groups, real_cluster
from tapp_core.platform.testbed.shaping import shaping_commands


def test_every_device_of_hetero4_is_a_host_with_its_quota_and_its_links() -> None:
    cluster = load_cluster("hetero4")  # speeds 1, 0.8, 0.5, 0.25 and one slow pair
    layout = plan_testbed(cluster, [0, 1])
    assert [h.name for h in layout.hosts] == ["cpu0", "cpu1", "cpu2", "cpu3"]
    assert [h.address for h in layout.hosts] == ["10.213.0.10", "10.213.0.11", "10.213.0.12", "10.213.0.13"]
    assert layout.bridge_address == "10.213.0.1" and layout.bridge == "tapptbbr"
    # 2.55 cores of shares on 2 cores: all scaled by 2 / 2.55, the ratios kept
    assert layout.scale == pytest.approx(2 / 2.55)
    assert [h.quota_cpus for h in layout.hosts] == pytest.approx([s * 2 / 2.55 for s in (1, 0.8, 0.5, 0.25)])
    assert sum(h.quota_cpus for h in layout.hosts) == pytest.approx(2)
    assert layout.speeds["cpu3"] / layout.speeds["cpu0"] == pytest.approx(0.25)
    assert all(h.cores is None for h in layout.hosts)  # 4 threads on 2 cores: shared
    assert layout.period_us == PERIOD_US and layout.quota_us(layout.hosts[3]) == round(0.25 * 2 / 2.55 * PERIOD_US)
    rates = {(s.source, s.target): s.bytes_per_s for s in layout.shaping}
    assert len(rates) == 12  # every ordered pair of 4 hosts
    assert rates[(2, 3)] == rates[(3, 2)] == pytest.approx(100e6 / 8)
    assert rates[(0, 1)] == pytest.approx(1e9 / 8)


def test_hosts_with_enough_cores_get_their_own() -> None:
    layout = plan_testbed(load_cluster("local"), [0, 1, 2, 3])
    assert [h.cores for h in layout.hosts] == [(0,), (1,), (2,)]
    assert layout.scale == 1.0
    assert [h.quota_cpus for h in layout.hosts] == pytest.approx([1, 0.5, 1 / 3])


def test_devices_naming_one_host_share_it() -> None:
    cluster = parse_cluster(
        {
            "name": "two",
            "devices": [
                {"name": "a", "memory": "1GiB", "host": "n1"},
                {"name": "b", "memory": "1GiB", "host": "n2", "speed": 0.5},
                {"name": "c", "memory": "1GiB", "host": "n1"},
            ],
            "links": {"bandwidth": "100Mbit/s", "latency": "1ms"},
        }
    )
    groups = host_groups(cluster)
    assert [(name, [d.name for d in devices]) for name, devices in groups] == [("n1", ["a", "c"]), ("n2", ["b"])]
    layout = plan_testbed(cluster, [0, 1, 2, 3])
    assert [h.devices for h in layout.hosts] == [("a", "c"), ("b",)]
    assert layout.hosts[0].quota_cpus == pytest.approx(2) and layout.hosts[1].quota_cpus == pytest.approx(0.5)
    assert [h.memory_bytes for h in layout.hosts] == [2 * 2**30, 2**30]  # its devices' memory together
    assert layout.host_of("c").address == "10.213.0.10"
    assert any("loopback, not shaped" in note for note in layout.notes)


def test_fast_links_are_left_to_the_veth() -> None:
    cluster = parse_cluster(
        {
            "name": "fast",
            "devices": [{"name": "a", "memory": "1GiB"}, {"name": "b", "memory": "1GiB"}],
            "links": {"bandwidth": "100Gbit/s", "latency": 0},
        }
    )
    layout = plan_testbed(cluster, [0])
    assert layout.shaping == ()
    assert any("not shaped" in note for note in layout.notes)


@pytest.mark.parametrize(
    ("prefix", "subnet", "message"),
    [
        ("Bad", "10.213.0.0/24", "must be a lowercase letter"),
        ("muchtoolong", "10.213.0.0/24", "at most 7"),
        ("tb", "8.8.8.0/24", "not a private range"),
        ("tb", "10.213.0.0/30", "no room"),
        ("tb", "10.213.0.1/24", "not an IPv4 network"),
    ],
)
def test_bad_names_and_subnets_are_refused(prefix: str, subnet: str, message: str) -> None:
    with pytest.raises(testbed.TestbedError, match=message):
        plan_testbed(load_cluster("local"), [0, 1], subnet, prefix)


def test_a_gpu_cluster_is_refused() -> None:
    with pytest.raises(testbed.TestbedError, match="GPU device"):
        plan_testbed(load_cluster("gpubox"), [0, 1])


def test_shaping_classes_per_peer_and_netem_only_where_the_kernel_has_it() -> None:
    layout = plan_testbed(load_cluster("hetero4"), [0, 1])
    host = layout.hosts[2]
    commands = [" ".join(c) for c in shaping_commands(layout, host, latency=False)]
    assert commands[0] == "tc qdisc add dev tapptbn2 root handle 1: htb default 1"
    assert any("classid 1:13 htb rate 100000000bit ceil 100000000bit" in c for c in commands)
    assert any("match ip dst 10.213.0.13/32 flowid 1:13" in c for c in commands)
    assert any("classid 1:10 htb rate 1000000000bit" in c for c in commands)
    assert not any("netem" in c for c in commands)
    with_latency = [" ".join(c) for c in shaping_commands(layout, host, latency=True)]
    assert "tc qdisc add dev tapptbn2 parent 1:13 netem delay 50us" in with_latency


def test_the_written_cluster_is_real_with_every_device_on_its_host() -> None:
    cluster = load_cluster("hetero4")
    layout = plan_testbed(cluster, [0, 1])
    written = parse_cluster(real_cluster(cluster, layout, "/state/ssh"), "<testbed>")
    assert not written.emulated and written.ssh == "/state/ssh" and written.name == "hetero4-testbed"
    assert [d.host for d in written.devices] == [h.address for h in layout.hosts]
    assert [d.speed for d in written.devices] == pytest.approx([s * 2 / 2.55 for s in (1, 0.8, 0.5, 0.25)], rel=1e-5)
    assert written.link("cpu2", "cpu3").bandwidth == pytest.approx(100e6 / 8)
    assert written.link("cpu0", "cpu1").bandwidth == pytest.approx(1e9 / 8)


def mounts(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mounts"
    path.write_text(text)
    return path


def test_cgroup_v1_groups_get_quota_period_and_cores(tmp_path: Path) -> None:
    cpu, cpuset = tmp_path / "cpu", tmp_path / "cpuset"
    for folder in (cpu, cpuset):
        folder.mkdir()
    (cpu / "cpu.cfs_quota_us").write_text("-1")
    (cpuset / "cpuset.mems").write_text("0")
    found = Cgroups.find(
        mounts(
            tmp_path,
            f"cgroup {cpu} cgroup rw,cpu 0 0\ncgroup {cpuset} cgroup rw,cpuset 0 0\ncgroup2 /u cgroup2 rw 0 0\n",
        )
    )
    assert found == Cgroups(1, cpu, cpuset)
    for name in ("cpu.cfs_period_us", "cpu.cfs_quota_us"):  # what the kernel would offer in a new group
        (cpu / "g").mkdir(exist_ok=True)
        (cpu / "g" / name).touch()
    (cpuset / "g").mkdir()
    for name in ("cpuset.mems", "cpuset.cpus"):
        (cpuset / "g" / name).touch()
    found.make("g", 2500, 10000, (1,))
    assert (cpu / "g" / "cpu.cfs_quota_us").read_text() == "2500"
    assert (cpu / "g" / "cpu.cfs_period_us").read_text() == "10000"
    assert (cpuset / "g" / "cpuset.cpus").read_text() == "1" and (cpuset / "g" / "cpuset.mems").read_text() == "0"
    assert found.procs_files("g") == [cpu / "g" / "cgroup.procs", cpuset / "g" / "cgroup.procs"]


def test_cgroup_v2_groups_write_cpu_max(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids")
    (root / "cgroup.subtree_control").write_text("")
    found = Cgroups.find(mounts(tmp_path, f"cgroup2 {root} cgroup2 rw 0 0\n"))
    assert found == Cgroups(2, root, root, root)
    (root / "g").mkdir()
    (root / "g" / "cpu.max").touch()
    found.make("g", 5000, 10000, None)
    assert (root / "g" / "cpu.max").read_text() == "5000 10000"
    assert (root / "cgroup.subtree_control").read_text() == "+cpu"
    assert found.memory_limit("g") is None


def test_cgroup_v2_groups_write_memory_max(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    (root / "g").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory")
    for name in ("cgroup.subtree_control", "g/cpu.max", "g/memory.max", "g/memory.swap.max"):
        (root / name).touch()
    found = Cgroups.find(mounts(tmp_path, f"cgroup2 {root} cgroup2 rw 0 0\n"))
    assert found is not None
    found.make("g", None, 10000, None, 3 * 2**30)
    assert (root / "g" / "memory.max").read_text() == str(3 * 2**30)
    assert (root / "g" / "memory.swap.max").read_text() == "0"
    assert found.memory_limit("g") == 3 * 2**30


def test_cgroup_v1_memory_is_a_hierarchy_of_its_own(tmp_path: Path) -> None:
    cpu, memory = tmp_path / "cpu", tmp_path / "memory"
    for folder in (cpu / "g", memory / "g"):
        folder.mkdir(parents=True)
    for name in ("cpu/cpu.cfs_quota_us", "cpu/g/cpu.cfs_quota_us", "cpu/g/cpu.cfs_period_us"):
        (tmp_path / name).touch()
    (memory / "g" / "memory.limit_in_bytes").write_text("9223372036854771712")
    found = Cgroups.find(mounts(tmp_path, f"cgroup {cpu} cgroup rw,cpu 0 0\ncgroup {memory} cgroup rw,memory 0 0\n"))
    assert found == Cgroups(1, cpu, None, memory)
    assert found.memory_limit("g") is None  # the kernel's "no limit"
    (memory / "g" / "memory.limit_in_bytes").write_text("")  # the kernel's file takes a write whole; this one appends
    assert found.make("g", 2500, 10000, None, 2**30) == [cpu / "g", memory / "g"]
    assert (memory / "g" / "memory.limit_in_bytes").read_text() == str(2**30)
    assert found.memory_limit("g") == 2**30
    assert found.procs_files("g") == [cpu / "g" / "cgroup.procs", memory / "g" / "cgroup.procs"]


def test_no_cpu_controller_is_none(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids")
    assert Cgroups.find(mounts(tmp_path, f"cgroup2 {root} cgroup2 rw 0 0\n")) is None
    assert Cgroups.find(tmp_path / "no-such-file") is None


def test_up_and_down_say_in_one_line_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(system, "missing", lambda: ["root (this is uid 1000)", "sshd and ssh (Debian: ...)"])
    for args in (("up", "--cluster", "local", "--out", str(tmp_path / "t.yaml")), ("down",)):
        result = CliRunner().invoke(app, ["testbed", *args])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 or " ".join(lines).startswith("error:"), result.output
        said = " ".join(result.output.split())
        assert "missing here: root (this is uid 1000); sshd and ssh" in said, said
    assert not (tmp_path / "t.yaml").exists()


def test_cores_are_read_as_ranges() -> None:
    assert parse_cores("0-2,5") == [0, 1, 2, 5]
    assert parse_cores(None) is None
    with pytest.raises(testbed.TestbedError, match="--cores"):
        parse_cores("a-b")


def test_service_hosts_come_after_the_devices_hosts_without_quota_or_shaping() -> None:
    layout = plan_testbed(load_cluster("local"), [0, 1], service_hosts=("tracking", "orchestrator"))
    tracking, orchestrator = layout.hosts[3], layout.hosts[4]
    assert (tracking.name, tracking.address, tracking.devices) == ("tracking", "10.213.0.13", ())
    assert orchestrator.address == "10.213.0.14"
    assert layout.quota_us(tracking) is None and layout.quota_us(layout.hosts[0]) == PERIOD_US
    assert {s.source for s in layout.shaping} | {s.target for s in layout.shaping} == {0, 1, 2}
    with pytest.raises(testbed.TestbedError, match="given twice"):
        plan_testbed(load_cluster("local"), [0, 1], service_hosts=("cpu0",))


def test_a_host_s_fresh_sys_mounts_the_control_groups_again_read_only(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n"
        "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n"
        "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,relatime,cpu,cpuacct 0 0\n"
        "cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
    )
    assert mount_commands(mounts) == [
        "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup",
        "mkdir -p /sys/fs/cgroup/cpu,cpuacct && mount -t cgroup -o ro,cpu,cpuacct cgroup /sys/fs/cgroup/cpu,cpuacct",
        "mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o ro,name=systemd cgroup /sys/fs/cgroup/systemd",
        "mkdir -p /sys/fs/cgroup/unified && mount -t cgroup2 -o ro cgroup2 /sys/fs/cgroup/unified",
    ]
    unified = tmp_path / "unified"
    unified.write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n")
    assert mount_commands(unified) == [
        "mkdir -p /sys/fs/cgroup && mount -t cgroup2 -o ro,nsdelegate cgroup2 /sys/fs/cgroup"
    ]


def test_a_process_finds_its_own_memory_group_as_its_pid_s() -> None:
    cgroups = Cgroups.find()
    if cgroups is None or cgroups.memory is None:
        pytest.skip("no memory controller mounted here")
    assert cgroups.memory_group_of() == cgroups.memory_group_of(os.getpid()) is not None
