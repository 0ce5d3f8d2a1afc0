"""Our runtime against PyTorch's own: a 2-stage pipeline on CPUs, or a single-stage plan on a GPU.

``--against pipelining`` (the default on CPUs): our GPipe against torch.distributed.pipelining's ScheduleGPipe
(gloo), same model, same 2 stages, same micro-batches, 2 ranks, emulation off, one process tree (one
mpiexec job runs both), alternating runs.

    .venv/bin/python bench/runtime_vs_torch.py [--model alexnet --batch-size 32 --micro-batches 4 --rounds 6]

A step is timed on each rank from a common barrier to the end of its optimiser step, and the step time is the
slowest rank's (DESIGN.md). Each block of steps drops its first step; the first round is warm-up. The last line
is the ratio of median step times, ours / theirs (bar: <= 1.05).

``--against plain`` (the default with ``--device cuda``; on the GPU machine, with its kit: ``source
.device-kit/setup.sh && python3 bench/runtime_vs_torch.py --device cuda``): for each model (default
``alexnet,vgg16``, batch 64, one micro-batch), the single-stage plan on GPU 0 (or on one CPU rank) measured by a ``WorkerPool`` (``pool.measure``: what TAPP measures)
against a plain loop in this process with the same model, batches, loss and optimiser (SGD with momentum): the
batches already on the device, forward, backward, ``optimizer.step()``, the loss read at the end of the step.
Both time a step up to a ``torch.cuda.synchronize()`` on a GPU; each run of ``--steps`` steps drops its first two, the first
round is warm-up, and the two alternate (ours first in even rounds). The last line per model is the ratio of
median step times, ours / plain (bar: <= 1.10).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tapp_core.runtime import WorkerPool

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--against", choices=("pipelining", "plain"), default=None, help="default: pipelining (cpu), plain (cuda)"
    )
    parser.add_argument(
        "--model", default=None, help="default alexnet; with --device cuda, a comma list (alexnet,vgg16)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="default 32 (cpu), 64 (cuda)")
    parser.add_argument("--micro-batches", type=int, default=None, help="default 4 (cpu), 1 (cuda)")
    parser.add_argument(
        "--cut", type=int, default=None, help="first layer of stage 1 (default: the most balanced by profiled time)"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=None, help="steps per run: default 4 (cpu), 20 (cuda)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.against = args.against or ("plain" if gpu else "pipelining")
    if gpu and args.against != "plain":
        parser.error("--device cuda compares with the plain loop only (--against plain)")
    gpu = args.against == "plain"  # the plain-loop comparison's defaults, on either device
    args.model = args.model or ("alexnet,vgg16" if gpu else "alexnet")
    args.batch_size = args.batch_size or (64 if gpu else 32)
    args.micro_batches = args.micro_batches or (1 if gpu else 4)
    args.steps = args.steps or (20 if gpu else 4)
    return args


def balanced_cut(model: str, micro_batch_size: int, threads: int) -> int:
    """The first layer of stage 1 that makes the slower stage as fast as it can be (profiled fwd + bwd time)."""
    from tapp_core.profile.profiler import ProfileRequest, profile_model

    library = profile_model(ProfileRequest(model, batch_size=micro_batch_size, threads=threads, repeats=3, warmup=1))
    times = [layer.forward_s + layer.backward_s for layer in library.layers]
    return min(range(1, len(times)), key=lambda cut: max(sum(times[:cut]), sum(times[cut:])))


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn import functional as F

    from tapp_core.model.graph import layer_nodes
    from tapp_core.model.zoo import build_traced_model
    from tapp_core.plan.plan import Plan
    from tapp_core.runtime.batches import SyntheticBatches
    from tapp_core.runtime.emulation import Emulation
    from tapp_core.runtime.engine import PlanPlace, StageEngine
    from tapp_core.runtime.optim import OptimizerConfig, make_optimizer
    from tapp_core.runtime.stage import StageFactory, split_stages
    from tapp_core.runtime.transport import Control, Transport

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    n_layers = len(layer_nodes(build_traced_model(args.model)))
    stage_of_layer = tuple(int(i >= args.cut) for i in range(n_layers))
    plan = Plan(args.model, args.batch_size, args.micro_batches, "gpipe", stage_of_layer, (("d0",), ("d1",)))
    optimizer = OptimizerConfig(lr=0.01, momentum=0.9)
    batches = SyntheticBatches(args.batch_size, seed=0)
    cpu = torch.device("cpu")

    # Ours: the engine on its own communicators, as a pool worker runs it.
    factory = StageFactory()
    stage = factory.stage(args.model, 0, stage_of_layer, 2, rank, cpu)
    control = Control(world.Dup(), deadline=float("inf"))
    transport = Transport(world.Dup(), world.Dup(), world.Dup(), control, Emulation(enabled=False))
    place = PlanPlace(plan, rank, (0, 1))
    engine = StageEngine(stage, place, factory.graph(args.model, 0), transport, optimizer, Emulation(enabled=False))

    # Theirs: the same split of a separately built copy of the same model.
    split, _ = split_stages(build_traced_model(args.model, seed=0), stage_of_layer, 2)
    submodule = split.get_submodule(f"submod_{rank}")
    their_stage = PipelineStage(submodule, rank, 2, cpu, group=dist.group.WORLD)
    schedule = ScheduleGPipe(their_stage, args.micro_batches, loss_fn=lambda out, target: F.cross_entropy(out, target))
    their_optimizer = make_optimizer(submodule.parameters(), optimizer)

    def run_ours(steps: int) -> list[float]:
        return engine.train(steps, batches).step_s

    def run_theirs(steps: int) -> list[float]:
        times = []
        for step in range(steps):
            x, y = batches.get(step)
            world.Barrier()
            start = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            their_optimizer.step()
            their_optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return times

    def cpu_seconds() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    kept: dict[str, list[float]] = {"ours": [], "theirs": []}
    cpu: dict[str, list[float]] = {"ours": [], "theirs": []}
    paired: list[float] = []
    for round_index in range(args.rounds):
        order = ("ours", "theirs") if round_index % 2 == 0 else ("theirs", "ours")
        medians = {}
        for system in order:
            cpu_start = cpu_seconds()
            local = np.array(run_ours(args.steps) if system == "ours" else run_theirs(args.steps))
            used = world.allreduce(cpu_seconds() - cpu_start) / args.steps
            slowest = np.empty_like(local)
            world.Allreduce(local, slowest, op=MPI.MAX)
            medians[system] = float(np.median(slowest[1:]))
            if round_index > 0:
                kept[system] += list(slowest[1:])
                cpu[system].append(used)
            if rank == 0:
                times = " ".join(f"{t * 1e3:7.1f}" for t in slowest)
                print(
                    f"round {round_index} {system:6s} {times} ms; CPU of both ranks {used * 1e3:6.1f} ms/step",
                    flush=True,
                )
        if round_index > 0:
            paired.append(medians["ours"] / medians["theirs"])
    if rank == 0:
        print(
            f"CPU per step (both ranks, median): ours {statistics.median(cpu['ours']) * 1e3:.1f} ms, "
            f"theirs {statistics.median(cpu['theirs']) * 1e3:.1f} ms"
        )
        print(f"median of the per-round ratios (adjacent runs, same load): {statistics.median(paired):.3f}")
        ours, theirs = statistics.median(kept["ours"]), statistics.median(kept["theirs"])
        print(
            f"model {args.model}, batch {args.batch_size}, {args.micro_batches} micro-batches, cut at layer {args.cut}"
        )
        print(
            f"median step: ours {ours * 1e3:.1f} ms ({len(kept['ours'])} steps), torch ScheduleGPipe {theirs * 1e3:.1f} ms ({len(kept['theirs'])} steps)"
        )
        print(f"ratio ours/theirs (median step time): {ours / theirs:.3f}")
    dist.destroy_process_group()


PLAIN_WARMUP_STEPS = 2
"""Steps dropped at the start of every run of the plain-loop comparison (ours and the plain loop's)."""


class PlainLoop:
    """The plain PyTorch loop: the model, its batches (made on the CPU like ours, then put on the device before
    any timing), the runtime's loss and optimiser."""

    def __init__(self, model: str, batch_size: int, micro_batches: int, batches: int, device: str) -> None:
        import torch

        from tapp_core.model.zoo import build_model
        from tapp_core.runtime.batches import SyntheticBatches
        from tapp_core.runtime.optim import OptimizerConfig, make_optimizer

        self.device = torch.device(device, 0) if device == "cuda" else torch.device(device)
        self.net = build_model(model, seed=0).to(self.device).train()
        self.optimizer = make_optimizer(self.net.parameters(), OptimizerConfig())
        source = SyntheticBatches(batch_size, seed=0)
        self.batches = [tuple(t.to(self.device) for t in source.get(step)) for step in range(batches)]
        self.batch_size = batch_size
        self.micro_batches = micro_batches

    def run(self, steps: int) -> list[float]:
        import torch

        from tapp_core.runtime.optim import micro_batch_loss

        size = self.batch_size // self.micro_batches
        times = []
        for step in range(steps):
            start = time.perf_counter()
            x, y = self.batches[step % len(self.batches)]
            total = torch.zeros((), device=self.device)
            for j in range(self.micro_batches):
                rows = slice(j * size, (j + 1) * size)
                loss = micro_batch_loss(self.net(x[rows]), y[rows], self.batch_size)
                loss.backward()
                total += loss.detach()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            float(total)
            times.append(time.perf_counter() - start)
        return times


def compare_with_plain(pool: WorkerPool, model: str, args: argparse.Namespace) -> float:
    """Interleaved runs of the single-stage plan (``pool``, its one device) and the plain loop; returns ours / plain."""
    from tapp_core.model.graph import layer_nodes
    from tapp_core.model.zoo import build_traced_model
    from tapp_core.plan.plan import Plan

    stage_of_layer = (0,) * len(layer_nodes(build_traced_model(model)))
    device = pool.cluster.devices[0]
    plan = Plan(model, args.batch_size, args.micro_batches, "gpipe", stage_of_layer, ((device.name,),))
    pool.prepare(model)
    plain = PlainLoop(model, args.batch_size, args.micro_batches, batches=8, device=device.kind)
    steps = args.steps + PLAIN_WARMUP_STEPS
    kept: dict[str, list[float]] = {"ours": [], "plain": []}
    paired = []
    for round_index in range(args.rounds):
        order = ("ours", "plain") if round_index % 2 == 0 else ("plain", "ours")
        medians = {}
        for system in order:
            if system == "ours":
                measured = pool.measure(plan, steps=steps, warmup=PLAIN_WARMUP_STEPS, timeout_s=args.timeout)
                if not measured.ok:
                    raise RuntimeError(f"the single-stage plan of {model} failed: {measured.error}")
                times = measured.step_times_s[PLAIN_WARMUP_STEPS:]
            else:
                times = plain.run(steps)[PLAIN_WARMUP_STEPS:]
            medians[system] = statistics.median(times)
            print(
                f"{model} round {round_index} {system:5s} median {medians[system] * 1e3:7.2f} ms "
                f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}, {len(times)} steps)",
                flush=True,
            )
            if round_index > 0:
                kept[system] += times
        if round_index > 0:
            paired.append(medians["ours"] / medians["plain"])
    ours, theirs = statistics.median(kept["ours"]), statistics.median(kept["plain"])
    quartiles = {name: statistics.quantiles(times, n=4) for name, times in kept.items()}
    print(
        f"{model}: batch {args.batch_size}, {args.micro_batches} micro-batch(es); median step ours {ours * 1e3:.2f} ms "
        f"(IQR {quartiles['ours'][0] * 1e3:.2f}-{quartiles['ours'][2] * 1e3:.2f}), plain loop {theirs * 1e3:.2f} ms "
        f"(IQR {quartiles['plain'][0] * 1e3:.2f}-{quartiles['plain'][2] * 1e3:.2f}); "
        f"median of the per-round ratios {statistics.median(paired):.3f}"
    )
    print(f"{model}: ratio ours/plain (median step time): {ours / theirs:.3f} (bar <= 1.10)")
    return ours / theirs


def plain_main(args: argparse.Namespace) -> int:
    import torch

    from tapp_core.platform.cluster import parse_cluster
    from tapp_core.runtime import WorkerPool

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("--device cuda: no CUDA device on this machine", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)  # as the rank (its device's threads)
    device: dict[str, object] = {"name": "cpu0", "kind": "cpu", "threads": args.threads, "memory": "8GiB"}
    if gpu:
        memory = torch.cuda.get_device_properties(0).total_memory
        device = {"name": "gpu0", "kind": "cuda", "gpu_index": 0, "threads": args.threads, "memory": memory}
    cluster = parse_cluster(
        {"name": "one", "emulated": False, "devices": [device], "links": {"bandwidth": "100Gbit/s", "latency": "0us"}}
    )
    print(f"{torch.cuda.get_device_name(0) if gpu else 'CPU'}, torch {torch.__version__}", flush=True)
    ratios = {}
    with WorkerPool(cluster) as pool:
        for model in args.model.split(","):
            ratios[model] = compare_with_plain(pool, model, args)
    print("summary: " + ", ".join(f"{model} {ratio:.3f}" for model, ratio in ratios.items()) + " (bar <= 1.10)")
    return 0


def main() -> int:
    args = parse_args()
    if args.against == "plain":
        return plain_main(args)
    if args.worker:
        worker(args)
        return 0
    from tapp_core.runtime.pool import mpiexec_path

    cut = args.cut
    if cut is None:
        cut = balanced_cut(args.model, args.batch_size // args.micro_batches, args.threads)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        mpiexec_path(),
        "-n",
        "2",
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--port",
        str(port),
        "--cut",
        str(cut),
    ]
    command += [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "port", "cut", "timeout")
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run(command, env=env, timeout=args.timeout, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
