"""TAPP's deployments (defined once, in deployments/prefect.yaml) served from one process, or checked.

    python deployments/deploy.py serve    # one machine, no work pool: scheduled sweeps and on-demand runs
    python deployments/deploy.py check    # load every deployment's flow, parameters and schedules; register nothing

``serve`` keeps running and starts each scheduled or requested flow run in a subprocess of this process. For a
team, deploy to the process work pool instead: ``prefect deploy --all --prefect-file deployments/prefect.yaml``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from prefect import Flow, serve
from prefect.deployments.runner import RunnerDeployment
from prefect.flows import load_flow_from_entrypoint
from prefect.schedules import Cron, Schedule

ROOT = Path(__file__).resolve().parent.parent
PREFECT_YAML = Path(__file__).resolve().parent / "prefect.yaml"


def load_spec(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    """The ``deployments`` list of a prefect.yaml."""
    return list(yaml.safe_load(path.read_text())["deployments"])


def schedules_of(entry: dict[str, Any]) -> list[Schedule]:
    return [
        Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True)) for s in entry.get("schedules") or []
    ]


def flow_of(entry: dict[str, Any]) -> Flow[Any, Any]:
    """The flow an entry points at, its parameters checked against the flow's signature."""
    flow = load_flow_from_entrypoint(str(ROOT / entry["entrypoint"]), use_placeholder_flow=False)
    flow.validate_parameters(entry.get("parameters") or {})
    return flow


def runner_deployments(spec: list[dict[str, Any]]) -> list[RunnerDeployment]:
    """One served deployment per entry (the work pool is the serving process itself, so it is left out)."""
    return [
        flow_of(entry).to_deployment(
            name=entry["name"],
            description=entry.get("description"),
            tags=entry.get("tags"),
            parameters=entry.get("parameters") or {},
            schedules=schedules_of(entry),
        )
        for entry in spec
    ]


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "serve"
    deployments = runner_deployments(load_spec())
    if command == "check":
        for deployment in deployments:
            crons = ", ".join(s.schedule.cron for s in deployment.schedules or []) or "on demand"  # type: ignore[union-attr]
            print(f"{deployment.flow_name}/{deployment.name}: {deployment.entrypoint} ({crons})")
        return 0
    if command == "serve":
        serve(*deployments)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
