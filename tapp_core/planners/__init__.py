"""Planners: ``get_planner(name, **options).plan(library, cluster, budget) -> Plan``.

TAPP's reinforcement-learning planner and the baselines and peers it is measured against: single device,
BSP, even split, Pipe-Torch DP, PipeDream/APapo antichain DP, AutoDDL coordinate descent, and an exhaustive
oracle. See ``base`` for the shared options and the progress callback.
"""

from tapp_core.planners.base import (
    DEFAULT_MICRO_BATCHES,
    PAPER_METHODS,
    PLANNER_NAMES,
    Method,
    Planner,
    PlannerBase,
    PlannerError,
    ProgressCallback,
    SearchProgress,
    get_planner,
    method_description,
    method_label,
    planner_options,
)

__all__ = [
    "DEFAULT_MICRO_BATCHES",
    "PAPER_METHODS",
    "PLANNER_NAMES",
    "Method",
    "Planner",
    "PlannerBase",
    "PlannerError",
    "ProgressCallback",
    "SearchProgress",
    "get_planner",
    "method_description",
    "method_label",
    "planner_options",
]
