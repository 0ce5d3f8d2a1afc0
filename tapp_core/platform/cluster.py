"""Clusters: the unequal devices a plan runs on and the links between them, read from YAML.

A device's *kind* (``tapp_core.platform.kinds``: ``kind`` with its ``threads``, a GPU's ``gpu_model``) decides which layer
library its layers are costed from. Its ``speed`` multiplies that library's times (a layer that took ``t``
seconds there takes ``t / speed`` on the device) where it applies: on emulated clusters, and for a device costed
from another kind's library or one profiled on another machine (``tapp_core.platform.kinds`` says exactly when).
``slowdown`` is the same thing written the other way (``slowdown = 1 / speed``); a file gives one or the other. On one host, devices are emulated: each is an MPI
rank pinned to ``threads`` threads that sleeps ``(slowdown - 1)`` times the compute it just did.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from tapp_core.errors import TappError
from tapp_core.paths import PROJECT_ROOT
from tapp_core.units import UnitError, parse_bandwidth, parse_bytes, parse_seconds


class ClusterError(TappError):
    """A cluster file that cannot be used; the message names the file, the field and the problem."""


def _parsed_by(parse: Callable[[object], Any]) -> BeforeValidator:
    def check(value: object) -> Any:
        try:
            return parse(value)
        except UnitError as exc:
            raise ValueError(str(exc)) from None

    return BeforeValidator(check)


Bytes = Annotated[int, _parsed_by(parse_bytes), Field(gt=0, description="bytes")]
Bandwidth = Annotated[float, _parsed_by(parse_bandwidth), Field(gt=0, description="bytes per second")]
Seconds = Annotated[float, _parsed_by(parse_seconds), Field(ge=0, description="seconds")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Device(_Strict):
    name: str = Field(min_length=1)
    kind: Literal["cpu", "cuda"] = "cpu"
    threads: int = Field(default=1, ge=1)
    speed: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    memory: Bytes
    host: str | None = None
    gpu_index: int | None = Field(default=None, ge=0)
    gpu_model: str | None = Field(default=None, min_length=1)
    """A cuda device's GPU model (``torch.cuda.get_device_name``, e.g. "NVIDIA H100 80GB HBM3"): with the kind,
    what makes a layer's time differ from one device to another."""

    @property
    def slowdown(self) -> float:
        return 1.0 / self.speed

    @model_validator(mode="after")
    def _gpu_model_on_gpus_only(self) -> Device:
        if self.gpu_model is not None and self.kind != "cuda":
            raise ValueError(f"gpu_model is for cuda devices; {self.name!r} is a {self.kind} device")
        return self

    @model_validator(mode="before")
    @classmethod
    def _speed_or_slowdown(cls, data: object) -> object:
        if isinstance(data, dict) and "slowdown" in data:
            if "speed" in data:
                raise ValueError("give 'speed' or 'slowdown', not both")
            data = dict(data)
            slowdown = data.pop("slowdown")
            valid = isinstance(slowdown, int | float) and not isinstance(slowdown, bool)
            if not valid or not math.isfinite(slowdown) or slowdown <= 0:
                raise ValueError(f"slowdown must be a positive finite number, got {slowdown!r}")
            data["speed"] = 1.0 / float(slowdown)
        return data


class Link(_Strict):
    """A link between two devices; what a transfer over it takes is ``tapp_core.cost.formulas.transfer_s``."""

    bandwidth: Bandwidth
    latency: Seconds


class LinkOverride(Link):
    between: tuple[str, ...] = Field(min_length=2, description="every pair among these devices")


class Links(_Strict):
    bandwidth: Bandwidth
    latency: Seconds
    overrides: tuple[LinkOverride, ...] = ()


class Cluster(_Strict):
    name: str
    emulated: bool = Field(default=True, description="heterogeneity emulated on one host")
    devices: tuple[Device, ...] = Field(min_length=1)
    links: Links
    ssh: str | None = Field(
        default=None,
        min_length=1,
        description="the command MPICH's Hydra starts ranks on other hosts with (default: ssh); a script that adds "
        "options, such as a testbed's key (tapp_core.platform.testbed)",
    )
    _source: Path | None = PrivateAttr(default=None)

    @property
    def source(self) -> Path | None:
        """The YAML file this cluster was read from (``load_cluster``), or the file of the cluster it was derived
        from (``scaled``); None for a cluster made in code. What lives beside that file (its calibration) belongs to
        it; the file is not read again."""
        return self._source

    def __eq__(self, other: object) -> bool:
        """Equal fields make equal clusters, wherever they were read from."""
        return isinstance(other, Cluster) and self.model_dump() == other.model_dump()

    def __hash__(self) -> int:
        return hash(self.model_dump_json())

    def from_file(self, path: str | os.PathLike[str] | None) -> Cluster:
        """This cluster, remembering ``path`` as its source file."""
        copy = self.model_copy()
        copy._source = Path(path) if path is not None else None
        return copy

    @model_validator(mode="after")
    def _consistent(self) -> Cluster:
        names = [d.name for d in self.devices]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"device names must be unique; repeated: {', '.join(dupes)}")
        known = set(names)
        for i, override in enumerate(self.links.overrides):
            unknown = [n for n in override.between if n not in known]
            if unknown:
                raise ValueError(f"links.overrides.{i}.between names unknown device(s): {', '.join(unknown)}")
        return self

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(f"cluster {self.name!r} has no device {name!r}")

    def link(self, a: str, b: str) -> Link:
        """The link between two devices; the last override naming both wins."""
        chosen = Link(bandwidth=self.links.bandwidth, latency=self.links.latency)
        for override in self.links.overrides:
            if a in override.between and b in override.between:
                chosen = Link(bandwidth=override.bandwidth, latency=override.latency)
        return chosen

    def pairs(self) -> list[tuple[str, str]]:
        return list(itertools.combinations(self.device_names, 2))

    def fastest_device(self) -> Device:
        return max(self.devices, key=lambda d: (d.kind == "cuda", d.speed, d.threads))

    def slow_devices(self) -> tuple[str, ...]:
        """The slow half: every device slower than the median device speed (none when all run at one speed)."""
        speeds = sorted(d.speed for d in self.devices)
        middle = len(speeds) // 2
        median = speeds[middle] if len(speeds) % 2 else (speeds[middle - 1] + speeds[middle]) / 2
        return tuple(d.name for d in self.devices if d.speed < median)

    def scaled(self, power: float) -> Cluster:
        """The cluster with its slow devices' (``slow_devices``) speed multiplied by ``power``: one member of the
        family of clusters of section 5.2.2 (different computing power). Named ``NAME@POWERx`` unless ``power`` is
        1, when it is this cluster; it keeps this cluster's source file. Only an emulated cluster can be scaled: a
        real device's speed is what its hardware does."""
        if not (math.isfinite(power) and power > 0):
            raise ClusterError(f"a computing power must be a positive number, got {power}")
        if power == 1:
            return self
        if not self.emulated:
            raise ClusterError(
                f"cluster {self.name!r} is not emulated: its devices' speed is their hardware's, so it cannot be "
                f"scaled to power {power:g}"
            )
        slow = set(self.slow_devices())
        if not slow:
            raise ClusterError(f"cluster {self.name!r} has no slow device to scale: its devices all run at one speed")
        devices = tuple(d.model_copy(update={"speed": d.speed * power}) if d.name in slow else d for d in self.devices)
        data = {
            **self.model_dump(),
            "name": scaled_name(self.name, power),
            "devices": [d.model_dump() for d in devices],
        }
        return Cluster.model_validate(data).from_file(self.source)


def scaled_name(name: str, power: float) -> str:
    """The name of cluster ``name`` with its slow devices scaled by ``power`` (``Cluster.scaled``)."""
    return name if power == 1 else f"{name}@{power:g}x"


def _format_validation_error(source: str, exc: ValidationError) -> str:
    """One line: the file, then every problem as ``field: message``.

    Pydantic also reports a tuple whose items all failed as too short; that follows from the items' own errors
    and is not said again."""
    errors = exc.errors()
    locations = [tuple(err["loc"]) for err in errors]
    problems = []
    for err, loc in zip(errors, locations, strict=True):
        if err["type"] == "too_short" and any(
            len(other) > len(loc) and other[: len(loc)] == loc for other in locations
        ):
            continue
        where = ".".join(str(p) for p in loc) or "(top level)"
        problems.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return f"invalid cluster file {source}: " + "; ".join(problems)


def parse_cluster(data: object, source: str = "<cluster>") -> Cluster:
    """Validate an already-loaded mapping; errors name ``source``, the field and the problem."""
    if not isinstance(data, dict):
        raise ClusterError(
            f"invalid cluster file {source}: expected a mapping at the top level, got {type(data).__name__}"
        )
    try:
        return Cluster.model_validate(data)
    except ValidationError as exc:
        raise ClusterError(_format_validation_error(source, exc)) from None


def cluster_search_dirs() -> list[Path]:
    """Where cluster names are looked up: $TAPP_CLUSTER_DIR, then the project's deployments/clusters."""
    dirs = []
    if env := os.environ.get("TAPP_CLUSTER_DIR"):
        dirs.append(Path(env))
    dirs.append(PROJECT_ROOT / "deployments" / "clusters")
    return dirs


def resolve_cluster_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A path to a YAML file, or the bare name of one in the cluster search dirs (``local``, ``hetero4``)."""
    path = Path(name_or_path)
    if path.is_dir():
        raise ClusterError(f"cluster file {path} is a folder, not a YAML file")
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise ClusterError(f"cluster file {path} does not exist")
        return path
    for directory in cluster_search_dirs():
        candidate = directory / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted({p.stem for d in cluster_search_dirs() if d.is_dir() for p in d.glob("*.yaml")})
    raise ClusterError(
        f"unknown cluster {str(name_or_path)!r}: not a file, and not one of {', '.join(known) or 'none'}"
    )


def load_cluster(name_or_path: str | os.PathLike[str]) -> Cluster:
    """Read and validate a cluster file, by path or by name."""
    path = resolve_cluster_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ClusterError(f"invalid cluster file {path}: not a text file (UTF-8 YAML expected)") from None
    except OSError as exc:
        raise ClusterError(f"cluster file {path} cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())  # PyYAML's message spans lines: one line here
        raise ClusterError(f"invalid cluster file {path}: not valid YAML: {reason}") from None
    if isinstance(data, dict) and "name" not in data:
        data = {"name": path.stem, **data}
    return parse_cluster(data, str(path)).from_file(path)
