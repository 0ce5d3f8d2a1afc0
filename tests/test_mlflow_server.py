"""The same flow against a real ``mlflow server`` over http (a free loopback port), read back over http."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pandas as pd
import pytest
from mlflow import MlflowClient

from flows.experiment import tapp_experiment
from flows.paper_table import paper_table
from flows.server import free_port
from reports import schema
from tasks.config import ExperimentConfig

SERVER_START_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    command = [
        str(mlflow), "server",
        "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
        "--artifacts-destination", str(folder / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    log = (folder / "server.log").open("wb")
    # Its own session, so the whole tree (uvicorn, job workers) is stopped with one signal to the group.
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(
                    f"mlflow server exited with {server.returncode}:\n{(folder / 'server.log').read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer within {SERVER_START_TIMEOUT_S} s")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def test_experiment_and_paper_table_over_http(
    prefect_harness: None, mlflow_server: str, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = ExperimentConfig(
        model="mlp",
        batch_size=8,
        search_rounds=2,
        samples_per_round=4,
        methods=("tapp", "single-cpu", "bsp", "pipetorch"),
        measure=False,
    )
    result = tapp_experiment(config=config, experiment="over-http", out="report", tracking_uri=mlflow_server)
    assert result.tracking_uri == mlflow_server

    client = MlflowClient(mlflow_server)
    parent = client.get_run(result.run_id)
    assert parent.info.status == "FINISHED"
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied by the server, not a local path
    evaluations = client.search_runs(
        [parent.info.experiment_id],
        f"tags.{schema.KIND} = 'evaluation' and tags.{schema.EXPERIMENT_RUN} = '{result.run_id}'",
    )
    assert sorted(r.data.tags[schema.METHOD] for r in evaluations) == ["bsp", "pipetorch", "single-cpu", "tapp"]

    (sampling,) = client.search_runs([parent.info.experiment_id], "tags.stage = 'sampling'")
    table = pd.read_csv(client.download_artifacts(sampling.info.run_id, "search/sampled_plans.csv", str(work_dir)))
    assert table["chosen"].sum() == 1

    rebuilt = paper_table(experiment="over-http", out="paper", tracking_uri=mlflow_server)
    for name in ("step_time.csv", "communication_share.csv"):
        assert (work_dir / "paper" / name).read_text() == (work_dir / "report" / name).read_text()
    assert [p.name for p in rebuilt.figure_files] == [
        "step_time.png",
        "reward_curve_mlp_local_b8.png",
        "gantt_tapp_mlp_local_b8.png",
    ]
