"""``bench/gpu_box.py`` runs end to end without a GPU (``--cpu-only``): this host detected, its kind profiled,
every asked method planned, estimated and measured in turns, and the bars' lines printed (their figures are
the bench's business, not this test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_box_runs_on_a_cpu_only_host(tmp_path: Path) -> None:
    methods = ["single-gpu", "single-cpu", "bsp", "pipetorch", "tapp"]
    command = [sys.executable, str(ROOT / "bench" / "gpu_box.py"), "--cpu-only", "--threads", "1"]
    command += ["--methods", *methods, "--tapp-budget", "8", "--steps", "3", "--warmup", "1"]
    command += ["--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=380, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method "))
    table = lines[header + 1 : next(i for i, line in enumerate(lines) if line.startswith("tiny_cnn: TAPP "))]
    rows = {line.split()[0]: line.split() for line in table}
    assert set(rows) == {"SingleCPU", "BSP", "Pipe-Torch", "TAPP"}  # no GPU here: no SingleGPU row
    for name, row in rows.items():
        estimated, measured = float(row[1]), float(row[2])
        assert estimated > 0 and measured > 0, name
    assert any(line.startswith("cost model |error| over ") for line in lines)
    assert any(
        line.startswith("TAPP <= 1.05 x best of SingleGPU/SingleCPU/BSP/Pipe-Torch, tiny_cnn: ") for line in lines
    )
    assert list((tmp_path / "cache").glob("libraries/tiny_cnn_b64_cpu-t1_*/layers.csv"))
