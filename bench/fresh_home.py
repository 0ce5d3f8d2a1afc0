"""A fresh home for a command a bench runs as a user would on a new machine: its own temporary folder, Prefect home
and TAPP cache under ``root``, and none of this shell's MLflow, Prefect or TAPP settings."""

from __future__ import annotations

import os
from pathlib import Path


def fresh_environment(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "TAPP_"))}
    (root / "tmp").mkdir(exist_ok=True)
    return env | {
        "TMPDIR": str(root / "tmp"),
        "PREFECT_HOME": str(root / "prefect-home"),
        "TAPP_CACHE_DIR": str(root / "cache"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # A fresh Prefect home migrates its database on the first start, which can pass Prefect's default wait.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "COLUMNS": "160",
    }
