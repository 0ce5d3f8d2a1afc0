"""The Prefect API an experiment's flow talks to, started before the flow when it is Prefect's local server.

With no ``PREFECT_API_URL``, the first flow call starts Prefect's temporary local server and waits for it: here
7-9 s, of which about 3 s are the calling process importing Prefect's whole server package only to launch it,
and the rest the server process importing it again and opening its database. ``tapp run`` instead launches the
same server itself, first: the same application (``prefect.server.api.server:create_app``) under uvicorn with the
environment Prefect's ephemeral mode gives it (its ephemeral services, no UI), in its own process, so that its
start overlaps the command's imports, input checks and the opening of the MLflow store. The flow then runs with
``PREFECT_API_URL`` pointed at it, and the server stops when the command ends, as Prefect's own would. Such a
server has no UI and is gone after the command, so its flow runs get no URL (``tasks.prefect_ui.flow_run_url``);
with ``PREFECT_API_URL`` naming a lasting server (``prefect server start``), they do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx

from tapp_core.errors import TappError


class PrefectServerError(TappError):
    """Prefect's local server did not start."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalPrefectServer:
    """Prefect's local API server in a child process on a free loopback port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> None:
        import prefect
        from prefect.settings import get_current_settings

        environment = {
            **os.environ,
            **get_current_settings().to_environment_variables(exclude_unset=True),
            # What Prefect's ephemeral mode sets: its own services only, no UI.
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        command = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent)]
        command += ["--factory", "prefect.server.api.server:create_app"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        self.process = subprocess.Popen(command, env=environment, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the API answers its health check; raise ``PrefectServerError`` if it exits or times out."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise PrefectServerError(
                        f"Prefect's local server exited with status {self.process.returncode} before it answered "
                        f"on {self.api_url} (its errors are above)"
                    )
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise PrefectServerError(
            f"Prefect's local server did not answer on {self.api_url} within {timeout_s:.0f} s; raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (a fresh PREFECT_HOME migrates its database first), "
            "or point PREFECT_API_URL at a running `prefect server start`"
        )

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def send_pending_logs_and_events() -> None:
    """Wait until Prefect's background senders have delivered what they hold (before the server stops)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(at_exit=False)
    EventsWorker.drain_all(at_exit=False)


@contextlib.contextmanager
def prefect_api() -> Iterator[Callable[[], LocalPrefectServer | None]]:
    """Start Prefect's local server now unless ``PREFECT_API_URL`` names one; yields ``ready``.

    Call ``ready()`` just before the first flow: it waits for the server and, for the rest of the block, points
    Prefect at it (returning it; None when the configured API is used). The server stops when the block ends.
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        yield lambda: None
        return
    server = LocalPrefectServer()
    with contextlib.ExitStack() as stack:
        server.start()
        stack.callback(server.stop)

        def ready() -> LocalPrefectServer:
            from tasks.prefect_ui import temporary_api  # not before the server starts: it imports pandas

            server.wait_ready(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
            stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))
            stack.enter_context(temporary_api(server.api_url))  # it has no UI and stops with the command: no links
            stack.callback(send_pending_logs_and_events)
            return server

        yield ready
