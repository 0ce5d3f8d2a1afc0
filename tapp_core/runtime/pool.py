"""A pool of MPI workers that stays up and measures plan after plan (the search's reward source).

One ``mpiexec`` job runs one rank per cluster device; its rank 0 connects back to this process over a socket
and takes jobs from it. Imports and process start are paid once per pool, not per plan. A plan that raises,
runs out of memory or passes its time limit comes back as a failed Measurement and the pool goes on. A rank that
dies (or a plan that hangs past its limit plus a grace period) ends in a failed Measurement that says so, and
the pool is restarted before the call returns.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TypedDict, Unpack

import torch

from tapp_core.cluster import Cluster
from tapp_core.errors import TappError
from tapp_core.metrics import DEFAULT_WARMUP, MIN_STEPS, Measurement
from tapp_core.plan import Plan, PlanError, check_devices, check_replicas, check_shape
from tapp_core.runtime.jobs import MeasureJob, PlanSetup, PrepareJob, Ready, StopJob, TrainJob, WorkJob
from tapp_core.runtime.optim import OptimizerConfig
from tapp_core.runtime.results import Reply, TrainResult
from tapp_core.runtime.wire import ConnectionClosed, recv_message, send_message

DEFAULT_STEPS = DEFAULT_WARMUP + MIN_STEPS
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class StepOptions(TypedDict, total=False):
    """``WorkerPool.run_steps``'s options, which ``measure`` passes on."""

    steps: int
    warmup: int
    seed: int
    emulate: bool | None
    timeout_s: float
    optimizer: OptimizerConfig | None


class PoolError(TappError):
    """The worker pool could not start, or died; the message says why (with the end of the workers' log)."""


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the ``mpich`` wheel's), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return "mpiexec"


def mpiexec_command(cluster: Cluster, program: list[str], mpiexec: str | None = None) -> list[str]:
    """``mpiexec -n <devices> [-hosts h:n,...] program``: rank i runs device i, on the device's host if given."""
    command = [mpiexec or mpiexec_path(), "-n", str(len(cluster.devices))]
    hosts = [d.host for d in cluster.devices]
    if any(hosts):
        if not all(hosts):
            raise PoolError(f"cluster {cluster.name!r} gives a host for some devices but not all")
        groups = [(host, len(list(run))) for host, run in itertools.groupby(hosts)]
        command += ["-hosts", ",".join(f"{host}:{count}" for host, count in groups)]
    return command + program


def check_runnable(plan: Plan, cluster: Cluster) -> None:
    """The checks that need no layer library: shape, devices known and used once, replicas dividing the micro-batch."""
    check_shape(plan)
    check_devices(plan, cluster)
    check_replicas(plan)


class WorkerPool:
    """``with WorkerPool(cluster) as pool: pool.measure(plan)`` — one mpiexec job for many plans."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        python: str = sys.executable,
        mpiexec: str | None = None,
        start_timeout_s: float = 180.0,
        grace_s: float = 20.0,
        env: Mapping[str, str] | None = None,
        bind_host: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.python = python
        self.mpiexec = mpiexec
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.extra_env = dict(env or {})
        self.bind_host = bind_host or (
            "127.0.0.1" if not any(d.host for d in cluster.devices) else socket.gethostname()
        )
        self.restarts = 0
        self.rank_pids: list[int] = []
        self._process: subprocess.Popen[bytes] | None = None
        self._link: socket.socket | None = None
        self._workdir = Path(tempfile.mkdtemp(prefix="tapp-pool-"))
        self._log_path = self._workdir / "workers.log"
        self._log_offset = 0
        self._job_ids = itertools.count(1)

    # --- life cycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None and self._link is not None

    def start(self) -> None:
        if self.alive:
            return
        cluster_file = self._workdir / "cluster.json"
        cluster_file.write_text(self.cluster.model_dump_json())
        listener = socket.create_server((self.bind_host, 0))
        port = listener.getsockname()[1]
        program = [self.python, "-m", "tapp_core.runtime.worker", "--connect", f"{self.bind_host}:{port}"]
        command = mpiexec_command(self.cluster, [*program, "--cluster", str(cluster_file)], self.mpiexec)
        env = {**os.environ, **self.extra_env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
        log = self._log_path.open("ab")
        self._log_offset = log.tell()
        try:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except OSError as exc:
            listener.close()
            raise PoolError(f"cannot start the worker pool with {command[0]}: {exc}") from exc
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                ready, _, _ = select.select([listener], [], [], 0.2)
                if ready:
                    self._link, _ = listener.accept()
                    break
                self._fail_if_exited("while starting")
                if time.monotonic() > deadline:
                    self._kill()
                    raise PoolError(
                        f"the worker pool did not start within {self.start_timeout_s:.0f} s{self._log_tail()}"
                    )
            self._link.settimeout(self.start_timeout_s)
            hello = recv_message(self._link)
            self._link.settimeout(None)
            if not isinstance(hello, Ready):
                raise ConnectionClosed(f"rank 0 greeted with a {type(hello).__name__}")
        except (ConnectionClosed, OSError) as exc:
            self._kill()
            raise PoolError(f"the worker pool failed while starting: {exc}{self._log_tail()}") from exc
        finally:
            listener.close()
        self.rank_pids = [r.pid for r in hello.ranks]

    def close(self) -> None:
        """Shut the workers down (politely, then by force)."""
        if self._process is None:
            return
        if self._link is not None:
            try:
                send_message(self._link, StopJob())
                self._process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def restart(self) -> None:
        self._kill()
        self.restarts += 1
        self.start()

    def _kill(self) -> None:
        """End the MPI job: mpiexec is asked to clean up (SIGINT), then forced; then any rank it left behind."""
        if self._link is not None:
            self._link.close()
            self._link = None
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in self.rank_pids:
            if self._is_our_rank(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _is_our_rank(self, pid: int) -> bool:
        """Whether ``pid`` is still one of this pool's ranks (not a reused pid): its command names our folder."""
        try:
            return str(self._workdir) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False

    def _fail_if_exited(self, when: str) -> None:
        if self._process is not None and self._process.poll() is not None:
            code = self._process.returncode
            self._kill()
            raise PoolError(f"the worker pool exited with status {code} {when}{self._log_tail()}")

    def _log_tail(self, lines: int = 15) -> str:
        try:
            with self._log_path.open("rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return ("; workers' log ends:\n" + "\n".join(text)) if text else ""

    # --- jobs -------------------------------------------------------------------------------------------------

    def _request(self, job: WorkJob) -> Reply:
        """Send ``job`` and wait for its reply; a dead or hung pool is restarted and reported in ``error``."""
        self.start()
        assert self._link is not None and self._process is not None
        deadline = time.monotonic() + job.timeout_s + self.grace_s
        try:
            send_message(self._link, job)
            while True:
                ready, _, _ = select.select([self._link], [], [], 0.1)
                if ready:
                    reply = recv_message(self._link)
                    if not isinstance(reply, Reply) or reply.id != job.id:
                        continue
                    if reply.restart:
                        self.restart()
                        return replace(reply, error=f"{reply.error}; the pool was restarted")
                    return reply
                if self._process.poll() is not None:
                    raise ConnectionClosed(f"mpiexec exited with status {self._process.returncode}")
                if time.monotonic() > deadline:
                    self.restart()
                    no_answer = f"no answer within {job.timeout_s:.0f} s + {self.grace_s:.0f} s grace"
                    return Reply(id=job.id, error=f"timeout: {no_answer}; the pool was restarted")
        except (ConnectionClosed, OSError) as exc:
            return Reply(id=job.id, error=self._restart_after_death(job, exc))

    def _restart_after_death(self, job: WorkJob, exc: Exception) -> str:
        """Restart the pool after a rank died running ``job``; what happened, for the job's error."""
        running = f"preparing model {job.model}" if isinstance(job, PrepareJob) else f"running plan {job.setup.plan.id}"
        message = f"a worker rank died while {running} ({exc}){self._exit_report()}"
        self._kill()
        try:
            self.restarts += 1
            self.start()
            message += "\nthe pool was restarted"
        except PoolError as restart_error:
            message += f"\nrestarting the pool failed too: {restart_error}"
        return message

    def _exit_report(self, wait_s: float = 3.0) -> str:
        """How mpiexec ended (given a moment to notice its dead rank and say so), and the end of its log."""
        assert self._process is not None
        try:
            code = self._process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return f"; mpiexec was still running{self._log_tail()}"
        return f"; mpiexec exited with status {code}{self._log_tail()}"

    def _setup(
        self, plan: Plan, model: str | None, seed: int, emulate: bool | None, optimizer: OptimizerConfig | None
    ) -> PlanSetup:
        """The job's plan setup, with the defaults filled in (the plan's model, the cluster's emulation)."""
        return PlanSetup(
            plan=plan,
            model=model or plan.model,
            seed=seed,
            emulate=self.cluster.emulated if emulate is None else emulate,
            optimizer=optimizer or OptimizerConfig(),
        )

    def prepare(self, model: str, seed: int = 0, timeout_s: float = 300.0) -> float:
        """Build and trace ``model`` on every rank ahead of its first plan; returns the slowest rank's seconds.

        A search calls this once per model, so that no plan's measurement pays for building the model.
        """
        reply = self._request(PrepareJob(id=next(self._job_ids), model=model, seed=seed, timeout_s=timeout_s))
        if reply.error:
            raise PoolError(f"preparing model {model!r} on the workers failed: {reply.error}")
        return reply.setup_s

    def run_steps(
        self,
        plan: Plan,
        model: str | None = None,
        *,
        steps: int = DEFAULT_STEPS,
        warmup: int = DEFAULT_WARMUP,
        seed: int = 0,
        emulate: bool | None = None,
        timeout_s: float = 300.0,
        optimizer: OptimizerConfig | None = None,
        collect_parameters: bool = False,
    ) -> tuple[Measurement, dict[str, torch.Tensor]]:
        """Train ``steps`` steps on synthetic batches (``SyntheticBatches(batch, seed)``) and measure them.

        With ``collect_parameters`` the second item holds every parameter and buffer after the last step, under
        the model's own names; otherwise it is empty.
        """
        setup = self._setup(plan, model, seed, emulate, optimizer)
        if steps <= warmup:
            error = f"{steps} steps leave none after {warmup} warm-up steps"
            return Measurement.failed(plan.id, error, setup.emulate), {}
        try:
            check_runnable(plan, self.cluster)
        except PlanError as exc:
            return Measurement.failed(plan.id, str(exc), setup.emulate), {}
        job = MeasureJob(
            id=next(self._job_ids),
            timeout_s=timeout_s,
            setup=setup,
            steps=steps,
            warmup=warmup,
            collect_parameters=collect_parameters,
        )
        reply = self._request(job)
        if reply.measurement is None:
            return Measurement.failed(plan.id, reply.error or "no measurement came back", setup.emulate), {}
        return reply.measurement, reply.parameters

    def measure(self, plan: Plan, model: str | None = None, **options: Unpack[StepOptions]) -> Measurement:
        """Run ``steps`` training steps of ``plan`` and measure them (options as ``run_steps``'); never raises for a
        failing plan."""
        measurement, _ = self.run_steps(plan, model, **options)
        return measurement

    def train(
        self,
        plan: Plan,
        model: str | None = None,
        *,
        dataset: str = "cifar10",
        data_dir: str | os.PathLike[str] | None = None,
        epochs: int = 1,
        seed: int = 0,
        emulate: bool | None = None,
        timeout_s: float = 24 * 3600.0,
        optimizer: OptimizerConfig | None = None,
        steps_per_epoch: int | None = None,
        augment: bool = False,
    ) -> TrainResult:
        """Train for ``epochs`` epochs on real data and evaluate on the test set after each."""
        setup = self._setup(plan, model, seed, emulate, optimizer)
        failed = TrainResult(plan.id, plan.schedule, dataset, dataset == "synthetic", epochs, emulated=setup.emulate)
        try:
            check_runnable(plan, self.cluster)
        except PlanError as exc:
            failed.error = str(exc)
            return failed
        job = TrainJob(
            id=next(self._job_ids),
            timeout_s=timeout_s,
            setup=setup,
            dataset=dataset,
            data_dir=str(data_dir) if data_dir is not None else None,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            augment=augment,
        )
        reply = self._request(job)
        if reply.train is None:
            failed.error = reply.error or "no training result came back"
            return failed
        return reply.train
