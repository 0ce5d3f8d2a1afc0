"""Hand-built layer libraries and clusters for tests (round numbers, so expected values can be worked by hand)."""

from __future__ import annotations

from collections.abc import Sequence

from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.profile.library import Layer, LayerLibrary


def library_from_edges(
    n_layers: int,
    edges: Sequence[tuple[int, int]],
    forward_s: Sequence[float] | None = None,
    backward_s: Sequence[float] | None = None,
    param_bytes: Sequence[int] | None = None,
    activation_bytes: Sequence[int] | None = None,
    batch_size: int = 8,
    model: str = "toy",
    threads: int = 1,
    gpu_model: str = "",
    host: str = "",
) -> LayerLibrary:
    """A library of ``n_layers`` layers linked by ``edges``, timed on a CPU with ``threads`` threads (a GPU of model
    ``gpu_model`` when given), profiled on ``host`` (empty: not recorded)."""
    succ: dict[int, list[int]] = {i: [] for i in range(n_layers)}
    pred: dict[int, list[int]] = {i: [] for i in range(n_layers)}
    for u, v in edges:
        succ[u].append(v)
        pred[v].append(u)
    fwd = forward_s or [1.0] * n_layers
    bwd = backward_s or [2.0 * t for t in fwd]
    params = param_bytes or [0] * n_layers
    acts = activation_bytes or [100] * n_layers
    layers = [
        Layer(
            index=i,
            name=f"l{i}",
            op="Linear",
            successors=tuple(succ[i]),
            predecessors=tuple(pred[i]),
            flops=1.0,
            param_bytes=params[i],
            activation_bytes=acts[i],
            output_shape=(batch_size, 10),
            forward_s=fwd[i],
            backward_s=bwd[i],
        )
        for i in range(n_layers)
    ]
    return LayerLibrary(
        model=model,
        batch_size=batch_size,
        device="cuda" if gpu_model else "cpu",
        threads=threads,
        layers=layers,
        input_bytes=3072,
        whole_model_s=sum(fwd) + sum(bwd),
        gpu_model=gpu_model,
        host=host,
    )


def chain_library(
    n_layers: int,
    forward_s: Sequence[float] | None = None,
    backward_s: Sequence[float] | None = None,
    param_bytes: Sequence[int] | None = None,
    activation_bytes: Sequence[int] | None = None,
    batch_size: int = 8,
    model: str = "toy",
    threads: int = 1,
    gpu_model: str = "",
    host: str = "",
) -> LayerLibrary:
    """``library_from_edges`` of a chain: layer ``i`` feeds layer ``i + 1``."""
    edges = [(i, i + 1) for i in range(n_layers - 1)]
    return library_from_edges(
        n_layers,
        edges,
        forward_s,
        backward_s,
        param_bytes,
        activation_bytes,
        batch_size,
        model,
        threads,
        gpu_model,
        host,
    )


def make_cluster(
    speeds: Sequence[float],
    memory: str = "1GiB",
    bandwidth: str | float = "1Gbit/s",
    latency: str | float = 0,
    kinds: Sequence[dict[str, object]] | None = None,
    emulated: bool = True,
) -> Cluster:
    """Devices ``d0, d1, ...`` of these speeds; ``kinds`` adds fields to each (``{"threads": 2}``,
    ``{"kind": "cuda", "gpu_model": "X"}``)."""
    extra = kinds or [{} for _ in speeds]
    return parse_cluster(
        {
            "name": "test",
            "emulated": emulated,
            "devices": [
                {"name": f"d{i}", "speed": s, "memory": memory, **more}
                for i, (s, more) in enumerate(zip(speeds, extra, strict=True))
            ],
            "links": {"bandwidth": bandwidth, "latency": latency},
        }
    )


def plain_cluster(n: int) -> Cluster:
    """``n`` real (not emulated) devices ``d0``.. of 2 GiB each, on 1 Gbit/s links: the runtime tests' cluster."""
    devices = [{"name": f"d{i}", "memory": "2GiB"} for i in range(n)]
    return parse_cluster(
        {
            "name": f"plain{n}",
            "emulated": False,
            "devices": devices,
            "links": {"bandwidth": "1Gbit/s", "latency": "0us"},
        }
    )
