"""Issue 35's bars, measured: `make run` on a clean checkout, and the section 5.2.2 sweep reported from MLflow.

    .venv/bin/python bench/paper_run.py [--skip-run] [--skip-sweep] [--keep DIR] [--run-args "..."]

``run``: ``make run`` (``tapp run`` on the defaults) in a fresh folder, with fresh caches (the profile is taken
again, the MLflow store and Prefect's home are new), timed from start to exit. It prints the wall time (bar: under
300 s on this machine), then each of the paper's methods' test accuracy with its Wilson interval and its training
samples, from MLflow (bars: every accuracy's interval clear of chance, 10 % on Fashion-MNIST and CIFAR-10, and the
same training samples for every method), and whether ``accuracy_vs_time.png`` was written.

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
CHANCE = 0.10
"""One of ten classes by chance: the accuracy bar is an interval above it."""
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
    parents = client.search_runs([experiment.experiment_id], "tags.run_kind = 'experiment'")
    parent = parents[0].data.metrics if parents else {}
    samples = {r.data.tags["method"]: r.data.params.get("train_samples") for r in trains}
    clear = []
    for method in PAPER_METHODS:
        accuracy = parent.get(f"{method}_test_accuracy")
        low, high = parent.get(f"{method}_test_accuracy_low"), parent.get(f"{method}_test_accuracy_high")
        if accuracy is None or low is None or high is None:
            print(f"  {method}: no accuracy")
            clear.append(False)
            continue
        print(f"  {method}: {accuracy:.1%} [{low:.1%}, {high:.1%}] after {samples.get(method)} training samples")
        clear.append(low > CHANCE)
    print(f"accuracy intervals clear of chance ({CHANCE:.0%}): {sum(clear)} of {len(clear)}")
    print(f"training samples per method: {sorted({str(v) for v in samples.values()})} (bar: one value)")
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
