"""TAPP as a planner: build the search from the options, run its rounds, finish it (``TappSearch.finish``: when
nothing was measured, the polish of ``polish``, a local search over stage boundaries, micro-batch counts, device
moves and relay stages, from the best simulated plans; when plans were measured, a race among the best candidates
by estimate and by measurement), return the chosen plan with the search's statistics and how it was chosen."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import PlannerBase, PlannerError, ProgressCallback, SearchProgress
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.tapp.options import SearchOptions
from tapp_core.planners.tapp.policy import PolicyConfig
from tapp_core.planners.tapp.rewards import MeasuredReward, Measurer, RewardSource, SimulatedReward
from tapp_core.planners.tapp.search import SearchConfig, TappSearch

DEFAULT_GROUPS = 8
"""Most stages the policy samples by default: its networks and the placement's steps grow with the groups, and
beyond a handful of stages a pipeline's bubbles and transfers rarely pay for more."""


@dataclass
class TappPlanner(PlannerBase, SearchOptions):
    """TAPP's planner: its search options are ``SearchOptions``'s fields (one definition, with their defaults),
    the planner's own are below."""

    name = "tapp"
    searches_schedules = True

    schedules: Sequence[str] | None = ("1f1b", "async")
    """TAPP chooses between the synchronous and the asynchronous pipeline unless told otherwise (every sample's
    schedule is one of the policy's decisions)."""

    groups: int | None = None
    """Most pipeline stages the policy samples (the polish's relay stages may add more); None: one per device, at
    most ``DEFAULT_GROUPS`` (on a larger cluster the other devices replicate stages or stay idle)."""
    measurer: Measurer | None = None
    """measured / hybrid: what measures plans, one call a round (``tapp_core.runtime.pool_race.PoolRounds`` runs a
    plan's round of a warm-up step and a few timed ones on a ``WorkerPool``); the planner starts no MPI."""
    checkpoint: str | os.PathLike[str] | None = None
    """Save the search here after every round."""
    resume: bool = False
    """Continue the search saved at ``checkpoint`` (up to ``rounds`` rounds in all) instead of starting anew."""

    def __post_init__(self) -> None:
        PlannerBase.__post_init__(self)
        SearchOptions.__post_init__(self)
        if self.resume and self.checkpoint is None:
            raise PlannerError("tapp planner: resume needs a checkpoint path")

    def config(self, context: CostContext, budget: int | None) -> SearchConfig:
        """The search's configuration: these options, and what this library, cluster and budget fix."""
        library, cluster = context.library, context.cluster
        return SearchConfig(
            **self.option_values(),
            budget=budget,
            seed=self.seed,
            batch_size=self.resolved_batch_size(library),
            micro_batch_choices=self.micro_batch_choices(library),
            schedules=self.schedule_specs,
            policy=PolicyConfig(groups=min(self.groups or DEFAULT_GROUPS, len(cluster.devices), len(library.layers))),
        )

    def simulated_reward(self, context: CostContext) -> SimulatedReward:
        """The cost model's reward source, in the context's calibration."""
        return SimulatedReward(PlanEvaluator(context))

    def search(
        self,
        context: CostContext,
        budget: int | None = None,
        measurer: Measurer | None = None,
        simulated: RewardSource | None = None,
    ) -> TappSearch:
        """A search to run round by round (an orchestrator's entry point); resumed from ``checkpoint`` if asked.
        ``measurer`` (default: the planner's) measures plans for a measured or hybrid reward; ``simulated`` is the
        cost model's reward source (default: ``simulated_reward``; an orchestrator may wrap it to see what the search
        asks it)."""
        measurer = measurer if measurer is not None else self.measurer
        if self.reward != "simulated" and measurer is None:
            raise PlannerError(f"tapp planner: a {self.reward} reward needs a measurer, on {context.cluster.name!r}")
        simulated = simulated if simulated is not None else self.simulated_reward(context)
        measured = MeasuredReward(measurer, context) if measurer is not None else None
        if self.resume:
            assert self.checkpoint is not None
            if not Path(self.checkpoint).is_file():
                raise PlannerError(f"tapp planner: cannot resume, checkpoint {self.checkpoint} does not exist")
            return TappSearch.resume(
                self.checkpoint, context, simulated, measured, rounds=self.rounds, polish=self.polish
            )
        return TappSearch(context, self.config(context, budget), simulated, measured, self.checkpoint)

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        library, cluster = context.library, context.cluster
        search = self.search(context, budget)
        for report in search.rounds():
            if progress:
                progress(
                    SearchProgress(
                        planner=self.name,
                        round=report.round,
                        total_rounds=search.config.rounds,
                        evaluations=report.evaluations,
                        best_step_time_s=report.best_step_time_s,
                        elapsed_s=report.elapsed_s,
                        reward=report.mean_reward,
                        entropy=report.entropy,
                        phase=report.phase,
                    )
                )
        try:
            return search.finish()
        except RuntimeError as exc:
            raise PlannerError(f"tapp found no plan of {library.model} that runs on {cluster.name!r}: {exc}") from None


@dataclass
class TappRlPlanner(TappPlanner):
    """The TAPP paper's algorithm alone: the population's policy-gradient rounds, with no warm start from the other
    planners' plans and no polish after them, so that what the reinforcement learning finds by itself is seen
    beside the full planner's plan (same options otherwise: rounds, samples, time limit, seed)."""

    name = "tapp-rl"

    polish: bool = False
    warm_start: bool = False
