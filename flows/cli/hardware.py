"""Commands that describe the machine the plans run on: ``calibrate`` (the cost model's calibration, measured) and
``cluster detect`` (the cluster file of this host)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import (
    DEFAULT_BATCH,
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    BatchOpt,
    ClusterOpt,
    LibraryOpt,
    ModelOpt,
    StepsOpt,
    WarmupOpt,
    console,
    reports_user_errors,
)


def calibrate(
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="where to write it (default: beside the cluster file, where it is picked up)"),
    ] = None,
    model: ModelOpt = DEFAULT_MODEL,
    batch_size: BatchOpt = DEFAULT_BATCH,
    library: LibraryOpt = None,
    steps: StepsOpt = DEFAULT_STEPS,
    warmup: WarmupOpt = DEFAULT_WARMUP,
) -> None:
    """Measure the cost model's calibration on this machine: per-message cost, GPU staging, update rate and compute
    scale per device kind, and, where the ranks want more threads than the host has cores, how much they slow each
    other computing at once. `tapp run`, `tapp plan` and `tapp simulate` then use it for this cluster."""
    from flows.cli.common import cluster_library
    from tapp_core.cost.calibration import calibration_path
    from tapp_core.platform.cluster import load_cluster
    from tapp_core.runtime.calibrator import calibrate as measure_calibration

    target = load_cluster(cluster)
    layers = cluster_library(model, batch_size, library, target)
    calibration = measure_calibration(
        target, layers, steps, warmup, log=lambda line: console.print(line, highlight=False)
    )
    path = calibration.save(out or calibration_path(cluster))
    console.print(f"wrote {path}")


cluster_app = typer.Typer(no_args_is_help=True, help="Describe the cluster of this host.")


@cluster_app.command("detect")
@reports_user_errors
def detect(
    out: Annotated[Path, typer.Option("--out", "-o", help="the cluster file to write (YAML)")],
    threads: Annotated[
        int | None, typer.Option(min=1, help="threads per CPU rank (default: 4 when the cores allow, else chosen)")
    ] = None,
    name: Annotated[str | None, typer.Option(help="the cluster's name (default: the file's name)")] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster", "-c", help="measure this cluster's links where its devices run (on their hosts) instead"
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="round trips per message size and pair")] = 15,
) -> None:
    """Write this host's cluster: every GPU a cuda device, the CPU cores split into CPU ranks, and the links between
    them measured by a short MPI ping-pong. Then `tapp profile --cluster FILE` and `tapp calibrate --cluster FILE`.

    With `--cluster C`: measure the links between C's devices where they run (a testbed's hosts, other machines)
    and write C with those links, comparing each pair with C's."""
    from tapp_core.runtime.detect import summary, write_detected_cluster, write_measured_links

    if cluster is not None:
        with console.status(f"measuring the links of {cluster} where its devices run"):
            _, lines = write_measured_links(cluster, out, repeats)
        for line in lines:
            console.print(line, highlight=False)
        console.print(f"wrote {out}")
        return
    with console.status("detecting this host and measuring its links"):
        detected = write_detected_cluster(out, threads, name)
    for line in summary(detected):
        console.print(line, highlight=False)
    console.print(f"wrote {out}")
