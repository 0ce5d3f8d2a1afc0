"""Shared fixtures: one Prefect test server and one MLflow store for the whole session.

Both are slow to start (Prefect's server 10-30 s, a new MLflow SQLite store migrates for ~3 s), so they are
session-scoped and started only by the tests that ask for them; each test gets its own MLflow experiment name.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tapp_core.runtime import WorkerPool

# The tests that press Ctrl-C on a child need SIGINT to reach it. A shell that starts pytest in the background
# ignores SIGINT for it, and every child would inherit that (Python keeps an ignored SIGINT ignored): a handler
# here is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# No test measures a cluster's calibration on first use (seconds of real runs each) or reads one an earlier run
# kept; the tests of calibrating on first use unset this themselves.
os.environ["TAPP_NO_CALIBRATE"] = "1"

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
    """A session-wide MLflow SQLite store (artifacts beside it), migrated once.

    MLflow resolves a SQLite store's default artifact root (``./mlruns``) against the working directory of the
    moment it first opens the store, and keeps that store object for the process. Opened from the checkout, every
    experiment any test makes in it would write its artifacts to the checkout's ``mlruns/``; opened from its own
    folder, they stay beside the database.
    """
    from tasks.tracking import open_store

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
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


# --- Real MPI ranks --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pool2() -> Iterator[WorkerPool]:
    """Two real ranks on ``plain_cluster(2)``, started once for every module that trains on them."""
    from tapp_core.runtime import WorkerPool
    from tests.factories import plain_cluster

    with WorkerPool(plain_cluster(2)) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool3() -> Iterator[WorkerPool]:
    """Three real ranks on ``plain_cluster(3)``, started once for every module that trains on them."""
    from tapp_core.runtime import WorkerPool
    from tests.factories import plain_cluster

    with WorkerPool(plain_cluster(3)) as pool:
        yield pool


# --- Tests write only under their temporary folders ------------------------------------------------------------

CHECKOUT = Path(__file__).resolve().parent.parent
LEFT_ALONE = (".venv", ".mypy_cache", ".ruff_cache", ".pytest_cache", "__pycache__")
"""Paths the test run may create or change in the checkout: the environment and tool caches."""
_UNTRACKED_BEFORE = pytest.StashKey[set[str] | None]()


def _untracked_files() -> set[str] | None:
    """Files of the checkout git does not track (ignored ones included), apart from ``LEFT_ALONE``; None without
    git."""
    excluded = [f":(exclude,glob)**/{name}/**" for name in LEFT_ALONE]
    try:
        listed = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--", ".", *excluded],
            cwd=CHECKOUT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {line[3:] for line in listed.splitlines() if line[:2] in ("??", "!!")}


# --- The longest modules first ------------------------------------------------------------------------------------

LONGEST_FIRST = (
    "test_process_life.py",
    "test_rule.py",
    "test_testbed.py",
    "test_sweep.py",
    "test_flows.py",
    "test_runtime_pool.py",
    "test_flows_server.py",
    "test_views.py",
    "test_cli_hardware.py",
    "test_runtime_checkpoints.py",
    "test_runtime_orphans.py",
    "test_examples.py",
    "test_gpt.py",
    "test_bench_scripts.py",
    "test_cuts.py",
)
"""The modules that take a minute or more (``--durations``, on 2 cores), longest first. ``make test`` hands whole
modules to its workers in collection order (``--dist loadfile --no-loadscope-reorder``): one of these handed out
last would keep one worker busy for minutes after the others have finished."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # stable: the others keep their order


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_UNTRACKED_BEFORE] = _untracked_files()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if the tests left files in the checkout: they must write only under their temporary folders."""
    before = session.config.stash.get(_UNTRACKED_BEFORE, None)
    after = _untracked_files()
    if before is None or after is None:
        return
    left = sorted(after - before)
    if left:
        shown = "\n  ".join(left[:20]) + (f"\n  ... and {len(left) - 20} more" if len(left) > 20 else "")
        message = f"the tests left {len(left)} file(s) in the checkout {CHECKOUT}:\n  {shown}"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- Real data ------------------------------------------------------------------------------------------------

REQUIRE_FASHION_MNIST = "TAPP_REQUIRE_FASHION_MNIST"
"""Set by CI (.ci/run), which installs Debian's dataset-fashion-mnist: a test that needs it then fails without it
instead of being skipped."""


@pytest.fixture(scope="session")
def fashion_mnist() -> Path:
    """Debian's Fashion-MNIST (``make data`` installs it where it can). Without it, a test that needs it is skipped
    with one line saying how to install it, except where it must be there (``TAPP_REQUIRE_FASHION_MNIST=1``)."""
    from tapp_core.model.data import FASHION_MNIST_ROOT, fashion_mnist_installed

    if fashion_mnist_installed():
        return Path(FASHION_MNIST_ROOT)
    reason = (
        f"Fashion-MNIST is not in {FASHION_MNIST_ROOT}: `make data` as root (apt-get install dataset-fashion-mnist)"
    )
    if os.environ.get(REQUIRE_FASHION_MNIST) == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module of small tensors: on shared cores, more only spin against other processes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
