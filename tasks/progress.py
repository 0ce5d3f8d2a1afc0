"""Progress of a flow's stages, shown three ways: a keyed Prefect progress artifact, a line in the run's log, and
to in-process listeners.

The command line registers a listener (``listening``) that drives its rich progress bars; flows and tasks only
call ``StageProgress.update``. Outside a Prefect run (a task's ``.fn()`` in a test) no artifact is made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.prefect_ui import in_prefect_run, log

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


def progress_key(stage: str) -> str:
    """The progress artifact's key: ``tapp-STAGE-progress`` (Prefect keys are lowercase letters, digits, dashes)."""
    return "tapp-" + "".join(c if c.isalnum() else "-" for c in stage.lower()) + "-progress"


class StageProgress:
    """``total`` steps of one stage (search rounds, plans measured, methods evaluated).

    The artifact's description stays short (``DESCRIPTION: done/total``: Prefect's cards cut long ones); each
    update's ``status`` goes to the run's log instead, as ``DESCRIPTION done/total: status``.
    """

    def __init__(self, stage: str, total: int, description: str) -> None:
        self.stage = stage
        self.total = max(total, 1)
        self.description = description
        self._artifact: UUID | None = None
        if in_prefect_run():
            artifact = create_progress_artifact(
                0.0, key=progress_key(stage), description=f"{description}: 0/{self.total}"
            )
            self._artifact = artifact if isinstance(artifact, UUID) else None  # a coroutine only in async code
        self._notify(0, "")

    def update(self, done: int, status: str = "", detail: str = "") -> None:
        """``done`` of ``total`` steps; ``status`` is shown beside the bar and logged, ``detail`` only logged."""
        if self._artifact is not None:
            description = f"{self.description}: {done}/{self.total}"
            update_progress_artifact(self._artifact, 100.0 * done / self.total, description=description)
        if status or detail:
            log(f"{self.description} {done}/{self.total}: " + "; ".join(t for t in (status, detail) if t))
        self._notify(done, status)

    def _notify(self, done: int, status: str) -> None:
        with _lock:
            listeners = list(_listeners)
        for listener in listeners:
            listener(self.stage, done, self.total, status)
