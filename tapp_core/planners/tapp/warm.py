"""TAPP's warm start: cheap plans the search starts from, so that no plan a one-line rule would find is missed.

The candidates are every device alone (one device per class of interchangeable devices,
``planners.stage_costs.device_classes``) at its best micro-batch count, and the plans of the cheap planners
(``WARM_PLANNERS``: BSP, the even split, PipeDream's dynamic programme and AutoDDL's coordinate descent; not
Pipe-Torch, whose enumeration of device orders takes minutes at 7-8 devices). Their modules are imported here, as
the registry declares (``builds_on`` of TAPP's ``Method``). AutoDDL is time-boxed: it gets an
evaluation budget worth ``box_s`` seconds at the rate the cost model estimated the other planners' plans (each
at every micro-batch count: the candidate is the fastest of them). Every candidate is
costed by the search's own reward source. The search puts them among the polish's starts and in one policy's
elite (``search.TappSearch``), and the plan's notes list them (``warm_start``: name -> step time, and
``warm_start_winner``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tapp_core.cost.context import CostContext
from tapp_core.errors import TappError
from tapp_core.plan.plan import Plan
from tapp_core.plan.schedules import parse_schedule_spec
from tapp_core.planners.autoddl import AutoDdlPlanner
from tapp_core.planners.base import PlannerBase
from tapp_core.planners.bsp import BspPlanner
from tapp_core.planners.even import EvenPlanner
from tapp_core.planners.pipedream import PipeDreamPlanner
from tapp_core.planners.space import contiguous_plan
from tapp_core.planners.stage_costs import device_classes
from tapp_core.planners.tapp.rewards import RewardSource, TimedPlan

WARM_PLANNERS: tuple[type[PlannerBase], ...] = (BspPlanner, EvenPlanner, PipeDreamPlanner, AutoDdlPlanner)
SINGLE = "single:"
"""Name prefix of a single-device candidate (``single:<device>``)."""
LEAST_AUTODDL_BUDGET = 50
"""Fewest evaluations AutoDDL gets, however short its box."""


@dataclass(frozen=True)
class WarmCandidate:
    name: str
    """``single:<device>`` or the planner's name."""
    timed: TimedPlan
    evaluations: int = 0
    """Cost-model estimates the planner spent on its own (beyond those of the search's reward source)."""


@dataclass(frozen=True)
class WarmStart:
    """What the warm start needs to know about the search."""

    context: CostContext
    reward: RewardSource
    batch_size: int
    micro_batch_choices: tuple[int, ...]
    schedules: tuple[str, ...]
    """The search's schedules (``schedules.schedule_spec``); a single device runs the first."""
    seed: int

    def candidates(self, box_s: float | None, budget: int | None = None) -> list[WarmCandidate]:
        """Every candidate that produced a plan that runs, fastest first: each device alone, then the planners while fewer
        than ``budget`` evaluations (None: no limit) were spent. AutoDDL stops after about ``box_s`` seconds
        (None: no box)."""
        first = self.reward.evaluations
        found = self.single_devices()
        rate_s = 0.0
        """Most seconds per estimate seen (the planners' plans, at every micro-batch count)."""
        for planner in WARM_PLANNERS:
            spent = self.reward.evaluations - first + sum(c.evaluations for c in found)
            left = None if budget is None else budget - spent
            if left is not None and left <= 0:
                break
            if planner is AutoDdlPlanner and box_s is not None:
                boxed = max(LEAST_AUTODDL_BUDGET, int(box_s / rate_s)) if rate_s > 0 else LEAST_AUTODDL_BUDGET
                left = boxed if left is None else min(left, boxed)
            plan = self._planned(planner, left)
            if plan is None:
                continue
            variants = [
                dataclasses.replace(plan, micro_batches=m, planner="", notes={}) for m in self.micro_batch_choices
            ]
            started = time.perf_counter()
            times = self.reward.step_times(variants)
            rate_s = max(rate_s, (time.perf_counter() - started) / len(variants))
            best = min(range(len(variants)), key=times.__getitem__)
            own = plan.notes.get("evaluations", 0)
            found.append(
                WarmCandidate(planner.name, TimedPlan(times[best], variants[best]), own if isinstance(own, int) else 0)
            )
        return sorted((c for c in found if math.isfinite(c.timed.step_time_s)), key=lambda c: c.timed.step_time_s)

    def single_devices(self) -> list[WarmCandidate]:
        """Each device alone (one per class), at its best micro-batch count by the reward source."""
        out = []
        for group in device_classes(self.context.cluster):
            device = group[0]
            plans = [
                contiguous_plan(self.context.library, [], [[device]], m, self.schedules[0], self.batch_size)
                for m in self.micro_batch_choices
            ]
            times = self.reward.step_times(plans)
            best = min(range(len(plans)), key=times.__getitem__)
            out.append(WarmCandidate(f"{SINGLE}{device}", TimedPlan(times[best], plans[best])))
        return out

    def _planned(self, planner_class: type[PlannerBase], budget: int | None) -> Plan | None:
        """The planner's plan, choosing among the search's schedules."""
        specs = [parse_schedule_spec(spec) for spec in self.schedules]
        planner = planner_class(
            batch_size=self.batch_size,
            micro_batches=self.micro_batch_choices,
            schedule=specs[0][0],
            schedules=[name for name, _ in specs],
            staleness=next((k for _, k in specs if k is not None), None),
            seed=self.seed,
        )
        try:
            return planner.plan(self.context, budget=budget)
        except TappError:
            return None


def warm_notes(candidates: Sequence[WarmCandidate]) -> dict[str, object]:
    """The plan's notes about a warm start: every candidate's step time, and the fastest one's name."""
    return {
        "warm_start": {c.name: c.timed.step_time_s for c in candidates},
        "warm_start_winner": candidates[0].name if candidates else None,
    }
