"""Before anything starts: a plan that cannot run fails with one PlanError line, a pool of a plan's devices only,
and a pool too large for this host refused with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tapp_core.plan.plan import Plan, PlanError
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.platform.hosts import OVERSUBSCRIBE_VARIABLE, HostCapacity, overload, oversubscribe_allowed
from tapp_core.runtime import PoolRefused, WorkerPool, check_before_launch, measure, train
from tapp_core.runtime.pool import PORTS_VARIABLE, mpiexec_command, pool_devices, port_range


def cluster_of(n: int, **device: object) -> Cluster:
    devices = [{"name": f"d{i}", "memory": "2GiB", **device} for i in range(n)]
    return parse_cluster(
        {"name": f"c{n}", "emulated": False, "devices": devices, "links": {"bandwidth": "1Gbit/s", "latency": "0us"}}
    )


THREE = (("d0",), ("d1",), ("d2",))
CANNOT_RUN = [
    (Plan("mlp", 16, 4, "gpipe", (0, 0, 1, 1, 2), THREE), "plan places 5 layers but the traced model has 6"),
    (Plan("mlp", 16, 4, "gpipe", (0, 0, 1, 1, 0, 1), THREE[:2]), "runs backward: stage 1 feeds stage 0"),
    (Plan("mlp", 16, 4, "gpipe", (0, 0, 1, 2, 3, 2), THREE), r"layer 4 \(\w+\) is on stage 3, but stages are 0..2"),
    (Plan("mlp", 16, 4, "gpipe", (0, 0, 0, 0, 2, 2), THREE), "stage 1 has no layer"),
    (Plan("mlp", 16, 4, "gpipe", (0, 0, 1, 1, 2, 2), (("d0",), ("d1",), ("gpu9",))), "unknown device 'gpu9'"),
    (Plan("mlp", 16, 3, "gpipe", (0, 0, 1, 1, 2, 2), THREE), "not divisible by 3 micro-batches"),
]


@pytest.mark.parametrize(("plan", "message"), CANNOT_RUN, ids=[m for _, m in CANNOT_RUN])
def test_a_plan_that_cannot_run_fails_before_any_pool_is_made(
    plan: Plan, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PORTS_VARIABLE, "no-port")  # making a pool would raise PoolRefused: the check must come first
    with pytest.raises(PlanError, match=message):
        measure(plan, cluster_of(3))
    with pytest.raises(PlanError, match=message):
        train(plan, cluster_of(3), dataset="synthetic")


def test_a_runnable_plan_passes_the_checks() -> None:
    check_before_launch(Plan("mlp", 16, 4, "1f1b", (0, 0, 1, 1, 2, 2), THREE), cluster_of(3))


@pytest.mark.timeout(120)
def test_tapp_measure_reports_a_plan_that_cannot_run_in_one_line(tmp_path: Path) -> None:
    plan = Plan("mlp", 16, 4, "gpipe", (0, 0, 1, 1, 0, 1), (("cpu0",), ("cpu1",))).save(tmp_path / "plan.json")
    tapp = Path(sys.executable).parent / "tapp"
    done = subprocess.run(
        [str(tapp), "measure", "-m", "mlp", "-c", "local", "-p", str(plan)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "runs backward" in lines[0], done.stderr


# --- which ranks a pool starts ---------------------------------------------------------------------------------


def test_a_pool_starts_its_devices_in_the_clusters_order() -> None:
    cluster = cluster_of(5)
    assert pool_devices(cluster, None) == ("d0", "d1", "d2", "d3", "d4")
    assert pool_devices(cluster, ["d4", "d1"]) == ("d1", "d4")
    with pytest.raises(Exception, match="has no device"):
        pool_devices(cluster, ["d1", "x"])


def test_the_host_list_follows_the_pools_devices() -> None:
    cluster = parse_cluster(
        {
            "name": "c",
            "devices": [
                {"name": "a", "memory": "1GiB", "host": "n1"},
                {"name": "b", "memory": "1GiB", "host": "n2"},
                {"name": "c", "memory": "1GiB", "host": "n2"},
            ],
            "links": {"bandwidth": "1Gbit/s", "latency": "1us"},
        }
    )
    assert mpiexec_command(cluster, ["p"], "mpiexec", ["b", "c"]) == ["mpiexec", "-n", "2", "-hosts", "n2:2", "p"]


def test_a_pool_refuses_plans_on_devices_it_did_not_start() -> None:
    pool = WorkerPool(cluster_of(3), devices=["d1", "d2"])
    with pytest.raises(PlanError, match=r"device\(s\) d0 that this pool did not start \(it runs d1, d2\)"):
        pool.check_plan(Plan("mlp", 16, 2, "gpipe", (0, 0, 0, 1, 1, 1), (("d0",), ("d2",))))
    pool.check_plan(Plan("mlp", 16, 2, "gpipe", (0, 0, 0, 1, 1, 1), (("d2",), ("d1",))))


# --- how many ranks this host can hold -------------------------------------------------------------------------


def test_a_small_host_holds_the_default_cluster_but_not_a_thousand_ranks() -> None:
    small = HostCapacity(cores=2, available_bytes=16 * 2**30)
    assert overload("local", cluster_of(3).devices, small) is None
    assert overload("hetero8", cluster_of(8).devices, small) is None
    reason = overload("big", cluster_of(1000).devices, small)
    assert reason is not None and "\n" not in reason
    assert "would start 1000 worker ranks on this host, which has 2 core(s)" in reason
    assert "at most 8 fit" in reason and OVERSUBSCRIBE_VARIABLE in reason


def test_memory_limits_the_ranks_too() -> None:
    tight = HostCapacity(cores=64, available_bytes=2 * 2**30)
    reason = overload("c", cluster_of(8).devices, tight)
    assert reason is not None and "at most 5 fit" in reason


def test_ranks_on_other_hosts_are_not_counted_here() -> None:
    remote = cluster_of(1000, host="far-away-node")
    assert overload("remote", remote.devices, HostCapacity(cores=1, available_bytes=2**30)) is None


def test_a_pool_too_large_for_this_host_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv(OVERSUBSCRIBE_VARIABLE, raising=False)
    pool = WorkerPool(cluster_of(1000))
    with pytest.raises(PoolRefused, match="would start 1000 worker ranks") as refused:
        pool.start()
    assert "\n" not in str(refused.value)
    assert pool.folder is None and not pool.alive and not list(tmp_path.iterdir())


def test_oversubscription_is_allowed_by_option_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERSUBSCRIBE_VARIABLE, raising=False)
    assert not oversubscribe_allowed(None)
    assert oversubscribe_allowed(True)
    monkeypatch.setenv(OVERSUBSCRIBE_VARIABLE, "1")
    assert oversubscribe_allowed(None)
    assert not oversubscribe_allowed(False)


def test_the_port_range_is_read_and_checked() -> None:
    assert port_range(None) is None and port_range("") is None
    assert port_range("50000") == (50000, 50000)
    assert port_range("50000-50099") == (50000, 50099)
    for bad in ("x", "50099-50000", "0-10", "70000", "1-2-3"):
        with pytest.raises(PoolRefused, match=PORTS_VARIABLE):
            port_range(bad)
