"""TAPP's planner: a partition network and an attention allocation network trained jointly by policy gradient
(seed 000, section 4), searching plans against a simulated, measured or hybrid reward.

Modules: ``options`` (the search options and their defaults), ``search`` (the policy-gradient rounds),
``polish`` (the local search after them), ``policy`` with ``networks``, ``features`` and ``repair`` (the
policy), ``rewards`` (where step times come from) and ``planner`` (all of it as a planner).
"""

from tapp_core.planners.tapp.options import SearchOptions
from tapp_core.planners.tapp.planner import TappPlanner
from tapp_core.planners.tapp.polish import Polish
from tapp_core.planners.tapp.rewards import MeasuredReward, Measurer, RewardSource, SimulatedReward, TimedPlan
from tapp_core.planners.tapp.search import RoundReport, SearchConfig, TappSearch

__all__ = [
    "MeasuredReward",
    "Measurer",
    "Polish",
    "RewardSource",
    "RoundReport",
    "SearchConfig",
    "SearchOptions",
    "SimulatedReward",
    "TappPlanner",
    "TappSearch",
    "TimedPlan",
]
