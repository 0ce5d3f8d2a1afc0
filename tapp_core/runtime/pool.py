"""A pool of MPI workers that stays up and measures plan after plan (the search's reward source).

One ``mpiexec`` job runs one rank per pool device (all of the cluster's by default, or the few a plan uses); its
rank 0 connects back to this process and takes jobs from it. Imports and process start are paid once per pool,
not per plan. A plan that raises, runs out of memory or passes its time limit comes back as a failed Measurement
and the pool goes on. A rank that dies (or a plan that hangs past its limit plus a grace period) ends in a failed
Measurement that says so, and the pool is restarted before the call returns.

Nothing runs that should not, and nothing is left behind:

- The port. The pool listens on loopback, or on this host's name when a device names another host, on a port the
  system picks, or the first free one of ``ports`` (default: the environment variable ``PORTS_VARIABLE``, e.g.
  ``TAPP_POOL_PORTS=50000-50099``, the range to open between hosts). Until rank 0 has proven the pool's key
  (``wire``: a random key per start, given to the ranks in their environment), nothing it sends is unpickled; a
  connection that fails is dropped and logged, and the pool goes on waiting for its rank 0 until the start
  timeout. The port closes once rank 0 is in.
- The processes. The ranks die with this process at any moment, start included (``guard``): mpiexec gets a
  parent-death signal when started from the main thread, every rank on this host watches this process, every rank
  its own parent and its launch deadline, and rank 0 aborts the MPI job when its link closes during a job. ``close`` ends them in order; SIGTERM, while a pool is open and no
  one else handles it, becomes ``SystemExit`` so that ``with`` blocks close their pools; pools still open at
  exit are closed.
- The folder. The pool's ``tapp-pool-*`` folder goes with ``close``; one left by a SIGKILL is removed by the next
  pool to start (``folders``).
- The scale. A pool that would put more ranks on this host than it can hold is refused before anything starts
  (``tapp_core.platform.hosts``; ``allow_oversubscribe`` lifts that).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from tapp_core.errors import TappError
from tapp_core.measure.metrics import DEFAULT_WARMUP, MIN_STEPS, Measurement, run_length
from tapp_core.model.workload import SYNTHETIC, RunSpec, Workload
from tapp_core.paths import PROJECT_ROOT
from tapp_core.plan.plan import Plan, PlanError, check_devices, check_groups, check_shape, check_stages_used
from tapp_core.platform.cluster import Cluster
from tapp_core.platform.hosts import address_toward, is_local_host, overload, oversubscribe_allowed, pool_address
from tapp_core.runtime import faults
from tapp_core.runtime.checkpoint import prepare_checkpoints
from tapp_core.runtime.guard import ProcessId, boot_id, set_parent_death_signal
from tapp_core.runtime.jobs import (
    MeasureJob,
    PlanSetup,
    PrepareJob,
    RankInfo,
    RankSetup,
    Ready,
    StopJob,
    TrainJob,
    WorkJob,
)
from tapp_core.runtime.oom_watch import OomWatch
from tapp_core.runtime.rank_watch import RankWatch
from tapp_core.runtime.results import Reply, TrainResult
from tapp_core.runtime.temp_folders import make_pool_folder, remove_pool_folder, sweep_pool_folders
from tapp_core.runtime.wire import KEY_VARIABLE, ConnectionClosed, Link, accept_rank, new_key

DEFAULT_STEPS = DEFAULT_WARMUP + MIN_STEPS
PORTS_VARIABLE = "TAPP_POOL_PORTS"
HANDSHAKE_TIMEOUT_S = 10.0
"""How long one connection may take to prove the key (rank 0 answers in milliseconds)."""

log = logging.getLogger(__name__)


class PoolError(TappError):
    """The worker pool could not start, or died; the message says why (with the end of the workers' log)."""


class PoolRefused(TappError):
    """The pool was not started: what it was asked for cannot work here (too many ranks for this host, a bad port
    range). Not worth a retry."""


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the ``mpich`` wheel's), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return "mpiexec"


def mpiexec_command(
    cluster: Cluster, program: list[str], mpiexec: str | None = None, devices: Sequence[str] | None = None
) -> list[str]:
    """``mpiexec -n <devices> [-hosts h:n,...] program``: rank i runs ``devices[i]`` (default: the cluster's), on
    the device's host if given.

    With hosts, Hydra starts the ranks on them (with the cluster's ``ssh`` command if it names one), and its proxies
    there connect back to this machine's address on the route to them (``-localhost``), not to whatever this
    machine's name resolves to (often loopback)."""
    chosen = [cluster.device(name) for name in devices] if devices is not None else list(cluster.devices)
    command = [mpiexec or mpiexec_path(), "-n", str(len(chosen))]
    names = [d.host for d in chosen]
    if any(names):
        if not all(names):
            raise PoolError(f"cluster {cluster.name!r} gives a host for some devices but not all")
        hosts = [str(name) for name in names]
        groups = [(host, len(list(run))) for host, run in itertools.groupby(hosts)]
        command += ["-hosts", ",".join(f"{host}:{count}" for host, count in groups)]
        if cluster.ssh:
            command += ["-launcher", "ssh", "-launcher-exec", cluster.ssh]
        remote = next((host for host in hosts if not is_local_host(host)), None)
        here = address_toward(remote) if remote is not None else None
        if here is not None:
            command += ["-localhost", here]
    return command + program


def check_runnable(plan: Plan, cluster: Cluster) -> None:
    """The checks that need neither the model nor a layer library (the plan's schedule is checked when it is
    made): shape, a layer on every stage, devices known and used once, every device of a group a sample of each
    micro-batch. Raises ``PlanError`` naming the first problem."""
    check_shape(plan)
    check_stages_used(plan.stage_of_layer, plan.n_stages)
    check_devices(plan, cluster)
    check_groups(plan)


def pool_devices(cluster: Cluster, devices: Sequence[str] | None) -> tuple[str, ...]:
    """The devices a pool starts ranks for, in the cluster's order: ``devices``, or all of the cluster's."""
    if devices is None:
        return cluster.device_names
    unknown = sorted(set(devices) - set(cluster.device_names))
    if unknown:
        raise PoolError(f"cluster {cluster.name!r} has no device(s) {', '.join(unknown)}")
    chosen = tuple(name for name in cluster.device_names if name in set(devices))
    if not chosen:
        raise PoolError("a worker pool needs at least one device")
    return chosen


def port_range(text: str | None) -> tuple[int, int] | None:
    """``PORT`` or ``FIRST-LAST`` (``PORTS_VARIABLE``'s form) as a range; None for none given."""
    if text is None or not text.strip():
        return None
    first, _, last = text.strip().partition("-")
    try:
        ports = (int(first), int(last or first))
    except ValueError:
        ports = (0, -1)
    if not 1 <= ports[0] <= ports[1] <= 65535:
        raise PoolRefused(f"{PORTS_VARIABLE} must be PORT or FIRST-LAST with 1 <= FIRST <= LAST <= 65535, got {text!r}")
    return ports


# --- every open pool closes: at exit, and on SIGTERM (made SystemExit while pools are open) --------------------

_open_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
_open_lock = threading.Lock()
_sigterm_installed = False


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _opened(pool: WorkerPool) -> None:
    """Track ``pool``; while pools are open, SIGTERM (if nobody else handles it) unwinds like an exception."""
    global _sigterm_installed
    with _open_lock:
        _open_pools.add(pool)
        if (
            not _sigterm_installed
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            _sigterm_installed = True


def _closed(pool: WorkerPool) -> None:
    global _sigterm_installed
    with _open_lock:
        _open_pools.discard(pool)
        if (
            _sigterm_installed
            and not _open_pools
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm
        ):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _sigterm_installed = False


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_open_pools):
        pool.close()


class WorkerPool:
    """``with WorkerPool(cluster) as pool: pool.measure(plan)`` — one mpiexec job for many plans.

    ``devices`` names the devices to start ranks for (default: all of the cluster's); plans may use those only.
    ``ports`` is the range to listen on (default: ``PORTS_VARIABLE``, else any free port); ``allow_oversubscribe``
    starts more ranks on this host than ``tapp_core.platform.hosts.overload`` deems it can hold (default: its variable).
    """

    def __init__(
        self,
        cluster: Cluster,
        *,
        devices: Sequence[str] | None = None,
        python: str = sys.executable,
        mpiexec: str | None = None,
        start_timeout_s: float = 180.0,
        grace_s: float = 20.0,
        env: Mapping[str, str] | None = None,
        bind_host: str | None = None,
        ports: tuple[int, int] | None = None,
        allow_oversubscribe: bool | None = None,
    ) -> None:
        self.cluster = cluster
        self.devices = pool_devices(cluster, devices)
        self.python = python
        self.mpiexec = mpiexec
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.extra_env = dict(env or {})
        self.bind_host = bind_host or pool_address([cluster.device(d) for d in self.devices])
        self.ports = ports if ports is not None else port_range(os.environ.get(PORTS_VARIABLE))
        self.allow_oversubscribe = allow_oversubscribe
        self.restarts = 0
        self.last_fault: faults.Fault | None = None
        """What the witnesses said of the last job that a rank's death or silence ended (``faults.witness``)."""
        self.ranks: tuple[RankInfo, ...] = ()
        """Every rank's process, in rank order (the pool's devices' order), once started."""
        self.rank_pids: list[int] = []
        """The processes of the ranks that run on this machine (its kernel), once started."""
        self._watch: RankWatch | None = None
        self._oom: OomWatch | None = None
        self.port: int | None = None
        """The port the pool listens on while it starts (None otherwise)."""
        self._token = secrets.token_hex(8)  # on the ranks' command lines: how the pool recognises its own ranks
        self._process: subprocess.Popen[bytes] | None = None
        self._link: Link | None = None
        self._busy = False
        self._folder: Path | None = None
        self._log_offset = 0
        self._job_ids = itertools.count(1)

    # --- life cycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> WorkerPool:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None and self._link is not None

    @property
    def folder(self) -> Path | None:
        """The pool's ``tapp-pool-*`` folder (the workers' log), from the first start until ``close``."""
        return self._folder

    @property
    def _log_path(self) -> Path:
        assert self._folder is not None
        return self._folder / "workers.log"

    def start(self) -> None:
        """Start the MPI job and wait until every rank is up; ``PoolRefused`` before anything starts if this host
        cannot hold the ranks, ``PoolError`` if the job fails to start (anything started is ended)."""
        if self.alive:
            return
        self._check_capacity()
        _opened(self)
        if self._folder is None:
            sweep_pool_folders()
            self._folder = make_pool_folder()
        try:
            self._launch()
        except BaseException:
            self._kill()
            raise

    def close(self) -> None:
        """Shut the workers down (politely between jobs, else by force) and remove the pool's folder."""
        try:
            if self._process is not None and self._link is not None and not self._busy:
                try:
                    self._link.send(StopJob())
                    self._process.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()
        finally:
            if self._folder is not None:
                remove_pool_folder(self._folder)
                self._folder = None
            _closed(self)

    def restart(self) -> None:
        self._kill()
        self.restarts += 1
        self.start()

    def _check_capacity(self) -> None:
        if oversubscribe_allowed(self.allow_oversubscribe):
            return
        reason = overload(self.cluster.name, [self.cluster.device(d) for d in self.devices])
        if reason is not None:
            raise PoolRefused(reason)

    def _launch(self) -> None:
        key = new_key()
        listener = self._listen()
        try:
            self.port = listener.getsockname()[1]
            deadline = time.monotonic() + self.start_timeout_s
            self._process = self._spawn(self.port, key)
            self._link = self._accept_rank0(listener, key, deadline)
        finally:
            listener.close()
            self.port = None
        try:
            self._link.send(RankSetup(self.cluster, self.devices))
            hello = self._wait_for_ready(deadline)
        except (ConnectionClosed, OSError) as exc:
            raise PoolError(f"the worker pool failed while starting: {exc}{self._log_tail()}") from exc
        self.ranks = hello.ranks
        self.rank_pids = [r.pid for r in hello.ranks if r.boot == boot_id()]
        local = [r.pid if r.boot == boot_id() else None for r in hello.ranks]
        self._watch = RankWatch(local, self._is_our_rank)
        self._oom = OomWatch(local)

    def _listen(self) -> socket.socket:
        """A listening socket on ``bind_host``: any free port, or the first free one of ``ports``."""
        first, last = self.ports or (0, 0)
        for port in range(first, last + 1):
            try:
                listener = socket.create_server((self.bind_host, port))
                listener.setblocking(False)  # a connection gone between select and accept must not block accept
                return listener
            except OSError as exc:
                if port == last:
                    where = f"port {first}" if first == last else f"ports {first}-{last}"
                    where = "a port" if first == 0 else where
                    raise PoolRefused(f"the worker pool cannot listen on {self.bind_host}, {where}: {exc}") from None
        raise AssertionError("unreachable: the port range is not empty")

    def _spawn(self, port: int, key: bytes) -> subprocess.Popen[bytes]:
        program = [
            *(self.python, "-m", "tapp_core.runtime.worker", "--connect", f"{self.bind_host}:{port}"),
            *("--owner", ProcessId.current().encode(), "--start-timeout", str(self.start_timeout_s)),
            *("--pool", self._token),
        ]
        command = mpiexec_command(self.cluster, program, self.mpiexec, self.devices)
        env = {**os.environ, **self.extra_env, KEY_VARIABLE: key.hex()}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
        # The parent-death signal follows the thread that starts the child: only the main thread lives as long
        # as this process. (From other threads, the ranks' own guards do the job.)
        in_main_thread = threading.current_thread() is threading.main_thread()
        die_with_us = functools.partial(_die_with, os.getpid()) if in_main_thread and sys.platform == "linux" else None
        with self._log_path.open("ab") as log:
            self._log_offset = log.tell()
            try:
                return subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # Ctrl-C reaches this process, which ends the job in order
                    preexec_fn=die_with_us,
                )
            except OSError as exc:
                raise PoolError(f"cannot start the worker pool with {command[0]}: {exc}") from exc

    def _accept_rank0(self, listener: socket.socket, key: bytes, deadline: float) -> Link:
        """Wait for rank 0 to connect and prove the key; strangers are dropped and logged."""
        while True:
            ready, _, _ = select.select([listener], [], [], 0.2)
            if ready:
                try:
                    return accept_rank(listener, key, min(HANDSHAKE_TIMEOUT_S, max(deadline - time.monotonic(), 1.0)))
                except BlockingIOError:
                    continue
                except OSError as exc:  # AuthenticationFailed included
                    log.warning("worker pool on port %s: refused a connection: %s", listener.getsockname()[1], exc)
                    continue
            self._fail_if_exited("while starting")
            if time.monotonic() > deadline:
                raise PoolError(f"the worker pool did not start within {self.start_timeout_s:.0f} s{self._log_tail()}")

    def _wait_for_ready(self, deadline: float) -> Ready:
        assert self._link is not None
        while not select.select([self._link], [], [], 0.2)[0]:
            self._fail_if_exited("while starting")
            if time.monotonic() > deadline:
                raise PoolError(f"the worker pool did not start within {self.start_timeout_s:.0f} s{self._log_tail()}")
        hello = self._link.recv()
        if not isinstance(hello, Ready):
            raise PoolError(f"rank 0 greeted with a {type(hello).__name__}{self._log_tail()}")
        return hello

    def _kill(self) -> None:
        """End the MPI job: mpiexec is asked to clean up (SIGINT), then forced; then any rank it left behind."""
        self._busy = False
        if self._link is not None:
            self._link.close()
            self._link = None
        if self._watch is not None:
            self._watch.close()
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

    def _seen_first(self) -> int | None:
        """The rank this pool saw end alone, first, in its current job (``rank_watch``)."""
        return self._watch.first if self._watch is not None else None

    def _is_our_rank(self, pid: int) -> bool:
        """Whether ``pid`` is still one of this pool's ranks (not a reused pid): its command names our token."""
        try:
            return self._token in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False

    def _fail_if_exited(self, when: str) -> None:
        if self._process is not None and self._process.poll() is not None:
            code = self._process.returncode
            self._kill()
            place = faults.where(self._log_text(), self.ranks, self.cluster, self.devices, self._seen_first())
            raise PoolError(f"the worker pool exited with status {code} {when}{place}{self._log_tail()}")

    def _log_text(self) -> str:
        """What the workers wrote since this start."""
        if self._folder is None:
            return ""
        try:
            with self._log_path.open("rb") as log:
                log.seek(self._log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def _log_tail(self, lines: int = 15) -> str:
        text = self._log_text().strip().splitlines()[-lines:]
        return ("; workers' log ends:\n" + "\n".join(text)) if text else ""

    # --- jobs -------------------------------------------------------------------------------------------------

    def _request(self, job: WorkJob) -> Reply:
        """Send ``job`` and wait for its reply; a dead or hung pool is restarted and reported in ``error``. A pool
        whose MPI job ended since its last job is reported too, not started again in silence: a rank died between
        jobs, and the caller (an elastic training) must learn which."""
        running = f"preparing model {job.model}" if isinstance(job, PrepareJob) else f"running plan {job.setup.plan.id}"
        if self._process is not None and not self.alive:
            return Reply(id=job.id, error=self._restart_after(f"a worker rank died before {running}"))
        self.start()
        try:
            reply = self._exchange(job)
        except (ConnectionClosed, OSError) as exc:
            return Reply(id=job.id, error=self._restart_after(f"a worker rank died while {running} ({exc})"))
        if reply is None:
            no_answer = f"timeout: no answer within {job.timeout_s:.0f} s + {self.grace_s:.0f} s grace"
            return Reply(id=job.id, error=self._restart_after(no_answer, exit_wait_s=0.0))
        if reply.restart:
            return replace(reply, error=self._restart_after(reply.error or "a rank asked for a restart", 0.0))
        return reply

    def _exchange(self, job: WorkJob) -> Reply | None:
        """Send ``job`` and wait for its Reply; None past its time limit and grace. While it runs, the pool is busy:
        a ``close`` then (an interrupt) ends the workers by force instead of queueing a StopJob behind the job."""
        assert self._link is not None and self._process is not None
        deadline = time.monotonic() + job.timeout_s + self.grace_s
        self._busy = True
        self._link.send(job)
        while True:
            ready, _, _ = select.select([self._link], [], [], 0.1)
            if ready:
                reply = self._link.recv()
                if isinstance(reply, Reply) and reply.id == job.id:
                    self._busy = False
                    return reply
                continue
            if self._process.poll() is not None:
                raise ConnectionClosed(f"mpiexec exited with status {self._process.returncode}")
            if time.monotonic() > deadline:
                return None

    def _restart_after(self, what: str, exit_wait_s: float = 3.0) -> str:
        """Restart the pool after ``what`` went wrong in a job; the job's error: what, where it happened
        (``faults.where``), how mpiexec ended and the end of its log, and how the restart went."""
        noticed = time.monotonic()
        report = self._exit_report(exit_wait_s)
        killed = self._oom.killed() if self._oom is not None else []
        fault = faults.witness(self._log_text(), self.ranks, self.cluster, self.devices, self._seen_first(), killed)
        self.last_fault = replace(fault, noticed_at=noticed)
        message = what + self.last_fault.report + report
        self._kill()
        try:
            self.restarts += 1
            self.start()
            message += "\nthe pool was restarted"
        except (PoolError, PoolRefused) as restart_error:
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

    def check_plan(self, plan: Plan) -> None:
        """``check_runnable``, and the plan's devices among this pool's; ``PlanError`` otherwise."""
        check_runnable(plan, self.cluster)
        outside = [d for d in plan.devices if d not in self.devices]
        if outside:
            raise PlanError(
                f"plan uses device(s) {', '.join(outside)} that this pool did not start (it runs {', '.join(self.devices)})"
            )

    def _setup(
        self, plan: Plan, model: str | Workload | RunSpec | None, emulate: bool | None, options: Mapping[str, Any]
    ) -> PlanSetup:
        """The job's plan setup, with the defaults filled in (the plan's model, the cluster's emulation): ``model``
        is a run spec, a workload or a model spec, and ``options`` replace the spec's by name
        (``RunSpec.with_options``)."""
        spec = model if isinstance(model, RunSpec) else RunSpec.of(model or plan.model)
        return PlanSetup(
            plan=plan,
            spec=spec.with_options(**options),
            emulate=self.cluster.emulated if emulate is None else emulate,
        )

    def prepare(self, model: str | Workload, seed: int = 0, timeout_s: float = 300.0) -> float:
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
        model: str | Workload | RunSpec | None = None,
        *,
        steps: int = DEFAULT_STEPS,
        warmup: int = DEFAULT_WARMUP,
        emulate: bool | None = None,
        timeout_s: float = 300.0,
        collect_parameters: bool = False,
        **options: Any,
    ) -> tuple[Measurement, dict[str, torch.Tensor]]:
        """Train ``steps`` steps on synthetic batches of the workload (``SyntheticBatches(batch, seed, workload)``)
        and measure them. ``model`` and ``options`` (``seed``, ``optimizer``...) make the run spec (``_setup``).

        With ``collect_parameters`` the second item holds every parameter and buffer after the last step, under
        the model's own names; otherwise it is empty.
        """
        setup = self._setup(plan, model, emulate, options)
        if steps <= warmup:
            error = f"{steps} steps leave none after {warmup} warm-up steps"
            return Measurement.failed(plan.id, error, setup.emulate), {}
        steps, warmup, tail = run_length(plan.pipeline_schedule, plan.n_stages, plan.micro_batches, steps, warmup)
        try:
            self.check_plan(plan)
        except PlanError as exc:
            return Measurement.failed(plan.id, str(exc), setup.emulate), {}
        job = MeasureJob(
            id=next(self._job_ids),
            timeout_s=timeout_s,
            setup=setup,
            steps=steps,
            warmup=warmup,
            tail=tail,
            collect_parameters=collect_parameters,
        )
        reply = self._request(job)
        if reply.measurement is None:
            return Measurement.failed(plan.id, reply.error or "no measurement came back", setup.emulate), {}
        return reply.measurement, reply.parameters

    def measure(self, plan: Plan, model: str | Workload | RunSpec | None = None, **options: Any) -> Measurement:
        """Run ``steps`` training steps of ``plan`` and measure them (options as ``run_steps``'); never raises for a
        failing plan."""
        measurement, _ = self.run_steps(plan, model, **options)
        return measurement

    def train(
        self,
        plan: Plan,
        model: str | Workload | RunSpec | None = None,
        *,
        emulate: bool | None = None,
        timeout_s: float = 24 * 3600.0,
        **options: Any,
    ) -> TrainResult:
        """Train as the run spec says (``model`` and ``options`` as ``run_steps``': ``dataset``, ``epochs``,
        ``steps_per_epoch``, ``test_samples``, ``checkpoints``...) and evaluate on the test set after each epoch.
        The spec's ``checkpoints``: write them, and resume from one (with its seed, which orders the data); a bad
        one raises ``TrainingCheckpointError`` before any rank starts the job."""
        setup = self._setup(plan, model, emulate, options)
        if setup.spec.checkpoints is not None:
            resolved, resumed_seed = prepare_checkpoints(setup.spec.checkpoints, setup.spec.workload, plan.batch_size)
            setup = replace(setup, spec=setup.spec.with_options(seed=resumed_seed, checkpoints=resolved))
        spec = setup.spec
        synthetic = spec.workload.data == SYNTHETIC
        failed = TrainResult(plan.id, plan.schedule, spec.workload.data, synthetic, spec.epochs, emulated=setup.emulate)
        try:
            self.check_plan(plan)
        except PlanError as exc:
            failed.error = str(exc)
            return failed
        job = TrainJob(id=next(self._job_ids), timeout_s=timeout_s, setup=setup)
        reply = self._request(job)
        if reply.train is None:
            failed.error = reply.error or "no training result came back"
            return failed
        return reply.train


def _die_with(parent: int) -> None:
    """In mpiexec, before it runs: SIGTERM (which mpiexec answers by ending its job) when the thread that started
    it ends; if that already happened, no mpiexec."""
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)
