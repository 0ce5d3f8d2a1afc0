"""`tapp run` as a user starts it: a real process with no PREFECT_API_URL, so it starts Prefect's local server
itself (``flows.server``), runs the flow against it and stops it."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from flows.server import LocalPrefectServer, PrefectServerError


def processes_with(environment_entry: str) -> list[int]:
    """Live processes whose environment holds ``environment_entry`` (``NAME=value``)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            entries = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if environment_entry.encode() in entries:
            found.append(int(proc.name))
    return found


def test_tapp_run_starts_prefect_local_server_records_the_flow_and_stops_it(tmp_path: Path) -> None:
    prefect_home = tmp_path / "prefect-home"
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))},
        "PREFECT_HOME": str(prefect_home),  # a fresh one: its database is migrated on this first start
        "TAPP_CACHE_DIR": str(tmp_path / "cache"),
    }
    command = [str(Path(sys.executable).parent / "tapp"), "run", "--model", "tiny_cnn", "--batch-size", "16"]
    command += ["--estimate-only", "--rounds", "2", "--methods", "tapp,single-cpu,bsp,pipetorch"]
    done = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out" / "report" / "step_time.md").is_file()
    assert "Error logging to API" not in done.stdout + done.stderr  # logs were sent before the server stopped
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        states = db.execute("SELECT state_type FROM flow_run WHERE name = 'tiny_cnn-local-b16'").fetchall()
    assert states == [("COMPLETED",)]
    assert processes_with(f"PREFECT_HOME={prefect_home}") == []  # the server stopped with the command


def test_a_server_that_cannot_start_is_a_clear_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = LocalPrefectServer(port=taken.getsockname()[1])
        server.start()
        try:
            with pytest.raises(PrefectServerError, match="exited with status"):
                server.wait_ready(timeout_s=120)
        finally:
            server.stop()
    assert server.process is None
