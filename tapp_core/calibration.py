"""A cluster's measured calibration: where it lives, and the check that it was made for this machine and library.

``tapp calibrate --cluster C`` (``tapp_core.calibrate``) measures the calibration on the machine itself and writes
it beside the cluster file: ``deployments/clusters/local.yaml`` -> ``deployments/clusters/local.calibration.json``.
The experiment flow, ``tapp plan`` and ``tapp simulate`` pick it up from there (``cluster_calibration``); with no
file there they use the ideal calibration (``DEFAULT_CALIBRATION``).

A calibration records what it was made for (``costs.MadeFor``) and is refused (``CalibrationError``, saying why)
when used with another machine, another torch or profiler, a cluster with a kind it did not measure, a MPI of other
CUDA-awareness, or one that records nothing (written by hand or by an older TAPP): its figures would silently be
wrong there.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import TypeAdapter

from tapp_core.cluster import Cluster, resolve_cluster_path
from tapp_core.costs import DEFAULT_CALIBRATION, Calibration, CalibrationError
from tapp_core.hosts import cuda_aware_mpi
from tapp_core.kinds import cluster_kinds
from tapp_core.library import PROFILE_VERSION, LayerLibrary

CALIBRATION_SUFFIX = ".calibration.json"


def calibration_path(cluster: str | os.PathLike[str] | Cluster) -> Path:
    """Where the calibration of cluster ``cluster`` (a name, a YAML file, or a loaded cluster, which remembers its
    file) lives: beside its file."""
    if isinstance(cluster, Cluster):
        if cluster.source is None:
            raise CalibrationError(
                f"cluster {cluster.name!r} was not read from a file: it has no calibration beside it"
            )
        path = cluster.source
    else:
        path = resolve_cluster_path(cluster)
    return path.with_name(path.stem + CALIBRATION_SUFFIX)


def check_calibration(calibration: Calibration, cluster: Cluster, library: LayerLibrary | None, source: str) -> None:
    """Refuse ``calibration`` (read from ``source``) unless it was made on this host, for every kind of
    ``cluster``, with this MPI's CUDA-awareness, and with ``library``'s torch and profiler (without a library:
    this process's, which will profile it)."""
    made = calibration.made_for
    rerun = f"run `tapp calibrate --cluster {cluster.name}` on this machine"
    if made is None:
        raise CalibrationError(f"calibration {source} does not record what it was made for; {rerun}")
    refused = f"calibration {source} was made for another set-up and is refused"
    host = platform.node()
    if made.host != host:
        raise CalibrationError(f"{refused}: it was measured on host {made.host!r}, this is {host!r}; {rerun}")
    missing = [kind for kind in cluster_kinds(cluster) if kind not in made.kinds]
    if missing:
        raise CalibrationError(
            f"{refused}: it measured the kinds {', '.join(made.kinds)}, cluster {cluster.name!r} also has "
            f"{', '.join(missing)}; {rerun}"
        )
    if made.cuda_aware_mpi != cuda_aware_mpi():
        raise CalibrationError(
            f"{refused}: it was measured with TAPP_MPI_CUDA_AWARE={int(made.cuda_aware_mpi)}, "
            f"it is {int(cuda_aware_mpi())} now; {rerun}"
        )
    for kind, (torch_version, profiler_version) in _software(library).items():
        if torch_version != made.torch_version:
            raise CalibrationError(
                f"{refused}: it was made with torch {made.torch_version}, {kind} is torch {torch_version}; {rerun}"
            )
        if profiler_version is not None and profiler_version != made.profiler_version:
            raise CalibrationError(
                f"{refused}: it was made for profiler version {made.profiler_version}, {kind} has version "
                f"{profiler_version}; {rerun}"
            )


def _software(library: LayerLibrary | None) -> dict[str, tuple[str, object]]:
    """(torch version, profiler version) of every kind's library, or of this process when there is none."""
    if library is None:
        import torch

        return {"this process": (torch.__version__, PROFILE_VERSION)}
    return {
        f"the {kind} layer library": (lib.torch_version, lib.extra.get("profile_version"))
        for kind, lib in library.kind_libraries.items()
        if lib.torch_version
    }


def cluster_calibration(
    cluster_name: str | os.PathLike[str] | Cluster,
    cluster: Cluster,
    library: LayerLibrary | None = None,
    path: Path | None = None,
) -> Calibration:
    """The calibration at ``path`` or, without one, beside the cluster file of ``cluster_name`` (a loaded cluster
    names its own file), checked against this machine, ``cluster`` and ``library`` (``check_calibration``); the ideal
    one when there is none beside it (or the cluster was made in code, with no file)."""
    if path is None and isinstance(cluster_name, Cluster) and cluster_name.source is None:
        return DEFAULT_CALIBRATION
    chosen = path if path is not None else calibration_path(cluster_name)
    if path is None and not chosen.is_file():
        return DEFAULT_CALIBRATION
    calibration = Calibration.load(chosen)
    check_calibration(calibration, cluster, library, str(chosen))
    return calibration


# ---------------------------------------------------------------------------------------------------------------
# What ``tapp_core.runtime.probe`` measures on the ranks (it writes them; ``tapp_core.calibrate`` reads them)


@dataclass(frozen=True)
class Line:
    """``fixed_s + per_byte_s * bytes``, fitted through two medians."""

    fixed_s: float
    per_byte_s: float
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def through(cls, sizes: tuple[int, int], seconds: tuple[float, float]) -> Line:
        per_byte = max(0.0, (seconds[1] - seconds[0]) / (sizes[1] - sizes[0]))
        return cls(max(0.0, seconds[0] - per_byte * sizes[0]), per_byte, sizes, seconds)


@dataclass
class KindProbe:
    kind: str
    device: str
    update: Line
    d2h: Line | None = None
    h2d: Line | None = None


@dataclass
class PairProbe:
    between: tuple[str, str]
    one_way_s: float


@dataclass
class SharingProbe:
    """One rank's training step of the model: alone on the host, and while every rank computes its own."""

    device: str
    kind: str
    alone_s: float
    together_s: float


@dataclass
class ProbeResult:
    kinds: list[KindProbe] = field(default_factory=list)
    pairs: list[PairProbe] = field(default_factory=list)
    sharing: list[SharingProbe] = field(default_factory=list)
    cuda_aware_mpi: bool = False
    emulated: bool = False

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, text: str) -> ProbeResult:
        return TypeAdapter(cls).validate_json(text)


__all__ = [
    "CALIBRATION_SUFFIX",
    "KindProbe",
    "Line",
    "PairProbe",
    "ProbeResult",
    "SharingProbe",
    "calibration_path",
    "check_calibration",
    "cluster_calibration",
]
