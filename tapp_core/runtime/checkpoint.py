"""The checkpoint format: a training's state written by the ranks of one plan, read back under any plan.

A checkpoint is a folder ``step-NNNNNNNN`` under the checkpoint folder. Every device of the plan writes two files
into it: ``<writer>.safetensors``, its tensors, and ``<writer>.json``, where each of them belongs. A tensor is a
``Piece`` of something named as the model names it (the original ``nn.Module``'s state-dict keys, never a stage's):
a parameter or buffer (kind ``state``), a parameter's optimiser state (kind ``optimizer.<key>``, such as
``optimizer.momentum_buffer``), or the data order's random state (kind ``data``). A piece is the whole tensor, or
the slice ``[start, stop)`` along ``dim`` that a device of a split stage holds; replicas write once. So nothing in
a checkpoint depends on the plan: a reader assembles each tensor whole (``Checkpoint.whole``) and cuts it as its own
plan needs.

The checkpoint is complete when ``manifest.json`` exists: written last (``commit``), after every writer's files,
each fsynced and renamed into place, are present with the sizes and hashes their writers recorded, and itself
written to a temporary name, fsynced and renamed. A crash before the rename leaves a folder without a manifest,
which readers skip (``Checkpoint.open`` of the checkpoint folder takes the newest complete one); older complete
checkpoints are removed only after a newer one is complete. Reading is safe: safetensors holds tensors only, JSON
holds the rest; nothing read runs code.

Nothing here knows MPI or a plan: ``runtime.checkpointing`` maps a rank's stage to pieces and back.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from tapp_core.errors import TappError
from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.paths import check_output_folder

if TYPE_CHECKING:
    from tapp_core.model.workload import Workload

FORMAT = "tapp-checkpoint/1"
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
"""The whole trained model, written into the checkpoint folder at the end of a training."""
STATE = "state"
DATA = "data"
OPTIMIZER = "optimizer."
AUGMENT_GENERATOR = "augment_generator"
KEEP = 2
"""Complete checkpoints kept: the newest and the one before it."""
_PIECE_KEYS = {"kind", "name", "key", "shape", "dim", "start", "stop", "file"}
_META_KEYS = {"model", "step", "epoch", "epoch_step"}
_STEP = re.compile(r"step-(\d{8})")


class TrainingCheckpointError(TappError):
    """A folder that is not a usable checkpoint; the message names it and what is wrong."""


@dataclass(frozen=True)
class Piece:
    """One tensor a device writes: ``name`` of ``kind``, whole (``dim`` None), or its slice ``[start, stop)`` along
    ``dim`` of a tensor whose size along ``dim`` is ``size``."""

    kind: str
    name: str
    tensor: torch.Tensor
    dim: int | None = None
    start: int = 0
    stop: int = 0
    size: int = 0

    def shape(self) -> list[int]:
        """The whole tensor's shape."""
        shape = list(self.tensor.shape)
        if self.dim is not None:
            shape[self.dim] = self.size
        return shape


def step_folder(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def write_pieces(folder: Path, writer: str, pieces: Sequence[Piece]) -> None:
    """Write ``writer``'s pieces into the checkpoint ``folder``: its tensors, then its index, each durable before
    it takes its name."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {str(i): p.tensor.detach().to("cpu").clone().contiguous() for i, p in enumerate(pieces)}
    index: dict[str, Any] = {"writer": writer, "file": None, "pieces": []}
    if tensors:
        data = save_tensors(tensors)
        index["file"] = f"{writer}.safetensors"
        index["bytes"], index["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        _write_durably(folder / index["file"], data)
    index["pieces"] = [
        {
            "kind": p.kind,
            "name": p.name,
            "key": str(i),
            "shape": p.shape(),
            "dim": p.dim,
            "start": p.start,
            "stop": p.stop,
        }
        for i, p in enumerate(pieces)
    ]
    _write_durably(folder / f"{writer}.json", json.dumps(index).encode())


def commit(folder: Path, writers: Sequence[str], meta: Mapping[str, Any]) -> Path:
    """Make the checkpoint in ``folder`` complete: check that every writer's files are there as recorded, write the
    manifest (``meta`` and every piece's place) last, then remove the older checkpoints beyond ``KEEP``."""
    files: dict[str, dict[str, Any]] = {}
    pieces: list[dict[str, Any]] = []
    for writer in writers:
        index = _read_json(folder / f"{writer}.json", f"checkpoint {folder}: the index of {writer}")
        if index.get("file") is not None:
            files[index["file"]] = {"bytes": index["bytes"], "sha256": index["sha256"]}
            pieces += [{**p, "file": index["file"]} for p in index["pieces"]]
    manifest = {"format": FORMAT, **meta, "files": files, "pieces": pieces}
    _check_files(folder, manifest, verify=False)
    _write_durably(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    _prune(folder.parent)
    return folder / MANIFEST


class Checkpoint:
    """A complete checkpoint, its manifest read and its files checked (present, of their sizes; hashed when
    ``verify``). ``open`` takes a checkpoint (a ``step-*`` folder) or the folder of checkpoints (its newest complete
    one)."""

    def __init__(self, folder: Path, manifest: Mapping[str, Any]) -> None:
        self.folder = folder
        self.manifest = manifest
        self._pieces: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for piece in manifest["pieces"]:
            self._pieces.setdefault((piece["kind"], piece["name"]), []).append(piece)

    @classmethod
    def open(cls, path: str | os.PathLike[str], verify: bool = True) -> Checkpoint:
        folder = Path(path)
        if not folder.is_dir():
            raise TrainingCheckpointError(f"checkpoint {folder} is not a folder")
        if not (folder / MANIFEST).exists():
            folder = newest_complete(folder)
        manifest = _read_json(folder / MANIFEST, f"checkpoint {folder}: its manifest")
        pieces = manifest.get("pieces")
        if (
            manifest.get("format") != FORMAT
            or not isinstance(pieces, list)
            or any(not isinstance(p, dict) or not p.keys() >= _PIECE_KEYS for p in pieces)
            or not manifest.keys() >= _META_KEYS
        ):
            raise TrainingCheckpointError(
                f"checkpoint {folder}: {MANIFEST} is not a TAPP checkpoint's ({FORMAT}) manifest"
            )
        _check_files(folder, manifest, verify)
        return cls(folder, manifest)

    @property
    def model(self) -> str:
        return str(self.manifest["model"])

    def position(self) -> tuple[int, int, int]:
        """(steps done, epoch, steps done in that epoch)."""
        return int(self.manifest["step"]), int(self.manifest["epoch"]), int(self.manifest["epoch_step"])

    def shapes(self, kind: str = STATE) -> dict[str, tuple[int, ...]]:
        """Every name of ``kind`` and its whole shape."""
        return {name: tuple(p[0]["shape"]) for (k, name), p in self._pieces.items() if k == kind}

    def kinds(self, name: str) -> list[str]:
        """The kinds stored for ``name`` (``state`` and its optimiser states)."""
        return sorted(k for k, n in self._pieces if n == name)

    def whole(self, kind: str, name: str) -> torch.Tensor:
        """``name`` of ``kind`` whole, assembled from its pieces."""
        pieces = self._pieces.get((kind, name))
        if not pieces:
            raise TrainingCheckpointError(f"checkpoint {self.folder} has no {kind} {name!r}")
        whole = next((p for p in pieces if p["dim"] is None), None)
        if whole is not None:
            return self._read(whole)
        parts = sorted(pieces, key=lambda p: int(p["start"]))
        dim, shape = int(parts[0]["dim"]), list(parts[0]["shape"])
        bounds = [(int(p["start"]), int(p["stop"])) for p in parts]
        if bounds[0][0] != 0 or bounds[-1][1] != shape[dim] or any(a[1] != b[0] for a, b in itertools.pairwise(bounds)):
            raise TrainingCheckpointError(
                f"checkpoint {self.folder}: the pieces of {kind} {name!r} do not tile it: {bounds}"
            )
        return torch.cat([self._read(p) for p in parts], dim=dim)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers under its own names."""
        return {name: self.whole(STATE, name) for name in self.shapes(STATE)}

    def check_model(self, model: str, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise unless the checkpoint holds exactly ``shapes`` (the model's state names and shapes)."""
        held = self.shapes(STATE)
        if held != dict(shapes):
            differ = sorted(set(held) ^ set(shapes)) or sorted(n for n in held if held[n] != shapes[n])
            which = f"model {self.model!r}, not {model!r}" if self.model != model else f"another {model!r}"
            raise TrainingCheckpointError(
                f"checkpoint {self.folder} is of {which} (they differ in {differ[0]!r}, {len(differ)} names in all)"
            )

    def _read(self, piece: Mapping[str, Any]) -> torch.Tensor:
        with safe_open(str(self.folder / piece["file"]), framework="pt") as tensors:
            tensor: torch.Tensor = tensors.get_tensor(piece["key"])
        return tensor


def newest_complete(root: Path) -> Path:
    """The newest checkpoint under ``root`` that has a manifest (folders without one were never completed)."""
    complete = [folder for _, folder in _checkpoints(root) if (folder / MANIFEST).exists()]
    if not complete:
        raise TrainingCheckpointError(f"{root} holds no complete TAPP checkpoint (no step-*/{MANIFEST})")
    return complete[-1]


def export_model(checkpoint: Checkpoint, out: str | os.PathLike[str]) -> Path:
    """Write the checkpoint's whole model (``Checkpoint.state_dict``) to ``out`` as one safetensors file."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in checkpoint.state_dict().items()}
    _write_durably(
        path, save_tensors(state, metadata={"model": checkpoint.model, "step": str(checkpoint.position()[0])})
    )
    return path


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name))]
    return sorted(found)


def _prune(root: Path) -> None:
    """Remove the checkpoints older than the ``KEEP`` newest complete ones (complete or not)."""
    complete = [step for step, folder in _checkpoints(root) if (folder / MANIFEST).exists()]
    if len(complete) <= KEEP:
        return
    oldest_kept = complete[-KEEP]
    for step, folder in _checkpoints(root):
        if step < oldest_kept:
            (folder / MANIFEST).unlink(missing_ok=True)  # first: a folder half removed is never taken as complete
            shutil.rmtree(folder, ignore_errors=True)


def _check_files(folder: Path, manifest: Mapping[str, Any], verify: bool) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise TrainingCheckpointError(f"checkpoint {folder}: {MANIFEST} lists no files")
    for name, recorded in files.items():
        path = folder / name
        if not path.is_file():
            raise TrainingCheckpointError(f"checkpoint {folder}: {MANIFEST} names {name}, which is missing")
        if path.stat().st_size != recorded["bytes"] or (
            verify and hashlib.sha256(path.read_bytes()).hexdigest() != recorded["sha256"]
        ):
            raise TrainingCheckpointError(
                f"checkpoint {folder}: {name} is not the file its manifest records (size or hash)"
            )


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise TrainingCheckpointError(f"{what} ({path.name}) is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainingCheckpointError(f"{what} ({path.name}) is not readable JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise TrainingCheckpointError(f"{what} ({path.name}) is not a JSON object")
    return loaded


def _write_durably(path: Path, data: bytes) -> None:
    """``data`` into ``path`` all or nothing: a temporary file, fsynced, renamed, and the rename made durable."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot open a folder for fsync; the rename still holds
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def prepare_checkpoints(
    options: CheckpointOptions, model: str | Workload, batch_size: int
) -> tuple[CheckpointOptions, int | None]:
    """``options`` with ``resume`` made the complete checkpoint it names, checked against ``model``'s workload (its
    model's state names and shapes) and ``batch_size`` (the data order counts batches), and the checkpoint's seed
    (its data order's); unchanged, and None, when not resuming. Raises ``TrainingCheckpointError``; writes nothing."""
    from tapp_core.model.workload import as_workload, build_traced_workload

    if options.every < 0:
        raise TrainingCheckpointError(f"checkpoint interval must be 0 or more steps, got {options.every}")
    if options.folder is not None:
        check_output_folder(options.folder, "checkpoint folder")
    checkpoint = Checkpoint.open(options.resume) if options.resume is not None else None
    _check_not_another_training(options.folder, checkpoint)
    if checkpoint is None:
        return options, None
    workload = as_workload(model)
    state = build_traced_workload(workload).state_dict()  # what the stages hold: a weight no layer uses is not
    checkpoint.check_model(workload.model, {name: tuple(tensor.shape) for name, tensor in state.items()})
    if int(checkpoint.manifest.get("batch_size", batch_size)) != batch_size:
        raise TrainingCheckpointError(
            f"checkpoint {checkpoint.folder} was trained on batches of {checkpoint.manifest['batch_size']}, "
            f"the plan's are {batch_size} (the data order counts batches)"
        )
    folder = options.folder if options.folder is not None else str(checkpoint.folder.parent)
    resolved = replace(options, folder=folder, resume=str(checkpoint.folder))  # ``until`` kept
    return resolved, int(checkpoint.manifest.get("seed", 0))


def _check_not_another_training(folder: str | None, resumed: Checkpoint | None) -> None:
    """A training writes its checkpoints into an empty folder, or into the folder of the checkpoint it resumes
    (where it replaces those past it): never among another training's."""
    if folder is None or not Path(folder).is_dir() or not _checkpoints(Path(folder)):
        return
    if resumed is not None and resumed.folder.parent.resolve() == Path(folder).resolve():
        return
    raise TrainingCheckpointError(
        f"checkpoint folder {folder} holds another training's checkpoints; resume from them (--resume {folder}) "
        "or give an empty folder"
    )


def clear_after(root: Path, step: int) -> None:
    """Remove the checkpoints past ``step`` (a resumed training writes its own), each manifest first."""
    if not root.is_dir():
        return
    for found, folder in _checkpoints(root):
        if found > step:
            (folder / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)
