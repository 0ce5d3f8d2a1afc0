"""TAPP core library: models, data, profiling, clusters, plans, cost model, planners and the MPI runtime.

This package never imports prefect or mlflow, so it can be used from a notebook or another orchestrator.
"""

__version__ = "0.1.0"
