"""Checks that an output path can be written, made before the work that produces what goes there.

A plan file, a Gantt chart, a layer library folder, a report folder: each is checked when the command starts, so
that a folder given as a file, a file given as a folder or a read-only place fails in one line, not after minutes
of work. "Writable" is tried, not inferred from permission bits (which do not bind root, and say nothing of a
read-only file system): a probe file is created and removed in the nearest folder that exists.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tapp_core.errors import TappError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout (or installed tree) that holds ``tapp_core``, ``deployments`` and the rest."""


class OutputPathError(TappError):
    """An output path that cannot be written."""


def writable_folder_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why files cannot be created in ``folder`` (which exists), or None if they can."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tapp-write-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the folder that has to take a new entry)."""
    current = path.absolute()
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def _check_creatable(path: Path, what: str) -> None:
    """Every missing folder on the way to ``path`` (which does not exist) can be made, and the last one that exists
    takes new entries."""
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise OutputPathError(f"{what} {path}: {existing} is a file, not a folder")
    problem = writable_folder_problem(existing)
    if problem is not None:
        raise OutputPathError(f"{what} {path} cannot be written: {existing} is not writable ({problem})")


def check_output_file(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` can be written as a file (created, with its folders, or replaced); ``what`` names it in the error
    (``"--out"``, ``"plan file"``)."""
    out = Path(path)
    if out.is_dir():
        raise OutputPathError(f"{what} {out} is a folder; give a file name")
    if out.exists():
        if not os.access(out, os.W_OK) or writable_folder_problem(out.parent) is not None:
            raise OutputPathError(f"{what} {out} cannot be written (read-only)")
        return out
    _check_creatable(out, what)
    return out


def check_output_folder(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` is, or can be made, a folder that takes new files."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{what} {out} is a file; give a folder")
    if out.is_dir():
        problem = writable_folder_problem(out)
        if problem is not None:
            raise OutputPathError(f"{what} {out} cannot be written ({problem})")
        return out
    _check_creatable(out, what)
    return out
