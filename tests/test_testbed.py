"""A real testbed on this machine (``tapp testbed up``): ranks started over ssh on their namespace hosts, inside
their quotas; links shaped; faults on real links (a rank killed, a link taken down, an sshd killed) named by host,
the pool restarted and nothing left behind; ``down`` after a crash. Needs root, network namespaces, a cpu cgroup
controller and sshd (``.ci/run`` installs openssh-server where it can); skipped otherwise, saying what is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import Cluster
from tapp_core.platform.testbed import down, missing, system, up
from tapp_core.platform.testbed.bed import restart_sshd
from tapp_core.platform.testbed.cgroups import Cgroups
from tapp_core.runtime import PoolError, WorkerPool
from tapp_core.runtime.detect import measure_cluster_links
from tests.test_runtime_faulty_models import FAULT_LAYER_STAGES

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(missing()), reason=f"no testbed here: missing {'; '.join(missing())}"),
]

PREFIX, SUBNET = "tapptt", "10.215.0.0/24"
STATES = Path(tempfile.gettempdir()) / "tapp-testbed-tests"
"""The tests' testbeds keep their state here, at the same place from run to run: a run that died with its
testbed up is cleaned up by the next (``down`` first)."""
TAPP = str(Path(sys.executable).parent / "tapp")
DEVICES = (("a",), ("b",), ("c",))
CLUSTER = {
    "name": "three",
    "devices": [
        {"name": "a", "memory": "2GiB"},
        {"name": "b", "memory": "2GiB", "speed": 0.5},
        {"name": "c", "memory": "2GiB", "speed": 0.5},
    ],
    "links": {
        "bandwidth": "1Gbit/s",
        "latency": "50us",
        "overrides": [{"between": ["b", "c"], "bandwidth": "200Mbit/s", "latency": "50us"}],
    },
}


def good_plan(steps_model: str = "mlp") -> Plan:
    return Plan(steps_model, 16, 4, "1f1b", (0, 0, 1, 1, 2, 2), DEVICES)


def stalling_plan() -> Plan:
    return Plan("tests.test_runtime_faulty_models:stalling", 16, 4, "gpipe", FAULT_LAYER_STAGES, DEVICES)


def leftovers(prefix: str, state: Path) -> list[str]:
    """Whatever of testbed ``prefix`` is still on this machine."""
    found = [f"namespace {n}" for n in system.namespaces() if n.startswith(f"{prefix}-")]
    links = system.run("ip", "-o", "link", "show").stdout.splitlines()
    found += [f"link {line.split(':')[1].strip()}" for line in links if f" {prefix}" in line]
    found += [f"qdisc {line}" for line in system.run("tc", "qdisc", "show").stdout.splitlines() if prefix in line]
    cgroups = Cgroups.find()
    assert cgroups is not None
    roots = {cgroups.cpu, *([cgroups.cpuset] if cgroups.cpuset else [])}
    found += [f"control group {p}" for root in roots for p in root.glob(f"{prefix}-*")]
    found += [f"process {pid}" for pid in _pids() if str(state) in system.command_line(pid)]
    return found + ([f"state folder {state}"] if state.exists() else [])


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def host_processes(cluster: Cluster, cgroups: Cgroups) -> list[str]:
    """The processes in the testbed hosts' control groups other than their sshd listeners."""
    found = []
    for host in {d.name for d in cluster.devices}:
        for pid in cgroups.pids(f"{PREFIX}-{host}"):
            line = system.command_line(pid)
            if line and "[listener]" not in line:
                found.append(f"{pid}: {line}")
    return found


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    folder = tmp_path_factory.mktemp("testbed")
    (folder / "three.yaml").write_text(yaml.safe_dump(CLUSTER))
    state = STATES / PREFIX
    down(PREFIX, state)
    try:
        cluster = up(folder / "three.yaml", folder / "three-testbed.yaml", prefix=PREFIX, subnet=SUBNET, state=state)
        yield cluster, state
    finally:
        down(PREFIX, state)
        assert leftovers(PREFIX, state) == []


@pytest.fixture
def cgroups() -> Cgroups:
    found = Cgroups.find()
    assert found is not None
    return found


def assert_nothing_left(pool: WorkerPool, cluster: Cluster, cgroups: Cgroups, wait_s: float = 20.0) -> None:
    """After ``pool`` closed: none of its ranks, and nothing but sshd in the hosts."""
    token = pool._token
    deadline = time.monotonic() + wait_s
    while True:
        ours = [pid for pid in _pids() if token in system.command_line(pid)]
        hosted = host_processes(cluster, cgroups)
        if not ours and not hosted:
            return
        assert time.monotonic() < deadline, f"left behind: ranks {ours}, on the hosts {hosted}"
        time.sleep(0.5)


def test_up_writes_a_real_cluster_and_a_second_up_is_refused(bed: tuple[Cluster, Path], tmp_path: Path) -> None:
    cluster, state = bed
    assert not cluster.emulated and cluster.ssh == str(state / "ssh")
    assert [d.host for d in cluster.devices] == ["10.215.0.10", "10.215.0.11", "10.215.0.12"]
    assert [d.speed for d in cluster.devices] == pytest.approx([1.0, 0.5, 0.5])
    command = [TAPP, "testbed", "up", "--cluster", "local", "--out", str(tmp_path / "x.yaml"), "--name", PREFIX]
    again = subprocess.run(
        [*command, "--subnet", SUBNET, "--state", str(state)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert "is up" in again.stderr and "tapp testbed down --name tapptt" in " ".join(again.stderr.split())


def test_ranks_start_over_ssh_on_their_hosts_inside_their_namespaces_and_quotas(
    bed: tuple[Cluster, Path], cgroups: Cgroups
) -> None:
    cluster, _ = bed
    with WorkerPool(cluster) as pool:
        pool.start()
        assert pool.bind_host == "10.215.0.1"  # rank 0 connects back over the bridge
        for device, rank in zip(cluster.devices, pool.ranks, strict=True):
            namespace = f"{PREFIX}-{device.name}"
            assert os.stat(f"/proc/{rank.pid}/ns/net").st_ino == os.stat(f"/run/netns/{namespace}").st_ino
            assert rank.pid in cgroups.pids(namespace)
            assert rank.bounded_memory  # it sees its host's memory limit (its device's memory) from its namespace
        measurement = pool.measure(good_plan(), steps=3, warmup=1, timeout_s=60)
        assert measurement.ok, measurement.error
        assert not measurement.emulated
    assert_nothing_left(pool, cluster, cgroups)


def test_the_ping_pong_finds_the_slow_link(bed: tuple[Cluster, Path]) -> None:
    cluster, _ = bed
    _, pairs = measure_cluster_links(cluster, repeats=2)
    found = {p.between: p.bandwidth_bytes_per_s for p in pairs}
    assert set(found) == {("a", "b"), ("a", "c"), ("b", "c")}
    assert found[("b", "c")] < 0.5 * min(found[("a", "b")], found[("a", "c")]), found


def test_a_rank_killed_during_a_measurement_is_named_and_the_pool_restarts(
    bed: tuple[Cluster, Path], cgroups: Cgroups
) -> None:
    cluster, _ = bed
    with WorkerPool(cluster, grace_s=5.0) as pool:
        pool.start()
        threading.Timer(1.5, os.kill, (pool.ranks[2].pid, signal.SIGKILL)).start()
        measurement = pool.measure(stalling_plan(), steps=40, warmup=1, timeout_s=60)
        assert not measurement.ok
        assert "rank 2 (c on host 10.215.0.12) ended first" in (measurement.error or ""), measurement.error
        assert "out of memory" not in (measurement.error or "") and pool.last_fault is not None
        assert pool.last_fault.out_of_memory == ()  # killed, but not for memory
        assert "the pool was restarted" in (measurement.error or "") and pool.restarts == 1
        after = pool.measure(good_plan(), steps=3, warmup=1, timeout_s=60)
        assert after.ok, after.error
    assert_nothing_left(pool, cluster, cgroups)


def test_a_rank_over_its_hosts_memory_limit_is_named_out_of_memory_and_the_pool_goes_on(
    bed: tuple[Cluster, Path], cgroups: Cgroups
) -> None:
    cluster, _ = bed
    filling = Plan("tests.test_runtime_faulty_models:filling", 32, 4, "gpipe", FAULT_LAYER_STAGES, DEVICES)
    with WorkerPool(cluster, grace_s=5.0) as pool:
        measurement = pool.measure(filling, steps=3, warmup=1, timeout_s=60)  # host b's rank fills 3 GiB of its 2
        assert not measurement.ok
        error = measurement.error or ""
        assert (
            "out of memory on device 'b' (rank 1 (b on host 10.215.0.11)): the kernel killed it at its memory "
            "limit of 2 GiB" in error
        ), error
        assert pool.last_fault is not None and pool.last_fault.out_of_memory == ("b",)
        after = pool.measure(good_plan(), steps=3, warmup=1, timeout_s=60)
        assert after.ok, after.error
        assert pool.last_fault.out_of_memory == ("b",)  # the last fault's, not cleared by a good job
    assert_nothing_left(pool, cluster, cgroups)


def test_a_link_taken_down_during_a_measurement_names_its_host(bed: tuple[Cluster, Path], cgroups: Cgroups) -> None:
    cluster, _ = bed
    link = f"{PREFIX}h2"  # host c's veth on the bridge
    with WorkerPool(cluster, grace_s=3.0) as pool:
        pool.start()
        threading.Timer(1.5, system.run, ("ip", "link", "set", link, "down")).start()
        try:
            measurement = pool.measure(stalling_plan(), steps=40, warmup=1, timeout_s=6)
        finally:
            time.sleep(2.0)  # the timer has fired
            system.run("ip", "link", "set", link, "up")
        assert not measurement.ok
        assert "host 10.215.0.12 (c) does not answer over ssh" in (measurement.error or ""), measurement.error
        after = pool.measure(good_plan(), steps=3, warmup=1, timeout_s=60)
        assert after.ok, after.error
        assert pool.restarts >= 1
    assert_nothing_left(pool, cluster, cgroups, wait_s=60.0)


def test_an_sshd_killed_during_a_measurement_names_its_host_at_the_restart(
    bed: tuple[Cluster, Path], cgroups: Cgroups
) -> None:
    """Hydra's proxies report to mpiexec over their own connections: a job already running on a host outlives
    that host's sshd. The next start of the pool needs it, fails naming the host, and starts again once the sshd
    is back."""
    cluster, state = bed
    with WorkerPool(cluster, grace_s=5.0) as pool:
        pool.start()

        killed: list[float] = []

        def kill_sshd() -> None:
            for pid in system.namespace_pids(f"{PREFIX}-c"):
                if system.command_line(pid).startswith("sshd"):
                    os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())

        threading.Timer(1.0, kill_sshd).start()
        during = pool.measure(good_plan(), steps=400, warmup=1, timeout_s=60)
        ended = time.monotonic()
        assert during.ok, during.error
        assert killed and killed[0] < ended, "the measurement ended before the sshd was killed"
        with pytest.raises(PoolError, match=r"host 10\.215\.0\.12 \(c\) does not answer over ssh.*refused"):
            pool.restart()
        restart_sshd("c", PREFIX, state)
        after = pool.measure(good_plan(), steps=3, warmup=1, timeout_s=60)
        assert after.ok, after.error
    assert_nothing_left(pool, cluster, cgroups)


def test_down_after_a_crashed_up_removes_what_it_recorded(tmp_path: Path) -> None:
    prefix = "tapptc"
    state = STATES / prefix
    down(prefix, state)
    up_command = [TAPP, "testbed", "up", "--cluster", "local"]
    up_command += ["--out", str(tmp_path / "t.yaml"), "--name", prefix, "--subnet", "10.216.0.0/24"]
    crashing = subprocess.Popen([*up_command, "--state", str(state)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # killed once its first host's sshd runs, before the others'
        try:
            made = json.loads((state / "testbed.json").read_text()).get("made", [])
        except (OSError, ValueError):
            made = []
        if any(entry["kind"] == "sshd" for entry in made):
            break
        time.sleep(0.02)
    crashing.send_signal(signal.SIGKILL)
    crashing.wait()
    assert f"{prefix}-cpu0" in system.namespaces()
    assert down(prefix, state) is True
    assert leftovers(prefix, state) == []
    assert down(prefix, state) is False  # nothing left to take down
    assert not (tmp_path / "t.yaml").exists()


def test_the_record_names_every_thing_made(bed: tuple[Cluster, Path]) -> None:
    cluster, state = bed
    made = json.loads((state / "testbed.json").read_text())["made"]
    names = {(e["kind"], e.get("name")) for e in made}
    assert {
        ("link", f"{PREFIX}br"),
        ("link", f"{PREFIX}h0"),
        ("netns", f"{PREFIX}-a"),
        ("cgroup", f"{PREFIX}-c"),
    } <= names
    assert sorted(e["host"] for e in made if e["kind"] == "sshd")[:3] == ["a", "b", "c"]
    assert cluster.ssh == str(state / "ssh") and (state / "ssh_config").is_file()
