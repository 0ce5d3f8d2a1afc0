"""TAPP's search options and their defaults, written once.

``SearchOptions`` is what a user chooses about the search. The TAPP planner's options are these fields (it
extends the class), a search's configuration (``search.SearchConfig``) is these fields plus what the run fixes
(seed, batch, micro-batch counts, schedule, budget, policy), and the flow's budget (``tasks.search.SearchBudget``)
holds these options with a few overridden by name. A new option is added here and nowhere else; ``rounds`` counts
every round, the measured ones included, wherever it appears.

The classes are not frozen because the planner, a mutable dataclass like every planner, extends them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tapp_core.planners.base import PlannerError

REWARD_KINDS = ("simulated", "measured", "hybrid")
_LEAST = {
    "rounds": 1,
    "samples_per_round": 1,
    "population": 1,
    "exploit_every": 1,
    "restart_after": 0,
    "measured_rounds": 0,
    "measured_per_round": 1,
}
"""The least value of each count option."""
DEFAULT_TIME_LIMIT_S = 90.0
"""The default time limit: a search ends within 120 s on a loaded two-core machine, the overrun of its last round
and polish step included."""


@dataclass
class SearchOptions:
    reward: str = "simulated"
    """'simulated' (cost model), 'measured' (worker pool) or 'hybrid' (cost model, then measurements)."""
    rounds: int = 250
    """Every round of the search, the measured ones included (``simulated_rounds`` are those before them)."""
    samples_per_round: int = 16
    """Samples per policy per round (``tapp run``'s default too)."""
    population: int = 8
    exploit_every: int = 50
    restart_after: int = 40
    """Rounds without improvement after which a policy (not the leader) restarts from a new random split; 0: never."""
    initial_splits: tuple[str, ...] = ("uniform", "speed", "shuffled")
    """Starting split of each policy in turn (see ``PolicyConfig.initial_split``; 'shuffled' takes the policy's
    seed)."""
    learning_rate: float = 0.01
    entropy_weight: float = 0.02
    baseline_decay: float = 0.9
    failure_penalty: float = 3.0
    imitation_weight: float = 1.0
    """Self-imitation: weight of the pull towards the best plans seen that beat the baseline (0: off)."""
    imitation_plans: int = 4
    measured_rounds: int = 1
    """hybrid: how many final rounds use measurements."""
    measured_per_round: int = 1
    """hybrid: how many of each policy's best samples of a round (by the cost model) are measured."""
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S
    """The whole search's time limit in seconds (None: none): the warm start, the rounds and the polish. The rounds
    stop at ``rounds_time_share`` of it when a polish follows (at all of it otherwise), the polish at the limit; a
    hybrid search still runs its measured rounds."""
    rounds_time_share: float = 0.7
    """Share of ``time_limit_s`` the warm start and the rounds may take when a polish follows."""
    polish: bool = True
    """After the rounds, when nothing was measured: a local search from the population's best simulated plans and
    the warm start's candidates (``polish.Polish``); its gain is in the plan's notes as ``polish_gain``."""
    warm_start: bool = True
    """Before the first round, unless the reward is 'measured': cheap candidates (``warm.WarmStart``: every device
    alone, BSP, the even split, PipeDream, a time-boxed AutoDDL) join the polish's starts and one policy's elite;
    the plan's notes list them (``warm_start``) and the fastest (``warm_start_winner``)."""

    def __post_init__(self) -> None:
        if self.reward not in REWARD_KINDS:
            raise PlannerError(f"TAPP search: reward must be one of {', '.join(REWARD_KINDS)}, got {self.reward!r}")
        for name, least in _LEAST.items():
            if getattr(self, name) < least:
                raise PlannerError(f"TAPP search: {name} must be at least {least}, got {getattr(self, name)}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise PlannerError(f"TAPP search: time_limit_s must be positive or None, got {self.time_limit_s}")
        if not 0 < self.rounds_time_share <= 1:
            raise PlannerError(f"TAPP search: rounds_time_share must be in (0, 1], got {self.rounds_time_share}")

    @property
    def simulated_rounds(self) -> int:
        """The rounds rewarded by the cost model: every round of a simulated search, none of a measured one, those
        before the last ``measured_rounds`` of a hybrid one."""
        if self.reward == "simulated":
            return self.rounds
        if self.reward == "measured":
            return 0
        return max(self.rounds - self.measured_rounds, 0)

    def option_values(self) -> dict[str, Any]:
        """The values of these options alone (of a planner or a configuration that extends them), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SearchOptions)}
