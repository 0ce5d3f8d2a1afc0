"""What Prefect and MLflow cost in the default experiment (``tapp run``): their share of the wall time (bar: < 10%).

    .venv/bin/python bench/orchestration_overhead.py [--model alexnet --cluster local --bare]

The default experiment runs once, as ``tapp run`` runs it (Prefect's local server started first, in its own
process, while the command imports, checks its inputs and opens the MLflow store), in a fresh folder with a fresh
MLflow SQLite store and fresh Prefect result storage, so nothing is cached. Each piece of orchestration is timed
where it happens:

- MLflow: every ``MlflowClient`` call (outermost calls only), store creation and migration included;
- Prefect: the wait for its local server to answer, the flow call minus its body (the flow run's states), every
  task call minus its body (task states, the profile cache, result persistence), the progress-artifact calls, and
  at the end sending the pending logs and events and stopping the server;
- imports of prefect, mlflow and the flows (the first of them while the server starts);
- the CPU Prefect's local server (a separate process) uses while the flow runs: on 2 cores it competes with the
  MPI ranks, so it is counted in full, as if every second of it had delayed the experiment.

Everything else is the experiment's own work: profiling, search rounds, measurements on the MPI workers,
planners, the cost model, tables and figures. With ``--bare`` the same work then runs again with tapp_core alone
(no Prefect, no MLflow), same seed and budget, and the two wall times are printed side by side as a cross-check
(measured step times vary between the runs, and more when other work shares the machine, so the difference is
noisier than the accounting).

The last line is the overhead share of the orchestrated run's wall time.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The experiment's own imports (torch, the planners, the runtime) are work, not orchestration: done up front.
for _module in (
    "tapp_core.profile.profiler",
    "tapp_core.planners.tapp.search",
    "tapp_core.runtime",
    "pandas",
    "matplotlib",
):
    importlib.import_module(_module)


class Clock:
    """Seconds per category: outermost calls for plain categories; call minus own body for Prefect's runs."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._local = threading.local()

    def wrap(self, category: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """Time ``function`` under ``category``; a call made inside another of the same category is not counted."""

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, category, 0)
            setattr(self._local, category, depth + 1)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(self._local, category, depth)
                if depth == 0:
                    self.seconds[category] += time.perf_counter() - started
                    self.calls[category] += 1

        return timed

    def _frames(self) -> list[list[float]]:
        if not hasattr(self._local, "frames"):
            self._local.frames = []
        return self._local.frames

    def wrap_run(self, category: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """A Prefect flow or task call: its time minus its body's (``wrap_body``) is Prefect's, at every nesting level."""

        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frames = self._frames()
            frames.append([0.0])
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                body = frames.pop()[0]
                self.seconds[category] += time.perf_counter() - started - body
                self.calls[category] += 1

        return timed

    def wrap_body(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                frames = self._frames()
                if frames:
                    frames[-1][0] += time.perf_counter() - started

        return timed


def instrument(clock: Clock, server_cpu_s: Callable[[], float]) -> None:
    """Time MLflow client calls, Prefect task and flow calls against their bodies, and progress artifacts."""
    from mlflow import MlflowClient
    from prefect import Flow, Task

    import tasks.progress
    from flows import experiment as experiment_flow
    from tasks import evaluate, measure, profile, report, search, train

    for name in dir(MlflowClient):
        member = getattr(MlflowClient, name)
        if not name.startswith("_") and callable(member):
            setattr(MlflowClient, name, clock.wrap("mlflow", member))
    MlflowClient.__init__ = clock.wrap("mlflow", MlflowClient.__init__)
    Task.__call__ = clock.wrap_run("prefect tasks", Task.__call__)
    Flow.__call__ = clock.wrap_run("prefect flow", Flow.__call__)
    # A task imported into several modules is one object: wrap it once.
    found = {id(v): v for m in (evaluate, measure, profile, report, search, train) for v in vars(m).values()}
    for value in found.values():
        if isinstance(value, Task):
            value.fn = clock.wrap_body(value.fn)
    flow = experiment_flow.tapp_experiment
    body = flow.fn

    @functools.wraps(body)
    def body_with_server_cpu(*args: Any, **kwargs: Any) -> Any:
        clock.seconds["server cpu at start"] = server_cpu_s()  # its start-up overlapped the imports (or was waited for)
        return body(*args, **kwargs)

    flow.fn = clock.wrap_body(body_with_server_cpu)
    for name in ("create_progress_artifact", "update_progress_artifact"):
        setattr(tasks.progress, name, clock.wrap("progress artifacts", getattr(tasks.progress, name)))


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process and its waited-for children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def orchestrated(args: argparse.Namespace, folder: Path) -> tuple[float, Clock, dict[str, float]]:
    """The default experiment as ``tapp run`` starts it: Prefect's local server first (``flows.server``), then the
    imports, the MLflow store and the flow."""
    clock = Clock()
    started = time.perf_counter()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
    from flows.server import prefect_api

    with prefect_api() as prefect_ready:
        import mlflow  # noqa: F401
        import prefect  # noqa: F401

        from flows.experiment import tapp_experiment
        from tasks.config import ExperimentConfig
        from tasks.tracking import open_store

        clock.seconds["imports"] = time.perf_counter() - started
        server_pids: list[int] = []

        def server_cpu_s() -> float:
            """CPU used so far by Prefect's local server: it runs beside the experiment, on the same cores."""
            return sum(process_cpu_s(pid) for pid in server_pids)

        instrument(clock, server_cpu_s)
        open_store(os.environ["MLFLOW_TRACKING_URI"])  # as `tapp run` does, while the server starts
        waited = time.perf_counter()
        server = prefect_ready()
        clock.seconds["server wait"] = time.perf_counter() - waited
        if server is not None and server.process is not None:
            server_pids.append(server.process.pid)
        from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

        with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: folder / "prefect-results"}):
            # No training: the bare path below does none (it measures the orchestration of the same work).
            config = ExperimentConfig(
                model=args.model, cluster=args.cluster, batch_size=args.batch_size, train_seconds=0
            )
            result = tapp_experiment(config=config, out=str(folder / "report"))
        clock.seconds["server cpu"] = server_cpu_s() - clock.seconds["server cpu at start"]
        stopping = time.perf_counter()
    clock.seconds["shutdown"] = time.perf_counter() - stopping  # pending logs and events sent, server stopped
    wall = time.perf_counter() - started
    step_times = {method: evaluation.step_time_s for method, evaluation in result.evaluations.items()}
    return wall, clock, step_times


def bare(args: argparse.Namespace, folder: Path) -> tuple[float, dict[str, float]]:
    """The same work on tapp_core alone: profile, search rounds, measured rounds, evaluations, tables and figures."""
    from reports.figures import gantt, reward_curve, step_time_bars
    from tapp_core.cost.calibration import cluster_calibration
    from tapp_core.cost.checks import validate
    from tapp_core.cost.context import CostContext
    from tapp_core.cost.simulation import estimate
    from tapp_core.platform.cluster import load_cluster
    from tapp_core.profile.cache import ProfileCache
    from tapp_core.runtime import WorkerPool
    from tapp_core.runtime.pool_race import PoolRounds
    from tasks.config import default_methods
    from tasks.evaluate import baseline_plan
    from tasks.measure import RuntimeSettings
    from tasks.search import SearchBudget

    started = time.perf_counter()
    cluster = load_cluster(args.cluster)
    calibration = cluster_calibration(args.cluster, cluster)  # `tapp calibrate`, else the ideal one
    runtime = RuntimeSettings()
    # The flow profiles every kind of the cluster into a fresh cache in its folder; so does this.
    library = ProfileCache(folder / "bare-cache").cluster_libraries(args.model, args.batch_size, cluster)
    context = CostContext(library, cluster, calibration)
    budget = SearchBudget()
    sampling = budget.sampling_runtime(runtime)

    def run(plan: Any, pool: WorkerPool, settings: RuntimeSettings = runtime) -> Any:
        return pool.measure(
            plan, args.model, steps=settings.steps, warmup=settings.warmup, timeout_s=settings.timeout_s
        )

    with WorkerPool(cluster) as pool:
        measurer = PoolRounds(pool, args.model, sampling.round_steps())
        planner = budget.planner(args.batch_size, 0, checkpoint=folder / "bare-search.pt")
        search = planner.search(context, measurer=measurer)
        history = [search.run_round() for _ in range(search.config.rounds)]
        tapp_plan = search.result()
        rows = []
        measured_plans: dict[str, Any] = {}
        for method in default_methods():
            plan = tapp_plan if method == "tapp" else baseline_plan(method, context, args.batch_size, 0)
            validate(plan, context)
            predicted = estimate(plan, context)
            if plan.id not in measured_plans:  # as the flow does: one measurement per distinct plan
                measured_plans[plan.id] = run(plan, pool)
            rows.append({"group": args.model, "method": method, "step_time_s": measured_plans[plan.id].step_time_s})
            if method == "tapp":
                gantt(predicted, folder / "bare" / "gantt.png")
    import pandas as pd

    frame = pd.DataFrame(rows)
    step_time_bars(frame, folder / "bare" / "step_time.png")
    reward_curve(
        pd.DataFrame({"round": [r.round for r in history], "reward_mean": [r.mean_reward for r in history]}),
        folder / "bare" / "reward_curve.png",
    )
    frame.to_csv(folder / "bare" / "step_time.csv", index=False)
    return time.perf_counter() - started, {row["method"]: row["step_time_s"] for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--bare", action="store_true", help="also run the same work without Prefect and MLflow")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tapp-overhead-") as tmp:
        folder = Path(tmp)
        os.chdir(folder)
        wall, clock, step_times = orchestrated(args, folder)
        parts = {
            "imports (prefect, mlflow, flows)": clock.seconds["imports"],
            "Prefect: waiting for its local server to start": clock.seconds["server wait"],
            "Prefect: the flow call minus its body (run states, engine)": clock.seconds["prefect flow"],
            f"Prefect: {clock.calls['prefect tasks']} task runs (states, cache, results)": clock.seconds[
                "prefect tasks"
            ],
            f"Prefect: {clock.calls['progress artifacts']} progress-artifact calls": clock.seconds[
                "progress artifacts"
            ],
            f"MLflow: {clock.calls['mlflow']} client calls (store, runs, metrics, artifacts)": clock.seconds["mlflow"],
            # Counted as if every CPU second of it had delayed the experiment: an upper bound on 2 shared cores.
            "Prefect: its local server's CPU while the flow ran": clock.seconds["server cpu"],
            "Prefect: sending pending logs and events, stopping the server": clock.seconds["shutdown"],
        }
        overhead = sum(parts.values())
        print(f"default experiment: {args.model} on {args.cluster}, batch {args.batch_size}, measured on the workers")
        print(f"{'orchestrated wall time':<62} {wall:8.1f} s")
        for name, seconds in parts.items():
            print(f"  {name:<60} {seconds:8.2f} s  {seconds / wall:6.1%}")
        print(f"  {'experiment work (everything else)':<60} {wall - overhead:8.2f} s  {(wall - overhead) / wall:6.1%}")
        if args.bare:
            bare_wall, bare_step_times = bare(args, folder)
            # Where the difference lies: the measured step times themselves (contention), or outside them.
            for method, seconds in step_times.items():
                other = bare_step_times.get(method, float("nan"))
                print(
                    f"  measured step time {method:<12} orchestrated {seconds:7.3f} s  bare {other:7.3f} s  {seconds / other:5.2f}x"
                )
            print(f"{'same work without Prefect and MLflow (bare) wall time':<62} {bare_wall:8.1f} s")
            print(f"{'side by side: (orchestrated - bare) / orchestrated':<62} {(wall - bare_wall) / wall:8.1%}")
    print(f"orchestration overhead (Prefect + MLflow) share of the default experiment: {overhead / wall:.1%}")


if __name__ == "__main__":
    main()
