"""One MPI rank's share of a job: build its stage of the plan, run the engine, report a RankResult.

Every plan runs on fresh communicators, so a failed plan's stray messages cannot reach the next one. A rank
that fails tells the others to abort; every rank answers with a RankResult all the same.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import resource
import statistics
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
from mpi4py import MPI

from tapp_core.model.data import ByteText, InMemoryImages, batch_loader
from tapp_core.model.graph import layer_nodes, trace_model
from tapp_core.model.workload import SyntheticSamples, Workload, open_workload_data
from tapp_core.plan.plan import Plan
from tapp_core.plan.program import tied_reductions
from tapp_core.platform import gpu
from tapp_core.platform.cluster import Cluster, Device
from tapp_core.platform.hosts import configure_threads
from tapp_core.runtime.allocator import release_freed_memory
from tapp_core.runtime.batches import IteratorBatches, SyntheticBatches
from tapp_core.runtime.checkpointing import StageCheckpoints
from tapp_core.runtime.emulation import Emulation, now
from tapp_core.runtime.engine import PlanPlace, StageEngine
from tapp_core.runtime.jobs import MeasureJob, PlanJob, PrepareJob, TrainJob, WorkJob
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer, micro_batch_loss
from tapp_core.runtime.results import OUT_OF_MEMORY, RankResult
from tapp_core.runtime.stage import StageFactory, split_stages
from tapp_core.runtime.transport import Control, PlanAborted, PlanTimeout, Transport, poll, sweep_abandoned


def torch_device(device: Device) -> torch.device:
    if device.kind == "cuda":
        return torch.device("cuda", device.gpu_index or 0)
    return torch.device("cpu")


def tool_rank(cluster_json: Path, tool: str) -> tuple[MPI.Intracomm, Cluster, torch.device] | None:
    """This rank of a short MPI tool (the calibration probe, the ping-pong) that runs one rank per device of the
    cluster in ``cluster_json``: its communicator, the cluster and its torch device, with the device's threads set
    and its GPU claimed before anything is timed. None (with a line on stderr) when the ranks are not the devices."""
    comm = MPI.COMM_WORLD
    cluster = Cluster.model_validate_json(cluster_json.read_text())
    if comm.Get_size() != len(cluster.devices):
        print(f"{tool}: {comm.Get_size()} ranks for {len(cluster.devices)} devices", file=sys.stderr)
        return None
    spec = cluster.devices[comm.Get_rank()]
    configure_threads(spec)
    device = torch_device(spec)
    if device.type == "cuda":
        gpu.claim(device)
    return comm, cluster, device


def plan_stage(plan: Plan, position: int) -> tuple[int, int]:
    """(stage, index in the stage's group) of the device at ``position`` of the plan's device order."""
    for stage, devices in enumerate(plan.stage_devices):
        if position < len(devices):
            return stage, position
        position -= len(devices)
    raise ValueError(f"the plan has no device at position {position}")


def reset_peak_memory(device: torch.device) -> int:
    """Start counting the peak anew; the memory in use now (the baseline a plan's own memory comes on top of).

    On a CPU the baseline is the resident set: the interpreter, torch, MPI's buffers, the models the rank has
    cached. The C allocator first gives back the memory freed by earlier plans (``malloc_trim``), which it would
    otherwise keep and hand out again without the resident set growing: a plan's growth would then hide in it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    release_freed_memory()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the resident-set high-water mark
    return _status_bytes("VmRSS:")


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_bytes("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(field: str) -> int:
    """A field of ``/proc/self/status`` in bytes (``VmRSS:``, ``VmHWM:``); 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


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
    torch.autograd.backward(micro_batch_loss(split(torch.randn(2, 4)), torch.tensor([0, 1]), 2))
    optimizer.step()


class PlanCommunicators:
    """One plan's communicators on this rank, duplicated from the world for the plan alone.

    ``plan`` carries data and aborts, ``header`` the messages' headers; once the rank knows its place,
    ``pipeline`` holds the plan's ranks (for its barriers) and ``replicas`` its stage's replicas (for the
    gradient allreduce), when there are several, and ``layouts`` the same ranks for the layout changes of a stage
    whose layers run split signatures (a communicator of their own: the changes and the gradient reductions are
    started in different orders).
    """

    def __init__(self, world: MPI.Intracomm) -> None:
        self.plan, self._plan_request = world.Idup()
        self.header, self._header_request = world.Idup()
        self.pipeline: MPI.Intracomm | None = None
        self.replicas: MPI.Intracomm | None = None
        self.layouts: MPI.Intracomm | None = None
        self.ties: dict[tuple[int, ...], MPI.Intracomm] = {}
        """Per group of plan positions holding a tied parameter, with this rank among them: their communicator."""

    def wait(self, deadline: float) -> None:
        def past_deadline() -> None:
            if now() > deadline:
                raise PlanTimeout("the plan ran past its time limit while starting")

        poll([self._plan_request, self._header_request], past_deadline)

    def join(self, place: PlanPlace, stage: int) -> MPI.Intracomm:
        """Make the plan's group and this stage's group (only the plan's ranks call this); returns the first."""
        self.pipeline = self.plan.Create_group(self.plan.Get_group().Incl(sorted(place.pool_ranks)))
        ranks = [r for p, r in enumerate(place.pool_ranks) if plan_stage(place.plan, p)[0] == stage]
        if len(ranks) > 1:
            self.replicas = self.plan.Create_group(self.plan.Get_group().Incl(ranks))
            if place.plan.runs_split(stage):
                self.layouts = self.replicas.Dup()
        return self.pipeline

    def join_ties(self, place: PlanPlace, groups: Sequence[tuple[int, ...]]) -> None:
        """Make the communicator of every tie group (plan positions) this rank is in: every member makes its groups
        in the same order (sorted), each with a tag of its own."""
        for tag, group in enumerate(sorted(set(groups))):
            if place.position in group and group not in self.ties:
                ranks = [place.pool_ranks[p] for p in group]
                self.ties[group] = self.plan.Create_group(self.plan.Get_group().Incl(ranks), tag)

    def free(self) -> None:
        """Free them after a plan that ended well; a failed plan's may hold unmatched requests and are left to MPI."""
        for comm in (*self.ties.values(), self.layouts, self.replicas, self.pipeline, self.plan, self.header):
            if comm is not None:
                comm.Free()


class Rank:
    """This process's rank (rank i runs ``devices[i]``, the pool's devices of ``cluster``): runs its share of each
    job."""

    def __init__(self, world: MPI.Intracomm, cluster: Cluster, devices: tuple[str, ...]) -> None:
        self.world = world
        self.rank = world.Get_rank()
        self.cluster = cluster
        self.devices = devices
        self.device_name = devices[self.rank]
        self.device = torch_device(cluster.device(self.device_name))
        if self.device.type == "cuda" and torch.cuda.is_available():  # else its plans fail, saying why
            gpu.claim(self.device)
        self.factory = StageFactory()

    def run(self, job: WorkJob) -> RankResult:
        if isinstance(job, PrepareJob):
            return self.prepare(job)
        return self.run_plan(job)

    def prepare(self, job: PrepareJob) -> RankResult:
        """Build and trace the model now, so that the first plan of it does not pay for that on this rank."""
        start = now()
        result = RankResult(job=job.id, rank=self.rank, device=self.device_name, status="ok")
        try:
            graph_module = self.factory.traced(job.model, job.seed)
            self.factory.split(job.model, job.seed, (0,) * len(layer_nodes(graph_module)), 1)
        except Exception as exc:
            result.status, result.error_kind, result.error = "error", classify(exc), describe(exc)
        result.setup_s = now() - start
        return result

    def run_plan(self, job: PlanJob) -> RankResult:
        """Run this rank's stage of the job's plan (status ``idle`` when the plan does not use this rank)."""
        start = now()
        result = RankResult(job=job.id, rank=self.rank, device=self.device_name, status="ok")
        comms = PlanCommunicators(self.world)
        control = Control(comms.plan, start + job.timeout_s)
        transport: Transport | None = None
        sweep_abandoned()
        try:
            comms.wait(control.deadline)
            setup, plan = job.setup, job.setup.plan
            place = self.place(plan)
            if place is None:
                result.status = "idle"
                comms.free()
                return result
            result.stage, result.replica = plan_stage(plan, place.position)
            pipeline = comms.join(place, result.stage)
            workload, seed = setup.spec.workload, setup.spec.seed
            graph = self.factory.graph(workload, seed)
            comms.join_ties(place, [tie.devices for tie in tied_reductions(plan, graph.shared)])
            result.baseline_memory_bytes = reset_peak_memory(self.device)
            # The split runs the whole model on a few samples (``split_stages``): a transient in the peak, given back
            # before the stage is built so that it does not stay resident under it (the memory model's "model trace").
            self.factory.split(workload, seed, plan.stage_of_layer, plan.n_stages)
            if self.device.type != "cuda":
                release_freed_memory()
            stage = self.factory.stage(workload, seed, plan.stage_of_layer, plan.n_stages, result.stage, self.device)
            emulation = Emulation.for_rank(self.cluster, list(self.devices), self.rank, setup.emulate)
            hosts = {self.cluster.device(d).host for d in plan.devices}
            transport = Transport(comms.plan, comms.header, pipeline, control, emulation, shared_clock=len(hosts) == 1)
            engine = StageEngine(
                stage,
                place,
                graph,
                transport,
                workload.optimizer,
                emulation,
                comms.replicas,
                comms.layouts,
                workload,
                tie_comms=comms.ties,
                seed=setup.spec.seed,
            )
            result.setup_s = now() - start
            if isinstance(job, MeasureJob):
                self._measure(engine, job, result)
            else:
                self._train(engine, job, result)
            result.peak_memory_bytes = peak_memory(self.device)
            comms.free()
        except Exception as exc:
            self._fail(exc, result, control, transport)
        finally:
            control.close()
        return result

    def place(self, plan: Plan) -> PlanPlace | None:
        """This rank's place in ``plan`` (None when the plan does not use its device)."""
        rank_of = {name: i for i, name in enumerate(self.devices)}
        missing = [d for d in plan.devices if d not in rank_of]
        if missing:
            raise ValueError(
                f"plan uses device(s) {', '.join(missing)} that this pool of {self.cluster.name!r} did not start"
            )
        ranks = tuple(rank_of[d] for d in plan.devices)
        return PlanPlace(plan, ranks.index(self.rank), ranks) if self.rank in ranks else None

    def _fail(self, exc: Exception, result: RankResult, control: Control, transport: Transport | None) -> None:
        """Record ``exc`` in ``result``, tell the other ranks (unless they told us) and drop the plan's traffic."""
        result.status = "error"
        result.error_kind = classify(exc)
        result.error = describe(exc)
        if result.error_kind != "aborted":
            where = f"rank {self.rank} ({self.device_name}" + (f", stage {result.stage})" if result.stage >= 0 else ")")
            control.abort(f"{where} failed: {result.error}")
        if transport is not None:
            transport.abandon()
        # A failed plan's communicators may hold unmatched requests; they are left to MPI, not reused.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _measure(self, engine: StageEngine, job: MeasureJob, result: RankResult) -> None:
        batch_size, spec = job.setup.plan.batch_size, job.setup.spec
        batches = SyntheticBatches(batch_size, seed=spec.seed, workload=spec.workload)
        record = engine.train(job.steps, batches)
        result.step_s, result.compute_s, result.loss = record.step_s, record.compute_s, record.loss
        result.wait_s, result.blocked_s = record.wait_s, record.blocked_s
        result.weight_ages = record.weight_ages
        if job.collect_parameters:
            state = engine.full_state()  # a sharded stage gathers its shards: every device of its group takes part
            if result.replica == 0:
                result.parameters = {name: tensor.detach().to("cpu").clone() for name, tensor in state.items()}

    def _train(self, engine: StageEngine, job: TrainJob, result: RankResult) -> None:
        spec = job.setup.spec
        train_set = _dataset(spec.workload, spec.data_dir, True, spec.augment)
        test_set = _dataset(spec.workload, spec.data_dir, False, False).head(spec.test_samples)
        plan, seed = job.setup.plan, spec.seed
        batch_size = plan.batch_size
        meta = {"model": spec.workload.model, "seed": seed, "batch_size": batch_size, "plan": plan.id}
        checkpoints = StageCheckpoints(engine, spec.checkpoints, meta)
        position = checkpoints.restore()
        complete = True
        for epoch in range(position.epoch, spec.epochs):
            if checkpoints.stopped:
                complete = False
                break
            loader = batch_loader(train_set, batch_size, seed=seed, epoch=epoch)
            steps = len(loader) if spec.steps_per_epoch is None else min(len(loader), spec.steps_per_epoch)
            start, state = (position.epoch_step, position.augment_state) if epoch == position.epoch else (0, None)
            records = checkpoints.train_epoch(epoch, start, steps, loader.cursor(start, state))
            for record in records:  # every step's times, for an elastic training's watch on slow devices
                result.step_s += record.step_s
                result.compute_s += record.compute_s
            if checkpoints.stopped and start + sum(len(r.step_s) for r in records) < steps:
                complete = False
                break  # stopped inside the epoch: no evaluation before it ends
            losses = [loss for record in records for loss in record.loss]
            test_loader = batch_loader(test_set, batch_size, seed=seed, shuffle=False, drop_last=False)
            evaluation = engine.evaluate(len(test_loader), IteratorBatches(test_loader, batch_size))
            result.epochs.append(
                {
                    "train_loss": statistics.fmean(losses) if losses else 0.0,
                    "time_s": sum(s for record in records for s in record.step_s),
                    "correct": evaluation.correct,
                    "samples": evaluation.samples,
                    "test_loss_sum": evaluation.loss_sum,
                }
            )
        checkpoints.finish(complete=complete)


@functools.lru_cache(maxsize=2)
def _dataset(
    workload: Workload, data_dir: str | None, train: bool, augment: bool
) -> InMemoryImages | ByteText | SyntheticSamples:
    """A dataset read once per rank for the pool's life: an experiment trains several plans on the same data, and
    reading and padding Fashion-MNIST's training set takes a second or two each time. Nothing changes it in use
    (``open_workload_data``: images, text as bytes, or synthetic samples of the workload's own inputs)."""
    return open_workload_data(workload, data_dir, train, augment)
