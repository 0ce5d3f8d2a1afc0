"""The MPI runtime: plans run for real, one rank per device, measured (``measure``) or trained (``train``).

The names below load on first use, so that a rank (``python -m tapp_core.runtime.worker``) can start its guard
before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tapp_core.runtime.launch import check_before_launch, measure, mpiexec_command, train
    from tapp_core.runtime.optim import OptimizerConfig, make_optimizer, micro_batch_loss
    from tapp_core.runtime.pool import PoolError, PoolRefused, WorkerPool
    from tapp_core.runtime.results import TrainResult

_HOMES: dict[str, str] = {
    "OptimizerConfig": "optim",
    "PoolError": "pool",
    "PoolRefused": "pool",
    "TrainResult": "results",
    "WorkerPool": "pool",
    "check_before_launch": "launch",
    "make_optimizer": "optim",
    "measure": "launch",
    "micro_batch_loss": "optim",
    "mpiexec_command": "launch",
    "train": "launch",
}

__all__ = [
    "OptimizerConfig",
    "PoolError",
    "PoolRefused",
    "TrainResult",
    "WorkerPool",
    "check_before_launch",
    "make_optimizer",
    "measure",
    "micro_batch_loss",
    "mpiexec_command",
    "train",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
