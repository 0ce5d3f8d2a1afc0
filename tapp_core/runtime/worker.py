"""The per-rank entry point, run under mpiexec with one rank per cluster device (rank i = device i).

    python -m tapp_core.runtime.worker --connect HOST:PORT --cluster cluster.json

Rank 0 coordinates: it connects to the pool in the parent process, takes jobs from it, hands each job to the
other ranks, runs its own share, gathers every rank's result and answers with one Measurement (or training
result). Every job runs on fresh communicators, so a failed plan's stray messages cannot reach the next one. A
rank that fails tells the others to abort, and every rank answers; the pool goes on with the next job.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import os
import resource
import select
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

from tapp_core.cluster import Cluster
from tapp_core.data import batch_loader, open_dataset
from tapp_core.graph import layer_nodes, trace_model
from tapp_core.plan import Plan
from tapp_core.runtime.batches import IteratorBatches, SyntheticBatches
from tapp_core.runtime.emulation import Emulation, configure_threads, now
from tapp_core.runtime.engine import StageEngine
from tapp_core.runtime.layout import Layout
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer, micro_batch_loss
from tapp_core.runtime.results import (
    OUT_OF_MEMORY,
    RankResult,
    assemble_measurement,
    assemble_training,
    first_error,
)
from tapp_core.runtime.stage import StageFactory, split_stages
from tapp_core.runtime.transport import Control, PlanAborted, PlanTimeout, Transport, poll, sweep_abandoned
from tapp_core.runtime.wire import ConnectionClosed, recv_message, send_message
from tapp_core.schedules import schedule_for

JOB_TAG = 11
RESULT_TAG = 12
RESULT_GRACE_S = 5.0
"""How long past a job's time limit rank 0 waits for the other ranks before it asks for a restart."""
_IDLE_POLL_S = 0.5e-3


def torch_device(cluster: Cluster, rank: int) -> torch.device:
    device = cluster.devices[rank]
    if device.kind == "cuda":
        return torch.device("cuda", device.gpu_index or 0)
    return torch.device("cpu")


def plan_ranks(layout: Layout) -> list[int]:
    return [rank for ranks in layout.stage_ranks for rank in ranks]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the resident-set high-water mark


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def classify(exc: BaseException) -> str:
    if isinstance(exc, PlanAborted):
        return "aborted"
    if isinstance(exc, PlanTimeout):
        return "timeout"
    text = str(exc).lower()
    if (
        isinstance(exc, MemoryError | torch.OutOfMemoryError)
        or "can't allocate memory" in text
        or "out of memory" in text
    ):
        return OUT_OF_MEMORY
    return "exception"


def describe(exc: BaseException) -> str:
    if isinstance(exc, PlanAborted | PlanTimeout):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {str(exc)[:2000]}{where}"


def warm_up() -> None:
    """Pay the first-call costs of the runtime's libraries (fx splitting, the optimiser, autograd) at start-up,
    not in the first plan's measurement."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    traced = trace_model(model)
    split, _ = split_stages(traced, (0, 0, 1), 2, input_shape=(4,))
    optimizer = make_optimizer(split.parameters(), OptimizerConfig())
    micro_batch_loss(split(torch.randn(2, 4)), torch.tensor([0, 1]), 2).backward()
    optimizer.step()


class Worker:
    """One rank: runs its share of each job."""

    def __init__(self, world: MPI.Intracomm, cluster: Cluster) -> None:
        self.world = world
        self.rank = world.Get_rank()
        self.cluster = cluster
        self.device_name = cluster.devices[self.rank].name
        self.device = torch_device(cluster, self.rank)
        self.factory = StageFactory()

    def run(self, job: dict[str, Any]) -> RankResult:
        if job["kind"] == "prepare":
            return self.prepare(job)
        start = now()
        deadline = start + float(job["timeout_s"])
        result = RankResult(job=job["id"], rank=self.rank, device=self.device_name, status="ok")
        plan_comm, dup_request = self.world.Idup()
        header_comm, header_request = self.world.Idup()

        def past_deadline() -> None:
            if now() > deadline:
                raise PlanTimeout("the plan ran past its time limit while starting")

        control = Control(plan_comm, deadline)
        replica_comm: MPI.Intracomm | None = None
        transport: Transport | None = None
        sweep_abandoned()
        try:
            poll([dup_request, header_request], past_deadline)
            plan = Plan.from_dict(job["plan"])
            rank_of = {name: i for i, name in enumerate(self.cluster.device_names)}
            missing = [d for d in plan.devices if d not in rank_of]
            if missing:
                raise ValueError(f"plan uses device(s) {', '.join(missing)} that cluster {self.cluster.name!r} lacks")
            layout = Layout(
                tuple(tuple(rank_of[d] for d in devs) for devs in plan.stage_devices), plan.micro_batch_size
            )
            position = layout.position(self.rank)
            if position is None:
                result.status = "idle"
                plan_comm.Free()
                header_comm.Free()
                return result
            result.stage, result.replica = position
            # Only the plan's ranks take part in its barriers and allreduces; the others are already idle.
            pipeline_comm = plan_comm.Create_group(plan_comm.Get_group().Incl(sorted(plan_ranks(layout))))
            ranks = layout.stage_ranks[result.stage]
            if len(ranks) > 1:
                replica_comm = plan_comm.Create_group(plan_comm.Get_group().Incl(list(ranks)))
            reset_peak_memory(self.device)
            stage = self.factory.stage(
                job["model"], int(job["seed"]), plan.stage_of_layer, plan.n_stages, result.stage, self.device
            )
            emulation = Emulation.for_rank(self.cluster, list(self.cluster.device_names), self.rank, job["emulate"])
            hosts = {self.cluster.device(d).host for d in plan.devices}
            transport = Transport(
                plan_comm, header_comm, pipeline_comm, control, emulation, shared_clock=len(hosts) == 1
            )
            engine = StageEngine(
                stage,
                layout,
                self.rank,
                transport,
                schedule_for(plan.schedule),
                OptimizerConfig(**job["optimizer"]),
                emulation,
                plan.batch_size,
                plan.micro_batches,
                replica_comm,
            )
            result.setup_s = now() - start
            if job["kind"] == "measure":
                self._measure(engine, plan, job, result)
            else:
                self._train(engine, plan, job, result)
            if job.get("collect_parameters") and result.replica == 0:
                result.parameters = {n: t.detach().to("cpu").clone() for n, t in stage.named_state().items()}
            result.peak_memory_bytes = peak_memory(self.device)
            if replica_comm is not None:
                replica_comm.Free()
            pipeline_comm.Free()
            plan_comm.Free()
            header_comm.Free()
        except Exception as exc:
            result.status = "error"
            result.error_kind = classify(exc)
            result.error = describe(exc)
            if result.error_kind != "aborted":
                where = f"rank {self.rank} ({self.device_name}" + (
                    f", stage {result.stage})" if result.stage >= 0 else ")"
                )
                control.abort(f"{where} failed: {result.error}")
            if transport is not None:
                transport.abandon()
            # A failed plan's communicators may hold unmatched requests; they are left to MPI, not reused.
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            control.close()
        return result

    def prepare(self, job: dict[str, Any]) -> RankResult:
        """Build and trace the model now, so that the first plan of it does not pay for that on this rank."""
        start = now()
        result = RankResult(job=job["id"], rank=self.rank, device=self.device_name, status="ok")
        try:
            graph_module, _ = self.factory.traced(job["model"], int(job["seed"]))
            self.factory.split(job["model"], int(job["seed"]), (0,) * len(layer_nodes(graph_module)), 1)
        except Exception as exc:
            result.status, result.error_kind, result.error = "error", classify(exc), describe(exc)
        result.setup_s = now() - start
        return result

    def _measure(self, engine: StageEngine, plan: Plan, job: dict[str, Any], result: RankResult) -> None:
        batches = SyntheticBatches(plan.batch_size, seed=int(job["seed"]), input_shape=self.factory.input_shape)
        record = engine.train(int(job["steps"]), batches)
        result.step_s, result.compute_s, result.loss = record.step_s, record.compute_s, record.loss
        result.wait_s, result.blocked_s = record.wait_s, record.blocked_s

    def _train(self, engine: StageEngine, plan: Plan, job: dict[str, Any], result: RankResult) -> None:
        train_set = open_dataset(job["dataset"], job.get("data_dir"), train=True, augment=job.get("augment", False))
        test_set = open_dataset(job["dataset"], job.get("data_dir"), train=False)
        seed = int(job["seed"])
        for epoch in range(int(job["epochs"])):
            loader = batch_loader(train_set, plan.batch_size, seed=seed, epoch=epoch)
            steps = len(loader) if job.get("steps_per_epoch") is None else min(len(loader), job["steps_per_epoch"])
            record = engine.train(steps, IteratorBatches(loader, plan.batch_size))
            test_loader = batch_loader(test_set, plan.batch_size, seed=seed, shuffle=False, drop_last=False)
            evaluation = engine.evaluate(len(test_loader), IteratorBatches(test_loader, plan.batch_size))
            result.epochs.append(
                {
                    "train_loss": statistics.fmean(record.loss) if record.loss else 0.0,
                    "time_s": sum(record.step_s),
                    "correct": evaluation.correct,
                    "samples": evaluation.samples,
                    "test_loss_sum": evaluation.loss_sum,
                }
            )


def assemble(job: dict[str, Any], results: list[RankResult]) -> dict[str, Any]:
    reply: dict[str, Any] = {"id": job["id"]}
    if job["kind"] == "prepare":
        reply["error"] = first_error(results)
        reply["setup_s"] = max(r.setup_s for r in results)
        return reply
    plan = Plan.from_dict(job["plan"])
    if job["kind"] == "measure":
        reply["measurement"] = assemble_measurement(
            plan.id, results, int(job["warmup"]), bool(job["emulate"]), plan.n_stages
        )
        if job.get("collect_parameters"):
            parameters: dict[str, torch.Tensor] = {}
            for r in results:
                parameters.update(r.parameters or {})
            reply["parameters"] = parameters
    else:
        reply["train"] = assemble_training(
            plan.id,
            plan.schedule,
            job["dataset"],
            job["dataset"] == "synthetic",
            int(job["epochs"]),
            results,
            bool(job["emulate"]),
            plan.n_stages,
        )
    return reply


def _wait_for_job(world: MPI.Intracomm) -> dict[str, Any]:
    while True:
        message = world.improbe(source=0, tag=JOB_TAG)
        if message is not None:
            return message.recv()
        time.sleep(_IDLE_POLL_S)


def _collect(world: MPI.Intracomm, job: dict[str, Any], own: RankResult) -> tuple[list[RankResult], list[int]]:
    """Every rank's result for ``job``; also the ranks that did not answer in time."""
    results = {0: own}
    deadline = now() + float(job["timeout_s"]) + RESULT_GRACE_S
    waiting = set(range(1, world.Get_size()))
    while waiting and now() < deadline:
        for rank in sorted(waiting):
            message = world.improbe(source=rank, tag=RESULT_TAG)
            if message is None:
                continue
            result: RankResult = message.recv()
            if result.job == job["id"]:  # answers to an earlier, abandoned job are dropped
                results[rank] = result
                waiting.discard(rank)
        if waiting:
            time.sleep(_IDLE_POLL_S)
    return [results[r] for r in sorted(results)], sorted(waiting)


def _send_all(world: MPI.Intracomm, job: dict[str, Any]) -> None:
    requests = [world.isend(job, rank, JOB_TAG) for rank in range(1, world.Get_size())]
    poll(requests, lambda: None)


def _watch_pool(link: socket.socket, busy: threading.Event) -> None:
    """Abort the whole MPI job if the pool's process goes away while a job runs (no orphaned ranks)."""
    while True:
        readable, _, _ = select.select([link], [], [], 0.5)
        if not readable:
            continue
        if not busy.is_set():
            time.sleep(0.05)  # a new job: the main thread reads it
            continue
        try:
            gone = link.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            gone = True
        if gone:
            print("worker: the pool's process is gone; aborting the MPI job", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(3)


def coordinate(world: MPI.Intracomm, worker: Worker, link: socket.socket) -> None:
    busy = threading.Event()
    threading.Thread(target=_watch_pool, args=(link, busy), daemon=True).start()
    while True:
        try:
            job = recv_message(link)
        except (ConnectionClosed, OSError):
            job = {"kind": "shutdown"}  # the pool's process is gone: take every rank down with us
        _send_all(world, job)
        if job["kind"] == "shutdown":
            return
        busy.set()
        own = worker.run(job)
        results, silent = _collect(world, job, own)
        busy.clear()
        if silent:
            reply: dict[str, Any] = {
                "id": job["id"],
                "restart": True,
                "error": f"rank(s) {', '.join(map(str, silent))} did not finish the plan within its time limit",
            }
        else:
            try:
                reply = assemble(job, results)
            except Exception as exc:
                reply = {"id": job["id"], "error": f"assembling the results failed: {describe(exc)}"}
        send_message(link, reply)


def follow(world: MPI.Intracomm, worker: Worker) -> None:
    while True:
        job = _wait_for_job(world)
        if job["kind"] == "shutdown":
            return
        result = worker.run(job)
        poll([world.isend(result, 0, RESULT_TAG)], lambda: None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="HOST:PORT of the pool")
    parser.add_argument("--cluster", required=True, help="the cluster as JSON")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <rank pid>` prints where a rank is stuck
    world = MPI.COMM_WORLD
    cluster = Cluster.model_validate_json(Path(args.cluster).read_text())
    if world.Get_size() != len(cluster.devices):
        print(f"worker: {world.Get_size()} ranks for {len(cluster.devices)} devices", file=sys.stderr)
        return 2
    configure_threads(cluster.devices[world.Get_rank()])
    warm_up()
    worker = Worker(world, cluster)
    ranks = world.gather({"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv}, root=0)
    if world.Get_rank() == 0:
        host, _, port = args.connect.rpartition(":")
        with socket.create_connection((host, int(port))) as link:
            send_message(link, {"kind": "ready", "ranks": ranks, "torch": torch.__version__})
            coordinate(world, worker, link)
    else:
        follow(world, worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
