"""Our GPipe against torch.distributed.pipelining's ScheduleGPipe (gloo): same model, same 2 stages, same
micro-batches, 2 ranks, emulation off, one process tree (one mpiexec job runs both), alternating runs.

    .venv/bin/python bench/runtime_vs_torch.py [--model alexnet --batch-size 32 --micro-batches 4 --rounds 6]

A step is timed on each rank from a common barrier to the end of its optimiser step, and the step time is the
slowest rank's (DESIGN.md). Each block of steps drops its first step; the first round is warm-up. The last line
is the ratio of median step times, ours / theirs (bar: <= 1.05).
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--cut", type=int, default=None, help="first layer of stage 1 (default: the most balanced by profiled time)"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def balanced_cut(model: str, micro_batch_size: int, threads: int) -> int:
    """The first layer of stage 1 that makes the slower stage as fast as it can be (profiled fwd + bwd time)."""
    from tapp_core.profiler import profile_model

    library = profile_model(model, batch_size=micro_batch_size, threads=threads, repeats=3, warmup=1)
    times = [layer.forward_s + layer.backward_s for layer in library.layers]
    return min(range(1, len(times)), key=lambda cut: max(sum(times[:cut]), sum(times[cut:])))


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn import functional as F

    from tapp_core.graph import layer_nodes
    from tapp_core.models import build_traced_model
    from tapp_core.plan import Plan
    from tapp_core.runtime.batches import SyntheticBatches
    from tapp_core.runtime.emulation import Emulation
    from tapp_core.runtime.engine import StageEngine
    from tapp_core.runtime.layout import Layout
    from tapp_core.runtime.optim import OptimizerConfig, make_optimizer
    from tapp_core.runtime.stage import StageFactory, split_stages
    from tapp_core.runtime.transport import Control, Transport
    from tapp_core.schedules import GPipe

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
    stage = StageFactory().stage(args.model, 0, stage_of_layer, 2, rank, cpu)
    control = Control(world.Dup(), deadline=float("inf"))
    transport = Transport(world.Dup(), world.Dup(), world.Dup(), control, Emulation(enabled=False))
    layout = Layout(((0,), (1,)), plan.micro_batch_size)
    engine = StageEngine(
        stage,
        layout,
        rank,
        transport,
        GPipe(),
        optimizer,
        Emulation(enabled=False),
        args.batch_size,
        args.micro_batches,
    )

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


def main() -> int:
    args = parse_args()
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
