"""Which layer library and which ``speed`` each device of a cluster is costed with.

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

from tapp_core.platform.cluster import Cluster
from tapp_core.platform.hosts import is_local_host
from tapp_core.platform.kinds import DeviceKind, device_kind
from tapp_core.profile.library import LayerLibrary


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


__all__ = ["DeviceLibrary", "device_library"]
