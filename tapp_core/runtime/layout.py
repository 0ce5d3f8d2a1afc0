"""Where each stage replica runs and which rows of a micro-batch it owns; the routes of every cut value.

A stage's replicas split each micro-batch into contiguous row ranges (``tapp_core.plan.replica_slices``). A
value travels from each producer replica to each consumer replica whose rows overlap its own, so stages with
different replica counts meet without a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from tapp_core.plan import replica_slices


@dataclass(frozen=True)
class Route:
    """One piece of a value: ``peer`` rank, and the local rows ``[lo, hi)`` of this rank's tensor it covers."""

    peer: int
    stage: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Layout:
    stage_ranks: tuple[tuple[int, ...], ...]
    """``stage_ranks[s]``: the ranks running the replicas of stage ``s``, in replica order."""
    micro_batch_size: int

    def position(self, rank: int) -> tuple[int, int] | None:
        """(stage, replica) of ``rank``, or None when the plan does not use it."""
        for stage, ranks in enumerate(self.stage_ranks):
            if rank in ranks:
                return stage, ranks.index(rank)
        return None

    def rows(self, stage: int, replica: int) -> tuple[int, int]:
        """The micro-batch rows ``[start, stop)`` that a replica of ``stage`` computes."""
        return replica_slices(self.micro_batch_size, len(self.stage_ranks[stage]))[replica]

    def routes(self, stage: int, replica: int, peer_stage: int) -> list[Route]:
        """The pieces this replica exchanges with the replicas of ``peer_stage``, in this replica's local rows."""
        start, stop = self.rows(stage, replica)
        pieces = []
        for peer_replica, peer_rank in enumerate(self.stage_ranks[peer_stage]):
            peer_start, peer_stop = self.rows(peer_stage, peer_replica)
            lo, hi = max(start, peer_start), min(stop, peer_stop)
            if lo < hi:
                pieces.append(Route(peer=peer_rank, stage=peer_stage, lo=lo - start, hi=hi - start))
        return pieces
