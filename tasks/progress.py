"""Progress of a flow's stages, shown twice: as a Prefect progress artifact (UI) and to in-process listeners.

The command line registers a listener (``listening``) that drives its rich progress bars; flows and tasks only
call ``StageProgress.update``. Outside a Prefect run (a task's ``.fn()`` in a test) no artifact is made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext, TaskRunContext

Listener = Callable[[str, int, int, str], None]
"""Called with (stage, done, total, status)."""

_listeners: list[Listener] = []
_lock = threading.Lock()


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def _in_prefect_run() -> bool:
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class StageProgress:
    """``total`` steps of one stage (search rounds, plans measured, methods evaluated)."""

    def __init__(self, stage: str, total: int, description: str) -> None:
        self.stage = stage
        self.total = max(total, 1)
        self.description = description
        self._artifact: UUID | None = None
        if _in_prefect_run():
            artifact = create_progress_artifact(0.0, description=description)
            self._artifact = artifact if isinstance(artifact, UUID) else None  # a coroutine only in async code
        self._notify(0, "")

    def update(self, done: int, status: str = "") -> None:
        if self._artifact is not None:
            description = f"{self.description}: {done}/{self.total}" + (f" ({status})" if status else "")
            update_progress_artifact(self._artifact, 100.0 * done / self.total, description=description)
        self._notify(done, status)

    def _notify(self, done: int, status: str) -> None:
        with _lock:
            listeners = list(_listeners)
        for listener in listeners:
            listener(self.stage, done, self.total, status)
