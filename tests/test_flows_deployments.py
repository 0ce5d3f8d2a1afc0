"""deployments/prefect.yaml: every entry loads its flow with valid parameters, and registers with its schedule."""

from __future__ import annotations

import sys
from pathlib import Path

from prefect.client.orchestration import get_client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deployments"))

import deploy  # deployments/ is a folder of scripts, not a package

from tasks.config import SweepConfig


def test_every_deployment_loads_its_flow_and_parameters() -> None:
    spec = deploy.load_spec()
    assert {d["name"] for d in spec} == {
        "nightly-benchmark-sweep",
        "weekly-section-522-sweep",
        "experiment",
        "paper-table",
    }
    for entry in spec:
        deploy.flow_of(entry)  # raises if the entrypoint or a parameter is wrong
    (sweep,) = [d for d in spec if d["name"] == "nightly-benchmark-sweep"]
    assert sweep["work_pool"]["name"] == "tapp-process"
    assert [s["cron"] for s in sweep["schedules"]] == ["0 2 * * *"]
    (weekly,) = [d for d in spec if d["name"] == "weekly-section-522-sweep"]
    configurations = SweepConfig.model_validate(weekly["parameters"]["sweep"]).configurations()
    assert {(c.target.name, c.batch_size) for c in configurations} == {
        (cluster, batch) for cluster in ("hetero4", "hetero4@0.5x", "hetero4@0.25x") for batch in (16, 32, 64, 128)
    }


def test_served_deployments_register_with_their_cron_schedules(prefect_harness: None) -> None:
    ids = [d.apply() for d in deploy.runner_deployments(deploy.load_spec())]
    with get_client(sync_client=True) as client:
        registered = {d.name: d for d in (client.read_deployment(i) for i in ids)}
    assert set(registered) == {"nightly-benchmark-sweep", "weekly-section-522-sweep", "experiment", "paper-table"}
    crons = {name: [s.schedule.cron for s in d.schedules] for name, d in registered.items()}
    assert crons == {
        "nightly-benchmark-sweep": ["0 2 * * *"],
        "weekly-section-522-sweep": ["0 12 * * 6"],
        "experiment": [],
        "paper-table": ["0 8 * * *"],
    }
    assert registered["nightly-benchmark-sweep"].parameters["sweep"]["models"] == ["alexnet", "vgg16", "inception_v3"]
    # A run asked for with a cluster by name passes the server's check of the parameters against the flow's schema.
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(
            registered["experiment"].id, parameters={"config": {"model": "vgg16", "cluster": "hetero4", "power": 0.5}}
        )
        assert run.parameters["config"]["cluster"] == "hetero4"
        client.delete_flow_run(run.id)
