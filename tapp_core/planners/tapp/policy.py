"""TAPP's policy: both networks and the micro-batch and schedule choices, sampled together into valid plans.

One sample is: a number of stages ``k`` and a group among the first ``k`` for every layer (partition network), the
monotone repair (``repair``), a schedule among the search's (its one-hot joins every group's features, so the
allocation network knows which schedule it places for), a device for every non-empty group in pipeline order and,
for every device left over, a group to join or none (allocation network), for every group of several devices how
it runs its layers (``patterns.PATTERNS``: data parallel with equal shares, or a split of its Linear and Conv2d
layers with shares in proportion to its devices' speeds), and a micro-batch count among those that give every
device of a group a sample.
So one stage on one device, with every other device idle, is a sample like any other. ``sample`` returns the
plans and the log-probability of each sample (with gradients, for REINFORCE) and the policy's entropy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tapp_core.cost.context import CostContext
from tapp_core.plan.placement import even_shares
from tapp_core.plan.plan import Plan
from tapp_core.plan.schedules import parse_schedule_spec
from tapp_core.planners.patterns import PATTERNS, pattern_signatures, splittable, with_signatures
from tapp_core.planners.stage_costs import LayerCosts, relative_speeds, speed_shares
from tapp_core.planners.tapp.features import (
    DEVICE_FEATURES,
    METRIC_NAMES,
    OP_VOCABULARY,
    device_features,
    layer_features,
    log_bandwidth_matrix,
    model_needs,
)
from tapp_core.planners.tapp.networks import AllocationNetwork, PartitionNetwork
from tapp_core.planners.tapp.repair import compact, monotone_groups, repair_weights

EMBEDDING_DIM = 16
NEG_INF = -1e9


@dataclass(frozen=True)
class PolicyConfig:
    groups: int
    hidden: int = 64
    key_dim: int = 32
    partition_prior: float = 4.0
    """How sharply the learned split decides a layer's group (logit drop per mean group share of distance)."""
    initial_split: str = "speed"
    """Initial group shares of the work: 'uniform', 'speed' (the devices' speeds, fastest first) or
    'shuffled:<seed>' (the devices' speeds in a random order)."""
    allocation_prior: float = 2.0
    """Strength of the prior matching a group's share of the work to a device's share of the speed."""
    replica_prior: float = 2.0
    """Initial preference of every leftover device for replicating no group."""


@dataclass(frozen=True)
class Actions:
    """The decisions behind a batch of samples (what REINFORCE scores)."""

    stage_counts: np.ndarray
    """(samples,) the number of stages chosen, minus 1."""
    labels: np.ndarray
    """(samples, layers) group of every layer, before the repair."""
    placed: np.ndarray
    """(samples, groups) device index of every non-empty group in pipeline order, -1 after the last."""
    replicas: np.ndarray
    """(samples, devices) group each left-over device replicates, -1 for none (and for placed devices)."""
    micro: np.ndarray
    """(samples,) index into the micro-batch choices."""
    schedule: np.ndarray
    """(samples,) index into the schedule choices."""
    patterns: np.ndarray
    """(samples, groups) index into ``PATTERNS`` of every group of several devices, -1 for the others."""


@dataclass
class PartitionDraw:
    labels: np.ndarray
    """(samples, layers) sampled group of every layer, before the repair."""
    log_prob: torch.Tensor
    """(samples,) log-probability of the number of stages and of every layer's group."""
    entropy: torch.Tensor
    """Mean entropy per layer decision, over the numbers of stages by their probability."""
    stage_entropy: torch.Tensor
    """Entropy of the number of stages."""
    layer_vectors: torch.Tensor


def repaired_stages(labels: np.ndarray, weights: np.ndarray, groups: int) -> np.ndarray:
    """Sampled groups made monotone (``repair.monotone_groups``) and renumbered as stages 0..k-1."""
    return compact(monotone_groups(labels, weights, groups))


@dataclass
class PolicySample:
    plans: list[Plan]
    log_prob: torch.Tensor
    """(samples,) log-probability of every sample's decisions, with gradients."""
    entropy: torch.Tensor
    """Mean over the seven kinds of decision of the mean entropy per decision, with gradients."""


def initial_shares(split: str, speeds: np.ndarray, groups: int) -> list[float]:
    """The share of the work each group starts with (see ``PolicyConfig.initial_split``)."""
    ranked = sorted(speeds.tolist(), reverse=True)[:groups]
    ranked += [ranked[-1]] * (groups - len(ranked))
    if split == "uniform":
        return [1.0] * groups
    if split == "speed":
        return ranked
    if split.startswith("shuffled:"):
        order = np.random.default_rng(int(split.split(":", 1)[1])).permutation(groups)
        return [ranked[i] for i in order]
    raise ValueError(f"unknown initial split {split!r}: use 'uniform', 'speed' or 'shuffled:<seed>'")


class TappPolicy(nn.Module):
    # Buffers (registered in __init__), declared for the type checker.
    op_ids: torch.Tensor
    numeric: torch.Tensor
    devices: torch.Tensor
    log_bandwidth: torch.Tensor
    slot_position: torch.Tensor
    work_position: torch.Tensor

    def __init__(
        self,
        context: CostContext,
        config: PolicyConfig,
        micro_batch_choices: Sequence[int],
        batch_size: int,
        schedules: str | Sequence[str],
    ) -> None:
        """``schedules``: the schedule choices (``schedules.schedule_spec``; one string: the only one)."""
        library, cluster = context.library, context.cluster
        super().__init__()
        features = layer_features(library)
        self.library = library
        self.config = config
        self.device_names = cluster.device_names
        self.micro_batch_choices = tuple(micro_batch_choices)
        self.batch_size = batch_size
        self.schedules = (schedules,) if isinstance(schedules, str) else tuple(schedules)
        self._schedule_specs = [parse_schedule_spec(spec) for spec in self.schedules]
        groups = config.groups
        relative = relative_speeds(context)
        speeds = np.array([relative[name] for name in cluster.device_names])
        self.work_fraction = features.work / max(features.work.sum(), 1e-12)
        self.repair_weights = repair_weights(features.work)
        self.speeds = speeds
        top = np.cumsum(np.sort(speeds)[::-1])
        self.top_speed_sums = torch.as_tensor(top[np.minimum(np.arange(groups), len(top) - 1)], dtype=torch.float32)
        """``[k]``: the summed speed of the ``k + 1`` fastest devices (what ``k + 1`` stages can hope to use)."""
        cut_bytes = LayerCosts.from_library(library).cut_bytes
        self.cut_size = np.log1p(cut_bytes) / max(np.log1p(cut_bytes).max(), 1e-12)
        self.edges = np.array(library.edges(), dtype=np.int64).reshape(-1, 2)
        self.register_buffer("op_ids", features.op_ids)
        self.register_buffer("numeric", features.numeric)
        needs = model_needs(library, self.micro_batch_choices, batch_size, self.schedules[0])
        self.register_buffer("devices", device_features(cluster, needs, speeds.tolist(), context.plan_memory))
        self.register_buffer("log_bandwidth", log_bandwidth_matrix(cluster))
        self.register_buffer("slot_position", torch.eye(groups))
        shares = initial_shares(config.initial_split, speeds, groups)
        self.register_buffer("work_position", features.metrics[:, METRIC_NAMES.index("work_position")].clone())
        self.embedding = nn.Embedding(len(OP_VOCABULARY), EMBEDDING_DIM)
        layer_dim = EMBEDDING_DIM + self.numeric.shape[1]
        self.partition = PartitionNetwork(
            layer_dim, groups, config.hidden, torch.tensor(shares, dtype=torch.float32), config.partition_prior
        )
        self.group_layer_dim = EMBEDDING_DIM + len(METRIC_NAMES)
        group_dim = self.group_layer_dim + 1 + 2 * groups + len(self.schedules)
        self.allocation = AllocationNetwork(group_dim, len(DEVICE_FEATURES), config.key_dim)
        self.micro_batch_logits = nn.Parameter(torch.zeros(len(self.micro_batch_choices)))
        self.schedule_logits = nn.Parameter(torch.zeros(len(self.schedules)))
        self.pattern_logits = nn.Parameter(torch.zeros(groups, len(PATTERNS)))
        self.splittable = splittable(library)
        self.weights = {x.index: x.param_bytes for x in library.layers}
        self.specs = library.specs()
        self.speed_of = dict(zip(self.device_names, speeds.tolist(), strict=True))

    # --- sampling and scoring ----------------------------------------------------------------------------------

    def sample(self, count: int, generator: torch.Generator) -> PolicySample:
        """Sample ``count`` plans."""
        draw = self.draw_partition(count, generator)
        return self.complete(draw, repaired_stages(draw.labels, self.repair_weights, self.config.groups), generator)

    def score(self, plans: Sequence[Plan]) -> PolicySample:
        """The log-probability of choosing exactly ``plans`` (self-imitation of the best plans seen; each one
        ``can_express``). Their stages are already monotone, so they are their own repair."""
        actions = self.actions_of(plans)
        draw = self.draw_partition(len(plans), None, actions.labels, actions.stage_counts)
        return self.complete(draw, compact(actions.labels), None, actions)

    def can_express(self, plan: Plan) -> bool:
        """Whether this policy can sample ``plan``: its model, devices and micro-batch count, contiguous stages, no
        more stages than groups."""
        order = list(plan.stage_of_layer)
        return (
            plan.model == self.library.model
            and plan.batch_size == self.batch_size
            and plan.schedule_spec in self.schedules
            and plan.micro_batches in self.micro_batch_choices
            and plan.n_stages <= self.config.groups
            and len(order) == len(self.library.layers)
            and order == sorted(order)
            and set(plan.devices) <= set(self.device_names)
            and all(p >= 0 for p, g in zip(self._patterns_of(plan), plan.stage_devices, strict=False) if len(g) > 1)
        )

    def draw_partition(
        self,
        count: int,
        generator: torch.Generator | None,
        labels: np.ndarray | None = None,
        stage_counts: np.ndarray | None = None,
    ) -> PartitionDraw:
        """The partition network's decisions for ``count`` samples (or the given ``labels`` and ``stage_counts``): a
        number of stages, then a group among that many for every layer."""
        layer_vectors = torch.cat([self.embedding(self.op_ids), self.numeric], dim=1)
        log_p = F.log_softmax(self.partition(layer_vectors, self.work_position), dim=2)  # (k, layers, groups)
        stage_log_p = F.log_softmax(self.partition.stage_logits, dim=0)
        if labels is None:
            counts = torch.multinomial(stage_log_p.exp().detach(), count, replacement=True, generator=generator)
            chosen = torch.empty((count, log_p.shape[1]), dtype=torch.long)
            for k in torch.unique(counts).tolist():
                rows = counts == k
                drawn = torch.multinomial(
                    log_p[k].exp().detach(), int(rows.sum()), replacement=True, generator=generator
                )
                chosen[rows] = drawn.T
        else:
            assert stage_counts is not None
            counts, chosen = torch.as_tensor(stage_counts), torch.as_tensor(labels)
        layers = torch.arange(log_p.shape[1])
        picked = log_p[counts[:, None], layers[None, :], chosen]
        stage_p = stage_log_p.exp()
        per_layer = -(log_p.exp() * log_p).sum(dim=2).mean(dim=1)
        return PartitionDraw(
            labels=chosen.numpy(),
            log_prob=stage_log_p[counts] + picked.sum(dim=1),
            entropy=(stage_p * per_layer).sum(),
            stage_entropy=-(stage_p * stage_log_p).sum(),
            layer_vectors=layer_vectors,
        )

    def actions_of(self, plans: Sequence[Plan]) -> Actions:
        """Decisions that produce ``plans``: their stages as the groups, each stage's first device placed, the
        others as replicas."""
        index = {name: i for i, name in enumerate(self.device_names)}
        placed = np.full((len(plans), self.config.groups), -1, dtype=np.int64)
        replicas = np.full((len(plans), len(self.device_names)), -1, dtype=np.int64)
        for s, plan in enumerate(plans):
            for g, devices in enumerate(plan.stage_devices):
                placed[s, g] = index[devices[0]]
                for name in devices[1:]:
                    replicas[s, index[name]] = g
        return Actions(
            stage_counts=np.array([plan.n_stages - 1 for plan in plans], dtype=np.int64),
            labels=np.array([plan.stage_of_layer for plan in plans], dtype=np.int64),
            placed=placed,
            replicas=replicas,
            micro=np.array([self.micro_batch_choices.index(plan.micro_batches) for plan in plans]),
            schedule=np.array([self.schedules.index(plan.schedule_spec) for plan in plans]),
            patterns=np.array([self._patterns_of(plan) for plan in plans], dtype=np.int64).reshape(len(plans), -1),
        )

    def _patterns_of(self, plan: Plan) -> list[int]:
        """The pattern of every group slot of ``plan`` (-1: one device, or none matches)."""
        out = [-1] * self.config.groups
        for g, group in enumerate(plan.stage_devices):
            if len(group) < 2:
                continue
            for k in range(len(PATTERNS)):
                probe = np.full(self.config.groups, -1, dtype=np.int64)
                probe[g] = k
                signatures, shares = self._placements(np.asarray(plan.stage_of_layer), plan.stage_devices, probe)
                mine = tuple((x, s) for x, s in plan.signatures if plan.stage_of_layer[x] == g)
                own_shares = plan.shares(g)
                expected = shares[g] if shares else even_shares(len(group))
                if mine == signatures and own_shares == expected:
                    out[g] = k
                    break
        return out

    def complete(
        self,
        draw: PartitionDraw,
        stages: np.ndarray,
        generator: torch.Generator | None,
        forced: Actions | None = None,
    ) -> PolicySample:
        """The schedule, the allocation network's and the micro-batch decisions for repaired ``stages`` (one row
        per sample)."""
        groups = self.config.groups
        count = stages.shape[0]
        n_stages = stages.max(axis=1) + 1
        schedule, schedule_log_prob, schedule_entropy = self._categorical(
            self.schedule_logits, count, generator, None if forced is None else forced.schedule
        )
        chosen = F.one_hot(torch.as_tensor(schedule), len(self.schedules)).float()
        slots = self._group_vectors(draw.layer_vectors[:, : self.group_layer_dim], stages)
        slots = torch.cat([slots, chosen[:, None, :].expand(count, groups, len(self.schedules))], dim=2)
        active = torch.arange(groups)[None, :] < torch.as_tensor(n_stages)[:, None]
        placed, place_log_prob, place_entropy = self._place(
            slots, stages, active, generator, None if forced is None else forced.placed
        )
        replicas, replica_log_prob, replica_entropy = self._replicate(
            slots, placed, active, generator, None if forced is None else forced.replicas
        )
        replicas = self._dividing(replicas)
        micro, micro_log_prob, micro_entropy = self._micro_batches(
            replicas, generator, None if forced is None else forced.micro
        )
        patterns, pattern_log_prob, pattern_entropy = self._patterns(
            replicas, generator, None if forced is None else forced.patterns
        )
        log_prob = draw.log_prob + place_log_prob + replica_log_prob + micro_log_prob + schedule_log_prob
        log_prob = log_prob + pattern_log_prob
        entropy = torch.stack(
            [
                draw.stage_entropy,
                draw.entropy,
                place_entropy,
                replica_entropy,
                micro_entropy,
                schedule_entropy,
                pattern_entropy,
            ]
        ).mean()
        plans = [
            self._plan(stages[s], n_stages[s], placed[s], replicas[s], micro[s], int(schedule[s]), patterns[s])
            for s in range(count)
        ]
        return PolicySample(plans, log_prob, entropy)

    def _patterns(
        self, replicas: np.ndarray, generator: torch.Generator | None, forced: np.ndarray | None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """A pattern for every group of several devices (-1 for the others), their log-probability and entropy."""
        samples, groups = replicas.shape[0], self.config.groups
        grouped = np.zeros((samples, groups), dtype=bool)
        for s in range(samples):
            grouped[s, replicas[s][replicas[s] >= 0]] = True
        log_p = F.log_softmax(self.pattern_logits, dim=1)
        if forced is None:
            flat = torch.multinomial(log_p.exp().detach(), samples, replacement=True, generator=generator)
            chosen = flat.T.numpy()
        else:
            chosen = np.maximum(forced, 0)
        mask = torch.as_tensor(grouped)
        picked = log_p[torch.arange(groups)[None, :], torch.as_tensor(chosen)]
        entropy = -(log_p.exp() * log_p).sum(dim=1)
        weighted = (entropy[None, :] * mask).sum() / mask.sum().clamp(min=1)
        return np.where(grouped, chosen, -1), (picked * mask).sum(dim=1), weighted

    @staticmethod
    def _categorical(
        logits: torch.Tensor, count: int, generator: torch.Generator | None, forced: np.ndarray | None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """``count`` draws from one categorical (or the ``forced`` ones): choices, log-probabilities, entropy."""
        log_p = F.log_softmax(logits, dim=0)
        if forced is None:
            chosen = torch.multinomial(log_p.exp().detach(), count, replacement=True, generator=generator)
        else:
            chosen = torch.as_tensor(forced)
        return chosen.numpy(), log_p[chosen], -(log_p.exp() * log_p).sum()

    def _group_vectors(self, layer_vectors: torch.Tensor, stages: np.ndarray) -> torch.Tensor:
        groups = self.config.groups
        samples = stages.shape[0]
        member = torch.zeros(samples, groups, stages.shape[1])
        member.scatter_(1, torch.as_tensor(stages)[:, None, :], 1.0)
        counts = member.sum(dim=2, keepdim=True).clamp(min=1.0)
        mean = member @ layer_vectors / counts
        share = member @ torch.as_tensor(self.work_fraction, dtype=torch.float32)
        feeds = torch.zeros(samples, groups, groups)
        if len(self.edges):
            src, dst = stages[:, self.edges[:, 0]], stages[:, self.edges[:, 1]]
            rows = np.repeat(np.arange(samples), src.shape[1])
            crossing = (src != dst).ravel()
            feeds[rows[crossing], src.ravel()[crossing], dst.ravel()[crossing]] = 1.0
        position = self.slot_position.expand(samples, groups, groups)
        return torch.cat([mean, share[:, :, None], feeds, position], dim=2)

    def _place(
        self,
        slots: torch.Tensor,
        stages: np.ndarray,
        active: torch.Tensor,
        generator: torch.Generator | None,
        forced: np.ndarray | None,
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        samples, groups = active.shape
        share = slots[:, :, self.group_layer_dim].detach().clamp(min=1e-6)
        # A device's share of the speed of as many of the fastest devices as the sample has stages.
        fastest = self.top_speed_sums[active.sum(dim=1).clamp(min=1) - 1]
        speed = torch.as_tensor(self.speeds, dtype=torch.float32)[None, :] / fastest[:, None]
        prior = -self.config.allocation_prior * (share.log()[:, :, None] - speed.log()[:, None, :]).abs()
        scores = self.allocation.placement_scores(slots, self.devices) + prior
        used = torch.zeros(samples, len(self.device_names), dtype=torch.bool)
        placed = np.full((samples, groups), -1, dtype=np.int64)
        starts = np.stack([np.searchsorted(row, np.arange(groups)) for row in stages])
        log_prob = torch.zeros(samples)
        entropy = torch.zeros(())
        decisions = active.sum().clamp(min=1)
        previous = None
        for g in range(groups):
            slot_scores = scores[:, g, :]
            if previous is not None:
                cut = torch.as_tensor(
                    self.cut_size[np.minimum(starts[:, g], len(self.cut_size) - 1)], dtype=torch.float32
                )
                slot_scores = slot_scores + self.allocation.link_scores(cut, self.log_bandwidth[previous])
            log_p = F.log_softmax(slot_scores.masked_fill(used, NEG_INF), dim=1)
            here = active[:, g]
            if forced is None:
                chosen = torch.multinomial(log_p.exp().detach(), 1, generator=generator)[:, 0]
            else:
                chosen = torch.as_tensor(np.maximum(forced[:, g], 0))
            log_prob = log_prob + torch.where(here, log_p.gather(1, chosen[:, None])[:, 0], torch.zeros(()))
            step_entropy = -(log_p.exp() * log_p.masked_fill(used, 0.0)).sum(dim=1)
            entropy = entropy + (step_entropy * here).sum()
            used = used | (F.one_hot(chosen, len(self.device_names)).bool() & here[:, None])
            placed[:, g] = np.where(here.numpy(), chosen.numpy(), -1)
            previous = chosen
        return placed, log_prob, entropy / decisions

    def _replicate(
        self,
        slots: torch.Tensor,
        placed: np.ndarray,
        active: torch.Tensor,
        generator: torch.Generator | None,
        forced: np.ndarray | None,
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        samples, groups = active.shape
        n_devices = len(self.device_names)
        scores = self.allocation.replica_scores(slots, self.devices)
        none = torch.zeros(groups + 1)
        none[groups] = self.config.replica_prior
        allowed = torch.cat([active, torch.ones(samples, 1, dtype=torch.bool)], dim=1)
        log_p = F.log_softmax((scores + none).masked_fill(~allowed[:, None, :], NEG_INF), dim=2)
        if forced is None:
            flat = log_p.reshape(samples * n_devices, groups + 1).exp().detach()
            chosen = torch.multinomial(flat, 1, generator=generator)[:, 0].reshape(samples, n_devices)
        else:
            chosen = torch.as_tensor(np.where(forced >= 0, forced, groups))
        free = torch.ones(samples, n_devices, dtype=torch.bool)
        for g in range(groups):
            taken = torch.as_tensor(placed[:, g])
            free[torch.arange(samples)[taken >= 0], taken[taken >= 0]] = False
        picked = log_p.gather(2, chosen[:, :, None])[:, :, 0]
        log_prob = (picked * free).sum(dim=1)
        entropy = -(log_p.exp() * log_p.masked_fill(~allowed[:, None, :], 0.0)).sum(dim=2)
        entropy = (entropy * free).sum() / free.sum().clamp(min=1)
        replicas = np.where(free.numpy() & (chosen.numpy() < groups), chosen.numpy(), -1)
        return replicas, log_prob, entropy

    def _dividing(self, replicas: np.ndarray) -> np.ndarray:
        """``replicas`` with the last replicas of a stage left idle until every device of the stage gets a sample
        of the largest micro-batch (so some micro-batch count suits every stage): a sample never fails for it."""
        largest = self.batch_size // min(self.micro_batch_choices)
        out = replicas.copy()
        for s in range(out.shape[0]):
            for g in np.unique(out[s][out[s] >= 0]):
                extra = np.flatnonzero(out[s] == g)
                out[s, extra[largest - 1 :]] = -1
        return out

    def _micro_batches(
        self, replicas: np.ndarray, generator: torch.Generator | None, forced: np.ndarray | None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        samples = replicas.shape[0]
        counts = np.ones((samples, self.config.groups), dtype=np.int64)
        for s in range(samples):
            for g in replicas[s][replicas[s] >= 0]:
                counts[s, g] += 1
        sizes = np.array([self.batch_size // m for m in self.micro_batch_choices])
        fits: np.ndarray = np.all(sizes[None, None, :] >= counts[:, :, None], axis=1)
        fits[~fits.any(axis=1)] = True  # no count fits: sample one anyway and let the plan fail
        mask = ~torch.as_tensor(fits)
        log_p = F.log_softmax(self.micro_batch_logits.expand(samples, -1).masked_fill(mask, NEG_INF), dim=1)
        if forced is None:
            chosen = torch.multinomial(log_p.exp().detach(), 1, generator=generator)[:, 0]
        else:
            chosen = torch.as_tensor(forced)
        log_prob = log_p.gather(1, chosen[:, None])[:, 0]
        entropy = -(log_p.exp() * log_p.masked_fill(mask, 0.0)).sum(dim=1).mean()
        return np.array(self.micro_batch_choices)[chosen.numpy()], log_prob, entropy

    def _plan(
        self,
        stages: np.ndarray,
        n_stages: int,
        placed: np.ndarray,
        replicas: np.ndarray,
        micro: int,
        schedule: int,
        patterns: np.ndarray,
    ) -> Plan:
        name, staleness = self._schedule_specs[schedule]
        devices = []
        for g in range(n_stages):
            extra = [self.device_names[d] for d in range(len(self.device_names)) if replicas[d] == g]
            devices.append((self.device_names[placed[g]], *extra))
        signatures, shares = self._placements(stages, devices, patterns)
        return Plan(
            model=self.library.model,
            batch_size=self.batch_size,
            micro_batches=int(micro),
            schedule=name,
            staleness=staleness,
            stage_of_layer=tuple(stages.tolist()),
            stage_devices=tuple(devices),
            signatures=signatures,
            stage_shares=shares,
        )

    def _placements(
        self, stages: np.ndarray, devices: Sequence[tuple[str, ...]], patterns: np.ndarray
    ) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[float, ...], ...]]:
        """The signatures and shares the groups' patterns give: data parallel groups share equally, split ones in
        proportion to their devices' speeds."""
        chosen: dict[int, str] = {}
        shares = [even_shares(len(group)) for group in devices]
        for g, group in enumerate(devices):
            if len(group) > 1 and PATTERNS[patterns[g]] != "data":
                layers = [x for x in self.splittable if stages[x] == g]
                chosen.update(pattern_signatures(PATTERNS[patterns[g]], layers, self.weights, self.specs))
                shares[g] = speed_shares(self.speed_of, group)
        uneven = any(s != even_shares(len(s)) for s in shares)
        return with_signatures((), chosen), (tuple(shares) if uneven else ())
