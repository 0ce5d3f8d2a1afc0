"""What a rank's C allocator keeps of the memory it freed (``tapp_core.runtime.allocator``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tapp_core.paths import PROJECT_ROOT
from tapp_core.platform.testbed.cgroups import Cgroups
from tapp_core.runtime import allocator

MiB = 2**20

# Frees 64 MiB of 1 MiB blocks that lie below a live one; prints what stays resident, in MiB. A 16 MiB block freed
# first raises glibc's moving threshold, so that the 1 MiB blocks come from its heap unless it is fixed.
PROBE = """
import sys
from tapp_core.runtime import allocator
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
if sys.argv[1] == "bounded":
    allocator.memory_limit = lambda: 2**30
    assert allocator.bound_freed_memory(2**31)
big = bytearray(16 << 20)
del big
before = rss()
blocks = [bytearray(1 << 20) for _ in range(64)]
live = bytearray(200 << 10)
del blocks
print((rss() - before) / 2**20)
"""


def _kept_mib(mode: str, environment: dict[str, str] | None = None) -> float:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env = {**inherited, "PYTHONPATH": str(PROJECT_ROOT), **(environment or {})}
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return float(run.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_bounded_rank_gives_back_what_it_freed_where_glibc_would_keep_it() -> None:
    assert _kept_mib("default") > 48
    assert _kept_mib("bounded") < 8
    # started in the environment bench/memory.py gives its ranks, as bounded from its start
    assert _kept_mib("default", allocator.bounding_environment()) < 8


def test_a_rank_is_bounded_only_under_a_limit_within_its_device_s_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "memory_limit", lambda: None)
    assert not allocator.bound_freed_memory(8 * MiB)
    monkeypatch.setattr(allocator, "memory_limit", lambda: 16 * MiB)
    assert not allocator.bound_freed_memory(8 * MiB)  # a container larger than the device: speed first


def test_the_limit_is_the_lowest_of_the_group_and_those_above_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "host" / "rank").mkdir(parents=True)
    (tmp_path / "host" / "memory.max").write_text(f"{800 * MiB}\n")
    (tmp_path / "host" / "rank" / "memory.max").write_text("max\n")
    cgroups = Cgroups(2, tmp_path, None, tmp_path)
    monkeypatch.setattr(Cgroups, "find", classmethod(lambda cls: cgroups))
    monkeypatch.setattr(Cgroups, "memory_group_of", lambda self, pid="self": "host/rank")
    assert allocator.memory_limit() == 800 * MiB
    monkeypatch.setattr(Cgroups, "memory_group_of", lambda self, pid="self": "")
    assert allocator.memory_limit() is None
