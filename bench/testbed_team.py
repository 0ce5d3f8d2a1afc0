"""A team on one machine: the README's "Workers on several hosts", done for real on a testbed.

    sudo .venv/bin/python bench/testbed_team.py [--model mlp] [--batch-size 16] [--timeout 1200]

The testbed (``tapp testbed up``, name ``tappteam``, subnet ``10.217.0.0/24``) has four hosts, each a network
namespace with its own sshd:

- ``tracking``: an ``mlflow server`` (SQLite store, artifacts proxied), started over ssh;
- ``orchestrator``: a Prefect server (``prefect server start`` with the README's team settings) and a process
  worker of the pool ``tapp-process``, started over ssh, with ``MLFLOW_TRACKING_URI`` naming the tracking host;
- ``n1``, ``n2``: the compute hosts of the cluster the flow runs on (one device each, the second at half speed,
  their link shaped to 1 Gbit/s).

From outside the testbed (this machine's own namespace) the script creates the work pool, deploys
``deployments/prefect.yaml``'s ``experiment`` and submits a run of it on the testbed's cluster file. The worker
runs the flow, whose worker pool starts its MPI job on ``n1`` and ``n2`` over ssh (rank 0 connecting back to the
orchestrator), and records to the MLflow server over http. The script then reads back, over http: the flow run's
state and its logs from the Prefect server, and the runs from the MLflow server; and says on which hosts ranks
were seen running. The testbed goes down at the end, with every server and worker on it.

Needs root, network namespaces, a cpu cgroup controller and sshd.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.platform.testbed import down, system, up  # noqa: E402
from tapp_core.platform.testbed.bed import host_addresses  # noqa: E402

NAME, SUBNET = "tappteam", "10.217.0.0/24"
BIN = Path(sys.executable).parent
METHODS = ["tapp", "single-cpu", "bsp", "pipetorch"]
CLUSTER = {
    "name": "team",
    "devices": [
        {"name": "w1", "memory": "4GiB", "host": "n1"},
        {"name": "w2", "memory": "4GiB", "host": "n2", "speed": 0.5},
    ],
    "links": {"bandwidth": "1Gbit/s", "latency": "100us"},
}


def on_host(ssh: str, address: str, command: str, log: Path) -> None:
    """Start ``command`` in the background on a testbed host (its own session, output to ``log``)."""
    remote = f"cd {ROOT} || exit 1; setsid {command} > {log} 2>&1 < /dev/null &"
    subprocess.run([ssh, address, remote], check=True, timeout=60)


def wait_for(url: str, what: str, log: Path, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                print(f"{what} answers at {url}")
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    tail = log.read_text()[-2000:] if log.exists() else "(no log)"
    raise SystemExit(f"{what} did not answer at {url} within {timeout_s:.0f} s:\n{tail}")


def outside(command: list[str], api: str, work: Path) -> str:
    """Run a Prefect command from this machine's own namespace (outside the testbed) against the server."""
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(work / "prefect-outside")}
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


class RankWatch:
    """Which testbed hosts ran a TAPP rank while the flow ran (their namespaces' processes, sampled)."""

    def __init__(self, hosts: dict[str, str]) -> None:
        self.hosts = hosts
        self.seen: set[str] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.5):
            for name in self.hosts:
                if any(is_rank(pid) for pid in system.namespace_pids(f"{NAME}-{name}")):
                    self.seen.add(name)


def is_rank(pid: int) -> bool:
    """Whether ``pid`` is a worker rank itself (Python running the worker), not mpiexec or ssh naming it."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return Path(argv[0].decode()).name.startswith("python") and b"tapp_core.runtime.worker" in argv[:3]


def team_run(args: argparse.Namespace, work: Path) -> bool:
    (work / "team.yaml").write_text(yaml.safe_dump(CLUSTER))
    cluster = up(
        work / "team.yaml",
        work / "team-testbed.yaml",
        prefix=NAME,
        subnet=SUBNET,
        state=work / "state",
        service_hosts=("tracking", "orchestrator"),
        log=lambda line: print(f"  {line}"),
    )
    assert cluster.ssh is not None
    hosts = host_addresses(NAME, work / "state")
    tracking, orchestrator = hosts["tracking"], hosts["orchestrator"]
    mlflow_uri, api = f"http://{tracking}:5000", f"http://{orchestrator}:4200/api"
    on_host(
        cluster.ssh,
        tracking,
        f"{BIN / 'mlflow'} server --backend-store-uri sqlite:///{work / 'mlflow.db'} --artifacts-destination "
        f"{work / 'mlartifacts'} --host {tracking} --port 5000 --workers 1 --allowed-hosts {tracking}:5000",
        work / "mlflow.log",
    )
    prefect_settings = (
        f"PREFECT_HOME={work / 'prefect-server'} PREFECT_SERVER_API_HOST={orchestrator} PREFECT_SERVER_API_PORT=4200 "
        f"PREFECT_UI_API_URL={api} PREFECT_SERVER_ANALYTICS_ENABLED=false"
    )
    on_host(cluster.ssh, orchestrator, f"env {prefect_settings} {BIN / 'prefect'} server start", work / "prefect.log")
    wait_for(f"{mlflow_uri}/health", "the MLflow server on host tracking", work / "mlflow.log")
    wait_for(f"{api}/health", "the Prefect server on host orchestrator", work / "prefect.log")
    outside([str(BIN / "prefect"), "work-pool", "create", "tapp-process", "--type", "process"], api, work)
    deploy = [str(BIN / "prefect"), "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml"]
    outside([*deploy, "--name", "experiment"], api, work)
    worker_settings = (
        f"TAPP_ROOT={ROOT} PREFECT_API_URL={api} PREFECT_HOME={work / 'prefect-worker'} "
        f"MLFLOW_TRACKING_URI={mlflow_uri} TAPP_CACHE_DIR={work / 'cache'}"
    )
    on_host(
        cluster.ssh,
        orchestrator,
        f"env {worker_settings} {BIN / 'prefect'} worker start --pool tapp-process",
        work / "worker.log",
    )
    return submit_and_check(args, work, api, mlflow_uri, hosts)


def submit_and_check(args: argparse.Namespace, work: Path, api: str, mlflow_uri: str, hosts: dict[str, str]) -> bool:
    parameters = {
        "model": args.model,
        "cluster": str(work / "team-testbed.yaml"),
        "batch_size": args.batch_size,
        "search_rounds": 2,
        "samples_per_round": 4,
        "measured_rounds": 1,
        "methods": METHODS,
        "experiment": "team",
        "out": str(work / "report"),
    }
    submitted = outside(
        [str(BIN / "prefect"), "deployment", "run", "tapp-experiment/experiment", "--params", json.dumps(parameters)],
        api,
        work,
    )
    run_id = next(w for line in submitted.splitlines() if "UUID" in line for w in line.split() if w.count("-") == 4)
    print(f"submitted flow run {run_id} from outside the testbed")
    watch = RankWatch(hosts)
    state = wait_for_flow_run(api, run_id, args.timeout)
    watch.done.set()
    logs = httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}}, timeout=30).json()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("team")
    runs = client.search_runs([experiment.experiment_id]) if experiment is not None else []
    methods = sorted({r.data.tags.get("method", "") for r in runs} - {""})
    print(f"flow run {run_id}: {state}; {len(logs)} log lines in the Prefect server at {api}")
    messages = [entry["message"] for entry in sorted(logs, key=lambda entry: entry["timestamp"])]
    for line in [m for m in messages if "TAPP" in m or "step time" in m][:4]:
        print(f"  log: {line.splitlines()[0][:150]}")
    print(f"MLflow server at {mlflow_uri}: {len(runs)} runs in experiment 'team', methods {', '.join(methods)}")
    print(f"ranks seen on hosts: {', '.join(sorted(watch.seen)) or 'none'}")
    ok = state == "COMPLETED" and len(logs) > 0 and len(runs) > 0 and watch.seen == {"n1", "n2"}
    print(f"bar: the team run finishes, its runs in the MLflow server, its logs in the Prefect server: {ok}")
    return ok


def wait_for_flow_run(api: str, run_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    state = "SCHEDULED"
    while time.monotonic() < deadline:
        state = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()["state"]["type"]
        if state in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
            return str(state)
        time.sleep(2.0)
    return f"{state} (still, after {timeout_s:.0f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds for the flow run to finish")
    parser.add_argument("--verbose", action="store_true", help="print the end of the servers' and worker's logs")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tapp-team-") as folder:
        work = Path(folder)
        try:
            ok = team_run(args, work)
        finally:
            for log in ("worker.log", "prefect.log", "mlflow.log"):
                if (work / log).exists() and args.verbose:
                    print(f"--- {log}\n{(work / log).read_text()[-3000:]}")
            down(NAME, work / "state")
    print(f"the team run took {time.monotonic() - started:.0f} s, testbed up and down included")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
