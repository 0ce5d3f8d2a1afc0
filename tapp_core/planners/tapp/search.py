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
the networks are initialised from the seed, so a search is reproducible.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tapp_core.cluster import Cluster
from tapp_core.library import LayerLibrary
from tapp_core.plan import Plan
from tapp_core.planners.costs import LayerCosts
from tapp_core.planners.space import balanced_cuts, stages_from_cuts
from tapp_core.planners.tapp.policy import PolicyConfig, PolicySample, TappPolicy, repaired_stages
from tapp_core.planners.tapp.rewards import RewardSource

REWARD_KINDS = ("simulated", "measured", "hybrid")
PHASES = ("simulated", "measured")


@dataclass(frozen=True)
class SearchConfig:
    reward: str = "simulated"
    rounds: int = 250
    samples_per_round: int = 8
    """Samples per policy per round."""
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
    measured_rounds: int = 3
    """hybrid: how many final rounds use measurements."""
    measured_per_round: int = 1
    """hybrid: how many of each policy's best samples of a round (by the cost model) are measured."""
    budget: int | None = None
    """Most distinct reward evaluations (cost model plus measurements); None: no limit."""
    time_limit_s: float | None = None
    """Stop the rounds after this many seconds (None: no limit); a hybrid search still runs its measured rounds."""
    seed: int = 0
    batch_size: int = 64
    micro_batch_choices: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    schedule: str = "1f1b"
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(groups=1))

    def __post_init__(self) -> None:
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"reward must be one of {', '.join(REWARD_KINDS)}, got {self.reward!r}")
        if min(self.rounds, self.samples_per_round, self.population, self.exploit_every) <= 0:
            raise ValueError("rounds, samples_per_round, population and exploit_every must be positive")

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SearchConfig:
        values = dict(data)
        values["policy"] = PolicyConfig(**values["policy"])  # type: ignore[arg-type]
        for name in ("micro_batch_choices", "initial_splits"):
            values[name] = tuple(values[name])  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]


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
                search.library,
                search.cluster,
                dataclasses.replace(config.policy, initial_split=split),
                config.micro_batch_choices,
                config.batch_size,
                config.schedule,
            )
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.learning_rate)
        self.generator = torch.Generator().manual_seed(seed)
        self.baseline: dict[str, float] = {}
        self.spread: dict[str, float] = {}
        self.elite: dict[str, list[tuple[float, Plan]]] = {}

    def best(self, phase: str) -> float:
        elite = self.elite.get(phase)
        return elite[0][0] if elite else math.inf

    def state_dict(self) -> dict[str, object]:
        return {
            "generation": self.generation,
            "stale": self.stale,
            "age": self.age,
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "baseline": dict(self.baseline),
            "spread": dict(self.spread),
            "elite": {k: [(t, p.to_dict()) for t, p in v] for k, v in self.elite.items()},
        }

    def load_state_dict(self, state: dict[str, object], with_generator: bool = True) -> None:
        self.stale = int(state["stale"])  # type: ignore[call-overload]
        self.age = int(state["age"])  # type: ignore[call-overload]
        self.policy.load_state_dict(state["policy"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # type: ignore[arg-type]
        if with_generator:
            self.generator.set_state(state["generator"])  # type: ignore[arg-type]
        self.baseline = dict(state["baseline"])  # type: ignore[call-overload]
        self.spread = dict(state["spread"])  # type: ignore[call-overload]
        self.elite = {k: [(t, Plan.from_dict(p)) for t, p in v] for k, v in state["elite"].items()}  # type: ignore[union-attr]


class TappSearch:
    def __init__(
        self,
        library: LayerLibrary,
        cluster: Cluster,
        config: SearchConfig,
        simulated: RewardSource,
        measured: RewardSource | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        if config.reward != "simulated" and measured is None:
            raise ValueError(f"a {config.reward} search needs a measured reward source")
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
        self.best: dict[str, tuple[float, Plan | None]] = {phase: (math.inf, None) for phase in PHASES}
        self.history: list[RoundReport] = []
        self.polish_gain = 0.0
        self._work_by_samples: dict[int, np.ndarray] = {}

    # --- the loop -----------------------------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        c = self.config
        if c.reward == "simulated":
            return "simulated"
        # A hybrid search out of time skips what is left of its pre-training, not its measured fine-tuning.
        if c.reward == "hybrid" and self.round < c.rounds - c.measured_rounds and not self._out_of_time:
            return "simulated"
        return "measured"

    @property
    def _out_of_time(self) -> bool:
        return self.config.time_limit_s is not None and self.elapsed_s >= self.config.time_limit_s

    @property
    def evaluations(self) -> int:
        return self.simulated.evaluations + (self.measured.evaluations if self.measured is not None else 0)

    @property
    def done(self) -> bool:
        c = self.config
        out_of_time = self._out_of_time
        if c.reward == "hybrid" and out_of_time:
            out_of_time = sum(report.phase == "measured" for report in self.history) >= c.measured_rounds
        return self.round >= c.rounds or self._out_of_budget or out_of_time

    def rounds(self) -> Iterator[RoundReport]:
        """Run rounds until the search is done, yielding each round's report."""
        while not self.done:
            yield self.run_round()

    def run_round(self) -> RoundReport:
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
                before = member.best(phase)
                size = self.config.samples_per_round
                sample = member.policy.complete(draw, stages[k * size : (k + 1) * size], member.generator)
                member_rewards, member_times, entropy = self._step(member, sample, phase)
                member.stale = 0 if member.best(phase) < before else member.stale + 1
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
        loss.backward()
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
        return chosen, self.measured.step_times([plans[i] for i in chosen])

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
        if step_time < self.best[phase][0]:
            self.best[phase] = (step_time, plan)
        elite = member.elite.setdefault(phase, [])
        if len(elite) >= self.config.imitation_plans and step_time >= elite[-1][0]:
            return
        if any(p == plan for _, p in elite):
            return
        elite.append((step_time, plan))
        elite.sort(key=lambda item: item[0])
        del elite[self.config.imitation_plans :]

    def _imitation_loss(self, member: _Member, phase: str) -> torch.Tensor:
        """Self-imitation learning: raise the probability of the policy's best plans seen, by how much they beat
        its baseline (plans below it are left alone)."""
        elite = member.elite.get(phase, [])
        if not elite or self.config.imitation_weight == 0 or phase not in member.baseline:
            return torch.zeros(())
        rewards = self._rewards([t for t, _ in elite], phase)
        weights = np.maximum(rewards - member.baseline[phase], 0.0) / member.spread[phase]
        if not weights.any():
            return torch.zeros(())
        scored = member.policy.score([p for _, p in elite])
        return -self.config.imitation_weight * (torch.as_tensor(weights, dtype=torch.float32) * scored.log_prob).mean()

    def _restart_stale(self, phase: str) -> None:
        """A policy whose best has not improved for ``restart_after`` rounds starts afresh from a new random split
        (unless it holds the population's best plan): the population keeps exploring other basins."""
        leader = min(self.members, key=lambda m: m.best(phase))
        for k, member in enumerate(self.members):
            if member is not leader and member.stale >= self.config.restart_after:
                self.members[k] = _Member(self, k, member.generation + 1)

    def _exploit(self, phase: str) -> None:
        """The policy whose best plan is worst continues from the policy whose best plan is best (among those
        that have run ``exploit_every`` rounds since they started, so a restart gets its chance)."""
        ranked = sorted((m for m in self.members if m.age >= self.config.exploit_every), key=lambda m: m.best(phase))
        if len(ranked) < 2:
            return
        best, worst = ranked[0], ranked[-1]
        if best is not worst and best.best(phase) < worst.best(phase):
            worst.load_state_dict(best.state_dict(), with_generator=False)

    def polish(self, span: int = 32, tries: int = 4, starts: int = 8) -> float:
        """Local search from the ``starts`` fastest distinct simulated plans the population remembers (the best
        plan and every policy's elite: different policies hold different basins, and the best plan's basin is not
        always the one whose neighbourhood holds the best plan), while it improves and the budget lasts; the best
        result becomes the search's best plan. Returns the relative gain over the best plan before the polish.

        A *descent* keeps the best of every micro-batch count and, in a contiguous plan, every stage boundary moved
        by 1, 2, 4, ... up to ``span`` layers either way. Each pass descends from the plan and from the ``tries``
        most promising moves: device moves (two stages' devices swapped; a stage moved to, or replicated onto, an
        unused device; each also with its stages re-balanced to the new speeds), because a device move pays off
        only once the boundaries follow it; and relay insertions (``_relay_moves``)."""
        start = self.best["simulated"][0]
        if not math.isfinite(start):
            return 0.0
        best_time, best_plan = start, self.best["simulated"][1]
        for time_s, plan in self._polish_starts(starts):
            if self._out_of_budget:
                break
            time_s, plan = self._polish_from(time_s, plan, span, tries)
            if time_s < best_time:
                best_time, best_plan = time_s, plan
        self.best["simulated"] = (best_time, best_plan)
        self.polish_gain = 1 - best_time / start
        return self.polish_gain

    def _polish_starts(self, count: int) -> list[tuple[float, Plan]]:
        """The ``count`` fastest distinct plans among the best plan and the policies' elites."""
        seen: dict[str, tuple[float, Plan]] = {}
        remembered = [self.best["simulated"]] + [item for m in self.members for item in m.elite.get("simulated", [])]
        for time_s, plan in remembered:
            if plan is not None and math.isfinite(time_s):
                seen.setdefault(plan.id, (time_s, plan))
        return sorted(seen.values(), key=lambda item: item[0])[:count]

    def _polish_from(self, best_time: float, plan: Plan, span: int, tries: int) -> tuple[float, Plan]:
        while not self._out_of_budget:
            candidates = [(best_time, plan)]
            moves = self._device_moves(plan) + self._relay_moves(plan, span)
            times = self.simulated.step_times(moves)
            order = np.argsort(times)[:tries]
            candidates += [(float(times[i]), moves[i]) for i in order if math.isfinite(times[i])]
            descended = [self._descend(time_s, candidate, span) for time_s, candidate in candidates]
            time_s, found = min(descended, key=lambda item: item[0])
            if time_s >= best_time:
                break
            best_time, plan = time_s, found
        return best_time, plan

    @property
    def _out_of_budget(self) -> bool:
        return self.config.budget is not None and self.evaluations >= self.config.budget

    def _descend(self, best_time: float, plan: Plan, span: int) -> tuple[float, Plan]:
        while not self._out_of_budget:
            neighbours = self._shifts(plan, span)
            times = self.simulated.step_times(neighbours)
            i = int(np.argmin(times))
            if times[i] >= best_time:
                break
            best_time, plan = float(times[i]), neighbours[i]
        return best_time, plan

    def _shifts(self, plan: Plan, span: int) -> list[Plan]:
        """Every micro-batch count; every boundary of a contiguous plan moved by powers of two up to ``span``."""
        neighbours = [dataclasses.replace(plan, micro_batches=m) for m in self.config.micro_batch_choices]
        n = len(plan.stage_of_layer)
        if list(plan.stage_of_layer) != sorted(plan.stage_of_layer):
            return neighbours
        cuts = [plan.stage_of_layer.index(k) for k in range(1, plan.n_stages)]
        bounds = [0, *cuts, n]
        sizes = sorted({*(2**k for k in range(span.bit_length()) if 2**k <= span), span} - {0})
        for j in range(len(cuts)):
            for shift in (sign * size for size in sizes for sign in (-1, 1)):
                if bounds[j] < cuts[j] + shift < bounds[j + 2]:
                    moved = [*cuts[:j], cuts[j] + shift, *cuts[j + 1 :]]
                    stages = np.searchsorted(moved, np.arange(n), side="right")
                    neighbours.append(dataclasses.replace(plan, stage_of_layer=tuple(int(x) for x in stages)))
        return neighbours

    def _device_moves(self, plan: Plan) -> list[Plan]:
        devices = list(plan.stage_devices)
        moves = []
        for a, b in itertools.combinations(range(len(devices)), 2):
            swapped = devices.copy()
            swapped[a], swapped[b] = devices[b], devices[a]
            moves.append(dataclasses.replace(plan, stage_devices=tuple(swapped)))
        unused = [d for d in self.cluster.device_names if d not in plan.devices]
        for stage in range(len(devices)):
            for device in unused:
                moved_to, replicated = devices.copy(), devices.copy()
                moved_to[stage] = (device,)
                replicated[stage] = (*devices[stage], device)
                moves.append(dataclasses.replace(plan, stage_devices=tuple(moved_to)))
                moves.append(dataclasses.replace(plan, stage_devices=tuple(replicated)))
        return moves + [self._rebalanced(move) for move in moves]

    def _relay_moves(self, plan: Plan, span: int) -> list[Plan]:
        """A one-layer stage on unused devices inserted beside a stage boundary, the boundary first moved by 0, 1,
        2, 4, ... up to ``span`` layers either way. Under 1F1B stage ``s`` of ``S`` runs ``S - s`` warm-up forwards,
        so a cheap extra stage gives every stage before it one more micro-batch in flight (filling its bubbles,
        at the price of its activations' memory and two small transfers); where it goes and on which devices is
        the search's to find. The relay's devices: the unused ones of one speed (1, 2, 4, ... or all of them),
        or every unused device."""
        order = list(plan.stage_of_layer)
        unused = [d for d in self.cluster.device_names if d not in plan.devices]
        if not unused or order != sorted(order):
            return []
        n = len(order)
        cuts = [order.index(k) for k in range(1, plan.n_stages)]
        bounds = [0, *cuts, n]
        by_speed: dict[float, list[str]] = {}
        for device in unused:
            by_speed.setdefault(self.cluster.device(device).speed, []).append(device)
        relays = {tuple(unused)}
        for same in by_speed.values():
            relays |= {tuple(same[:k]) for k in (*(2**i for i in range(len(same).bit_length())), len(same))}
        sizes = {0, *(2**k for k in range(span.bit_length()) if 2**k <= span), span}
        moves = []
        for j, cut in enumerate(cuts):
            positions = {cut + sign * size for size in sizes for sign in (-1, 1)}
            for low in sorted({p - 1 for p in positions} | positions):  # the relay's layer, before or after
                if not bounds[j] < low < low + 1 < bounds[j + 2]:
                    continue
                stages = stages_from_cuts(n, [*cuts[:j], low, low + 1, *cuts[j + 1 :]])
                for relay in sorted(relays):
                    devices = (*plan.stage_devices[: j + 1], relay, *plan.stage_devices[j + 1 :])
                    moves.append(dataclasses.replace(plan, stage_of_layer=stages, stage_devices=devices))
        return moves

    def _rebalanced(self, plan: Plan) -> Plan:
        """The plan's devices with contiguous stages whose work matches each stage's speed (its slowest replica's
        speed times its replicas), costed at the plan's micro-batch size."""
        work = self._layer_work(plan.micro_batch_size)
        shares = [len(group) * min(self.cluster.device(d).speed for d in group) for group in plan.stage_devices]
        cuts = balanced_cuts(work, shares)
        return dataclasses.replace(plan, stage_of_layer=stages_from_cuts(len(work), cuts))

    def _layer_work(self, samples: int) -> np.ndarray:
        """Per-layer work per sample at micro-batches of ``samples`` (what a polish re-balances by), cached."""
        if samples not in self._work_by_samples:
            self._work_by_samples[samples] = np.diff(LayerCosts.from_library(self.library, samples).work_prefix)
        return self._work_by_samples[samples]

    # --- results --------------------------------------------------------------------------------------------------

    @property
    def best_step_time(self) -> float:
        """Best measured step time if anything was measured, else the best simulated one."""
        measured = self.best["measured"][0]
        return measured if math.isfinite(measured) else self.best["simulated"][0]

    @property
    def best_plan(self) -> Plan | None:
        measured = self.best["measured"][1]
        return measured if measured is not None else self.best["simulated"][1]

    def result(self) -> Plan:
        """The best plan found, with the search's statistics in its notes."""
        plan = self.best_plan
        if plan is None:
            raise RuntimeError("the search has not found a plan that runs (every sample failed)")
        notes = {
            "reward": self.config.reward,
            "rounds": self.round,
            "evaluations": self.evaluations,
            "simulated_evaluations": self.simulated.evaluations,
            "measured_evaluations": self.measured.evaluations if self.measured is not None else 0,
            "best_simulated_step_time_s": self.best["simulated"][0],
            "best_measured_step_time_s": self.best["measured"][0],
            "search_rounds_s": self.elapsed_s,
            "polish_gain": self.polish_gain,
            "seed": self.config.seed,
        }
        return dataclasses.replace(plan, notes=notes)

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        return {
            "config": self.config.to_dict(),
            "round": self.round,
            "elapsed_s": self.elapsed_s,
            "members": [m.state_dict() for m in self.members],
            "reference": dict(self.reference),
            "best": {k: (t, p.to_dict() if p is not None else None) for k, (t, p) in self.best.items()},
            "history": [dataclasses.asdict(r) for r in self.history],
            "simulated": self.simulated.state(),
            "measured": self.measured.state() if self.measured is not None else None,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.round = int(state["round"])  # type: ignore[call-overload]
        self.elapsed_s = float(state["elapsed_s"])  # type: ignore[arg-type]
        self.members = []
        for k, saved in enumerate(state["members"]):  # type: ignore[arg-type]
            member = _Member(self, k, int(saved["generation"]))
            member.load_state_dict(saved)
            self.members.append(member)
        self.reference = dict(state["reference"])  # type: ignore[call-overload]
        self.best = {
            k: (t, Plan.from_dict(p) if p is not None else None)
            for k, (t, p) in state["best"].items()  # type: ignore[union-attr]
        }
        self.history = [RoundReport(**r) for r in state["history"]]  # type: ignore[union-attr]
        self.simulated.load_state(state["simulated"])  # type: ignore[arg-type]
        if self.measured is not None and state["measured"] is not None:
            self.measured.load_state(state["measured"])  # type: ignore[arg-type]

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the checkpoint atomically (a crash mid-write leaves the previous one)."""
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
        library: LayerLibrary,
        cluster: Cluster,
        simulated: RewardSource,
        measured: RewardSource | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        rounds: int | None = None,
    ) -> TappSearch:
        """The search saved at ``path``, ready to run its next round; it keeps saving to ``checkpoint``
        (default: ``path``) and, if ``rounds`` is given, runs until that many rounds instead of its own count."""
        state = torch.load(Path(path), weights_only=False)
        config = SearchConfig.from_dict(state["config"])
        if rounds is not None:
            config = dataclasses.replace(config, rounds=rounds)
        search = cls(library, cluster, config, simulated, measured, checkpoint if checkpoint is not None else path)
        search.load_state_dict(state)
        return search
