"""TAPP's search (seed 000, section 4.3, Algorithm 1): joint policy-gradient training of both networks.

Every round each policy samples a batch of plans, gets their step times from the reward source, and takes one
REINFORCE step: reward ``-log(step time / reference)`` (the reference is the median step time of the phase's
first round, so rewards are relative), advantage against the policy's moving-average baseline scaled by the
round's spread, plus an entropy bonus. A failed plan is rewarded as if it took ``failure_penalty`` times the
reference. Self-imitation (Oh et al., 2018) adds the log-probability of the policy's best plans so far,
weighted by how much they beat the baseline, so what a lucky sample found is learned rather than forgotten.

A small population of policies (different seeds; starting splits even, speed-proportional, or
speed-proportional in a random device order) shares the reward source. Every ``exploit_every`` rounds the
policy with the worst best plan takes over the weights of the one with the best (population-based training),
and a policy that has not improved for ``restart_after`` rounds starts afresh from a new random split, so
that one unlucky start does not decide the outcome and other basins keep being explored.

Reward phases: ``simulated`` uses the cost model every round; ``measured`` measures every distinct sample on the
runtime; ``hybrid`` pre-trains on the cost model and, for its last ``measured_rounds`` rounds, measures only the
``measured_per_round`` best samples of each policy's round by the cost model and learns from those.

The search is an object, so an orchestrator can run one round per task: ``run_round()`` does one round and, with
a ``checkpoint`` path, saves every policy, optimizer, baseline and random state, the best plans and every reward
seen; ``TappSearch.resume(path, ...)`` continues exactly where it stopped. Sampling uses seeded generators and
the networks are initialised from the seed, so a search is reproducible. ``finish()`` ends a search: the polish
(``polish``, a local search on the cost model) when nothing was measured, then the chosen plan.

The options and their defaults are ``options.SearchOptions``; ``SearchConfig`` adds what one run fixes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import pickle
import re
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np
import torch

from tapp_core.cost.context import CostContext
from tapp_core.errors import TappError
from tapp_core.measure.races import RaceResult, rounds_count
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import DEFAULT_MICRO_BATCHES
from tapp_core.planners.tapp.options import SearchOptions
from tapp_core.planners.tapp.policy import PolicyConfig, PolicySample, TappPolicy, repaired_stages
from tapp_core.planners.tapp.polish import SPAN, STARTS, TRIES, Polish, polish_starts
from tapp_core.planners.tapp.rewards import Racing, RewardSource, TimedPlan
from tapp_core.planners.tapp.warm import WarmCandidate, WarmStart, warm_notes

PHASES = ("simulated", "measured")
WARM_AUTODDL_SHARE = 0.1
"""Share of the time limit the warm start's AutoDDL may take."""
FINAL_BY_MEASUREMENT = 2
"""The final race's first candidates: the best distinct measured plans (every round of each pooled)."""
FINAL_BY_ESTIMATE = 1
"""Then the best distinct plans by the cost model."""
FINAL_CANDIDATES = 4
"""At most this many plans race in the final choice: each costs every round of it (``rewards.FINAL``)."""


def _distinct(timed: Sequence[TimedPlan], count: int | None = None) -> list[Plan]:
    """The first ``count`` (default: all) distinct plans of ``timed``, in its order."""
    plans: dict[str, Plan] = {}
    for entry in timed:
        if count is not None and len(plans) >= count:
            break
        plans.setdefault(entry.plan.id, entry.plan)
    return list(plans.values())


@dataclass
class SearchConfig(SearchOptions):
    """One search's options (``SearchOptions``, with their defaults) and what its run fixes."""

    budget: int | None = None
    """Most distinct reward evaluations (cost model plus measurements); None: no limit."""
    seed: int = 0
    batch_size: int = 64
    micro_batch_choices: tuple[int, ...] = DEFAULT_MICRO_BATCHES
    schedules: tuple[str, ...] = ("1f1b",)
    """The schedules the policy chooses among, each with its staleness bound (``schedules.schedule_spec``)."""
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(groups=1))

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SearchConfig:
        values = dict(data)
        values["policy"] = PolicyConfig(**values["policy"])
        if "schedule" in values:  # a checkpoint of a search that had one schedule
            values["schedules"] = (values.pop("schedule"),)
        for name in ("micro_batch_choices", "initial_splits", "schedules"):
            values[name] = tuple(values[name])
        return cls(**values)


@dataclass(frozen=True)
class RoundReport:
    round: int
    """Rounds completed, from 1."""
    phase: str
    mean_reward: float
    entropy: float
    """Mean policy entropy per decision, over the population."""
    round_best_step_time_s: float
    best_step_time_s: float
    evaluations: int
    failures: int
    elapsed_s: float


class MemberCheckpoint(TypedDict):
    generation: int
    stale: int
    age: int
    policy: dict[str, Any]
    optimizer: dict[str, Any]
    generator: torch.Tensor
    baseline: dict[str, float]
    spread: dict[str, float]
    elite: dict[str, list[tuple[float, dict[str, object]]]]


class SearchCheckpoint(TypedDict):
    config: dict[str, object]
    round: int
    elapsed_s: float
    members: list[MemberCheckpoint]
    reference: dict[str, float]
    best: dict[str, tuple[float, dict[str, object] | None]]
    history: list[dict[str, Any]]
    simulated: Mapping[str, object]
    measured: Mapping[str, object] | None
    warm: list[tuple[str, float, dict[str, object], int]]
    """The warm start's candidates: name, step time, plan, the planner's own evaluations."""
    warm_s: float


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The networks are small: one thread is several times faster than contending for a shared machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Member:
    """One policy of the population with its optimizer, random stream, baseline and best plans."""

    def __init__(self, search: TappSearch, index: int, generation: int = 0) -> None:
        config = search.config
        self.generation = generation
        """How many times this policy was restarted."""
        self.stale = 0
        """Rounds since its best plan last improved."""
        self.age = 0
        """Rounds since it started."""
        seed = config.seed * 1009 + index + 100003 * generation
        split = config.initial_splits[index % len(config.initial_splits)] if generation == 0 else "shuffled"
        if split == "shuffled":
            split = f"shuffled:{seed}"
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.policy = TappPolicy(
                search.context,
                dataclasses.replace(config.policy, initial_split=split),
                config.micro_batch_choices,
                config.batch_size,
                config.schedules,
            )
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.learning_rate)
        self.generator = torch.Generator().manual_seed(seed)
        self.baseline: dict[str, float] = {}
        self.spread: dict[str, float] = {}
        self.elite: dict[str, list[TimedPlan]] = {}
        """Per phase: its ``imitation_plans`` fastest distinct plans, fastest first."""

    def best_time(self, phase: str) -> float:
        """This policy's fastest step time in ``phase``; inf until one of its plans ran."""
        elite = self.elite.get(phase)
        return elite[0].step_time_s if elite else math.inf

    def state_dict(self) -> MemberCheckpoint:
        return {
            "generation": self.generation,
            "stale": self.stale,
            "age": self.age,
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "baseline": dict(self.baseline),
            "spread": dict(self.spread),
            "elite": {k: [(e.step_time_s, e.plan.to_dict()) for e in v] for k, v in self.elite.items()},
        }

    def load_state_dict(self, state: MemberCheckpoint, with_generator: bool = True) -> None:
        self.stale = int(state["stale"])
        self.age = int(state["age"])
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        if with_generator:
            self.generator.set_state(state["generator"])
        self.baseline = dict(state["baseline"])
        self.spread = dict(state["spread"])
        self.elite = {k: [TimedPlan(t, Plan.from_dict(p)) for t, p in v] for k, v in state["elite"].items()}


class TappSearch:
    """The population's policy-gradient rounds on ``simulated`` (and ``measured``) rewards, the best plans they
    found, and the end of the search (``finish``)."""

    def __init__(
        self,
        context: CostContext,
        config: SearchConfig,
        simulated: RewardSource,
        measured: RewardSource | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        library, cluster = context.library, context.cluster
        if config.reward != "simulated" and measured is None:
            raise ValueError(f"a {config.reward} search needs a measured reward source")
        self.context = context
        self.library = library
        self.cluster = cluster
        self.config = config
        self.simulated = simulated
        self.measured = measured
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.members = [_Member(self, k) for k in range(config.population)]
        self.round = 0
        self.elapsed_s = 0.0
        self.reference: dict[str, float] = {}
        self.best: dict[str, TimedPlan | None] = dict.fromkeys(PHASES)
        """Per phase: the fastest plan seen, None until a plan ran."""
        self.history: list[RoundReport] = []
        self.polish_gain: float | None = None
        """Relative gain of the polish over the best simulated plan before it; None: not polished."""
        self.final_race: RaceResult | None = None
        """The race that made the final choice (``finish``), when plans were measured."""
        self.warm: list[WarmCandidate] = []
        """The warm start's candidates, fastest first (``warm_up``)."""
        self.warmed = False
        self._polish: Polish | None = None
        self.warm_s = 0.0
        self.polish_s = 0.0
        """Seconds the warm start and the polish took (both are in ``elapsed_s`` too)."""

    # --- the loop -----------------------------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        c = self.config
        if c.reward == "simulated":
            return "simulated"
        # A hybrid search out of time skips what is left of its pre-training, not its measured fine-tuning.
        if c.reward == "hybrid" and self.round < c.simulated_rounds and not self._out_of_time:
            return "simulated"
        return "measured"

    @property
    def _out_of_time(self) -> bool:
        """The rounds' share of the time limit is spent (all of it when no polish follows)."""
        c = self.config
        if c.time_limit_s is None:
            return False
        share = c.rounds_time_share if c.polish and c.reward == "simulated" else 1.0
        return self.elapsed_s >= share * c.time_limit_s

    @property
    def evaluations(self) -> int:
        """Distinct reward evaluations, and the estimates the warm start's planners and the polish's exact cuts made
        on their own."""
        own = sum(c.evaluations for c in self.warm) + (self._polish.evaluations if self._polish is not None else 0)
        return own + self.simulated.evaluations + (self.measured.evaluations if self.measured is not None else 0)

    @property
    def done(self) -> bool:
        c = self.config
        out_of_time = self._out_of_time
        if c.reward == "hybrid" and out_of_time:
            out_of_time = sum(report.phase == "measured" for report in self.history) >= c.measured_rounds
        return self.round >= c.rounds or self._out_of_budget or out_of_time

    def rounds(self) -> Iterator[RoundReport]:
        """Run rounds until the search is done (after the warm start), yielding each round's report."""
        self.warm_up()
        while not self.done:
            yield self.run_round()

    def warm_up(self) -> None:
        """The warm start (``warm.WarmStart``), once, before the first round, where the options ask for it and the
        first phase is the cost model's: its candidates become the best simulated plan if faster, one policy's elite
        (those it can express) and polish starts."""
        c = self.config
        if self.warmed or self.round > 0:
            return
        self.warmed = True
        if not c.warm_start or c.reward == "measured":
            return
        started = time.perf_counter()
        warm = WarmStart(self.context, self.simulated, c.batch_size, c.micro_batch_choices, c.schedules, c.seed)
        box = WARM_AUTODDL_SHARE * c.time_limit_s if c.time_limit_s is not None else None
        left = c.budget - self.evaluations if c.budget is not None else None
        self.warm = warm.candidates(box, left)
        leader = self.members[0]
        for candidate in self.warm:
            if leader.policy.can_express(candidate.timed.plan):
                self._remember(leader, candidate.timed.plan, candidate.timed.step_time_s, "simulated")
            elif candidate.timed.step_time_s < self.best_time("simulated"):
                self.best["simulated"] = candidate.timed
        self.warm_s = time.perf_counter() - started
        self.elapsed_s += self.warm_s

    def run_round(self) -> RoundReport:
        self.warm_up()
        started = time.perf_counter()
        phase = self.phase
        rewards: list[float] = []
        entropies: list[float] = []
        times: list[float] = []
        with _one_thread():
            # All the policies' partitions are repaired in one pass: the repair's cost is per call, not per sample.
            draws = [m.policy.draw_partition(self.config.samples_per_round, m.generator) for m in self.members]
            policy = self.members[0].policy
            stages = repaired_stages(
                np.concatenate([d.labels for d in draws]), policy.repair_weights, policy.config.groups
            )
            for k, (member, draw) in enumerate(zip(self.members, draws, strict=True)):
                before = member.best_time(phase)
                size = self.config.samples_per_round
                sample = member.policy.complete(draw, stages[k * size : (k + 1) * size], member.generator)
                member_rewards, member_times, entropy = self._step(member, sample, phase)
                member.stale = 0 if member.best_time(phase) < before else member.stale + 1
                member.age += 1
                rewards += list(member_rewards)
                times += member_times
                entropies.append(entropy)
        self.round += 1
        if len(self.members) > 1 and self.round % self.config.exploit_every == 0:
            self._exploit(phase)
        if phase == "simulated" and self.config.restart_after:
            self._restart_stale(phase)
        self.elapsed_s += time.perf_counter() - started
        report = RoundReport(
            round=self.round,
            phase=phase,
            mean_reward=float(np.mean(rewards)),
            entropy=float(np.mean(entropies)),
            round_best_step_time_s=float(min(times)),
            best_step_time_s=self.best_step_time,
            evaluations=self.evaluations,
            failures=sum(1 for t in times if not math.isfinite(t)),
            elapsed_s=self.elapsed_s,
        )
        self.history.append(report)
        if self.checkpoint is not None:
            self.save(self.checkpoint)
        return report

    def _step(self, member: _Member, sample: PolicySample, phase: str) -> tuple[np.ndarray, list[float], float]:
        """One REINFORCE step of one policy on its ``sample``: (rewards, step times, entropy)."""
        used, times = self._rewarded(sample.plans, phase)
        rewards = self._rewards(times, phase)
        advantages = self._advantages(member, rewards, phase)
        loss = -(torch.as_tensor(advantages, dtype=torch.float32) * sample.log_prob[used]).mean()
        loss = loss - self.config.entropy_weight * sample.entropy + self._imitation_loss(member, phase)
        member.optimizer.zero_grad()
        torch.autograd.backward(loss)
        member.optimizer.step()
        for i, t in zip(used, times, strict=True):
            self._remember(member, sample.plans[i], t, phase)
        return rewards, times, float(sample.entropy.detach())

    def _rewarded(self, plans: Sequence[Plan], phase: str) -> tuple[list[int], list[float]]:
        """Indices of the samples the policy learns from this round, and their step times."""
        simulated = self.simulated.step_times(plans)
        if phase == "simulated":
            return list(range(len(plans))), simulated
        assert self.measured is not None
        first: dict[str, int] = {}
        for i, plan in enumerate(plans):
            first.setdefault(plan.id, i)
        chosen = sorted(first.values(), key=lambda i: simulated[i])
        if self.config.reward == "hybrid":
            chosen = chosen[: self.config.measured_per_round]
        measured = [plans[i] for i in chosen]
        if self.round + 1 >= self.config.rounds and isinstance(self.measured, Racing):
            # The final race (``finish``) races the near-best plans again: confirming them here would pay twice.
            return chosen, self.measured.screen(measured)
        return chosen, self.measured.step_times(measured)

    def _rewards(self, times: Sequence[float], phase: str) -> np.ndarray:
        finite = [t for t in times if math.isfinite(t)]
        if phase not in self.reference and finite:
            self.reference[phase] = float(np.median(finite))
        reference = self.reference.get(phase, 1.0)
        worst = self.config.failure_penalty * reference
        return np.array([-math.log((t if math.isfinite(t) else worst) / reference) for t in times])

    def _advantages(self, member: _Member, rewards: np.ndarray, phase: str) -> np.ndarray:
        baseline = member.baseline.get(phase, float(rewards.mean()))
        spread = max(float(rewards.std()), 0.01)
        member.spread[phase] = spread
        decay = self.config.baseline_decay
        member.baseline[phase] = decay * baseline + (1 - decay) * float(rewards.mean())
        return (rewards - baseline) / spread

    def _remember(self, member: _Member, plan: Plan, step_time: float, phase: str) -> None:
        """Track the best plan overall and each policy's ``imitation_plans`` fastest distinct plans."""
        if not math.isfinite(step_time):
            return
        if step_time < self.best_time(phase):
            self.best[phase] = TimedPlan(step_time, plan)
        elite = member.elite.setdefault(phase, [])
        if len(elite) >= self.config.imitation_plans and step_time >= elite[-1].step_time_s:
            return
        if any(e.plan == plan for e in elite):
            return
        elite.append(TimedPlan(step_time, plan))
        elite.sort(key=lambda e: e.step_time_s)
        del elite[self.config.imitation_plans :]

    def _imitation_loss(self, member: _Member, phase: str) -> torch.Tensor:
        """Self-imitation learning: raise the probability of the policy's best plans seen, by how much they beat
        its baseline (plans below it are left alone)."""
        elite = member.elite.get(phase, [])
        if not elite or self.config.imitation_weight == 0 or phase not in member.baseline:
            return torch.zeros(())
        rewards = self._rewards([e.step_time_s for e in elite], phase)
        weights = np.maximum(rewards - member.baseline[phase], 0.0) / member.spread[phase]
        if not weights.any():
            return torch.zeros(())
        scored = member.policy.score([e.plan for e in elite])
        return -self.config.imitation_weight * (torch.as_tensor(weights, dtype=torch.float32) * scored.log_prob).mean()

    def _restart_stale(self, phase: str) -> None:
        """A policy whose best has not improved for ``restart_after`` rounds starts afresh from a new random split
        (unless it holds the population's best plan): the population keeps exploring other basins."""
        leader = min(self.members, key=lambda m: m.best_time(phase))
        for k, member in enumerate(self.members):
            if member is not leader and member.stale >= self.config.restart_after:
                self.members[k] = _Member(self, k, member.generation + 1)

    def _exploit(self, phase: str) -> None:
        """The policy whose best plan is worst continues from the policy whose best plan is best (among those
        that have run ``exploit_every`` rounds since they started, so a restart gets its chance)."""
        ranked = sorted(
            (m for m in self.members if m.age >= self.config.exploit_every), key=lambda m: m.best_time(phase)
        )
        if len(ranked) < 2:
            return
        best, worst = ranked[0], ranked[-1]
        if best is not worst and best.best_time(phase) < worst.best_time(phase):
            worst.load_state_dict(best.state_dict(), with_generator=False)

    @property
    def _out_of_budget(self) -> bool:
        return self.config.budget is not None and self.evaluations >= self.config.budget

    # --- the end: polish and choice -------------------------------------------------------------------------------

    def finish(self) -> Plan:
        """End the search: its chosen plan, with how it was chosen in its notes (``chosen_by``).

        When nothing was measured: the best plan by the cost model, polished first when the options ask for it.
        When plans were measured: a race (``MeasuredReward.race``) among the best plans by measurement and by the
        cost model (``_final_candidates``); among the plans whose interval overlaps the
        fastest's, the winner is the one with the lowest median over all its measured rounds (``_fastest_pooled``),
        and the race's summary is in the notes as ``final_race``. A measured best is never polished on the cost model. The TAPP
        planner and the flow's sampling stage both end a search here.
        """
        self.warm_up()
        if self.config.polish and self.best["measured"] is None:
            self.polish()
        chosen = self.result()
        measured = self.measured
        if self.best["measured"] is None or not isinstance(measured, Racing):
            how = "cost model" if self.best["measured"] is None else "best measurement"
            return dataclasses.replace(chosen, notes={**chosen.notes, "chosen_by": how})
        candidates = self._final_candidates()
        race = measured.race(candidates)
        self.final_race = race
        winner = self._fastest_pooled(race.best_group())
        if winner is None:
            notes = {**chosen.notes, "chosen_by": "best measurement (every plan failed the final race)"}
            return dataclasses.replace(chosen, notes=notes)
        how = f"race of {len(race.plans)} candidates ({rounds_count(race.rounds)}, stopped: {race.stop})"
        if len(race.best_group()) > 1:
            how += (
                f"; {len(race.best_group())} tied within the race's noise, the one with the lowest median over all"
                " its measured rounds chosen"
            )
        notes = {**chosen.notes, "chosen_by": how, "final_race": {**race.summary(), "winner": winner.id}}
        return dataclasses.replace(winner, planner=chosen.planner, notes=notes)

    def _fastest_pooled(self, group: Sequence[Plan]) -> Plan | None:
        """Among plans the final race could not tell apart, the one whose median over every round the search
        measured of it (the race's included) is lowest, then the one with fewest devices: a search for speed uses
        all its evidence, where a bare race (``RaceResult.winner``) frees devices at the same speed."""
        if not group:
            return None
        assert self.measured is not None
        pooled = self.measured.step_times(group)
        best = min(range(len(group)), key=lambda i: (pooled[i], len(group[i].devices), i))
        return group[best]

    def _final_candidates(self) -> list[Plan]:
        """At most ``FINAL_CANDIDATES`` distinct plans for the final race, in this order: the best by measurement
        (what every measured plan's rounds say now, all pooled), the best by the cost model, the warm start's best
        (so that TAPP races the plans of the cheap planners it started from), then the best of each schedule by the
        cost model and the warm start's best of each (so that a family the cost model ranks too well, such as split
        layers it overrates, cannot crowd out another) while there is room."""
        assert self.measured is not None
        measured = _distinct(self.remembered("measured"))
        now = self.measured.step_times(measured)
        fastest = [measured[i] for _, i in sorted((t, i) for i, t in enumerate(now) if math.isfinite(t))]
        simulated = sorted(self.remembered("simulated"), key=lambda t: t.step_time_s)
        ordered = [*fastest[:FINAL_BY_MEASUREMENT], *_distinct(simulated, FINAL_BY_ESTIMATE)]
        ordered += [c.timed.plan for c in self.warm[:1]]
        for spec in self.config.schedules:
            ordered += _distinct([t for t in simulated if t.plan.schedule_spec == spec], 1)
            ordered += [c.timed.plan for c in self.warm if c.timed.plan.schedule_spec == spec][:1]
        return _distinct([TimedPlan(0.0, p) for p in ordered], FINAL_CANDIDATES)

    def polish(self, span: int = SPAN, tries: int = TRIES, starts: int = STARTS) -> float:
        """The local search of ``polish.Polish`` from the ``starts`` fastest distinct simulated plans this search
        remembers (``remembered``), while the budget and the time limit last; the best plan it finds becomes the
        search's best simulated plan. Returns the relative gain over the best simulated plan before it."""
        self.warm_up()
        before = self.best["simulated"]
        if before is None:
            return 0.0
        started = time.perf_counter()
        limit = self.config.time_limit_s
        deadline = started + limit - self.elapsed_s if limit is not None else math.inf

        def exhausted() -> bool:
            return self._out_of_budget or time.perf_counter() >= deadline

        def estimates_left() -> int | None:
            return self.config.budget - self.evaluations if self.config.budget is not None else None

        polish = Polish(
            self.context,
            self.simulated,
            self.config.micro_batch_choices,
            self.config.schedules,
            exhausted,
            deadline,
            estimates_left,
        )
        self._polish = polish
        after = polish.run(before, polish_starts(self.remembered("simulated"), starts), span, tries)
        self.best["simulated"] = after
        self.polish_gain = 1 - after.step_time_s / before.step_time_s
        self.polish_s = time.perf_counter() - started
        self.elapsed_s += self.polish_s
        return self.polish_gain

    def remembered(self, phase: str) -> list[TimedPlan]:
        """The best plan of ``phase``, every policy's elite and (simulated) the warm start's candidates; the best
        first (equal plans may repeat)."""
        best = self.best[phase]
        elites = [e for m in self.members for e in m.elite.get(phase, [])]
        warm = [c.timed for c in self.warm] if phase == "simulated" else []
        return ([best] if best is not None else []) + elites + warm

    # --- results --------------------------------------------------------------------------------------------------

    def best_time(self, phase: str) -> float:
        """The fastest step time seen in ``phase``; inf until a plan ran."""
        best = self.best[phase]
        return best.step_time_s if best is not None else math.inf

    @property
    def best_step_time(self) -> float:
        """Best measured step time if anything was measured, else the best simulated one."""
        measured = self.best["measured"]
        return measured.step_time_s if measured is not None else self.best_time("simulated")

    @property
    def best_plan(self) -> Plan | None:
        measured, simulated = self.best["measured"], self.best["simulated"]
        best = measured if measured is not None else simulated
        return best.plan if best is not None else None

    def result(self) -> Plan:
        """The best plan found, named as TAPP's (``planner``), with the search's statistics in its notes."""
        plan = self.best_plan
        if plan is None:
            raise RuntimeError("the search has not found a plan that runs (every sample failed)")
        notes = {
            "reward": self.config.reward,
            "rounds": self.round,
            "evaluations": self.evaluations,
            "simulated_evaluations": self.simulated.evaluations,
            "measured_evaluations": self.measured.evaluations if self.measured is not None else 0,
            "best_simulated_step_time_s": self.best_time("simulated"),
            "best_measured_step_time_s": self.best_time("measured"),
            "search_s": self.elapsed_s,
            "search_rounds_s": self.elapsed_s - self.warm_s - self.polish_s,
            "warm_start_s": self.warm_s,
            "polish_s": self.polish_s,
            "polish_gain": self.polish_gain if self.polish_gain is not None else 0.0,
            "seed": self.config.seed,
            **warm_notes(self.warm),
        }
        return dataclasses.replace(plan, planner="tapp", notes=notes)

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def state_dict(self) -> SearchCheckpoint:
        return {
            "config": self.config.to_dict(),
            "round": self.round,
            "elapsed_s": self.elapsed_s,
            "members": [m.state_dict() for m in self.members],
            "reference": dict(self.reference),
            "best": {k: (self.best_time(k), b.plan.to_dict() if b is not None else None) for k, b in self.best.items()},
            "history": [dataclasses.asdict(r) for r in self.history],
            "simulated": self.simulated.state(),
            "measured": self.measured.state() if self.measured is not None else None,
            "warm": [(c.name, c.timed.step_time_s, c.timed.plan.to_dict(), c.evaluations) for c in self.warm],
            "warm_s": self.warm_s,
        }

    def load_state_dict(self, state: SearchCheckpoint) -> None:
        self.round = int(state["round"])
        self.elapsed_s = float(state["elapsed_s"])
        self.members = []
        for k, saved in enumerate(state["members"]):
            member = _Member(self, k, int(saved["generation"]))
            member.load_state_dict(saved)
            self.members.append(member)
        self.reference = dict(state["reference"])
        self.best = {
            k: TimedPlan(t, Plan.from_dict(p)) if p is not None else None for k, (t, p) in state["best"].items()
        }
        self.history = [RoundReport(**r) for r in state["history"]]
        self.simulated.load_state(state["simulated"])
        self.warm = [WarmCandidate(n, TimedPlan(t, Plan.from_dict(p)), e) for n, t, p, e in state.get("warm", [])]
        self.warm_s = float(state.get("warm_s", 0.0))
        self.warmed = True
        if self.measured is not None and state["measured"] is not None:
            self.measured.load_state(state["measured"])

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the checkpoint atomically (a crash mid-write leaves the previous one). It holds tensors and plain
        data only (numbers, strings, lists, dicts), so that ``read_checkpoint`` loads it with torch's safe
        unpickler."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        torch.save(self.state_dict(), partial)
        partial.replace(out)
        return out

    @classmethod
    def resume(
        cls,
        path: str | os.PathLike[str],
        context: CostContext,
        simulated: RewardSource,
        measured: RewardSource | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        rounds: int | None = None,
        polish: bool | None = None,
    ) -> TappSearch:
        """The search saved at ``path``, ready to run its next round; it keeps saving to ``checkpoint``
        (default: ``path``). Its options are the saved ones, except ``rounds`` (it runs until that many rounds
        instead of its own count) and ``polish``, if given: neither changes what was saved. A file that is not such
        a checkpoint, or one of another model or cluster, raises ``CheckpointError``; nothing in it runs."""
        library, cluster = context.library, context.cluster
        state = read_checkpoint(path)
        config = saved_config(state, path)
        if rounds is not None:
            config = dataclasses.replace(config, rounds=rounds)
        if polish is not None:
            config = dataclasses.replace(config, polish=polish)
        search = cls(context, config, simulated, measured, checkpoint if checkpoint is not None else path)
        try:
            search.load_state_dict(state)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(
                f"checkpoint {path} does not fit this search of {library.model} on {cluster.name!r}: {reason}"
            ) from None
        return search


class CheckpointError(TappError):
    """A search checkpoint that cannot be read or resumed; nothing in the file was run."""


_CHECKPOINT_KEYS = frozenset(SearchCheckpoint.__annotations__)


def read_checkpoint(path: str | os.PathLike[str]) -> SearchCheckpoint:
    """The state ``TappSearch.save`` wrote to ``path``, read with torch's safe unpickler (``weights_only``):
    tensors and plain data only, so a crafted file cannot run code. ``CheckpointError`` for anything else."""
    source = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files it then refuses
            warnings.simplefilter("ignore")
            state = torch.load(source, weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {source} cannot be read: {exc.strerror or exc}") from None
    except pickle.UnpicklingError as exc:
        found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(exc))
        what = f" ({found.group(1).strip()})" if found else ""
        raise CheckpointError(
            f"checkpoint {source} refused by the safe loader{what}: not a TAPP search checkpoint; nothing in it was run"
        ) from None
    except Exception as exc:  # a damaged file raises many types (RuntimeError from the zip reader, EOFError...)
        raise CheckpointError(f"checkpoint {source} is not a TAPP search checkpoint ({type(exc).__name__})") from None
    if not isinstance(state, dict) or not set(state) >= _CHECKPOINT_KEYS:
        raise CheckpointError(f"checkpoint {source} is not a TAPP search checkpoint (not the state TappSearch saves)")
    return cast(SearchCheckpoint, state)  # its keys were checked above


def saved_config(state: SearchCheckpoint, path: str | os.PathLike[str]) -> SearchConfig:
    """The search configuration a checkpoint (``read_checkpoint``) was saved with."""
    try:
        return SearchConfig.from_dict(state["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} holds an unusable search configuration: {exc}") from None
