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

The server never outlives the command: it is stopped when the block ends (normally, on an error, on Ctrl-C, and
on SIGTERM, which ``sigterm_exits`` turns into ``SystemExit``), and it gets SIGTERM from the kernel when the command
dies without a word (SIGKILL: a parent-death signal, set in the child before it runs).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import httpx

from tapp_core.errors import TappError
from tapp_core.runtime.guard import set_parent_death_signal

TERMINATED_EXIT = 128 + signal.SIGTERM
"""The exit status of a command ended by SIGTERM (as a shell reports it)."""


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
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(
            command,
            env=environment,
            stdin=subprocess.DEVNULL,
            # The parent-death signal follows the thread that starts the child: only the main thread lives as long
            # as the command does.
            preexec_fn=functools.partial(_die_with, os.getpid()) if on_main_thread else None,
        )

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

    def stop(self, graceful: bool = True) -> None:
        """Stop the server: gracefully (SIGTERM, then SIGKILL after 10 s), or at once when nothing used it."""
        if self.process is None:
            return
        if graceful:
            self.process.terminate()
        else:
            self.process.kill()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def _die_with(parent: int) -> None:
    """In the server's process, before it runs: SIGTERM when the command's process dies; if it already has, exit."""
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit`` in the main thread, so the command ends as on Ctrl-C: its
    MLflow runs marked KILLED, its worker pool, Prefect server and temporary folders cleaned up. Only from the main
    thread, and only where SIGTERM has no handler yet."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
    used = False
    with contextlib.ExitStack() as stack:
        server.start()
        stack.callback(lambda: server.stop(graceful=used))  # unused (bad input): no need to wait for its shutdown

        def ready() -> LocalPrefectServer:
            from tasks.prefect_ui import temporary_api  # not before the server starts: it imports pandas

            nonlocal used
            used = True
            server.wait_ready(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
            stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))
            stack.enter_context(temporary_api(server.api_url))  # it has no UI and stops with the command: no links
            stack.callback(send_pending_logs_and_events)
            return server

        yield ready
