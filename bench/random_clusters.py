"""Random heterogeneous clusters, to judge planners on clusters nobody tuned them for (issue 14).

``random_clusters(count, seed)`` returns ``count`` ordinary ``tapp_core.platform.cluster.Cluster`` objects. Cluster ``i``
depends only on ``(seed, i)``: ``--random 3`` gives the first three clusters of ``--random 12``. Each one is built
from a plain mapping by ``parse_cluster`` and ``write_cluster`` writes that same mapping as a cluster file, so
``bench/planners.py --clusters that.yaml`` re-runs one cell on exactly the same cluster.

What a random cluster has (the ranges of issue 14):

- 3 to 8 devices named ``d0``, ``d1``, ...; speeds log-uniform over 0.05-20. One cluster in three has a
  *dominant* device: ``DOMINANT_RATIO`` (2.5-10) times faster than the fastest of the others.
- Memory log-uniform over 1-64 GiB; one device in five is *small* (1-1.2 GiB), where Inception-V3 at batch 64
  (1.23 GiB on one device) does not fit, so some plans are infeasible.
- Links 10 Mbit/s - 100 Gbit/s: the devices fall into 1-3 *islands*, fast inside (100 Mbit/s - 100 Gbit/s),
  joined to each other by slow links (10 Mbit/s - 1 Gbit/s, higher latency). One cluster in three has its
  fastest device *isolated*: every link out of it is 10-100 Mbit/s.
- A kind per device (``draw_kind``): by default every device is ``cpu`` with one thread, costed from one layer
  library scaled by its speed. Given ``threads=(1, 2)``, each device's CPU thread count is drawn from those, and it
  is costed from the library of its own kind (``tapp_core.platform.kinds``), its speed multiplying that: per-layer ratios
  between devices are then not one number. The kinds come from a random stream of their own, so that drawing them
  leaves every cluster's speeds, memory and links as they are; such a cluster's name ends in ``-t1-2``.

Speeds are relative to the machine the layer library was profiled on; devices faster than that host cannot be
emulated on it, so these clusters are for the cost model (the planners' estimates), not for ``tapp measure``.

Numbers come from ``random.Random(...).random()`` only, whose sequence Python keeps stable across versions, and
are rounded to three significant digits (memory to whole MiB) before the cluster is built, so the YAML holds
exactly the cluster the benchmark used.

``replicated(cluster, copies)`` makes hetero8 doubled and quadrupled, and ``random_clusters(..., devices=16)``
random clusters of any size, for the scale runs (where the oracle is not expected to finish).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.units import parse_bandwidth, parse_bytes, parse_seconds

DEVICE_COUNTS = (3, 8)
SPEEDS = (0.05, 20.0)
MEMORY_GIB = (1.0, 64.0)
SMALL_MEMORY_GIB = (1.0, 1.2)
SMALL_MEMORY_SHARE = 0.2
DOMINANT_SHARE = 1 / 3
DOMINANT_RATIO = (2.5, 10.0)
ISOLATED_SHARE = 1 / 3
ISOLATED_MBIT = (10.0, 100.0)
ISLANDS = (1, 3)
INSIDE_ISLAND_MBIT = (100.0, 100_000.0)
BETWEEN_ISLANDS_MBIT = (10.0, 1_000.0)
INSIDE_LATENCY_US = (10.0, 100.0)
BETWEEN_LATENCY_US = (100.0, 1_000.0)
KIND_STREAM = "kind"
"""Name of the random stream that ``draw_kind`` uses (separate from speeds, memory and links)."""


class _Draw:
    """Draws from ``random.Random.random()`` alone (the one method whose sequence Python guarantees)."""

    def __init__(self, *key: object) -> None:
        self._rng = random.Random("/".join(str(k) for k in key))

    def chance(self, p: float) -> bool:
        return self._rng.random() < p

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * self._rng.random()

    def log_uniform(self, low: float, high: float) -> float:
        return low * math.exp(math.log(high / low) * self._rng.random())

    def integer(self, low: int, high: int) -> int:
        """Uniform over ``low..high`` inclusive."""
        return min(high, low + int(self._rng.random() * (high - low + 1)))


def _significant(value: float, digits: int = 3) -> float:
    return float(f"{value:.{digits}g}")


def _text(value: float) -> str:
    """A number without exponent notation (YAML and the unit parser both read it back exactly)."""
    return f"{value:.10g}"


@dataclass(frozen=True)
class _Island:
    members: list[str]
    mbit: float
    latency_us: float


def draw_kind(seed: int, index: int, device: int, threads: tuple[int, ...] = (1,)) -> dict[str, object]:
    """The kind fields of one random device: a CPU whose thread count is drawn from ``threads``."""
    draw = _Draw(KIND_STREAM, seed, index, device)
    return {"kind": "cpu", "threads": threads[draw.integer(0, len(threads) - 1)]}


def kinds_suffix(threads: tuple[int, ...]) -> str:
    """What a cluster name gets for drawn thread counts (none for the default one-thread family)."""
    return "" if threads == (1,) else "-t" + "-".join(str(t) for t in threads)


def _speeds(draw: _Draw, n: int) -> list[float]:
    if not draw.chance(DOMINANT_SHARE):
        return [_significant(draw.log_uniform(*SPEEDS)) for _ in range(n)]
    ratio = draw.log_uniform(*DOMINANT_RATIO)
    others = [_significant(draw.log_uniform(SPEEDS[0], SPEEDS[1] / ratio)) for _ in range(n - 1)]
    at = draw.integer(0, n - 1)
    return [*others[:at], _significant(min(SPEEDS[1], ratio * max(others))), *others[at:]]


def _memory_mib(draw: _Draw) -> int:
    low, high = SMALL_MEMORY_GIB if draw.chance(SMALL_MEMORY_SHARE) else MEMORY_GIB
    return round(draw.log_uniform(low, high) * 1024)


def _islands(draw: _Draw, names: list[str]) -> list[_Island]:
    count = draw.integer(ISLANDS[0], min(ISLANDS[1], len(names)))
    members: list[list[str]] = [[] for _ in range(count)]
    for name in names:
        members[draw.integer(0, count - 1)].append(name)
    return [
        _Island(
            group,
            _significant(draw.log_uniform(*INSIDE_ISLAND_MBIT)),
            _significant(draw.log_uniform(*INSIDE_LATENCY_US)),
        )
        for group in members
        if group
    ]


def _link(mbit: float, latency_us: float) -> dict[str, str]:
    return {"bandwidth": f"{_text(mbit)}Mbit/s", "latency": f"{_text(latency_us)}us"}


def _links(draw: _Draw, names: list[str], speeds: list[float]) -> dict[str, object]:
    """Islands fast inside and slow between; maybe every link out of the fastest device slow. Later overrides win,
    so the between-island pairs come first, then each island's inside, then the isolated device's links."""
    islands = _islands(draw, names)
    overrides: list[dict[str, object]] = []
    for a in range(len(islands)):
        for b in range(a + 1, len(islands)):
            between = _link(
                _significant(draw.log_uniform(*BETWEEN_ISLANDS_MBIT)),
                _significant(draw.log_uniform(*BETWEEN_LATENCY_US)),
            )
            overrides.append({"between": islands[a].members + islands[b].members, **between})
    overrides += [
        {"between": island.members, **_link(island.mbit, island.latency_us)}
        for island in islands
        if len(island.members) > 1
    ]
    if draw.chance(ISOLATED_SHARE):
        fastest = names[max(range(len(names)), key=lambda i: speeds[i])]
        slow = _link(
            _significant(draw.log_uniform(*ISOLATED_MBIT)), _significant(draw.log_uniform(*BETWEEN_LATENCY_US))
        )
        overrides += [{"between": [fastest, other], **slow} for other in names if other != fastest]
    default = overrides[0] if overrides else {"between": names, **_link(islands[0].mbit, islands[0].latency_us)}
    return {"bandwidth": default["bandwidth"], "latency": default["latency"], "overrides": overrides}


def random_cluster_data(
    seed: int, index: int, devices: int | None = None, threads: tuple[int, ...] = (1,)
) -> dict[str, Any]:
    """The mapping of random cluster ``index`` of family ``seed`` (a cluster file's content); ``devices`` fixes
    the device count (default: drawn from ``DEVICE_COUNTS``), ``threads`` the CPU thread counts drawn."""
    draw = _Draw("cluster", seed, index, devices or "")
    n = devices or draw.integer(*DEVICE_COUNTS)
    names = [f"d{k}" for k in range(n)]
    speeds = _speeds(draw, n)
    rows = [
        {"name": name, **draw_kind(seed, index, k, threads), "speed": speed, "memory": f"{_memory_mib(draw)}MiB"}
        for k, (name, speed) in enumerate(zip(names, speeds, strict=True))
    ]
    suffix = (f"-n{devices}" if devices else "") + kinds_suffix(threads)
    return {
        "name": f"random-s{seed}-{index:02d}{suffix}",
        "emulated": True,
        "devices": rows,
        "links": _links(draw, names, speeds),
    }


def random_clusters(
    count: int, seed: int, devices: int | None = None, threads: tuple[int, ...] = (1,)
) -> list[Cluster]:
    """The first ``count`` random clusters of family ``seed`` (their devices' thread counts drawn from
    ``threads``)."""
    return [
        parse_cluster(random_cluster_data(seed, i, devices, threads), f"random cluster {i} of seed {seed}")
        for i in range(count)
    ]


def cluster_data(cluster: Cluster) -> dict[str, Any]:
    """A cluster as the mapping of its cluster file, in the units people write (MiB, Mbit/s, us) wherever that
    reads back exactly, else in bytes, bytes/s and seconds."""
    data = cluster.model_dump(mode="json", exclude_none=True)
    for device in data["devices"]:
        device["memory"] = _exact(device["memory"], 2**20, "MiB", parse_bytes)
    data["links"]["overrides"] = [{"between": o.pop("between"), **o} for o in data["links"]["overrides"]]
    for link in (data["links"], *data["links"]["overrides"]):
        link["bandwidth"] = _exact(link["bandwidth"], 1e6 / 8, "Mbit/s", parse_bandwidth)
        link["latency"] = _exact(link["latency"], 1e-6, "us", parse_seconds)
    return data


def _exact(value: float, unit: float, name: str, parse: Callable[[object], float]) -> float | str:
    text = f"{_text(value / unit)}{name}"
    return text if parse(text) == value else value


def write_cluster(cluster: Cluster, directory: str | Path) -> Path:
    """Write ``cluster`` as ``directory/<name>.yaml``, readable by ``load_cluster`` and ``--clusters``."""
    data = cluster_data(cluster)

    def flow(item: object) -> str:
        return yaml.safe_dump(item, default_flow_style=True, width=10_000, sort_keys=False).strip()

    links = data["links"]
    head = {"name": data["name"], "emulated": data["emulated"]}
    lines = [f"# {describe(cluster)}", yaml.safe_dump(head, sort_keys=False).strip(), "devices:"]
    lines += [f"  - {flow(device)}" for device in data["devices"]]
    lines += [
        "links:",
        f"  {flow({'bandwidth': links['bandwidth']})[1:-1]}",
        f"  {flow({'latency': links['latency']})[1:-1]}",
    ]
    if links["overrides"]:
        lines += ["  overrides:"] + [f"    - {flow(o)}" for o in links["overrides"]]
    path = Path(directory) / f"{cluster.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def replicated(cluster: Cluster, copies: int) -> Cluster:
    """``copies`` copies of every device (``name-0``, ``name-1``, ...), every link override spanning the copies
    of the devices it names: hetero8 doubled keeps its three groups, each twice as large."""
    data = cluster_data(cluster)
    data["name"] = f"{cluster.name}x{copies}"
    data["devices"] = [{**d, "name": f"{d['name']}-{k}"} for d in data["devices"] for k in range(copies)]
    for override in data["links"]["overrides"]:
        override["between"] = [f"{name}-{k}" for name in override["between"] for k in range(copies)]
    return parse_cluster(data, f"{cluster.name} x{copies}")


def describe(cluster: Cluster) -> str:
    """One line: devices, speeds (and a dominant device), thread counts where they differ, memory, links, and the
    links out of the fastest device."""
    ranked = sorted(cluster.devices, key=lambda d: -d.speed)
    fastest = ranked[0]
    parts = [f"{len(ranked)} devices", f"speeds {ranked[-1].speed:g}-{fastest.speed:g}"]
    if len(ranked) > 1 and fastest.speed >= DOMINANT_RATIO[0] * ranked[1].speed:
        parts.append(f"dominant {fastest.name} ({fastest.speed / ranked[1].speed:.1f}x the next)")
    kinds = sorted({d.threads for d in cluster.devices})
    if len(kinds) > 1:
        parts.append("threads " + ", ".join(f"{t}: {sum(d.threads == t for d in ranked)}" for t in kinds))
    memory = [d.memory / 2**30 for d in cluster.devices]
    parts.append(f"memory {min(memory):.2f}-{max(memory):.0f} GiB")
    links = [cluster.link(a, b).bandwidth for a, b in cluster.pairs()]
    if links:
        parts.append(f"links {_rate(min(links))}-{_rate(max(links))}")
        out = [cluster.link(fastest.name, d.name).bandwidth for d in ranked[1:]]
        parts.append(f"out of fastest {fastest.name} {_rate(min(out))}-{_rate(max(out))}")
    return "; ".join(parts)


def _rate(bytes_per_s: float) -> str:
    mbit = bytes_per_s * 8 / 1e6
    return f"{mbit / 1000:.3g} Gbit/s" if mbit >= 1000 else f"{mbit:.3g} Mbit/s"
