"""Issue 25's bars, measured: `make run` on a clean checkout, and the section 5.2.2 sweep reported from MLflow.

    .venv/bin/python bench/paper_run.py [--skip-run] [--skip-sweep] [--keep DIR] [--run-args "..."]

``run``: ``make run`` (``tapp run`` on the defaults) in a fresh folder, with fresh caches (the profile is taken
again, the MLflow store and Prefect's home are new), timed from start to exit. It prints the wall time (bar: under
5 minutes on this machine), each of the paper's methods' test accuracy and training time from MLflow (bars: a
number in every accuracy cell; at most 30 s of training per method) and whether ``accuracy_vs_time.png`` was
written.

``sweep``: ``tapp sweep --experiment E --model tiny_cnn --cluster hetero4 --power 1 0.5 --batch-sizes 16 32
--estimate-only`` then ``tapp report --experiment E --out DIR`` in a fresh folder: the files written (bar:
computing_power, batch_size and paper_comparison as .csv, .md and .tex) and their row counts, with both commands'
times. Run it under ``flock /tmp/tapp-heavy.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.fresh_home import fresh_environment  # noqa: E402

TAPP = str(Path(sys.executable).parent / "tapp")
PAPER_METHODS = ("single-cpu", "pipetorch", "bsp", "tapp")
SWEEP = ["--model", "tiny_cnn", "--cluster", "hetero4", "--power", "1", "0.5", "--batch-sizes", "16", "32"]


def timed(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    started = time.monotonic()
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
        raise SystemExit(f"{' '.join(args[:3])} failed with exit status {done.returncode}")
    return seconds, done.stdout


def bench_run(root: Path, extra: str = "") -> None:
    """``make run`` in a fresh checkout copy (its .venv linked), so that nothing of this checkout is reused."""
    checkout = root / "checkout"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        target = checkout / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    (checkout / ".venv").symlink_to(ROOT / ".venv")
    env = fresh_environment(root)
    seconds, output = timed(["make", "-s", "run", *([f"ARGS={extra}"] if extra else [])], checkout, env)
    print(f"make run{f' ARGS={extra!r}' if extra else ''}: {seconds:.0f} s wall (bar: under 300 s)")
    print("\n".join(line for line in output.splitlines() if line.startswith(("tapp_experiment", "| ", "**Test"))))
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{checkout / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tapp")
    trains = client.search_runs([experiment.experiment_id], "tags.run_kind = 'train'")
    by_method = {r.data.tags["method"]: r.data.metrics for r in trains}
    for method in PAPER_METHODS:
        metrics = by_method.get(method, {})
        accuracy, spent = metrics.get("test_accuracy"), metrics.get("train_time_s")
        shown = f"{accuracy:.1%} after {spent:.1f} s of training" if accuracy is not None else "no accuracy"
        print(f"  {method}: {shown}")
    worst = max((m.get("train_time_s", float("nan")) for m in by_method.values()), default=float("nan"))
    print(f"most training time of a method: {worst:.1f} s (bar: at most 30 s)")
    figures = sorted((checkout / "out" / "tapp").glob("*/accuracy_vs_time.png"))  # out/EXPERIMENT/RUN_ID
    print(
        f"accuracy_vs_time.png: {'written' if figures else 'MISSING'} ({figures[-1] if figures else checkout / 'out'})"
    )


def bench_sweep(root: Path) -> None:
    folder = root / "sweep"
    folder.mkdir()
    env = fresh_environment(root)
    seconds, _ = timed([TAPP, "sweep", "--experiment", "E", *SWEEP, "--estimate-only"], folder, env)
    print(f"tapp sweep ... --estimate-only: {seconds:.0f} s")
    seconds, _ = timed([TAPP, "report", "--experiment", "E", "--out", "DIR"], folder, env)
    print(f"tapp report --experiment E --out DIR: {seconds:.0f} s")
    for name in ("computing_power", "batch_size", "paper_comparison"):
        written = [suffix for suffix in ("csv", "md", "tex") if (folder / "DIR" / f"{name}.{suffix}").is_file()]
        rows = len((folder / "DIR" / f"{name}.csv").read_text().splitlines()) - 1 if "csv" in written else 0
        print(f"  {name}: {', '.join('.' + s for s in written) or 'MISSING'}; {rows} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-run", action="store_true", help="do not time make run")
    parser.add_argument("--skip-sweep", action="store_true", help="do not run the sweep and its report")
    parser.add_argument("--keep", type=Path, help="work in this folder (kept) instead of a temporary one")
    parser.add_argument("--run-args", default="", help="make run's ARGS (default: none, the defaults)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tapp-paper-run-") as temporary:
        root = options.keep or Path(temporary)
        root.mkdir(parents=True, exist_ok=True)
        if not options.skip_run:
            bench_run(root, options.run_args)
        if not options.skip_sweep:
            bench_sweep(root)


if __name__ == "__main__":
    main()
