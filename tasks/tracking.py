"""MLflow bookkeeping for TAPP's flows: one parent run per experiment, nested runs per stage and per method.

Runs are addressed by id through ``MlflowClient``, never through MLflow's fluent "active run": that one is per
thread, and Prefect may run each task in its own thread, process or host. A task is handed a ``RunRef`` (tracking
URI, experiment id, run id), which pickles, and opens its own child run under it with ``tracked_run``.

The tags (named in ``reports.schema``, which ``reports`` reads them back by) make a UI comparison and the paper table a filter:
``model``, ``method``, ``cluster``, ``batch_size``, ``seed``, ``dataset``, ``emulated``, ``code_version``,
``run_kind`` and ``experiment_run`` (the experiment's parent run, on every run of one experiment). Every run also
carries what the MLflow UI shows as its Source and Created by (``mlflow.source.*``, ``mlflow.user``) and, when it
was made inside a Prefect flow run, that flow run's id and page (``prefect.flow_run_id``, ``prefect.flow_run_url``).

What the MLflow UI opens on is set here too (``prepare_experiment``): every experiment TAPP writes to gets a saved
view of the runs list (``RUNS_VIEW``: the method runs by their place in the result, fastest first, with ``method``, ``model``, ``cluster``,
``step_time_s`` and its interval ``step_time_low_s``/``step_time_high_s`` as columns, and the step time's bar chart
first), and ``runs_view_url`` / ``run_url`` are the links that open it.

MLflow 3.17's UI applies a saved view only to a link that carries no filter or sort of its own, and as soon as it
opens one it writes the view's filter and sort into the address: reloaded or bookmarked, that address opens the
UI's default columns (Run Name, Created, Dataset, Duration, Source, Models), not the view's. Two things make up
for it: the banner's **Override saved view** button keeps the view in the browser (its local storage), after which
reloads and bookmarks keep its columns; and each method run's name carries its step time and interval
(``tasks.views``), so that the default columns show them too.
"""

from __future__ import annotations

import fcntl
import functools
import getpass
import io
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import mlflow
import pandas as pd
import sqlalchemy.exc
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunTag, ViewType
from mlflow.exceptions import MlflowException

from reports import schema
from tapp_core.errors import TappError
from tapp_core.paths import writable_folder_problem
from tapp_core.runtime.guard import ProcessId, boot_id

DEFAULT_EXPERIMENT = "tapp"
PARENT_TAG = "mlflow.parentRunId"
GIT_COMMIT_TAG = "mlflow.source.git.commit"
SOURCE_NAME_TAG = "mlflow.source.name"
SOURCE_TYPE_TAG = "mlflow.source.type"
USER_TAG = "mlflow.user"
NOTE_TAG = "mlflow.note.content"
"""A run's (or an experiment's) description: Markdown, shown at the top of its page."""
RUN_COLOR_TAG = "mlflow.runColor"
"""A run's colour in the MLflow UI's runs list and charts (``#rrggbb``); TAPP gives each method its palette colour."""
HOST_TAG = "tapp.host"
PROCESS_TAG = "tapp.process"
"""The process that made a run (``guard.ProcessId``: boot, pid, start time), so that a later run can tell that a run
left RUNNING has lost its process (``fail_orphaned_runs``)."""
FLOW_RUN_TAG = "prefect.flow_run_id"
FLOW_RUN_URL_TAG = "prefect.flow_run_url"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
RUNS_VIEW = "tapp"
"""The key of TAPP's saved runs view (experiment tag ``mlflow.sharedViewState.tapp``)."""
DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves by default; ``TAPP_MLFLOW_UI_URL`` names another (for links to a SQLite store)."""

MAX_TAG_LENGTH = 5000
MAX_NOTE_LENGTH = 20000
"""MLflow allows longer tag values than ``MAX_TAG_LENGTH`` (20,000 characters on an experiment), enough for a
description."""
MAX_PARAM_LENGTH = 6000


class TrackingError(TappError):
    """The tracking store cannot be used: an unreachable server, a missing folder, a deleted experiment."""


def tracking_uri(uri: str | None = None) -> str:
    """The store to use: ``uri``, else ``MLFLOW_TRACKING_URI``, else MLflow's default (``sqlite:///mlflow.db``)."""
    return uri or mlflow.get_tracking_uri()


def check_tracking(uri: str | None = None, timeout_s: float = 5.0, *, existing: bool = False) -> str:
    """Fail fast, before any run exists, if the store cannot be reached; returns the resolved URI.

    A SQLite store's folder must exist and, unless only an ``existing`` store is to be read, take new files (a
    read-only folder fails here in a moment, not after MLflow's two minutes of retries). With ``existing`` the
    store must already be there: reading a store that is not there must not create an empty one."""
    resolved = tracking_uri(uri)
    if resolved.startswith(("http://", "https://")):
        health = resolved.rstrip("/") + "/health"
        try:
            response = httpx.get(health, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise TrackingError(
                f"MLflow tracking server {resolved} is unreachable ({type(exc).__name__}: {exc}); start it with "
                "`mlflow server --host 127.0.0.1 --port 5000`, or unset MLFLOW_TRACKING_URI to use ./mlflow.db"
            ) from None
        if response.status_code != 200:
            raise TrackingError(
                f"MLflow tracking server {resolved} answered {response.status_code} on {health}; is it an MLflow server?"
            )
    elif resolved.startswith("sqlite:///"):
        _check_sqlite_store(resolved, existing)
    return resolved


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store (None for other stores or an in-memory database)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path).expanduser() if path and path != ":memory:" else None


def _check_sqlite_store(uri: str, existing: bool) -> None:
    database = sqlite_path(uri)
    if database is None:
        return
    folder = database.parent
    if not folder.is_dir():
        raise TrackingError(f"MLflow tracking store {uri}: folder {folder} does not exist")
    if existing:
        if not database.is_file():
            raise TrackingError(
                f"no MLflow store at {database}: nothing has been recorded there (run `tapp run` first, or give "
                "--tracking-uri)"
            )
        return
    problem = writable_folder_problem(folder)  # SQLite writes its journal beside the database
    if problem is None and database.exists() and not os.access(database, os.W_OK):
        problem = "the database file is read-only"
    if problem is not None:
        raise TrackingError(f"MLflow tracking store {uri} cannot be written: {folder} ({problem})")


def open_store(uri: str) -> None:
    """Open the store now: a new SQLite store is created and migrated (about 3 s), and one that is not an MLflow
    store fails here, with its name, rather than in the middle of an experiment.

    Creating and migrating a SQLite store is serialised across processes (``store_lock``): two first runs in an
    empty folder would otherwise both migrate the new database, and one of them fail."""
    with store_lock(uri):
        try:
            MlflowClient(uri).search_experiments(max_results=1)
        except MlflowException as exc:
            raise TrackingError(f"MLflow tracking store {uri} cannot be opened: {exc.message}") from None
        except sqlalchemy.exc.SQLAlchemyError as exc:  # a file that is not a database at all
            reason = getattr(exc, "orig", None) or exc  # the database driver's own error, when there is one
            raise TrackingError(f"MLflow tracking store {uri} cannot be opened: {reason}") from None


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock (``fcntl.flock``) on a SQLite store's folder for the block; nothing for other stores.

    The folder itself is locked, not a lock file beside the database, so that the lock leaves nothing behind.
    Every process that opens a store through ``open_store`` takes it, so only one creates or migrates it."""
    database = sqlite_path(uri)
    if database is None or not database.parent.is_dir():
        yield
        return
    descriptor = os.open(database.parent, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing the last descriptor releases the lock


@functools.cache
def code_version() -> str:
    """The git commit of this checkout (``+dirty`` when tracked files differ from it), or ``unknown``."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=10).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


@dataclass(frozen=True)
class ExperimentTags:
    """What identifies one experiment's runs; every run of the experiment carries these tags."""

    model: str
    cluster: str
    batch_size: int
    seed: int
    dataset: str
    emulated: bool
    sweep_run: str | None = None
    """The benchmark sweep's parent run, when the experiment is part of one."""
    more: tuple[tuple[str, str], ...] = ()
    """The experiment's other tags (``ExperimentConfig.tags``: the cluster's family and power, the schedule)."""

    def as_tags(self, **more: object) -> dict[str, str]:
        tags = {
            schema.MODEL: self.model,
            schema.CLUSTER: self.cluster,
            schema.BATCH_SIZE: str(self.batch_size),
            schema.SEED: str(self.seed),
            schema.DATASET: self.dataset,
            schema.EMULATED: str(self.emulated).lower(),
            schema.CODE_VERSION: code_version(),
            GIT_COMMIT_TAG: code_version().removesuffix("+dirty"),
        }
        if self.sweep_run:
            tags[schema.SWEEP_RUN] = self.sweep_run
        tags.update(self.more)
        tags.update({k: str(v) for k, v in more.items() if v is not None})
        return tags

    def child(self, parent: RunRef, kind: str, **more: object) -> dict[str, str]:
        """Tags of a run nested in the experiment run ``parent``."""
        return self.as_tags(**{schema.KIND: kind, schema.EXPERIMENT_RUN: parent.run_id, **more})


@dataclass(frozen=True)
class RunRef:
    """Where a run lives; what a task needs to open a child run under it from any thread, process or host."""

    tracking_uri: str
    experiment_id: str
    run_id: str


def experiment_id(client: MlflowClient, name: str) -> str:
    """The id of experiment ``name``, created if missing."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name)
        except MlflowException:
            found = client.get_experiment_by_name(name)  # created meanwhile by a concurrent flow
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} is deleted; restore it (mlflow experiments restore --experiment-id "
            f"{found.experiment_id}) or choose another name"
        )
    return found.experiment_id


class TrackedRun:
    """Logging into one MLflow run by id (thread-safe: no fluent state)."""

    def __init__(self, ref: RunRef, client: MlflowClient | None = None) -> None:
        self.ref = ref
        self.client = client or MlflowClient(ref.tracking_uri)

    @property
    def run_id(self) -> str:
        return self.ref.run_id

    def set_tags(self, tags: Mapping[str, object]) -> None:
        items = [RunTag(k, str(v)[:MAX_TAG_LENGTH]) for k, v in tags.items()]
        if items:
            self.client.log_batch(self.run_id, tags=items, synchronous=True)

    def set_note(self, markdown: str) -> None:
        """The run's description (Markdown), shown at the top of its page in the MLflow UI."""
        self.client.set_tag(self.run_id, NOTE_TAG, markdown[:MAX_NOTE_LENGTH])

    def log_params(self, params: Mapping[str, object]) -> None:
        if params:
            items = [Param(k, _param_text(v)) for k, v in params.items()]
            self.client.log_batch(self.run_id, params=items, synchronous=True)

    def log_metrics(self, metrics: Mapping[str, float | int | None], step: int = 0) -> None:
        """Finite values only: a failed measurement's NaN is recorded as its error tag, not as a number."""
        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None and math.isfinite(float(v))
        ]
        if items:
            self.client.log_batch(self.run_id, metrics=items, synchronous=True)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        self.client.log_text(self.run_id, json.dumps(data, indent=2, default=_json_default) + "\n", artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, frame: pd.DataFrame, artifact_file: str) -> None:
        """A table as CSV (for pandas and people) and as MLflow's table JSON (for the UI's artifact view and
        ``mlflow.load_table``), the latter named like the CSV with ``.json``."""
        buffer = io.StringIO()
        frame.to_csv(buffer, index=False)
        self.client.log_text(self.run_id, buffer.getvalue(), artifact_file)
        self.client.log_table(self.run_id, frame, str(Path(artifact_file).with_suffix(".json")))

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_dir(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(self.run_id, figure, artifact_file)


@contextmanager
def tracked_run(
    name: str,
    tags: Mapping[str, str],
    parent: RunRef | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    uri: str | None = None,
) -> Iterator[TrackedRun]:
    """A run that ends FINISHED when the block completes, FAILED (with an ``error`` tag) when it raises, and KILLED
    when it is interrupted (SIGINT; SIGTERM, which Prefect's flow engine or the command turns into an exception). A
    run whose process is killed outright stays RUNNING until a later run notices (``fail_orphaned_runs``).

    With ``parent`` it is nested under that run, in the parent's store and experiment.
    """
    resolved = parent.tracking_uri if parent else tracking_uri(uri)
    client = MlflowClient(resolved)
    all_tags = {**source_tags(), **prefect_tags(), **process_tags(), **tags}
    if parent is not None:
        exp_id = parent.experiment_id
        all_tags[PARENT_TAG] = parent.run_id
    else:
        exp_id = experiment_id(client, experiment)
        prepare_experiment(client, exp_id)
    created = client.create_run(exp_id, run_name=name, tags=all_tags)
    run = TrackedRun(RunRef(resolved, exp_id, created.info.run_id), client)
    try:
        yield run
    except BaseException as exc:
        interrupted = _interrupted(exc)
        status = "KILLED" if interrupted else "FAILED"
        reason = f"interrupted ({type(exc).__name__})" if interrupted else f"{type(exc).__name__}: {exc}"
        client.set_tag(run.run_id, schema.ERROR, reason[:MAX_TAG_LENGTH])
        client.set_terminated(run.run_id, status)
        raise
    client.set_terminated(run.run_id, "FINISHED")


def _interrupted(exc: BaseException) -> bool:
    """Ctrl-C, ``SystemExit``, or Prefect's ``TerminationSignal`` (SIGTERM during a flow run)."""
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        return True
    signals = sys.modules.get("prefect.exceptions")  # not imported here: prefect takes seconds to import
    return signals is not None and isinstance(exc, signals.TerminationSignal)


def source_tags() -> dict[str, str]:
    """What the MLflow UI shows as a run's Source (the Prefect flow, else the command) and Created by (the user).

    ``MlflowClient.create_run`` sets neither (only MLflow's fluent ``start_run`` does)."""
    from tasks.prefect_ui import flow_run_id

    command = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    source = f"prefect flow {_flow_name()}" if flow_run_id() is not None else command
    return {SOURCE_NAME_TAG: source, SOURCE_TYPE_TAG: "JOB" if _deployed() else "LOCAL", USER_TAG: _user()}


def process_tags() -> dict[str, str]:
    """The host and process that make a run."""
    return {HOST_TAG: socket.gethostname(), PROCESS_TAG: ProcessId.current().encode()}


def fail_orphaned_runs(uri: str) -> list[str]:
    """Mark FAILED, with the reason, every run of the store left RUNNING by a process of this host that is gone
    (killed outright, or the host restarted); returns their ids. Runs of live processes, of other hosts, or made
    before runs carried their process (``PROCESS_TAG``) are left alone."""
    here = boot_id()
    if not here:
        return []  # not Linux: whether a process lives cannot be told
    client = MlflowClient(uri)
    host = socket.gethostname()
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    query = f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'"
    failed = []
    for start in range(0, len(experiments), 100):
        token = None
        while True:
            page = client.search_runs(experiments[start : start + 100], query, ViewType.ALL, 1000, page_token=token)
            failed += [run.info.run_id for run in page if _fail_if_orphaned(client, run, host, here)]
            token = page.token
            if not token:
                break
    return failed


def _fail_if_orphaned(client: MlflowClient, run: Run, host: str, here: str) -> bool:
    try:
        process = ProcessId.decode(run.data.tags.get(PROCESS_TAG, ""))
    except ValueError:
        return False
    if process.boot == here and process.alive() is not False:
        return False
    restarted = " (the host has restarted since)" if process.boot != here else ""
    reason = (
        f"interrupted: its process {process.pid} on {host} is gone{restarted}, without ending the run; marked "
        "FAILED by a later run on this store"
    )
    client.set_tag(run.info.run_id, schema.ERROR, reason)
    client.set_terminated(run.info.run_id, "FAILED")
    return True


def prefect_tags() -> dict[str, str]:
    """The Prefect flow run a run was made in: its id, and its page when a lasting Prefect server holds it."""
    from tasks.prefect_ui import flow_run_id, flow_run_url

    found = flow_run_id()
    if found is None:
        return {}
    url = flow_run_url(found)
    return {FLOW_RUN_TAG: found, **({FLOW_RUN_URL_TAG: url} if url else {})}


def _flow_name() -> str:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context.flow.name if context is not None and context.flow is not None else "flow"


def _deployed() -> bool:
    """Started by a Prefect deployment (a schedule or a worker), not by a person at a prompt."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name for this uid (some containers)
        return "unknown"


# --- What the MLflow UI opens on ------------------------------------------------------------------------------

VIEW_COLUMNS = (
    "tags.`method`",
    "tags.`model`",
    "tags.`cluster`",
    f"metrics.`{schema.STEP_TIME}`",
    f"metrics.`{schema.STEP_TIME_LOW}`",
    f"metrics.`{schema.STEP_TIME_HIGH}`",
    f"tags.`{schema.STEP_TIME_SOURCE}`",
    f"tags.`{schema.BEST_GROUP}`",
)
VIEW_CHARTS = (schema.STEP_TIME_MS, schema.COMMUNICATION_SHARE)
"""The bar charts of the view: the step time in milliseconds (MLflow labels a bar with two decimals, so in seconds
four methods of 0.19–0.20 s all read "0.20"), and the communication share."""


def runs_view_state() -> dict[str, object]:
    """The saved view's state, in the MLflow UI's (3.17) own terms: every method run, by its place in its
    experiment's result (``schema.PLACE``: the fastest first, TAPP first among equal step times, where MLflow alone
    would put the latest run first), with the columns that compare them, and the step time's chart first."""
    charts = [
        {
            "uuid": f"tapp-chart-{metric}",
            "type": "BAR",
            "runsCountToCompare": 20,
            "metricSectionId": "tapp-metrics",
            "deleted": False,
            "isGenerated": True,
            "displayName": metric,
            "metricKey": metric,
        }
        for metric in VIEW_CHARTS
    ]
    return {
        "searchFilter": f"tags.{schema.KIND} = '{schema.EVALUATION}'",
        "orderByKey": f"metrics.`{schema.PLACE}`",  # step time, TAPP first among equals (MLflow: the latest first)
        "orderByAsc": True,
        "selectedColumns": list(VIEW_COLUMNS),
        "columnOrder": list(VIEW_COLUMNS),
        "columnWidths": {"attributes.`Run Name`": 320, **{column: 150 for column in VIEW_COLUMNS[3:6]}},
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts,
        "compareRunSections": [
            {
                "uuid": "tapp-metrics",
                "name": "Step time",
                "display": True,
                "isReordered": True,
                "deleted": False,
                "isGenerated": True,
                "columns": 1,
                "cardHeight": 460,
            }
        ],
    }


def prepare_experiment(client: MlflowClient, exp_id: str) -> None:
    """Give the experiment TAPP's saved runs view (rewritten only when it differs) and, if it has none, a
    description that says how to open it."""
    experiment = client.get_experiment(exp_id)
    state = json.dumps(runs_view_state(), sort_keys=True)
    current = experiment.tags.get(VIEW_TAG_PREFIX + RUNS_VIEW)
    try:
        unchanged = current is not None and json.loads(current).get("state") == state
    except (ValueError, AttributeError):
        unchanged = False
    if not unchanged:
        now = int(time.time() * 1000)
        view = {"name": "TAPP: step time per method", "createdAt": now, "updatedAt": now, "state": state}
        client.set_experiment_tag(exp_id, VIEW_TAG_PREFIX + RUNS_VIEW, json.dumps(view))
        # Not read by MLflow 3.17's UI (the link's workflowType decides), but it says what the experiment is.
        client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, "custom_model_development")
    if not experiment.tags.get(NOTE_TAG):
        client.set_experiment_tag(
            exp_id,
            NOTE_TAG,
            "TAPP's experiments: one parent run per `tapp run`, with the result table in its description, and a "
            "nested run per stage and per method. To compare the methods, choose the view **TAPP: step time per "
            "method** (Views menu above the runs), or open the link `tapp run` prints.",
        )


def mlflow_ui_url(uri: str) -> str:
    """The MLflow UI of store ``uri``: the server itself over http(s), else ``TAPP_MLFLOW_UI_URL``, else where
    ``mlflow ui`` serves by default."""
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/")
    return os.environ.get("TAPP_MLFLOW_UI_URL", DEFAULT_MLFLOW_UI).rstrip("/")


def runs_view_url(ui: str, exp_id: str) -> str:
    """The runs list in TAPP's saved view, in the UI's model-training mode (not its GenAI overview)."""
    query = urllib.parse.urlencode({"viewStateShareKey": RUNS_VIEW, "workflowType": "machine_learning"})
    return f"{ui}/#/experiments/{exp_id}/runs?{query}"


def run_url(ui: str, exp_id: str, run_id: str, artifact: str | None = None) -> str:
    """A run's page (or one of its artifacts) in the UI's model-training mode."""
    page = f"{ui}/#/experiments/{exp_id}/runs/{run_id}" + (f"/artifacts/{artifact}" if artifact else "")
    return page + "?workflowType=machine_learning"


def _param_text(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=_json_default)
    return text[:MAX_PARAM_LENGTH]


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


__all__ = [
    "DEFAULT_EXPERIMENT",
    "RUNS_VIEW",
    "ExperimentTags",
    "RunRef",
    "TrackedRun",
    "TrackingError",
    "check_tracking",
    "code_version",
    "experiment_id",
    "fail_orphaned_runs",
    "mlflow_ui_url",
    "open_store",
    "prepare_experiment",
    "run_url",
    "runs_view_url",
    "source_tags",
    "tracked_run",
    "tracking_uri",
]
