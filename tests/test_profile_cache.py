"""The one profile cache: its key, its entries on disk, and its use by both the command line and the flow."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flows.cli.common import cluster_library
from tapp_core.errors import TappError
from tapp_core.platform.cluster import parse_cluster
from tapp_core.profile.cache import KEY_FILE, DeviceKind, ProfileCache, ProfileKey, local_kinds
from tapp_core.profile.library import LayerLibrary
from tapp_core.profile.profiler import ProfileRequest
from tasks.profile import profile_cluster_layers

QUICK = {"repeats": 1, "warmup": 0}


def same_library(a: LayerLibrary, b: LayerLibrary) -> bool:
    """Equal rows and metadata: the same profile, since a new one has other times and another date."""
    return a.to_frame().equals(b.to_frame()) and a.metadata() == b.metadata()


def test_the_key_follows_every_input() -> None:
    key = ProfileKey.of(ProfileRequest("mlp", 8, threads=1))
    assert (
        key == ProfileKey.of(ProfileRequest("mlp", 8, threads=1))
        and key.digest == ProfileKey.of(ProfileRequest("mlp", 8, threads=1)).digest
    )
    others = [
        ProfileKey.of(ProfileRequest("tiny_cnn", 8, threads=1)),
        ProfileKey.of(ProfileRequest("mlp", 16, threads=1)),
        ProfileKey.of(ProfileRequest("mlp", 8, threads=2)),
        ProfileKey.of(ProfileRequest("mlp", 8, threads=1, repeats=3)),
        ProfileKey.of(ProfileRequest("mlp", 8, threads=1, seed=1)),
        replace(key, torch_version="0.0.1"),
        replace(key, host="elsewhere"),
        replace(key, kind=DeviceKind("cuda", 1, "NVIDIA H100 80GB HBM3")),
    ]
    assert len({key.digest, *(other.digest for other in others)}) == len(others) + 1
    assert key.kind == DeviceKind("cpu", 1) and key.kind.label == "cpu-t1"
    assert key.torch_version == torch.__version__
    assert (
        ProfileKey.of(ProfileRequest("mlp", 8)).kind.threads == torch.get_num_threads()
    )  # torch's threads when none are given


def test_editing_a_model_file_changes_the_key(tmp_path: Path) -> None:
    model_file = tmp_path / "net.py"
    model_file.write_text("def net(): ...\n")
    before = ProfileKey.of(ProfileRequest(f"{model_file}:net", 8, threads=1))
    model_file.write_text("def net(): return None\n")
    assert ProfileKey.of(ProfileRequest(f"{model_file}:net", 8, threads=1)).sources != before.sources


def test_a_library_is_profiled_once_then_read_back(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path)
    key = ProfileKey.of(ProfileRequest("mlp", 8, threads=1, **QUICK))
    assert cache.get(key) is None
    first = cache.library(key)
    entry = cache.path(key)
    assert sorted(p.name for p in entry.iterdir()) == sorted(["layers.csv", "library.json", KEY_FILE])
    assert json.loads((entry / KEY_FILE).read_text())["torch_version"] == torch.__version__
    assert same_library(cache.library(key), first)
    assert [p.name for p in (tmp_path / "libraries").iterdir()] == [entry.name]  # no staging folder left


def test_a_torch_upgrade_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ProfileCache(tmp_path)
    cache.library(ProfileKey.of(ProfileRequest("mlp", 8, threads=1, **QUICK)))
    monkeypatch.setattr(torch, "__version__", "99.0.0")
    assert cache.get(ProfileKey.of(ProfileRequest("mlp", 8, threads=1, **QUICK))) is None


@pytest.mark.parametrize(
    ("broken_file", "content"),
    [("library.json", "{}"), ("library.json", "not json"), ("layers.csv", "index\nx\n"), (KEY_FILE, "{}")],
)
def test_a_corrupt_entry_is_removed_and_profiled_again(tmp_path: Path, broken_file: str, content: str) -> None:
    cache = ProfileCache(tmp_path)
    key = ProfileKey.of(ProfileRequest("mlp", 8, threads=1, **QUICK))
    cache.library(key)
    (cache.path(key) / broken_file).write_text(content)
    assert cache.get(key) is None
    assert not cache.path(key).exists()
    rebuilt = cache.library(key)
    assert same_library(LayerLibrary.load(cache.path(key)), rebuilt)


def test_the_command_line_and_the_flow_share_one_cache(work_dir: Path) -> None:
    cluster = parse_cluster(
        {
            "name": "one",
            "devices": [{"name": "d", "threads": torch.get_num_threads(), "memory": "1GiB"}],
            "links": {"bandwidth": "1Gbit/s", "latency": "10us"},
        }
    )
    by_flow = profile_cluster_layers.fn("mlp", 8, cluster, 5)
    by_cli = cluster_library("mlp", 8, None, cluster)
    assert same_library(by_cli, by_flow)
    assert len(list((work_dir / ".tapp" / "libraries").iterdir())) == 1


def test_a_cluster_is_profiled_once_per_kind_this_host_has(tmp_path: Path) -> None:
    cluster = parse_cluster(
        {
            "name": "mixed",
            "devices": [
                {"name": "a", "threads": 1, "memory": "1GiB"},
                {"name": "b", "threads": 1, "memory": "1GiB"},
                {"name": "c", "threads": 2, "memory": "1GiB"},
                {"name": "far", "threads": 3, "memory": "1GiB", "host": "another-host"},
                {"name": "gpu", "kind": "cuda", "gpu_model": "NVIDIA H100 80GB HBM3", "memory": "80GiB"},
            ],
            "links": {"bandwidth": "1Gbit/s", "latency": 0},
        }
    )
    # Another host's kind is profiled there; a GPU only where this host has that GPU.
    here = local_kinds(cluster)
    assert here["cpu-t1"] == ("cpu", 1) and here["cpu-t2"] == ("cpu", 2) and "cpu-t3" not in here
    assert ("cuda-NVIDIA H100 80GB HBM3" in here) == (
        torch.cuda.is_available() and torch.cuda.get_device_name(0) == "NVIDIA H100 80GB HBM3"
    )
    cache = ProfileCache(tmp_path)
    library = cache.cluster_libraries("mlp", 8, cluster, kinds=["cpu-t1", "cpu-t2"], **QUICK)
    assert sorted(library.kind_libraries) == ["cpu-t1", "cpu-t2"]
    assert library.kind.name == "cpu-t1"  # the fastest device (the GPU) is not among them: the first asked for
    assert len(list((tmp_path / "libraries").iterdir())) == 2
    again = cache.cluster_libraries("mlp", 8, cluster, kinds=["cpu-t1", "cpu-t2"], **QUICK)
    assert same_library(again.kind_libraries["cpu-t2"], library.kind_libraries["cpu-t2"])  # from the cache
    with pytest.raises(TappError, match=r"cannot profile kind.*cpu-t3"):
        cache.cluster_libraries("mlp", 8, cluster, kinds=["cpu-t3"], **QUICK)
