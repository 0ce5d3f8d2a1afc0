"""The cluster of this host, described without hand work (``tapp cluster detect``); or the links of a given
cluster, measured where its devices run (``tapp cluster detect --cluster``: ``write_measured_links``).

Every GPU becomes a ``cuda`` device (its index, its model and its memory, from torch.cuda). The CPU cores left
once each GPU rank has ``HOST_CORES_PER_GPU`` cores for its host threads (the rank itself, the batch prefetch,
MPI) are split into CPU ranks of ``threads`` threads: given, or 4 when at least 8 cores are left (half of them,
at least 1, otherwise), at most ``MAX_CPU_RANKS`` ranks. The host's memory is shared evenly among the CPU ranks.
Heterogeneity is real (``emulated: false``): every ``speed`` is 1.

The links are measured, not assumed: a short MPI ping-pong (``tapp_core.runtime.pingpong``, under the project's
``mpiexec``) between every pair of ranks, GPU ends staged through host memory as the runtime stages them. The
default link is the median of the CPU-CPU pairs (of all pairs when there is at most one CPU rank); every pair
with a GPU end gets its own override.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import yaml

from tapp_core.errors import TappError
from tapp_core.paths import PROJECT_ROOT
from tapp_core.platform.cluster import Cluster, load_cluster, parse_cluster
from tapp_core.platform.hosts import Host, PairLink, cuda_aware_mpi, this_host

HOST_CORES_PER_GPU = 2
MAX_CPU_RANKS = 8
DEFAULT_THREADS = 4
MAX_BANDWIDTH = 1e13
"""Bytes/s written for a link whose large messages took no longer than its small ones (noise)."""
LINK_TOLERANCE = 0.1
"""A measured pair whose bandwidth is further than this from the pairs' median gets a link of its own."""
UNMEASURED_LINKS = {"bandwidth": "1Gbit/s", "latency": "0us"}
"""The links of a one-rank cluster: there is no pair to measure, and nothing uses them."""


class DetectError(TappError):
    """This host cannot be described as asked (too few cores for the threads, a ping-pong that failed)."""


def read_pairs(text: str) -> list[PairLink]:
    """The pairs the ping-pong wrote (JSON: ``{"pairs": [PairLink fields...]}``)."""
    try:
        return [
            PairLink(
                between=(str(p["between"][0]), str(p["between"][1])),
                latency_s=float(p["latency_s"]),
                bandwidth_bytes_per_s=float(p["bandwidth_bytes_per_s"]),
                sizes=tuple(int(n) for n in p["sizes"]),
                one_way_s=tuple(float(t) for t in p["one_way_s"]),
            )
            for p in json.loads(text)["pairs"]
        ]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise DetectError(f"the ping-pong's output is not what it should be: {exc!r}") from None


def cpu_ranks(host: Host, threads: int | None = None) -> tuple[int, int]:
    """(CPU ranks, threads per rank) for ``host``; ``threads`` None chooses them (see the module docstring)."""
    left = host.cores - HOST_CORES_PER_GPU * len(host.gpus)
    if threads is not None and threads < 1:
        raise DetectError(f"--threads must be at least 1, got {threads}")
    if left < 1:
        if threads is not None or not host.gpus:
            raise DetectError(f"{host.cores} core(s) leave none for CPU ranks beside {len(host.gpus)} GPU rank(s)")
        return 0, 1
    if threads is None:
        threads = DEFAULT_THREADS if left >= 2 * DEFAULT_THREADS else max(1, left // 2)
    if threads > left:
        gpus = f" beside {len(host.gpus)} GPU rank(s)" if host.gpus else ""
        raise DetectError(f"--threads {threads} is more than the {left} core(s) this host has for CPU ranks{gpus}")
    return min(MAX_CPU_RANKS, left // threads), threads


def devices_of(host: Host, threads: int | None = None) -> list[dict[str, object]]:
    """The cluster's devices, GPUs first (as cluster-file mappings)."""
    ranks, per_rank = cpu_ranks(host, threads)
    devices: list[dict[str, object]] = [
        {
            "name": f"gpu{g.index}",
            "kind": "cuda",
            "gpu_index": g.index,
            "gpu_model": g.model,
            "memory": _mib(g.memory_bytes),
        }
        for g in host.gpus
    ]
    share = host.memory_bytes // max(ranks, 1)
    devices += [{"name": f"cpu{i}", "kind": "cpu", "threads": per_rank, "memory": _mib(share)} for i in range(ranks)]
    return devices


def measure_links(cluster: Cluster, repeats: int = 15, timeout_s: float = 300.0) -> list[PairLink]:
    """Every pair's link by MPI ping-pong (see ``tapp_core.runtime.pingpong``)."""
    from tapp_core.runtime.pool import mpiexec_command

    with tempfile.TemporaryDirectory(prefix="tapp-detect-") as folder:
        cluster_file, out = Path(folder) / "cluster.json", Path(folder) / "links.json"
        cluster_file.write_text(cluster.model_dump_json())
        program = [sys.executable, "-m", "tapp_core.runtime.pingpong", "--cluster", str(cluster_file)]
        command = mpiexec_command(cluster, [*program, "--out", str(out), "--repeats", str(repeats)])
        env = {**os.environ}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DetectError(f"the MPI ping-pong ({command[0]}) failed: {exc}") from None
        if done.returncode != 0 or not out.is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise DetectError(f"the MPI ping-pong exited with status {done.returncode}:\n{tail}")
        return read_pairs(out.read_text())


def links_of(devices: Sequence[dict[str, object]], pairs: Sequence[PairLink]) -> dict[str, object]:
    """The cluster file's ``links``: the CPU-CPU median as the default, an override per pair with a GPU end."""
    if not pairs:
        return dict(UNMEASURED_LINKS)
    on_gpu = {str(d["name"]) for d in devices if d["kind"] == "cuda"}
    with_gpu = [p for p in pairs if on_gpu & set(p.between)]
    plain = [p for p in pairs if p not in with_gpu] or list(pairs)
    links: dict[str, object] = {
        "bandwidth": _bandwidth(statistics.median(p.bandwidth_bytes_per_s for p in plain)),
        "latency": _seconds(statistics.median(p.latency_s for p in plain)),
    }
    if with_gpu:
        links["overrides"] = [
            {
                "between": list(p.between),
                "bandwidth": _bandwidth(p.bandwidth_bytes_per_s),
                "latency": _seconds(p.latency_s),
            }
            for p in with_gpu
        ]
    return links


def detect_cluster(
    threads: int | None = None, name: str | None = None, repeats: int = 15, host: Host | None = None
) -> tuple[Cluster, str]:
    """This host's cluster with measured links, and the cluster file's text (YAML, with how it was measured)."""
    host = host or this_host()
    devices = devices_of(host, threads)
    # The links are measured between the ranks of the cluster itself, described with placeholder links first.
    draft = parse_cluster({"name": "draft", "emulated": False, "devices": devices, "links": UNMEASURED_LINKS})
    pairs = measure_links(draft, repeats) if len(devices) > 1 else []
    data = {
        "name": name or _file_name(host.name),
        "emulated": False,
        "devices": devices,
        "links": links_of(devices, pairs),
    }
    cluster = parse_cluster(data, "<detected>")
    return cluster, _header(host, devices, pairs, repeats) + yaml.safe_dump(data, sort_keys=False, width=120)


def write_detected_cluster(out: Path, threads: int | None = None, name: str | None = None) -> Cluster:
    """Detect this host's cluster and write it to ``out``; returns it as ``load_cluster`` reads it back."""
    _, text = detect_cluster(threads, name or out.stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return load_cluster(out)


def measure_cluster_links(cluster: Cluster, repeats: int = 15) -> tuple[dict[str, object], list[PairLink]]:
    """The links between ``cluster``'s devices where they run (on their hosts), measured: the pairs' median as the
    default, and an override for every pair more than ``LINK_TOLERANCE`` away from it in bandwidth."""
    pairs = measure_links(cluster, repeats)
    default = statistics.median(p.bandwidth_bytes_per_s for p in pairs)
    links: dict[str, object] = {
        "bandwidth": _bandwidth(default),
        "latency": _seconds(statistics.median(p.latency_s for p in pairs)),
    }
    apart = [p for p in pairs if abs(p.bandwidth_bytes_per_s / default - 1) > LINK_TOLERANCE]
    if apart:
        links["overrides"] = [
            {
                "between": list(p.between),
                "bandwidth": _bandwidth(p.bandwidth_bytes_per_s),
                "latency": _seconds(p.latency_s),
            }
            for p in apart
        ]
    return links, pairs


def write_measured_links(
    cluster_file: str | os.PathLike[str], out: Path, repeats: int = 15
) -> tuple[Cluster, list[str]]:
    """``cluster_file``'s cluster with its links measured where its devices run, written to ``out``; also one line
    per pair comparing the measured link with the file's."""
    cluster = load_cluster(cluster_file)
    if len(cluster.devices) < 2:
        raise DetectError(f"cluster {cluster.name!r} has one device: no link to measure")
    links, pairs = measure_cluster_links(cluster, repeats)
    data = {**cluster.model_dump(mode="json", exclude_none=True), "links": links}
    lines = [_compared(cluster, pair) for pair in pairs]
    header = [
        f"Links measured by `tapp cluster detect --cluster {cluster_file}` at {datetime.now(UTC):%Y-%m-%d %H:%M} "
        f"UTC: MPI ping-pong where the devices run, one-way time = half the median of {repeats} round trips.",
        *lines,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(f"# {line}\n" for line in header) + yaml.safe_dump(data, sort_keys=False, width=120))
    return load_cluster(out), lines


def _compared(cluster: Cluster, pair: PairLink) -> str:
    said = cluster.link(*pair.between)
    error = pair.bandwidth_bytes_per_s / said.bandwidth - 1
    return (
        f"{pair.between[0]} <-> {pair.between[1]}: measured {pair.bandwidth_bytes_per_s * 8 / 1e6:.1f} Mbit/s, "
        f"{pair.latency_s * 1e6:.0f} us; the file says {said.bandwidth * 8 / 1e6:.1f} Mbit/s, "
        f"{said.latency * 1e6:.0f} us ({error:+.1%} bandwidth)"
    )


def summary(cluster: Cluster) -> list[str]:
    """One line per device and per distinct link, for the command line."""
    lines = []
    for d in cluster.devices:
        what = f"{d.gpu_model or 'GPU'} (cuda:{d.gpu_index})" if d.kind == "cuda" else f"{d.threads} thread(s)"
        lines.append(f"{d.name}: {d.kind}, {what}, {d.memory / 2**30:.1f} GiB")
    for a, b in cluster.pairs():
        link = cluster.link(a, b)
        lines.append(f"{a} <-> {b}: {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.1f} us")
    return lines


def _header(host: Host, devices: Sequence[dict[str, object]], pairs: Sequence[PairLink], repeats: int) -> str:
    cpus = [d for d in devices if d["kind"] == "cpu"]
    staging = (
        "MPI reads GPU memory (TAPP_MPI_CUDA_AWARE=1)" if cuda_aware_mpi() else "staged through pinned host memory"
    )
    lines = [
        f"Detected by `tapp cluster detect` on {host.name} at {datetime.now(UTC):%Y-%m-%d %H:%M} UTC:",
        f"{host.cores} usable cores, {host.memory_bytes / 2**30:.1f} GiB, {len(host.gpus)} GPU(s); "
        f"{len(cpus)} CPU rank(s) of {cpus[0]['threads'] if cpus else 0} thread(s)"
        + (f", {HOST_CORES_PER_GPU} cores kept for each GPU rank." if host.gpus else "."),
        f"Links: MPI ping-pong, one-way time = half the median of {repeats} round trips"
        + (f"; GPU ends {staging}." if host.gpus else "."),
    ]
    if not pairs:
        lines.append("One rank: no pair to measure, the links are placeholders.")
    for pair in pairs:
        times = ", ".join(f"{_size(n)} {t * 1e6:.1f}us" for n, t in zip(pair.sizes, pair.one_way_s, strict=True))
        lines.append(f"  {pair.between[0]} - {pair.between[1]}: {times}")
    return "".join(f"# {line}\n" for line in lines)


def _bandwidth(bytes_per_s: float) -> str:
    return f"{min(bytes_per_s, MAX_BANDWIDTH) / 1e6:.1f}MB/s"


def _seconds(seconds: float) -> str:
    return f"{max(seconds, 0.0) * 1e6:.2f}us"


def _mib(nbytes: int) -> str:
    return f"{nbytes // 2**20}MiB"


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes} B"


def _file_name(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in host) or "this-host"
