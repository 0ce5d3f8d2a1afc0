"""The one cache of layer libraries, shared by the command line and the experiment flow.

A library depends on what was profiled (the model, its batch size, the timing repeats, warm-up and seed), on the
*device kind* it was timed on (a CPU and its intra-op threads; a GPU and its model), and on the software that timed
it (the host, the torch version, the profiler's version and the digests of the sources it was built from: the
profiler, the FLOP rules, the layer definition, the built-in models, and the file of a ``file.py:callable``
model). ``ProfileKey`` holds all of it; any change gives another key, so a library is never reused after, say, a
torch upgrade or an edit to a model.

A cluster of several kinds needs a library per kind: ``ProfileCache.cluster_libraries`` gets (or profiles) one
for every kind of the cluster that this host has (``local_kinds``) and returns them as one library
(``LayerLibrary.with_kinds``).

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
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tapp_core.errors import TappError
from tapp_core.paths import PROJECT_ROOT
from tapp_core.platform.cluster import Cluster
from tapp_core.platform.hosts import is_local_host
from tapp_core.platform.kinds import DeviceKind, device_kind
from tapp_core.profile.library import PROFILE_VERSION, LayerLibrary, LibraryError
from tapp_core.profile.profiler import ProfileRequest, profile_model

CACHE_DIR_ENV = "TAPP_CACHE_DIR"
DEFAULT_CACHE_DIR = Path(".tapp")
KEY_FILE = "key.json"

_CORE = PROJECT_ROOT / "tapp_core"
_SOURCES = (
    _CORE / "profile" / "profiler.py",
    _CORE / "model" / "flops.py",
    _CORE / "model" / "graph.py",
    _CORE / "model" / "crossing.py",
    _CORE / "profile" / "library.py",
    *sorted((_CORE / "model" / "zoo").glob("*.py")),
)
"""The code a library is made by: editing any of it invalidates every cached library."""


def default_cache_dir() -> Path:
    """``$TAPP_CACHE_DIR``, else ``.tapp`` in the working directory."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def local_kinds(cluster: Cluster) -> dict[str, tuple[str, int]]:
    """The kinds of ``cluster``'s devices that this host has, by kind name: what to profile them with, as
    (a ``ProfileRequest``'s device, threads). Every thread count of a CPU device on this host (a device with no host
    is on this one); a GPU device on this host whose model is this host's GPU at its ``gpu_index`` (any GPU there
    when the file names no model). Devices of other hosts are profiled there."""
    found: dict[str, tuple[str, int]] = {}
    for device in cluster.devices:
        kind = device_kind(device)
        if kind.name in found or not is_local_host(device.host):
            continue
        if not kind.is_cuda:
            found[kind.name] = ("cpu", device.threads)
        elif torch.cuda.is_available():
            index = device.gpu_index or 0
            if index < torch.cuda.device_count() and kind.gpu in ("", torch.cuda.get_device_name(index)):
                found[kind.name] = (f"cuda:{index}", device.threads)
    return found


@dataclass(frozen=True)
class ProfileKey:
    """Everything a layer library depends on: equal keys, interchangeable libraries."""

    request: ProfileRequest
    """The profile's request, its model a spec and its threads resolved."""
    kind: DeviceKind
    """The device kind the request times on here (a GPU's model included)."""
    host: str
    torch_version: str
    profiler_version: int
    sources: str
    """Digest of the profiler's and the models' source files and, for a ``file.py:callable`` model, that file."""

    @classmethod
    def of(cls, request: ProfileRequest) -> ProfileKey:
        """The key of ``profile_model(request)`` on this host; the request's model must be a spec (a string)."""
        if not isinstance(request.model, str):
            raise TypeError("a cached profile's model is a spec (a registry name or module:callable)")
        kind = DeviceKind.of(request.device, request.threads)
        return cls(
            request=replace(request, device=kind.device, threads=kind.threads),
            kind=kind,
            host=platform.node(),
            torch_version=torch.__version__,
            profiler_version=PROFILE_VERSION,
            sources=_sources_digest(request.model),
        )

    @property
    def model(self) -> str:
        assert isinstance(self.request.model, str)
        return self.request.model

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def folder_name(self) -> str:
        readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.model}_b{self.request.batch_size}_{self.kind.label}")
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
        library = profile_model(key.request)
        self.put(key, library)
        return library

    def library(self, key: ProfileKey) -> LayerLibrary:
        """The cached library of ``key``, profiled and stored first if there is none."""
        cached = self.get(key)
        return cached if cached is not None else self.profile(key)

    def cluster_libraries(
        self,
        model: str,
        batch_size: int,
        cluster: Cluster,
        repeats: int = 5,
        warmup: int = 2,
        seed: int = 0,
        kinds: Iterable[str] | None = None,
        fresh: bool = False,
    ) -> LayerLibrary:
        """One library per kind of ``cluster`` that this host has (``local_kinds``; only ``kinds`` if given), from
        the cache or profiled (``fresh``: always profiled, and stored), as one library: the fastest device's kind
        is the reference (``with_kinds``). A cluster none of whose kinds is here gets the library of this host's
        CPU with the threads of its fastest CPU device, which its devices' speeds then scale."""
        here = local_kinds(cluster)
        wanted = list(kinds) if kinds is not None else list(here)
        missing = [name for name in wanted if name not in here]
        if missing:
            raise TappError(
                f"cluster {cluster.name!r}: this host cannot profile kind(s) {', '.join(missing)} "
                f"(it has {', '.join(here) or 'none of its kinds'})"
            )
        if not wanted:
            cpus = [d for d in cluster.devices if d.kind == "cpu"]
            threads = max(cpus, key=lambda d: d.speed).threads if cpus else 1
            return self.library(ProfileKey.of(ProfileRequest(model, batch_size, "cpu", threads, repeats, warmup, seed)))
        fastest = device_kind(cluster.fastest_device()).name
        wanted.sort(key=lambda name: name != fastest)
        get = self.profile if fresh else self.library
        libraries = [
            get(ProfileKey.of(ProfileRequest(model, batch_size, *here[name], repeats, warmup, seed))) for name in wanted
        ]
        return libraries[0].with_kinds(libraries[1:])


__all__ = ["CACHE_DIR_ENV", "DeviceKind", "ProfileCache", "ProfileKey", "default_cache_dir", "local_kinds"]
