"""What a flow run shows in Prefect's UI: TAPP's own log lines, keyed artifacts, and where the run can be seen.

Log lines go through Prefect's run logger (``get_run_logger``), so they are the flow run's Logs tab, each with its
task; outside a Prefect run (a task's ``.fn()`` in a test, a notebook) they go to the ``tapp`` logger and no
artifact is made. Artifacts carry keys (lowercase letters, digits, dashes), so they are listed on Prefect's
Artifacts page as well as on the flow run's; the same key in a later run is a new version.

``flow_run_url`` is the flow run's page in the Prefect UI, or None when nobody can open it: no server is
configured, or the server is one TAPP started for one command and stops at its end (``temporary_api``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging import get_run_logger

from reports import numbers

RESULT_KEY = "tapp-result"
"""Markdown: the verdict, the search, the result table, the chosen plan and the links (the parent run's
description)."""
EVALUATION_KEY = "tapp-evaluation"
"""Table: one row per evaluated method (``tasks.summary.table_records``)."""
SAMPLED_PLANS_KEY = "tapp-sampled-plans"
"""Table: every plan the search sampled, with its estimate and measurement."""
MLFLOW_RUN_KEY = "tapp-mlflow-run"
"""Link: the experiment's parent run in the MLflow UI (Prefect stores a link artifact as type ``markdown``)."""
SIGNIFICANT_DIGITS = numbers.SIGNIFICANT_DIGITS
"""Numbers shown in tables and log lines (``reports.numbers``)."""

_fallback = logging.getLogger("tapp")
_temporary_apis: set[str] = set()
_temporary_lock = threading.Lock()


class _CompletedTaskLines(logging.Filter):
    """Drops Prefect's ``Finished in state Completed()`` line of each task run (``Cached(...)`` too: INFO is a
    completed state): about half of a flow run's log, and said by each task's state in the UI. A task that fails or
    crashes still logs its state, at ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.getMessage().startswith("Finished in state "))


_QUIET_TASK_STATES = _CompletedTaskLines()


def quiet_task_states() -> None:
    """Keep Prefect's per-task "Finished in state Completed()" lines out of the flow run's log, where TAPP's own
    lines (``log``) are what a reader follows; idempotent."""
    logger = logging.getLogger("prefect.task_runs")
    if _QUIET_TASK_STATES not in logger.filters:
        logger.addFilter(_QUIET_TASK_STATES)


def in_prefect_run() -> bool:
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def log(message: str) -> None:
    """One plain line in the current flow or task run's log (tables go to artifacts); the ``tapp`` logger outside a
    run."""
    if in_prefect_run():
        get_run_logger().info(message)
    else:
        _fallback.info(message)


def shown(value: object) -> object:
    """``value`` rounded as shown (``reports.numbers.rounded``) when it is a float (NaN and infinity as they are)."""
    if isinstance(value, float) and math.isfinite(value):
        return numbers.rounded(value)
    return value


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    if in_prefect_run():
        create_markdown_artifact(markdown, key=key, description=description)


def table_artifact(key: str, table: pd.DataFrame | Sequence[Mapping[str, Any]], description: str) -> None:
    """A table artifact, its floats rounded for reading (NaN shows as an empty cell)."""
    if not in_prefect_run():
        return
    records = table.to_dict("records") if isinstance(table, pd.DataFrame) else list(table)
    rows = [{str(k): _plain(v) for k, v in row.items()} for row in records]
    create_table_artifact(rows, key=key, description=description)


def link_artifact(key: str, link: str, text: str, description: str) -> None:
    if in_prefect_run():
        create_link_artifact(link, link_text=text, key=key, description=description)


def _plain(value: object) -> object:
    """A JSON-ready cell: numpy scalars as Python numbers, floats rounded, infinity as text."""
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    return shown(value)


def flow_run_id() -> str | None:
    """The id of the flow run this code runs in, if any."""
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        return str(context.flow_run.id)
    task_context = TaskRunContext.get()
    if task_context is not None and task_context.task_run.flow_run_id is not None:
        return str(task_context.task_run.flow_run_id)
    return None


def flow_run_name() -> str | None:
    context = FlowRunContext.get()
    return context.flow_run.name if context is not None and context.flow_run is not None else None


@contextmanager
def temporary_api(api_url: str) -> Iterator[None]:
    """Mark ``api_url`` as a server that lives only for this command: its flow runs get no URL."""
    with _temporary_lock:
        _temporary_apis.add(api_url)
    try:
        yield
    finally:
        with _temporary_lock:
            _temporary_apis.discard(api_url)


def flow_run_url(run_id: str | None) -> str | None:
    """The flow run's page in the Prefect UI of the configured server; None without one, or on a temporary one."""
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.urls import url_for

    api = PREFECT_API_URL.value()
    with _temporary_lock:
        temporary = api in _temporary_apis
    if run_id is None or not api or temporary:
        return None
    return url_for("flow-run", obj_id=run_id)


__all__ = [
    "EVALUATION_KEY",
    "MLFLOW_RUN_KEY",
    "RESULT_KEY",
    "SAMPLED_PLANS_KEY",
    "flow_run_id",
    "flow_run_name",
    "flow_run_url",
    "in_prefect_run",
    "link_artifact",
    "log",
    "markdown_artifact",
    "shown",
    "table_artifact",
    "temporary_api",
]
