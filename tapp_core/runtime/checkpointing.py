"""A rank's side of checkpoints (``runtime.checkpoint`` is the format): what its stage writes, how a checkpoint of any
plan is loaded into it, and a training cut into runs of ``every`` steps with a checkpoint after each.

What a device writes: every parameter and buffer of its stage under the model's names, with each parameter's
optimiser state, by the stage's first device only unless the stage splits it (``runtime.sharding``): then every
device writes its slice, placed along the shard's dimension. The last stage's first device also writes the data
order's random state. Every device then waits at a barrier of the plan's ranks, and the plan's first device
writes the manifest (``checkpoint.commit``).

Loading is the other way round: each device assembles every tensor its stage holds whole from the checkpoint and
keeps its own slice, whatever plan wrote it. The runs between checkpoints are separate ``StageEngine.train`` calls:
a synchronous schedule ends every step with its update, so this changes nothing; an asynchronous one drains its
pipeline at each checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.model.data import BatchCursor
from tapp_core.runtime.batches import IteratorBatches
from tapp_core.runtime.checkpoint import (
    AUGMENT_GENERATOR,
    DATA,
    MODEL_FILE,
    OPTIMIZER,
    STATE,
    Checkpoint,
    Piece,
    TrainingCheckpointError,
    clear_after,
    commit,
    export_model,
    step_folder,
    write_pieces,
)
from tapp_core.runtime.engine import RankRecord, StageEngine
from tapp_core.runtime.sharding import Shard


@dataclass(frozen=True)
class TrainPosition:
    """Where a training stands: steps done in all, the epoch, steps done in it, and the augmentation's random state
    there (None at an epoch's start)."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    augment_state: torch.Tensor | None = None


def _slice(shard: Shard, index: int) -> dict[str, int]:
    start, stop = shard.ranges[index]
    return {"dim": shard.dim, "start": start, "stop": stop, "size": max(hi for _, hi in shard.ranges)}


def _split(shards: dict[str, Shard], local: str) -> Shard | None:
    shard = shards.get(local)
    return shard if shard is not None and not shard.first_only else None


def stage_pieces(engine: StageEngine) -> list[Piece]:
    """What this device writes of its stage: parameters, buffers and optimiser states (see the module's doc)."""
    names = engine.stage.state_names()
    shards = dict(engine.sharded.shards) if engine.sharded is not None else {}
    states = engine.optimizer_states()
    pieces = []
    for local, tensor in engine.stage.module.state_dict(keep_vars=True).items():
        shard = _split(shards, local)
        if local not in names or (engine.replica > 0 and shard is None):
            continue
        place = _slice(shard, engine.replica) if shard is not None else {}
        pieces.append(Piece(STATE, names[local], tensor, **place))
        for key, value in states.get(local, {}).items():
            if isinstance(value, torch.Tensor):
                own = place if value.shape == tensor.shape else {}
                pieces.append(Piece(OPTIMIZER + key, names[local], value, **own))
    return pieces


def load_stage(engine: StageEngine, checkpoint: Checkpoint) -> None:
    """Set this device's parameters, buffers and optimiser states from ``checkpoint``, cut for its place."""
    names = engine.stage.state_names()
    shards = dict(engine.sharded.shards) if engine.sharded is not None else {}
    states: dict[str, dict[str, Any]] = {}
    for local, tensor in engine.stage.module.state_dict(keep_vars=True).items():
        if local not in names:
            continue
        shard, name = _split(shards, local), names[local]
        whole = checkpoint.whole(STATE, name)
        part = _part(whole, shard, engine.replica)
        if part.shape != tensor.shape:
            raise TrainingCheckpointError(
                f"checkpoint {checkpoint.folder}: {name} is {tuple(part.shape)} here, the stage holds {tuple(tensor.shape)}"
            )
        with torch.no_grad():
            tensor.copy_(part)
        if not isinstance(tensor, nn.Parameter):
            continue
        state: dict[str, Any] = {}
        for kind in checkpoint.kinds(name):
            if kind.startswith(OPTIMIZER):
                value = checkpoint.whole(kind, name)
                value = _part(value, shard, engine.replica) if value.shape == whole.shape else value
                state[kind.removeprefix(OPTIMIZER)] = value.to(tensor.device).clone()
        if state:
            states[local] = state
    engine.load_optimizer_states(states)


def _part(whole: torch.Tensor, shard: Shard | None, index: int) -> torch.Tensor:
    if shard is None:
        return whole
    start, stop = shard.ranges[index]
    return whole.narrow(shard.dim, start, stop - start)


class StageCheckpoints:
    """One device's checkpoints of a training: ``restore`` its starting point, ``train_epoch`` in runs with a
    checkpoint after every ``CheckpointOptions.every`` steps, ``finish`` with a last checkpoint and (plan's first
    device) the whole model exported into the checkpoint folder (``MODEL_FILE``)."""

    def __init__(self, engine: StageEngine, options: CheckpointOptions | None, meta: dict[str, Any]) -> None:
        self.engine = engine
        self.options = options or CheckpointOptions()
        self.root = Path(self.options.folder) if self.options.folder is not None else None
        self.meta = meta
        self.position = engine.place.position
        self.writers = [f"device-{p:03d}" for p in range(len(engine.place.pool_ranks))]
        self.step = self.saved = 0
        self._where: tuple[int, int, int, BatchCursor | None] = (0, 0, 0, None)

    def restore(self) -> TrainPosition:
        """Load the checkpoint to resume from, if any, and say where it stands; clear the checkpoints past it."""
        position = TrainPosition()
        if self.options.resume is not None:
            checkpoint = Checkpoint.open(self.options.resume, verify=False)
            load_stage(self.engine, checkpoint)
            step, epoch, epoch_step = checkpoint.position()
            augment = checkpoint.whole(DATA, AUGMENT_GENERATOR) if epoch_step > 0 else None
            position = TrainPosition(step, epoch, epoch_step, augment)
        self.step = self.saved = position.step
        if self.root is not None:
            if self.position == 0:
                clear_after(self.root, position.step)
            self.engine.transport.barrier()
        return position

    def train_epoch(self, epoch: int, start: int, steps: int, cursor: BatchCursor) -> list[RankRecord]:
        """Train steps ``start`` to ``steps`` of ``epoch`` (its batches from ``cursor``), checkpointing on the way."""
        records = []
        done = start
        while done < steps:
            run = steps - done
            if self.root is not None and self.options.every > 0:
                run = min(run, self.options.every - self.step % self.options.every)
            if self.options.until is not None:
                run = min(run, self.options.until - self.step)
            if run <= 0:
                break
            records.append(self.engine.train(run, IteratorBatches(cursor, self.meta["batch_size"]), self.step))
            done += run
            self.step += run
            self._where = (epoch, done, steps, cursor)
            if self.root is not None and self.options.every > 0 and self.step % self.options.every == 0:
                self.save()
        return records

    @property
    def stopped(self) -> bool:
        """Whether the training stopped at ``CheckpointOptions.until``, before its end."""
        return self.options.until is not None and self.step >= self.options.until

    def finish(self, complete: bool = True) -> None:
        """The last checkpoint (unless just written), then, when the training is ``complete``, the whole model
        exported beside the checkpoints."""
        if self.root is None:
            return
        if self.saved != self.step:
            self.save()
        if self.position == 0 and complete:
            export_model(Checkpoint.open(self.root, verify=False), self.root / MODEL_FILE)

    def save(self) -> None:
        """Write this device's pieces of a checkpoint at the current step; the plan's first device commits it once
        every device's are written."""
        assert self.root is not None
        epoch, done, steps, cursor = self._where
        if done >= steps:
            epoch, done = epoch + 1, 0
        pieces = stage_pieces(self.engine)
        if self.engine.stage.is_last and self.engine.replica == 0 and done > 0 and cursor is not None:
            if cursor.position != done:
                raise RuntimeError(f"the data order stands at batch {cursor.position}, the training at step {done}")
            pieces.append(Piece(DATA, AUGMENT_GENERATOR, cursor.augment_state()))
        folder = step_folder(self.root, self.step)
        write_pieces(folder, self.writers[self.position], pieces)
        self.engine.transport.barrier()
        if self.position == 0:
            commit(folder, self.writers, {**self.meta, "step": self.step, "epoch": epoch, "epoch_step": done})
        self.saved = self.step
