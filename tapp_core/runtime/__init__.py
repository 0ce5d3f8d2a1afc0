"""The MPI runtime: plans run for real, one rank per device, measured (``measure``) or trained (``train``)."""

from tapp_core.runtime.launch import measure, mpiexec_command, train
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer, micro_batch_loss
from tapp_core.runtime.pool import PoolError, WorkerPool
from tapp_core.runtime.results import TrainResult

__all__ = [
    "OptimizerConfig",
    "PoolError",
    "TrainResult",
    "WorkerPool",
    "make_optimizer",
    "measure",
    "micro_batch_loss",
    "mpiexec_command",
    "train",
]
