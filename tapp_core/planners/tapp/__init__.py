"""TAPP's planner: a partition network and an attention allocation network trained jointly by policy gradient
(seed 000, section 4), searching plans against a simulated, measured or hybrid reward."""

from tapp_core.planners.tapp.planner import TappPlanner
from tapp_core.planners.tapp.rewards import MeasuredReward, Measurer, RewardSource, SimulatedReward
from tapp_core.planners.tapp.search import RoundReport, SearchConfig, TappSearch

__all__ = [
    "MeasuredReward",
    "Measurer",
    "RewardSource",
    "RoundReport",
    "SearchConfig",
    "SimulatedReward",
    "TappPlanner",
    "TappSearch",
]
