"""deployments/prefect.yaml: every entry loads its flow with valid parameters, and registers with its schedule."""

from __future__ import annotations

import sys
from pathlib import Path

from prefect.client.orchestration import get_client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deployments"))

import deploy  # deployments/ is a folder of scripts, not a package


def test_every_deployment_loads_its_flow_and_parameters() -> None:
    spec = deploy.load_spec()
    assert {d["name"] for d in spec} == {"nightly-benchmark-sweep", "experiment", "paper-table"}
    for entry in spec:
        deploy.flow_of(entry)  # raises if the entrypoint or a parameter is wrong
    (sweep,) = [d for d in spec if d["name"] == "nightly-benchmark-sweep"]
    assert sweep["work_pool"]["name"] == "tapp-process"
    assert [s["cron"] for s in sweep["schedules"]] == ["0 2 * * *"]


def test_served_deployments_register_with_their_cron_schedules(prefect_harness: None) -> None:
    ids = [d.apply() for d in deploy.runner_deployments(deploy.load_spec())]
    with get_client(sync_client=True) as client:
        registered = {d.name: d for d in (client.read_deployment(i) for i in ids)}
    assert set(registered) == {"nightly-benchmark-sweep", "experiment", "paper-table"}
    crons = {name: [s.schedule.cron for s in d.schedules] for name, d in registered.items()}
    assert crons == {"nightly-benchmark-sweep": ["0 2 * * *"], "experiment": [], "paper-table": ["0 8 * * *"]}
    assert registered["nightly-benchmark-sweep"].parameters["models"] == ["alexnet", "vgg16", "inception_v3"]
