"""Do the profiled layer times add up to the whole model? The bar: sum of layer times / whole-model time within
0.85-1.15 for alexnet, vgg16, inception_v3 and vit at batch 64.

For each model it prints the layer count, the measured whole-model forward+backward time, the sum of the layer
times (per-layer medians), their ratio, the FLOPs per image, the parameter count and the wall time the profiling
took; it exits non-zero when a ratio is outside the bar. "step ratio" is the median over instrumented steps of
each step's layer total, divided by the whole-model time: it shows what the instrumentation costs, and its gap to
"ratio" is what taking medians layer by layer drops when a loaded machine preempts the run. Timings on a shared machine are noisy: the load average is printed
before and after. One intra-op thread is the default, as in the default cluster's devices (and it is far less
disturbed by other processes than several threads that wait on each other).

    .venv/bin/python bench/profile_ratio.py [--models alexnet vgg16 inception_v3 vit] [--batch-size 64]
        [--threads 1] [--repeats 5] [--warmup 2] [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from tapp_core.profile.profiler import ProfileRequest, profile_model

LOW, HIGH = 0.85, 1.15


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["alexnet", "vgg16", "inception_v3", "vit"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 = torch's default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, help="also save each layer library under OUT/MODEL")
    args = parser.parse_args(argv)

    print(
        f"batch {args.batch_size}, device {args.device}, threads {args.threads or 'default'}, "
        f"repeats {args.repeats} after {args.warmup} warm-up; {os.cpu_count()} CPUs, load average {_load()}"
    )
    header = f"{'model':<14}{'layers':>7}{'whole s':>10}{'layers s':>10}{'ratio':>8}{'step ratio':>11}{'MFLOP/img':>11}{'params':>12}{'wall s':>9}"
    print(header)
    failed = []
    for name in args.models:
        start = time.perf_counter()
        library = profile_model(
            ProfileRequest(
                name,
                args.batch_size,
                device=args.device,
                threads=args.threads or None,
                repeats=args.repeats,
                warmup=args.warmup,
            )
        )
        wall_s = time.perf_counter() - start
        ratio = library.layer_time_sum_s / library.whole_model_s
        step_ratio = statistics.median(library.extra["layer_steps_s"]) / library.whole_model_s  # type: ignore[arg-type]
        flops = sum(layer.flops for layer in library.layers)
        params = library.param_bytes // 4  # float32
        print(
            f"{name:<14}{len(library):>7}{library.whole_model_s:>10.3f}{library.layer_time_sum_s:>10.3f}"
            f"{ratio:>8.3f}{step_ratio:>11.3f}{flops / 1e6:>11.1f}{params:>12,}{wall_s:>9.1f}",
            flush=True,
        )
        if args.out:
            library.save(args.out / name)
        if not LOW <= ratio <= HIGH:
            failed.append(f"{name} ({ratio:.3f})")
    print(f"load average after: {_load()}")
    if failed:
        print(f"FAIL: ratio outside {LOW}-{HIGH} for {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"OK: every ratio within {LOW}-{HIGH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
