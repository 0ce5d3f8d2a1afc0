"""The one cache of layer libraries, shared by the command line and the experiment flow.

A library depends on what was profiled (the model, its batch size, the timing repeats, warm-up and seed), on the
*device kind* it was timed on (a CPU and its intra-op threads; a GPU and its model), and on the software that timed
it (the host, the torch version, the profiler's version and the digests of the sources it was built from: the
profiler, the FLOP rules, the layer definition, the built-in models, and the file of a ``file.py:callable``
model). ``ProfileKey`` holds all of it; any change gives another key, so a library is never reused after, say, a
torch upgrade or an edit to a model.

Entries live in ``<root>/libraries/<model>_b<batch>_<kind>_<digest>/``: the library's own files plus ``key.json``,
the full key it was made for. An entry that cannot be read back (a half-written or hand-edited file) is removed
and profiled again. Entries are written to a temporary folder and renamed into place, so a reader never sees half
of one and two processes that profile the same key at once both end with a whole entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tapp_core.library import LayerLibrary, LibraryError
from tapp_core.profiler import PROFILE_VERSION, profile_model

CACHE_DIR_ENV = "TAPP_CACHE_DIR"
DEFAULT_CACHE_DIR = Path(".tapp")
KEY_FILE = "key.json"

_CORE = Path(__file__).resolve().parent
_SOURCES = (
    _CORE / "profiler.py",
    _CORE / "flops.py",
    _CORE / "graph.py",
    _CORE / "library.py",
    *sorted((_CORE / "models").glob("*.py")),
)
"""The code a library is made by: editing any of it invalidates every cached library."""


def default_cache_dir() -> Path:
    """``$TAPP_CACHE_DIR``, else ``.tapp`` in the working directory."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


@dataclass(frozen=True)
class DeviceKind:
    """What makes a layer's time differ from one device to another: a CPU's intra-op threads, a GPU's model."""

    device: str
    """``cpu`` or ``cuda`` (as ``profile_model``'s ``device``; ``cuda:1`` names one GPU)."""
    threads: int
    """torch's intra-op threads during the profile (they also drive a GPU's host side)."""
    gpu: str = ""
    """The GPU's model name; empty on a CPU."""

    @classmethod
    def of(cls, device: str = "cpu", threads: int | None = None) -> DeviceKind:
        """The kind ``profile_model(device=device, threads=threads)`` would time on here."""
        resolved_threads = threads if threads is not None else torch.get_num_threads()
        return cls(device, resolved_threads, _gpu_name(device))

    @property
    def label(self) -> str:
        """A short readable name for folder names: ``cpu-t1``, ``cuda-NVIDIA_H100_80GB_HBM3-t8``."""
        gpu = f"-{self.gpu}" if self.gpu else ""
        return f"{self.device}{gpu}-t{self.threads}"


def _gpu_name(device: str) -> str:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return ""  # on a machine without CUDA the profiler refuses the device with its own message
    return torch.cuda.get_device_name(torch.device(device))


@dataclass(frozen=True)
class ProfileKey:
    """Everything a layer library depends on: equal keys, interchangeable libraries."""

    model: str
    batch_size: int
    kind: DeviceKind
    repeats: int
    warmup: int
    seed: int
    host: str
    torch_version: str
    profiler_version: int
    sources: str
    """Digest of the profiler's and the models' source files and, for a ``file.py:callable`` model, that file."""

    @classmethod
    def of(
        cls,
        model: str,
        batch_size: int,
        device: str = "cpu",
        threads: int | None = None,
        repeats: int = 5,
        warmup: int = 2,
        seed: int = 0,
    ) -> ProfileKey:
        """The key of ``profile_model(model, batch_size, device, threads, repeats, warmup, seed)`` on this host."""
        return cls(
            model=model,
            batch_size=batch_size,
            kind=DeviceKind.of(device, threads),
            repeats=repeats,
            warmup=warmup,
            seed=seed,
            host=platform.node(),
            torch_version=torch.__version__,
            profiler_version=PROFILE_VERSION,
            sources=_sources_digest(model),
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def folder_name(self) -> str:
        readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.model}_b{self.batch_size}_{self.kind.label}")
        return f"{readable[-80:]}_{self.digest}"


def _sources_digest(model: str) -> str:
    source, _, _ = model.rpartition(":")
    model_file = Path(source) if source.endswith(".py") else None
    files = [*_SOURCES, *([model_file] if model_file is not None and model_file.is_file() else [])]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


class ProfileCache:
    """Layer libraries on disk under ``root`` (default: ``default_cache_dir()``), one folder per ``ProfileKey``."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def path(self, key: ProfileKey) -> Path:
        return self.root / "libraries" / key.folder_name

    def get(self, key: ProfileKey) -> LayerLibrary | None:
        """The cached library of ``key``, or None; an entry that cannot be read back is removed."""
        folder = self.path(key)
        if not folder.exists():
            return None
        try:
            stored_key = json.loads((folder / KEY_FILE).read_text())
            if stored_key != json.loads(json.dumps(key.to_dict())):
                raise LibraryError(f"{folder / KEY_FILE} holds another key")
            return LayerLibrary.load(folder)
        except (OSError, ValueError):  # LibraryError and JSON errors are ValueErrors
            shutil.rmtree(folder, ignore_errors=True)
            return None

    def put(self, key: ProfileKey, library: LayerLibrary) -> Path:
        """Store ``library`` as the entry of ``key`` (an entry another process stored meanwhile is kept)."""
        folder = self.path(key)
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key.digest}-", dir=folder.parent))
        try:
            library.save(staging)
            (staging / KEY_FILE).write_text(json.dumps(key.to_dict(), indent=2, sort_keys=True) + "\n")
            try:
                staging.rename(folder)
            except OSError:
                if self.get(key) is None:  # not a whole entry from another process: replace it
                    shutil.rmtree(folder, ignore_errors=True)
                    staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return folder

    def profile(self, key: ProfileKey) -> LayerLibrary:
        """Profile as ``key`` says, and store the library."""
        library = profile_model(
            key.model,
            key.batch_size,
            device=key.kind.device,
            threads=key.kind.threads,
            repeats=key.repeats,
            warmup=key.warmup,
            seed=key.seed,
        )
        self.put(key, library)
        return library

    def library(self, key: ProfileKey) -> LayerLibrary:
        """The cached library of ``key``, profiled and stored first if there is none."""
        cached = self.get(key)
        return cached if cached is not None else self.profile(key)


__all__ = ["CACHE_DIR_ENV", "DeviceKind", "ProfileCache", "ProfileKey", "default_cache_dir"]
