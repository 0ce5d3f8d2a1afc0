"""Two first runs at once on a fresh SQLite store: both must finish (bar: every try).

    .venv/bin/python bench/first_runs.py [--tries 5] [--tapp PATH]

Each try starts two ``tapp run --estimate-only`` (tiny_cnn, 2 search rounds, tapp and even split) at the same
moment in a new empty folder, with a private ``TMPDIR`` and one ``PREFECT_HOME`` shared by the tries (migrated by a
first run before the tries, so that its migration is not what is timed or raced). It prints each try's exit
statuses and seconds, the first error line of a failed run, then how many tries both runs finished. ``--tapp``
names another ``tapp`` executable, to show the race on a checkout without the store lock.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.fresh_home import fresh_environment  # noqa: E402

RUN = ["run", "--model", "tiny_cnn", "--estimate-only", "--rounds", "2", "--methods", "tapp,even"]


def first_error(output: str) -> str:
    for line in output.splitlines():
        if "error" in line.lower() or "Error" in line:
            return line.strip()[:160]
    return output.strip().splitlines()[-1][:160] if output.strip() else "(no output)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--tapp", default=str(Path(sys.executable).parent / "tapp"))
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tapp-first-runs-") as temporary:
        root = Path(temporary)
        env = fresh_environment(root)
        warm = root / "warm"
        warm.mkdir()
        subprocess.run([options.tapp, *RUN], cwd=warm, env=env, capture_output=True, check=True)
        both = 0
        for attempt in range(1, options.tries + 1):
            folder = root / f"try{attempt}"
            folder.mkdir()
            started = time.monotonic()
            runs = [
                subprocess.Popen(
                    [options.tapp, *RUN, "--out", f"out{i}"],
                    cwd=folder,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for i in range(2)
            ]
            outputs = [run.communicate()[0] for run in runs]
            codes = [run.returncode for run in runs]
            both += codes == [0, 0]
            print(f"try {attempt}: exit {codes[0]} and {codes[1]} in {time.monotonic() - started:.0f} s", flush=True)
            for code, output in zip(codes, outputs, strict=True):
                if code != 0:
                    print(f"  {first_error(output)}", flush=True)
    print(f"both runs finished in {both} of {options.tries} tries")


if __name__ == "__main__":
    main()
