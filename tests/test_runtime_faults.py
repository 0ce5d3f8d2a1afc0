"""Where a pool's failure happened, read from Hydra's report and the cluster (no MPI needed)."""

from __future__ import annotations

from tapp_core.platform.cluster import parse_cluster
from tapp_core.runtime.faults import first_ended, rank_name, unanswering, where
from tapp_core.runtime.jobs import RankInfo

CLUSTER = parse_cluster(
    {
        "name": "two-hosts",
        "devices": [
            {"name": "a", "memory": "1GiB", "host": "10.9.0.10"},
            {"name": "b", "memory": "1GiB", "host": "10.9.0.11"},
        ],
        "links": {"bandwidth": "1Gbit/s", "latency": 0},
    }
)
RANKS = (RankInfo(101, "x", ()), RankInfo(202, "y", ()))
HYDRA = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 202 RUNNING AT 10.9.0.11
=   KILLED BY SIGNAL: 9 (Killed)
===================================================================================
"""


def test_the_rank_hydra_saw_end_first_is_named_with_its_host() -> None:
    assert (
        first_ended(HYDRA, RANKS, CLUSTER, ("a", "b"))
        == "rank 1 (b on host 10.9.0.11) ended first (killed by signal: 9 (killed))"
    )
    exit_code = HYDRA.replace("KILLED BY SIGNAL: 9 (Killed)", "EXIT CODE: 9")
    assert (
        first_ended(exit_code, RANKS, CLUSTER, ("a", "b")) == "rank 1 (b on host 10.9.0.11) ended first (exit code: 9)"
    )
    stranger = HYDRA.replace("PID 202", "PID 303")
    assert first_ended(stranger, RANKS, CLUSTER, ("a", "b")) == (
        "the rank with pid 303 on host 10.9.0.11 ended first (killed by signal: 9 (killed))"
    )
    assert first_ended("nothing reported", RANKS, CLUSTER, ("a", "b")) is None


def test_ranks_are_named_by_device_and_host() -> None:
    assert rank_name(CLUSTER, ("b", "a"), 0) == "rank 0 (b on host 10.9.0.11)"
    local = parse_cluster({"name": "one", "devices": [{"name": "d", "memory": "1GiB"}], "links": CLUSTER.links})
    assert rank_name(local, ("d",), 0) == "rank 0 (d)"


def test_hosts_of_this_machine_are_not_asked() -> None:
    local = parse_cluster({"name": "one", "devices": [{"name": "d", "memory": "1GiB"}], "links": CLUSTER.links})
    assert unanswering(local, ("d",)) == []
    assert where("", (), local, ("d",)) == ""


def test_a_host_that_cannot_be_reached_is_named() -> None:
    refusing = CLUSTER.model_copy(update={"ssh": "false"})  # a launcher that never reaches anything
    found = unanswering(refusing, ("a", "b"), timeout_s=5)
    assert [line.split(" does not answer")[0] for line in found] == ["host 10.9.0.10 (a)", "host 10.9.0.11 (b)"]
