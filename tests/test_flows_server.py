"""`tapp run` as a user starts it: a real process with no PREFECT_API_URL, so it starts Prefect's local server
itself (``flows.server``), runs the flow against it and stops it."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows.server import LocalPrefectServer, PrefectServerError, free_port


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
    assert len(list((tmp_path / "out" / "tapp").glob("*/step_time.md"))) == 1  # out/EXPERIMENT/RUN_ID
    assert "Error logging to API" not in done.stdout + done.stderr  # logs were sent before the server stopped
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        states = db.execute("SELECT state_type FROM flow_run WHERE name = 'tiny_cnn-local-b16-estimated'").fetchall()
    assert states == [("COMPLETED",)]
    assert processes_with(f"PREFECT_HOME={prefect_home}") == []  # the server stopped with the command
    assert "Prefect: " not in done.stdout  # no link to a server that is gone
    assert "viewStateShareKey=tapp&workflowType=machine_learning" in done.stdout


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


def reachable_address() -> str:
    """This host's address on its network (what a browser on another machine would use); loopback if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


@pytest.mark.slow
@pytest.mark.parametrize("remote", [False, True], ids=["one-machine-other-port", "team-remote-browsers"])
def test_the_readmes_prefect_server_gives_its_ui_a_working_api_url(tmp_path: Path, remote: bool) -> None:
    """``prefect server start`` as the README starts it, on a free port (not 4200): the UI reads its API address
    from ``/ui-settings``, and that address must answer, from this host or (team set-up) from another."""
    port = free_port()
    host = reachable_address() if remote else "127.0.0.1"
    readme = readme_server_settings("# A team" if remote else "# One machine", port, host)
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **readme,
    }
    prefect = Path(sys.executable).parent / "prefect"
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(
        [str(prefect), "server", "start"], env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        settings = _wait_for_ui_settings(server, f"http://127.0.0.1:{port}", tmp_path / "server.log")
        assert settings["api_url"] == f"http://{host}:{port}/api"
        assert httpx.get(f"{settings['api_url']}/health", timeout=10).status_code == 200
        assert httpx.get(f"http://{host}:{port}/", timeout=10).status_code == 200  # the UI itself
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_server_settings(comment: str, port: int, host: str) -> dict[str, str]:
    """The settings the README's lines after ``comment`` give ``prefect server start``, on ``port`` (for the
    README's 4200/4300) and ``host`` (for PREFECT_HOST)."""
    lines = README.read_text().split(comment, 1)[1].splitlines()[1:]
    settings: dict[str, str] = {}
    for line in lines:
        words = line.split("#")[0].split()
        if words[:1] == ["export"]:
            words = words[1:]
        settings |= dict(word.split("=", 1) for word in words if "=" in word)
        if "prefect server start" in line:
            break
    else:
        pytest.fail(f"no `prefect server start` after {comment!r} in the README")
    for readme_port in ("4200", "4300"):
        settings = {k: v.replace(readme_port, str(port)) for k, v in settings.items()}
    return {k: v.replace("PREFECT_HOST", host) for k, v in settings.items()}


def _wait_for_ui_settings(server: subprocess.Popen[bytes], base: str, log: Path) -> dict[str, object]:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"prefect server start exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            answer = httpx.get(f"{base}/ui-settings", timeout=2)
            if answer.status_code == 200:
                settings: dict[str, object] = answer.json()
                return settings
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"prefect server start did not answer on {base} within 240 s:\n{log.read_text()[-3000:]}")
