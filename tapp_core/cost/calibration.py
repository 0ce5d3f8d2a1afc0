"""The calibration, in one place: what it is (``Calibration``, ``KindCalibration``, ``MadeFor``), its file and where it
lives, the check that it was made for this machine and library, and the pure maths that fits it to what
``tapp calibrate`` measured (``fit_compute``, ``per_message_s``, ``shared_cores_factors``). Running the probes on
MPI ranks is ``tapp_core.runtime.calibrator``'s.

``tapp calibrate --cluster C`` (``tapp_core.runtime.calibrator``) measures the calibration on the machine itself and writes
it beside the cluster file: ``deployments/clusters/local.yaml`` -> ``deployments/clusters/local.calibration.json``.
The experiment flow, ``tapp plan`` and ``tapp simulate`` pick it up from there (``cluster_calibration``); with no
file there they use the ideal calibration (``DEFAULT_CALIBRATION``).

A calibration records what it was made for (``calibration.MadeFor``) and is refused (``CalibrationError``, saying why)
when used with another machine, another torch or profiler, a cluster with a kind it did not measure, a MPI of other
CUDA-awareness, or one that records nothing (written by hand or by an older TAPP): its figures would silently be
wrong there.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import TypeAdapter

from tapp_core.errors import TappError
from tapp_core.platform.cluster import Cluster, resolve_cluster_path
from tapp_core.platform.hosts import cuda_aware_mpi
from tapp_core.platform.kinds import cluster_kinds, device_kind
from tapp_core.profile.cache import default_cache_dir
from tapp_core.profile.library import PROFILE_VERSION, LayerLibrary
from tapp_core.records import json_object, write_record


class CalibrationError(TappError):
    """A calibration file or dictionary that cannot be used; the message names the field."""


def _numbers(cls: type[Any], data: Mapping[str, object], source: str, skip: Iterable[str] = ()) -> dict[str, Any]:
    """``data``'s fields of dataclass ``cls`` as floats; an unknown field or a value that is not a number is an
    error naming it."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CalibrationError(f"calibration {source} has unknown field(s): {', '.join(unknown)}")
    numbers: dict[str, Any] = {}
    for name, value in data.items():
        if name in skip:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers[name] = float(value)
        else:
            raise CalibrationError(f"calibration {source} field {name} must be a number, got {value!r}")
    return numbers


def _check_non_negative(owner: object, names: Iterable[str], where: str = "") -> None:
    for name in names:
        if not getattr(owner, name) >= 0:
            raise CalibrationError(f"calibration field {where}{name} must be >= 0, got {getattr(owner, name)!r}")


@dataclass(frozen=True)
class KindCalibration:
    """One device kind's figures (``Calibration.kinds``), measured by ``tapp calibrate`` on a device of the kind."""

    compute_scale: float = 1.0
    """Measured compute over the kind's library's: a whole-model step on one device of the kind against the sum
    of its layers."""
    per_micro_batch_s: float = 0.0
    """Fixed cost of every forward and every backward beyond the library's per-layer fixed parts (a GPU's
    launches, the runtime's own work per operation)."""
    update_s_per_param_byte: float = 0.0
    """The optimiser's step per parameter byte (a GPU updates far faster than a CPU rank)."""
    per_step_s: float = 0.0
    """Fixed cost of every update."""
    d2h_s_per_byte: float = 0.0
    """A GPU kind's copy to host memory per byte (staging a tensor for MPI); 0 on a CPU."""
    h2d_s_per_byte: float = 0.0
    """A GPU kind's copy from host memory per byte."""
    staging_per_copy_s: float = 0.0
    """A GPU kind's fixed cost of one staging copy (launch and wait)."""
    shared_cores_factor: float = 1.0
    """On a host whose ranks want more threads than it has cores (``Calibration.host_cores``): a device of the
    kind's compute while every rank of the host computes, over its compute alone (``sharing_stretch``)."""
    runtime_memory_bytes: float = 0.0
    """What a rank of the kind holds before a plan's first tensor: the interpreter, torch, MPI, its data and the
    model it traced at its initial weights (``rank.reset_peak_memory``'s baseline). A device's ``memory`` is the
    whole rank's (a testbed host's kernel limit counts it all); a plan gets the rest (``CostContext.plan_memory``)."""

    def __post_init__(self) -> None:
        positive = ("compute_scale", "shared_cores_factor")
        _check_non_negative(self, (f.name for f in fields(self) if f.name not in positive), "kinds.")
        for name in positive:
            if not getattr(self, name) > 0:
                raise CalibrationError(f"calibration field kinds.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def stages_through_host(self) -> bool:
        return bool(self.d2h_s_per_byte or self.h2d_s_per_byte or self.staging_per_copy_s)


@dataclass(frozen=True)
class MadeFor:
    """What a measured calibration was made for; ``tapp_core.cost.calibration`` refuses it anywhere else."""

    host: str
    cluster: str
    kinds: tuple[str, ...]
    """The kinds of the cluster's devices, by name."""
    torch_version: str
    profiler_version: int
    model: str
    batch_size: int
    cuda_aware_mpi: bool
    date: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str) -> MadeFor:
        try:
            kinds = data["kinds"]
            if not isinstance(kinds, list | tuple):
                raise TypeError("kinds must be a list")
            return cls(
                host=str(data["host"]),
                cluster=str(data["cluster"]),
                kinds=tuple(str(k) for k in kinds),
                torch_version=str(data["torch_version"]),
                profiler_version=int(str(data["profiler_version"])),
                model=str(data["model"]),
                batch_size=int(str(data["batch_size"])),
                cuda_aware_mpi=bool(data["cuda_aware_mpi"]),
                date=str(data.get("date", "")),
            )
        except KeyError as exc:
            raise CalibrationError(f"calibration {source}: made_for has no {exc} field") from None
        except (TypeError, ValueError) as exc:
            raise CalibrationError(f"calibration {source}: made_for is malformed: {exc}") from None


@dataclass(frozen=True)
class Calibration:
    """The constants that turn the ideal model into a fitted one. The defaults are the ideal model.

    The top-level compute, update and per-operation fields are those of every kind ``kinds`` does not list."""

    per_message_s: float = 0.0
    """Fixed cost of every message (tensor) sent, on top of the link latency."""
    per_step_s: float = 0.0
    """Fixed cost per step on every device, charged to its update."""
    per_micro_batch_s: float = 0.0
    """Fixed cost of every forward and every backward operation."""
    update_s_per_param_byte: float = 0.0
    """Optimizer step time per parameter byte of the stage, on the profiling device."""
    compute_scale: float = 1.0
    """Multiplies all layer compute times (profiled in isolation; a pipeline stage may run slower or faster)."""
    slowdown_exponent: float = 1.0
    """Compute on a device of slowdown ``x`` takes ``x ** slowdown_exponent`` times longer (emulation may differ)."""
    bandwidth_scale: float = 1.0
    """Effective fraction of the nominal link bandwidth."""
    host_cores: float = 0.0
    """The cores of each host the cluster's ranks run on, where they want more threads than that (0: the ranks
    were not found sharing cores; no sharing is costed). See ``shared_hosts``."""
    note: str = ""
    """Where the constants came from (fitted on which cluster and runs)."""
    kinds: Mapping[str, KindCalibration] = field(default_factory=dict)
    """Per device kind (``tapp_core.platform.kinds.DeviceKind.name``): its own compute, update and staging figures."""
    cuda_aware_mpi: bool = False
    """Whether MPI reads GPU memory itself (``TAPP_MPI_CUDA_AWARE=1``): then no tensor is staged through the host."""
    made_for: MadeFor | None = None
    """What a measured calibration was made for; None for one made by hand (tests, what-if studies)."""

    def __post_init__(self) -> None:
        _check_non_negative(
            self, ("per_message_s", "per_step_s", "per_micro_batch_s", "update_s_per_param_byte", "host_cores")
        )
        for name in ("compute_scale", "bandwidth_scale"):
            if not getattr(self, name) > 0:
                raise CalibrationError(f"calibration field {name} must be > 0, got {getattr(self, name)!r}")
        if not math.isfinite(self.slowdown_exponent):
            raise CalibrationError(
                f"calibration field slowdown_exponent must be finite, got {self.slowdown_exponent!r}"
            )

    def for_kind(self, kind: str) -> KindCalibration:
        """The figures of device kind ``kind``: its own, else the top-level ones (no staging)."""
        found = self.kinds.get(kind)
        if found is not None:
            return found
        return KindCalibration(
            compute_scale=self.compute_scale,
            per_micro_batch_s=self.per_micro_batch_s,
            update_s_per_param_byte=self.update_s_per_param_byte,
            per_step_s=self.per_step_s,
        )

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["kinds"] = {name: asdict(figures) for name, figures in self.kinds.items()}
        if self.made_for is not None:
            data["made_for"] = {**asdict(self.made_for), "kinds": list(self.made_for.kinds)}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object], source: str = "<calibration>") -> Calibration:
        extra = ("note", "kinds", "cuda_aware_mpi", "made_for")
        numbers = _numbers(cls, data, source, skip=extra)
        kinds = data.get("kinds") or {}
        if not isinstance(kinds, Mapping):
            raise CalibrationError(f"calibration {source} field kinds must be a mapping of kind names")
        made_for = data.get("made_for")
        if made_for is not None and not isinstance(made_for, Mapping):
            raise CalibrationError(f"calibration {source} field made_for must be a mapping")
        try:
            parsed_kinds = {}
            for name, figures in kinds.items():
                if not isinstance(figures, Mapping):
                    raise CalibrationError(f"calibration {source} kind {name} must be a mapping")
                parsed_kinds[str(name)] = KindCalibration(**_numbers(KindCalibration, figures, f"{source} kind {name}"))
            return replace(
                cls(
                    note=str(data.get("note", "")),
                    kinds=parsed_kinds,
                    cuda_aware_mpi=bool(data.get("cuda_aware_mpi", False)),
                    made_for=MadeFor.from_dict(made_for, source) if made_for is not None else None,
                ),
                **numbers,
            )
        except CalibrationError as exc:
            message = str(exc)
            raise CalibrationError(message if source in message else f"calibration {source}: {message}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "<calibration>") -> Calibration:
        return cls.from_dict(json_object(text, "calibration", source, CalibrationError), source)

    def save(self, path: str | Path) -> Path:
        return write_record(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        src = Path(path)
        if not src.is_file():
            raise CalibrationError(f"calibration file {src} does not exist")
        return cls.from_json(src.read_text(), str(src))


DEFAULT_CALIBRATION = Calibration()
"""The ideal model: no overheads. The runtime's link emulation uses it (it emulates the links, not the runtime)."""


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


CALIBRATION_VERSION = 2
"""What a calibration measures, numbered: a kept calibration of another number is measured afresh (2: the rank's own
memory, ``KindCalibration.runtime_memory_bytes``, which one kept before lacks)."""


def cached_calibration_path(cluster: Cluster, model: str, root: Path | None = None) -> Path:
    """Where a calibration of ``cluster`` measured on first use with ``model`` is kept (``root``: default
    ``default_cache_dir()``), keyed as the profile cache keys a layer library: by this host, the cluster's every
    field, the model, torch, the profiler, the MPI's CUDA-awareness and what a calibration measures
    (``CALIBRATION_VERSION``). A changed cluster or host, or another model,
    finds no entry and is measured afresh: the compute scale and the cost per operation are fitted to the model's
    own steps (a tiny model's, where fixed costs are the whole step, put AlexNet's at a twentieth of its time)."""
    import torch

    key = {
        "host": platform.node(),
        "cluster": cluster.model_dump(mode="json"),
        "model": model,
        "torch": torch.__version__,
        "profiler": PROFILE_VERSION,
        "cuda_aware_mpi": cuda_aware_mpi(),
        "measures": CALIBRATION_VERSION,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    readable = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{cluster.name}_{model}")[-80:]
    return (root or default_cache_dir()) / CALIBRATIONS_FOLDER / f"{readable}_{digest}{CALIBRATION_SUFFIX}"


NO_CALIBRATE_VARIABLE = "TAPP_NO_CALIBRATE"
"""Set to 1, every command uses the ideal calibration unless one is given (``--calibration``, or beside the cluster
file), as ``--no-calibrate`` does: none is measured or kept (the test suite sets it: a calibration takes seconds of
real runs, and a test must not read one an earlier run kept)."""


def calibrate_by_default() -> bool:
    """Whether a command that needs a calibration measures it on first use and uses the one kept
    (``NO_CALIBRATE_VARIABLE`` unset)."""
    return os.environ.get(NO_CALIBRATE_VARIABLE, "") in ("", "0")


def calibration_phrase(calibration: Calibration, calibrate: bool) -> str:
    """Which calibration an estimate used, in one phrase: its note, or why it is the ideal one."""
    if calibration.note:
        return calibration.note
    if not calibrate:
        return "ideal (--no-calibrate)"
    return "ideal (none measured for this cluster yet: a measuring `tapp run` or `tapp calibrate` measures it)"


CALIBRATIONS_FOLDER = "calibrations"
"""The profile cache's folder of calibrations measured on first use (``cached_calibration_path``)."""


def cluster_calibration(
    cluster_name: str | os.PathLike[str] | Cluster,
    cluster: Cluster,
    library: LayerLibrary | None = None,
    path: Path | None = None,
    kept: bool = True,
) -> Calibration:
    """The calibration at ``path``; without one, the one ``tapp calibrate`` wrote beside the cluster file of
    ``cluster_name`` (a loaded cluster names its own file), else (where ``kept``) the one measured on first use
    with ``library``'s model and kept in the cache (``cached_calibration_path``), checked against this machine, ``cluster`` and
    ``library`` (``check_calibration``); the ideal one when there is none."""
    if path is not None:
        return _checked(Calibration.load(path), cluster, library, str(path))
    beside = _beside_cluster_file(cluster_name)
    if beside is not None and beside.is_file():
        return _checked(Calibration.load(beside), cluster, library, str(beside))
    if not kept or library is None:
        return DEFAULT_CALIBRATION
    cached = cached_calibration_path(cluster, library.model)
    if cached.is_file():
        try:
            return _checked(Calibration.load(cached), cluster, library, str(cached))
        except CalibrationError:
            return DEFAULT_CALIBRATION  # made for another library's software: measured afresh where allowed
    return DEFAULT_CALIBRATION


def _beside_cluster_file(cluster_name: str | os.PathLike[str] | Cluster) -> Path | None:
    if isinstance(cluster_name, Cluster) and cluster_name.source is None:
        return None
    return calibration_path(cluster_name)


def _checked(calibration: Calibration, cluster: Cluster, library: LayerLibrary | None, source: str) -> Calibration:
    check_calibration(calibration, cluster, library, source)
    return calibration


# ---------------------------------------------------------------------------------------------------------------
# What ``tapp_core.runtime.probe`` measures on the ranks (it writes them; ``tapp_core.runtime.calibrator`` reads them)


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


# ---------------------------------------------------------------------------------------------------------------
# Fitting the calibration to what was measured (``tapp_core.runtime.calibrator`` measures it on the ranks)


@dataclass(frozen=True)
class StepPoint:
    """One single-device plan, measured: its batch size, micro-batch count and median step time."""

    batch_size: int
    micro_batches: int
    step_s: float


@dataclass(frozen=True)
class KindSteps:
    """One kind's single-device plans on its first device."""

    kind: str
    device: str
    points: tuple[StepPoint, ...]
    runtime_memory_bytes: float = 0.0
    """What the device's rank held before the plans' first tensors (``KindCalibration.runtime_memory_bytes``)."""


@dataclass(frozen=True)
class ComputeFit:
    compute_scale: float
    per_operation_s: float
    per_step_s: float
    """Everything a step costs that neither its compute nor its operations explain (the update included)."""


def fit_compute(library: LayerLibrary, points: Sequence[StepPoint], slowdown: float = 1.0) -> ComputeFit:
    """A kind's compute scale, fixed cost per operation and fixed cost per step from its single-device plans.

    A plan of ``b`` samples in ``M`` micro-batches does ``M F + P b`` seconds of ``library`` work (``F``: the
    layers' fixed parts, ``P``: their time per sample), times ``slowdown``, in ``2 M`` operations; its step is
    ``scale * slowdown * (M F + P b) + 2 M per_operation + per_step``. Least squares over the points; a negative
    per-operation or per-step cost (noise) is pinned to 0 and the rest refitted, and a scale past
    ``PLAUSIBLE_COMPUTE_SCALES`` is 1 with the fixed costs refitted."""
    fixed = sum(layer.forward_fixed_s + layer.backward_fixed_s for layer in library.layers)
    per_sample = (library.layer_time_sum_s - fixed) / library.batch_size
    rows = np.array(
        [[slowdown * (p.micro_batches * fixed + per_sample * p.batch_size), 2 * p.micro_batches, 1.0] for p in points]
    )
    y = np.array([p.step_s for p in points])
    solution = _non_negative_fit(rows, y, [0, 1, 2])
    low, high = PLAUSIBLE_COMPUTE_SCALES
    if not low <= solution[0] <= high:  # the steps cannot tell compute from fixed costs: the profile's own times
        solution = _non_negative_fit(rows, y - rows[:, 0], [1, 2])
        solution[0] = 1.0
    return ComputeFit(float(solution[0]), float(solution[1]), float(solution[2]))


PLAUSIBLE_COMPUTE_SCALES = (0.5, 3.0)
"""The compute scales a fit may give; past them it is the steps' noise, not the host, and the scale is 1 (the
profile's own times). A model whose steps are a few milliseconds of fixed costs (a small text classifier) gave
0.001 on one cluster and 1.12 on another, on the same host the same hour; AlexNet's is 1.2, and 1.8 on a host
busy with other jobs."""


def _non_negative_fit(rows: np.ndarray, y: np.ndarray, free: list[int]) -> np.ndarray:
    """Least squares of ``y`` over the ``free`` columns of ``rows`` (the others 0); a negative coefficient of any
    free column but column 0 (noise) is pinned to 0 and the rest refitted."""
    free = list(free)
    while True:
        solution = np.zeros(rows.shape[1])
        solution[free] = np.linalg.lstsq(rows[:, free], y, rcond=None)[0]
        negative = [i for i in free if i != 0 and solution[i] < 0]
        if not negative:
            return solution
        free.remove(negative[0])


PROBE_MESSAGE_BYTES = 4
"""What one message of ``tapp_core.runtime.probe``'s ping-pong carries."""


def per_message_s(probe: ProbeResult, cluster: Cluster, figures: Mapping[str, KindCalibration]) -> float:
    """The runtime's cost of one message beyond the link's latency and bandwidth (as the cluster file gives them,
    and as the emulation delays a message): the median over the pairs of their one-way time, less the link's time
    for the message and the staging copies of GPU ends."""
    residuals = []
    for pair in probe.pairs:
        a, b = (cluster.device(name) for name in pair.between)
        link = cluster.link(a.name, b.name)
        # ``formulas.transfer_s`` of the ideal calibration, written out: the formulas import this module.
        link_s = link.latency + PROBE_MESSAGE_BYTES / link.bandwidth
        staging = sum(figures[device_kind(d).name].staging_per_copy_s for d in (a, b) if d.kind == "cuda") / 2
        residuals.append(pair.one_way_s - link_s - staging)
    return max(0.0, statistics.median(residuals)) if residuals else 0.0


def shared_cores_factors(probes: Sequence[SharingProbe]) -> dict[str, float]:
    """Per kind, the median over its devices of their step while every rank computed over their step alone; at
    least 1 (less is noise)."""
    by_kind: dict[str, list[float]] = {}
    for probe in probes:
        by_kind.setdefault(probe.kind, []).append(probe.together_s / probe.alone_s)
    return {kind: max(1.0, statistics.median(ratios)) for kind, ratios in by_kind.items()}


__all__ = [
    "CALIBRATIONS_FOLDER",
    "CALIBRATION_SUFFIX",
    "CALIBRATION_VERSION",
    "DEFAULT_CALIBRATION",
    "NO_CALIBRATE_VARIABLE",
    "Calibration",
    "CalibrationError",
    "ComputeFit",
    "KindCalibration",
    "KindProbe",
    "KindSteps",
    "Line",
    "MadeFor",
    "PairProbe",
    "ProbeResult",
    "SharingProbe",
    "StepPoint",
    "cached_calibration_path",
    "calibrate_by_default",
    "calibration_path",
    "calibration_phrase",
    "check_calibration",
    "cluster_calibration",
    "fit_compute",
    "per_message_s",
    "shared_cores_factors",
]
