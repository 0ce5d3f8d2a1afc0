"""A stage's gradients between its backwards and its update: weight versions and bucketed reductions.

Weight stashing: where the schedule lets a forward run on weights that an update will have changed by the time its
backward runs (``PipelineSchedule.weight_versions``), each forward runs on a snapshot of the weights current at that
moment and its backward computes the gradient at that snapshot (PipeDream); with a ``predict`` rule (stale-gradient
compensation, ``runtime.optim``) the snapshot is the weights predicted where the gradient will be applied. Every snapshot's gradients belong to the
step whose update comes next (a step's backwards all run before the next step's), so the update sums them.

Reductions: on a stage of several devices, the gradients are summed across them bucket by bucket
(``tapp_core.plan.program.gradient_buckets``). A bucket's reduction starts as soon as the step's last backward has
produced every gradient in it (a hook on each parameter counts them), or at the program's ``reduce`` action at the
latest; the update waits for all of them. Each bucket is one flat buffer kept from step to step (a fresh one of
AlexNet's 89 MiB of gradients cost a 1-thread rank some 40 ms of page faults every step), and each parameter's
gradient is a view of it until the update has used it.

Ties: a tied parameter (one whose users are on several stages, ``tapp_core.plan.ties``) is in no bucket. At the
program's ``tie`` action its gradient (this device's, not summed within the stage) starts summing among every device
of every stage holding it; the update waits for that too, so every copy takes the same gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from mpi4py import MPI
from torch import nn

from tapp_core.plan.program import Bucket
from tapp_core.runtime.optimizer_shards import OptimizerShards
from tapp_core.runtime.transport import Reduction, Transport


@dataclass
class TiedGradient:
    """Tie ``index`` of the plan: the stage module's parameter ``name``, summed over ``comm`` (every device holding
    it; ``peers``: the others' ranks in the pool)."""

    index: int
    name: str
    comm: MPI.Comm
    peers: list[int]
    flat: torch.Tensor | None = None
    reduction: Reduction | None = None


@dataclass
class _BucketState:
    names: tuple[str, ...]
    """The bucket's parameters (the stage module's names), in a fixed order."""
    flat: torch.Tensor | None = None
    ready: set[str] = field(default_factory=set)
    reduction: Reduction | None = None


class StageGradients:
    """The weights a stage's forwards run on and the gradients its update applies."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        stashes: bool,
        buckets: Sequence[Bucket],
        layer_of: Mapping[str, int],
        transport: Transport,
        comm: MPI.Comm | None,
        peers: list[int],
        overlap: bool = True,
        predict: Callable[[], dict[str, torch.Tensor]] | None = None,
        ties: Sequence[TiedGradient] = (),
    ) -> None:
        """``layer_of``: each parameter's layer (library index); ``comm``/``peers``: the stage's devices, when several;
        ``overlap``: start a bucket's reduction as soon as the last backward made it (else at the ``reduce``);
        ``predict``: the weights a new snapshot takes (by name; the current weights, copied, when None); ``ties``:
        the stage's tied parameters, reduced by their ties instead of its buckets."""
        self.params = dict(params)
        self.stashes = stashes
        self.predict = predict
        self.transport = transport
        self.comm = comm
        self.peers = peers
        self.version = 0
        """Updates applied so far."""
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._users: dict[int, int] = {}
        self._ties = {tie.index: tie for tie in ties}
        tied = {tie.name for tie in ties}
        self._buckets = [
            _BucketState(tuple(sorted(n for n in self.params if layer_of[n] in bucket.layers and n not in tied)))
            for bucket in buckets
        ]
        self._bucket_of = {name: b for b, state in enumerate(self._buckets) for name in state.names}
        self._final = False
        self._overlap = overlap
        self.shards: OptimizerShards | None = None
        """Where the stage shards its optimiser state (``shard_with``)."""
        if comm is not None and overlap:
            for name, param in self.params.items():
                self._hook(name, param)

    def shard_with(self, shards: OptimizerShards) -> None:
        """Reduce-scatter the buckets into the slices ``shards`` updates, rather than allreduce them. The backwards
        accumulate each parameter's gradient in its bucket's flat buffer (its ``grad`` a view of it, as DDP's
        ``gradient_as_bucket_view``): the buffer costs no memory beyond the gradients, which the sharded state's
        memory saving would otherwise give back."""
        self.shards = shards
        self._gradient_views()

    def _gradient_views(self) -> None:
        """Zero each bucket's flat buffer and make every parameter's gradient a view of it again."""
        for state in (s for s in self._buckets if s.names):
            if state.flat is None:
                first = self.params[state.names[0]]
                size = sum(self.params[n].numel() for n in state.names)
                state.flat = torch.zeros(size, dtype=first.dtype, device=first.device)
            else:
                state.flat.zero_()
            offset = 0
            for name in state.names:
                param = self.params[name]
                param.grad = state.flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()

    def _in_place(self, state: _BucketState) -> bool:
        """Whether every gradient of the bucket is still the view of its flat buffer that ``_gradient_views`` made."""
        assert state.flat is not None
        offset, width = state.flat.data_ptr(), state.flat.element_size()
        for name in state.names:
            grad = self.params[name].grad
            if grad is None or grad.data_ptr() != offset:
                return False
            offset += grad.numel() * width
        return True

    def bucket_names(self) -> list[tuple[str, ...]]:
        """Each bucket's parameters, in the order its gradients are flattened."""
        return [state.names for state in self._buckets]

    # --- weights for a forward --------------------------------------------------------------------------------

    def weights_for_forward(self) -> tuple[dict[str, torch.Tensor] | None, int]:
        """The weights a forward runs on (None: the live parameters) and their version."""
        if not self.stashes:
            return None, self.version
        version = self.version
        if version not in self._snapshots:
            weights = (
                self.predict() if self.predict is not None else {n: p.detach().clone() for n, p in self.params.items()}
            )
            snapshot = {n: w.requires_grad_(True) for n, w in weights.items()}
            for name, tensor in snapshot.items():
                self._hook(name, tensor)
            self._snapshots[version] = snapshot
            self._users[version] = 0
        self._users[version] += 1
        return self._snapshots[version], version

    def backward_done(self, version: int) -> int:
        """A backward of a forward that ran on ``version`` is done; returns its age (updates since that forward)."""
        if self.stashes:
            self._users[version] -= 1
        return self.version - version

    # --- reductions ------------------------------------------------------------------------------------------------

    def final_backward(self, starting: bool) -> None:
        """Around the step's last backward: while it runs, a bucket whose gradients are all made starts reducing."""
        self._final = starting

    def _hook(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._bucket_of and self._overlap and self.comm is not None:
            tensor.register_post_accumulate_grad_hook(_calling(weakref.WeakMethod(self._made), name))  # type: ignore[no-untyped-call]

    def _made(self, name: str) -> None:
        if not self._final:
            return
        state = self._buckets[self._bucket_of[name]]
        state.ready.add(name)
        if len(state.ready) == len(state.names):
            self.start_reduction(self._bucket_of[name])

    def start_reduction(self, bucket: int) -> None:
        """Start summing ``bucket``'s gradients across the stage's devices (once per step)."""
        state = self._buckets[bucket]
        if state.reduction is not None or self.comm is None or not state.names:  # no names: every one frozen
            return
        if self.shards is None or not self._in_place(state):
            self._flatten(state)
        assert state.flat is not None
        if self.shards is not None:
            shard = self.shards.bucket_of(state.names)
            assert shard is not None
            state.reduction = self.shards.start_reduction(shard, state.flat)
        else:
            state.reduction = self.transport.start_allreduce(state.flat, self.comm, self.peers)

    def _flatten(self, state: _BucketState) -> None:
        """Copy the bucket's gradients into its flat buffer (a parameter without one: zeros)."""
        grads = [self._step_gradient(name) for name in state.names]
        parts = [
            g if g is not None else torch.zeros_like(self.params[n]) for g, n in zip(grads, state.names, strict=True)
        ]
        size = sum(g.numel() for g in parts)
        if state.flat is None or state.flat.numel() != size:
            state.flat = torch.empty(size, dtype=parts[0].dtype, device=parts[0].device)
        if self.shards is not None:  # some gradients may be views of the buffer: copied out first
            state.flat.copy_(torch.cat([g.reshape(-1) for g in parts]))
        else:
            torch.cat([g.reshape(-1) for g in parts], out=state.flat)

    def start_tie(self, index: int) -> None:
        """Start summing tie ``index``'s gradient among every device holding its parameter (once per step)."""
        tie = self._ties[index]
        if tie.reduction is not None:
            return
        grad = self._step_gradient(tie.name)
        part = grad if grad is not None else torch.zeros_like(self.params[tie.name])
        if tie.flat is None or tie.flat.numel() != part.numel():
            tie.flat = torch.empty(part.numel(), dtype=part.dtype, device=part.device)
        tie.flat.copy_(part.reshape(-1))
        tie.reduction = self.transport.start_allreduce(tie.flat, tie.comm, tie.peers)

    def _step_gradient(self, name: str) -> torch.Tensor | None:
        """This step's gradient of parameter ``name``: the live parameter's and every snapshot's, summed (None: the
        step used it nowhere)."""
        total = self.params[name].grad
        for snapshot in self._snapshots.values():
            grad = snapshot[name].grad
            if grad is not None:
                total = grad if total is None else total + grad
        return total

    # --- the update ------------------------------------------------------------------------------------------------

    def prepare_update(self) -> None:
        """Finish every reduction and leave each parameter's ``grad`` as this step's summed gradient."""
        for bucket in range(len(self._buckets)):
            self.start_reduction(bucket)
        self.transport.finish_reductions([s.reduction for s in self._buckets if s.reduction is not None])
        reduced: set[str] = set()
        for state in (s for s in self._buckets if s.names):
            assert state.flat is not None
            offset = 0
            for name in state.names:
                param = self.params[name]
                # Sharded, the parameter's gradient is in the flat buffer already: the slices take their sums.
                if self.shards is None:
                    param.grad = state.flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                reduced.add(name)
            state.reduction, state.ready = None, set()
        if self.shards is not None:
            self.shards.take_gradients()
            self._gradient_views()  # the next step's gradients accumulate from zero
        reduced |= self._finish_ties()
        if self.stashes:
            with torch.no_grad():
                for name, param in self.params.items():
                    if name not in reduced:
                        param.grad = self._step_gradient(name)
            self._clear_snapshot_gradients()

    def _finish_ties(self) -> set[str]:
        """Finish every tie's reduction (each on its own communicator) and give its parameter the sum."""
        for index in self._ties:
            self.start_tie(index)
        for tie in self._ties.values():
            assert tie.reduction is not None and tie.flat is not None
            self.transport.finish_reductions([tie.reduction])
            self.params[tie.name].grad = tie.flat.view_as(self.params[tie.name])
            tie.reduction = None
        return {tie.name for tie in self._ties.values()}

    def _clear_snapshot_gradients(self) -> None:
        for snapshot in self._snapshots.values():
            for tensor in snapshot.values():
                tensor.grad = None

    def updated(self) -> None:
        """The optimiser stepped: a new weight version is current; drop the snapshots no forward still needs."""
        self.version += 1
        for version in [v for v, users in self._users.items() if users == 0 and v != self.version]:
            del self._snapshots[version]
            del self._users[version]

    def snapshot_versions(self) -> Iterator[int]:
        return iter(self._snapshots)


def _calling(made: weakref.WeakMethod[Callable[[str], None]], name: str) -> Callable[[torch.Tensor], None]:
    """A gradient hook that calls ``made(name)`` while its object lives. A hook lives in the tensor's autograd
    metadata, which the garbage collector does not see into: a strong reference from it to the object that holds the
    tensor would make a cycle never freed (the stage's parameters, gradients and optimiser state, plan after plan)."""

    def hook(_: torch.Tensor) -> None:
        method = made()
        if method is not None:
            method(name)

    return hook
