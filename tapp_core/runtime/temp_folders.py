"""TAPP's folders in the temporary directory: a pool's (``tapp-pool-*``, holding the workers' log), a search's
(``tapp-search-*``, its checkpoint during an experiment).

Each is removed by its user on every way out that runs Python code (a normal end, an exception, SIGINT, and SIGTERM,
which the pool and ``tapp run`` turn into ``SystemExit``). A SIGKILL leaves it behind, so each folder records its
owner (``guard.ProcessId``) and the next user of that kind of folder removes the ones whose owner is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tapp_core.runtime.guard import ProcessId, boot_id

PREFIX = "tapp-pool-"
OWNER_FILE = "owner"
ORPHAN_AGE_S = 24 * 3600.0
"""A folder without a readable owner (from an older version, or half made) is swept once this old."""


def make_owned_folder(prefix: str) -> Path:
    """A new private folder (mode 0700) named ``prefix...`` in the temporary directory, owned by this process."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    (folder / OWNER_FILE).write_text(ProcessId.current().encode())
    return folder


def sweep_owned_folders(prefix: str, root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's ``prefix...`` folders in ``root`` (default: the temporary directory) whose owner is gone."""
    removed = []
    for folder in Path(root if root is not None else tempfile.gettempdir()).glob(prefix + "*"):
        if _abandoned(folder):
            remove_pool_folder(folder)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def owned_folder(prefix: str) -> Iterator[Path]:
    """A folder of ``make_owned_folder`` for the block, removed when it ends; abandoned ones are swept first."""
    sweep_owned_folders(prefix)
    folder = make_owned_folder(prefix)
    try:
        yield folder
    finally:
        remove_pool_folder(folder)


def make_pool_folder() -> Path:
    """A new pool folder (``make_owned_folder``)."""
    return make_owned_folder(PREFIX)


def remove_pool_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def sweep_pool_folders(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove this user's pool folders in ``root`` (default: the temporary directory) whose owner is gone."""
    return sweep_owned_folders(PREFIX, root)


def _abandoned(folder: Path) -> bool:
    try:
        info = folder.lstat()
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False  # a link, a file, or someone else's: not ours to remove
    try:
        owner = ProcessId.decode((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return time.time() - info.st_mtime > ORPHAN_AGE_S
    here = boot_id()
    if here and owner.boot and owner.boot != here:
        return True  # made before this host last booted
    return owner.alive() is False
