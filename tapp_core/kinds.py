"""Device kinds: what makes a layer's time differ from one device to another, and which layer library and which
``speed`` each device of a cluster is costed with.

A *kind* is a CPU with its intra-op thread count (``cpu-t4``) or a GPU with its model (``cuda-NVIDIA H100 80GB
HBM3``; ``cuda`` for a cluster device whose file names no model). A layer's advantage of one kind over another is
not one number (on an H100 against a 4-thread CPU rank, 0.7x to 230x across Inception-V3's layers), so a cluster
is costed from one layer library per kind: ``LayerLibrary.kinds`` carries them, ``tapp profile --cluster``
makes them.

Which library a device is costed from (``device_library``)
    1. The library of the device's own kind, when there is one.
    2. Otherwise the *nearest*: a library of the same device type (a CPU library for a CPU device, the one with
       the closest thread count, the larger on a tie; for a GPU, another GPU's library), else the library with
       the most compute (a GPU's, else the most threads). A warning says so, once per pair of kinds.

Which ``speed`` it gets (``DeviceLibrary.speed_applies``)
    The device's ``speed`` multiplies its library's times (a layer of ``t`` seconds takes ``t / speed``) when
    - the cluster is emulated: ``speed`` is then what the emulation slows the rank by, on top of its kind;
    - the library is not of the device's kind (rule 2): ``speed`` is then the user's ratio to that kind;
    - the library was profiled on another host than the device's (a library that records no host counts as
      profiled elsewhere): ``speed`` is then the ratio between the two machines.
    Otherwise (a real device of a kind profiled on its own host) ``speed`` is ignored: the library is the device.

With a single library whose kind every device shares, and an emulated cluster, this is exactly the model of one
library scaled by each device's ``speed``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tapp_core.cluster import Cluster, Device
from tapp_core.hosts import is_local_host

if TYPE_CHECKING:
    from tapp_core.library import LayerLibrary


@dataclass(frozen=True)
class DeviceKind:
    """What makes a layer's time differ from one device to another: a CPU's intra-op threads, a GPU's model."""

    device: str
    """``cpu`` or ``cuda`` (as ``profile_model``'s ``device``; ``cuda:1`` names one GPU)."""
    threads: int
    """torch's intra-op threads during the profile (they also drive a GPU's host side)."""
    gpu: str = ""
    """The GPU's model name; empty on a CPU (and on a cluster's GPU whose file names no model)."""

    @classmethod
    def of(cls, device: str = "cpu", threads: int | None = None) -> DeviceKind:
        """The kind ``profile_model(device=device, threads=threads)`` would time on here."""
        import torch

        resolved_threads = threads if threads is not None else torch.get_num_threads()
        gpu = ""
        if device.startswith("cuda") and torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(torch.device(device))
        return cls(device, resolved_threads, gpu)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def name(self) -> str:
        """The kind as the cost model and the calibration know it: ``cpu-t2``, ``cuda-NVIDIA H100 80GB HBM3``,
        ``cuda`` (a GPU of unknown model). A GPU's host threads are not part of it."""
        if self.is_cuda:
            return f"cuda-{self.gpu}" if self.gpu else "cuda"
        return f"cpu-t{self.threads}"

    @property
    def label(self) -> str:
        """A short readable name for folder names: ``cpu-t1``, ``cuda-NVIDIA_H100_80GB_HBM3-t8``."""
        gpu = f"-{self.gpu}" if self.gpu else ""
        return f"{self.device}{gpu}-t{self.threads}".replace(" ", "_")


def device_kind(device: Device) -> DeviceKind:
    """The kind of a cluster's device: its ``kind`` and ``threads``, and a GPU's ``gpu_model``."""
    if device.kind == "cuda":
        return DeviceKind("cuda", device.threads, device.gpu_model or "")
    return DeviceKind("cpu", device.threads)


def cluster_kinds(cluster: Cluster) -> dict[str, DeviceKind]:
    """The kinds of a cluster's devices by name, in the order of their first device."""
    kinds: dict[str, DeviceKind] = {}
    for device in cluster.devices:
        kind = device_kind(device)
        kinds.setdefault(kind.name, kind)
    return kinds


@dataclass(frozen=True)
class DeviceLibrary:
    """The library a device is costed from, and whether its ``speed`` multiplies that library's times."""

    library: LayerLibrary
    kind: DeviceKind
    """The device's own kind (the calibration's figures are looked up by its name)."""
    own: bool
    """Whether ``library`` is of the device's kind."""
    speed_applies: bool


_warned: set[tuple[str, str]] = set()


def _nearest(libraries: dict[str, LayerLibrary], kind: DeviceKind) -> LayerLibrary:
    """Rule 2 of the module docstring."""
    same_type = [lib for lib in libraries.values() if lib.kind.is_cuda == kind.is_cuda]
    if same_type:
        return min(same_type, key=lambda lib: (abs(lib.kind.threads - kind.threads), -lib.kind.threads))
    return max(libraries.values(), key=lambda lib: (lib.kind.is_cuda, lib.kind.threads))


def device_library(library: LayerLibrary, cluster: Cluster, device: str) -> DeviceLibrary:
    """Which of ``library``'s kinds ``device`` is costed from, and whether its speed applies (module docstring)."""
    spec = cluster.device(device)
    kind = device_kind(spec)
    by_kind = library.kind_libraries
    chosen = by_kind.get(kind.name)
    if chosen is None and kind.is_cuda and not kind.gpu:
        # A GPU whose model the file does not give takes the GPU library there is, if only one.
        gpus = [lib for lib in by_kind.values() if lib.kind.is_cuda]
        chosen = gpus[0] if len(gpus) == 1 else None
    own = chosen is not None
    if chosen is None:
        chosen = _nearest(by_kind, kind)
        pair = (kind.name, chosen.kind.name)
        if pair not in _warned:
            _warned.add(pair)
            warnings.warn(
                f"no layer library of kind {kind.name} (device {device} of cluster {cluster.name!r}): costed from "
                f"the {chosen.kind.name} library scaled by its speed {spec.speed:g} "
                f"(profile it with `tapp profile --cluster`)",
                stacklevel=3,
            )
    profiled_on_its_host = bool(chosen.host) and (
        chosen.host == spec.host or (is_local_host(spec.host) and is_local_host(chosen.host))
    )
    speed_applies = cluster.emulated or not own or not profiled_on_its_host
    return DeviceLibrary(chosen, kind, own, speed_applies)


__all__ = ["DeviceKind", "DeviceLibrary", "cluster_kinds", "device_kind", "device_library"]
