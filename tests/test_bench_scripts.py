"""Every benchmark script still starts: its imports resolve against today's code and its options parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.read_text().find("argparse") >= 0)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_the_benchmark_starts(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
