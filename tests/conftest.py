"""Shared fixtures: one Prefect test server and one MLflow store for the whole session.

Both are slow to start (Prefect's server 10-30 s, a new MLflow SQLite store migrates for ~3 s), so they are
session-scoped and started only by the tests that ask for them; each test gets its own MLflow experiment name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

# A fresh Prefect home migrates its database on first start; on 2 busy cores that can pass Prefect's 30 s default.
PREFECT_STARTUP_TIMEOUT_S = 180


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Real flows run against a temporary Prefect server (one per session); cached results stay in a temp dir."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(PREFECT_STARTUP_TIMEOUT_S))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here, and none needed
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    storage = tmp_path_factory.mktemp("prefect-results")
    with (
        temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage}),
        prefect_test_harness(server_startup_timeout=PREFECT_STARTUP_TIMEOUT_S),
    ):
        yield


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A session-wide MLflow SQLite store (artifacts beside it), migrated once."""
    from tasks.tracking import open_store

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    open_store(uri)
    return uri


@pytest.fixture
def tracking_uri(mlflow_store: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``MLFLOW_TRACKING_URI`` pointed at the session store for this test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    return mlflow_store


@pytest.fixture
def experiment_name(request: pytest.FixtureRequest) -> str:
    """An MLflow experiment name unique to this test."""
    return "test-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)


@pytest.fixture
def work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a temporary folder, with TAPP's caches inside it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAPP_CACHE_DIR", str(tmp_path / ".tapp"))
    return tmp_path
