"""TAPP's two networks (seed 000, sections 4.1 and 4.2), trained jointly.

``PartitionNetwork``: first the number of stages ``k`` (a learned categorical over 1..groups, uniform at first, so a
single stage is as reachable as many), then a feed-forward network giving every layer a probability over the first
``k`` groups. Its logits are a learned split of the model's cumulative work into one slice per group among the first
``k`` (a few parameters that move whole boundaries at once), initialised balanced to the devices' speeds, plus a
per-layer feed-forward correction whose last layer starts near zero.

``AllocationNetwork``: attention from every group to the devices. A group is the mean of its layers' op
embeddings and metrics, plus its share of the work, a one-hot vector of the groups it feeds, and its position
in the pipeline; a device is its speed, memory and links. Groups pick devices in pipeline order, pointer
style, never a device twice; the score of a device also weighs its link to the device the previous group took,
scaled by how much crosses that cut. Devices left over then each choose a group to replicate, or none. A fixed
prior favours devices whose share of the cluster's speed matches the group's share of the work, and no
replication, so that the first samples are sensible; the learned scores take over from there.
"""

from __future__ import annotations

import math

import torch
from torch import nn

NEG_INF = -1e9


class PartitionNetwork(nn.Module):
    """The number of stages, then layer features -> group logits: a learned split of the cumulative work into
    ``k`` group slices (the logit of a group falls with the layer's distance from its slice), plus a feed-forward
    correction per layer; the groups from ``k`` on are masked."""

    def __init__(self, layer_dim: int, groups: int, hidden: int, shares: torch.Tensor, strength: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(layer_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, groups)
        with torch.no_grad():
            self.head.weight.mul_(0.01)
            self.head.bias.zero_()
        self.share_logits = nn.Parameter(shares.log())
        self.stage_logits = nn.Parameter(torch.zeros(groups))
        """Logits of 1..groups stages."""
        self.strength = strength

    def split(self, position: torch.Tensor) -> torch.Tensor:
        """(layers,) work positions in [0, 1] -> (groups, layers, groups) logits of the learned split into ``k + 1``
        slices (first index ``k``), the groups from ``k + 1`` on masked."""
        groups = self.share_logits.shape[0]
        mask = torch.triu(torch.ones(groups, groups, dtype=torch.bool), diagonal=1)  # [k, g]: g > k
        shares = torch.softmax(self.share_logits[None, :].masked_fill(mask, NEG_INF), dim=1)
        high = torch.cumsum(shares, dim=1)
        low = high - shares
        x = position[None, :, None]
        distance = torch.relu(low[:, None, :] - x) + torch.relu(x - high[:, None, :])
        counts = torch.arange(1, groups + 1, dtype=position.dtype)[:, None, None]
        logits = -self.strength * counts * distance
        return logits.masked_fill(mask[:, None, :], NEG_INF)

    def forward(self, layer_vectors: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """(layers, layer_dim), (layers,) -> (groups, layers, groups) logits, for ``k + 1`` stages at index ``k``."""
        learned: torch.Tensor = self.head(self.body(layer_vectors))
        return learned[None, :, :] + self.split(position)


class AllocationNetwork(nn.Module):
    def __init__(self, group_dim: int, device_dim: int, key_dim: int) -> None:
        super().__init__()
        self.key_dim = key_dim
        self.group_query = nn.Sequential(nn.Linear(group_dim, key_dim), nn.Tanh(), nn.Linear(key_dim, key_dim))
        self.device_key = nn.Linear(device_dim, key_dim)
        # Score of a device's link to the previous group's device: (a + b * cut size) * log bandwidth.
        self.link_weight = nn.Parameter(torch.zeros(2))
        self.device_query = nn.Linear(device_dim, key_dim)
        self.group_key = nn.Sequential(nn.Linear(group_dim, key_dim), nn.Tanh(), nn.Linear(key_dim, key_dim))
        self.none_score = nn.Parameter(torch.zeros(()))

    def placement_scores(self, groups: torch.Tensor, devices: torch.Tensor) -> torch.Tensor:
        """(samples, slots, group_dim), (devices, device_dim) -> (samples, slots, devices) attention scores."""
        queries: torch.Tensor = self.group_query(groups)
        keys: torch.Tensor = self.device_key(devices)
        return queries @ keys.T / math.sqrt(self.key_dim)

    def link_scores(self, cut_size: torch.Tensor, log_bandwidth: torch.Tensor) -> torch.Tensor:
        """(samples,) normalised cut size, (samples, devices) log bandwidth from the previous device."""
        return (self.link_weight[0] + self.link_weight[1] * cut_size)[:, None] * log_bandwidth

    def replica_scores(self, groups: torch.Tensor, devices: torch.Tensor) -> torch.Tensor:
        """(samples, slots, group_dim), (devices, device_dim) -> (samples, devices, slots + 1); the last is 'none'."""
        scores = self.device_query(devices) @ self.group_key(groups).transpose(1, 2) / math.sqrt(self.key_dim)
        none = self.none_score.expand(scores.shape[0], scores.shape[1], 1)
        return torch.cat([scores, none], dim=2)
