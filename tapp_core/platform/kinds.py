"""Device kinds: what makes a layer's time differ from one device to another.

A *kind* is a CPU with its intra-op thread count (``cpu-t4``) or a GPU with its model (``cuda-NVIDIA H100 80GB
HBM3``; ``cuda`` for a cluster device whose file names no model). A layer's advantage of one kind over another is
not one number (on an H100 against a 4-thread CPU rank, 0.7x to 230x across Inception-V3's layers), so a cluster
is costed from one layer library per kind (``tapp_core.profile.device_libraries`` says which library each device
takes).
"""

from __future__ import annotations

from dataclasses import dataclass

from tapp_core.platform.cluster import Cluster, Device


@dataclass(frozen=True)
class DeviceKind:
    """What makes a layer's time differ from one device to another: a CPU's intra-op threads, a GPU's model."""

    device: str
    """``cpu`` or ``cuda`` (as a ``ProfileRequest``'s ``device``; ``cuda:1`` names one GPU)."""
    threads: int
    """torch's intra-op threads during the profile (they also drive a GPU's host side)."""
    gpu: str = ""
    """The GPU's model name; empty on a CPU (and on a cluster's GPU whose file names no model)."""

    @classmethod
    def of(cls, device: str = "cpu", threads: int | None = None) -> DeviceKind:
        """The kind a ``ProfileRequest`` of ``device`` and ``threads`` would time on here."""
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


__all__ = ["DeviceKind", "cluster_kinds", "device_kind"]
