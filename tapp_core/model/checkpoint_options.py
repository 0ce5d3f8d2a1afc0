"""A training's checkpoint options: plain data, one field of what a training is asked to do (the run's
specification), read by the runtime (``tapp_core.runtime.checkpoint`` holds the format)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointOptions:
    """Where a training writes its checkpoints and how often, and the checkpoint it resumes from."""

    folder: str | None = None
    """The folder of checkpoints (one ``step-*`` folder each); None: none written."""
    every: int = 0
    """Write one every this many steps (0: at the end of the training only)."""
    resume: str | None = None
    """Go on from this checkpoint (a ``step-*`` folder, or a folder of them: its newest complete one)."""
    until: int | None = None
    """Stop once this many steps are done in all, with a checkpoint there (one segment of an elastic training,
    ``runtime.elastic``); None: train to the end."""
