"""``tapp testbed up`` and ``tapp testbed down``: a real cluster of several hosts on this one (``tapp_core.platform.testbed``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import DEFAULT_CLUSTER, ClusterOpt, console, reports_user_errors

testbed_app = typer.Typer(
    no_args_is_help=True,
    help="A real heterogeneous cluster on this host: hosts as network namespaces with their own sshd, devices "
    "slowed by CPU quotas, links shaped by the kernel (needs root).",
)

NameOpt = Annotated[
    str, typer.Option("--name", help="the testbed's name: prefix of its namespaces, links and control groups")
]
StateOpt = Annotated[
    Path | None,
    typer.Option("--state", help="the testbed's state folder (default: $TAPP_TESTBED_STATE/NAME, /run/tapp-testbed)"),
]


@testbed_app.command("up")
@reports_user_errors
def testbed_up(
    out: Annotated[Path, typer.Option("--out", "-o", help="the testbed's cluster file to write (YAML)")],
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    name: NameOpt = "tapptb",
    subnet: Annotated[str, typer.Option(help="the private IPv4 subnet of the hosts")] = "10.213.0.0/24",
    cores: Annotated[
        str | None, typer.Option(help="the cores the hosts may use, e.g. 0-3 or 0,2 (default: this process's)")
    ] = None,
    state: StateOpt = None,
    service_host: Annotated[
        list[str] | None,
        typer.Option("--service-host", help="also a host with no device, for servers (MLflow, Prefect); repeatable"),
    ] = None,
) -> None:
    """Make the cluster's hosts here and write its real cluster file (`emulated: false`, every device on its host):
    then `tapp measure`, `tapp calibrate`, `tapp run`... with `--cluster FILE` run on them."""
    from tapp_core.platform.testbed import up

    up(
        cluster,
        out,
        prefix=name,
        subnet=subnet,
        cores=parse_cores(cores),
        state=state,
        service_hosts=service_host or (),
        log=lambda line: console.print(line, highlight=False),
    )
    console.print(f"wrote {out}")


@testbed_app.command("down")
@reports_user_errors
def testbed_down(name: NameOpt = "tapptb", state: StateOpt = None) -> None:
    """End every process of the testbed's hosts and remove its namespaces, links, control groups and state."""
    from tapp_core.platform.testbed import down

    if not down(name, state, log=lambda line: console.print(line, highlight=False)):
        console.print(f"no testbed named {name!r} is up")


def parse_cores(text: str | None) -> list[int] | None:
    """``0-3,6`` as [0, 1, 2, 3, 6]; None for none given."""
    from tapp_core.platform.testbed import TestbedError

    if text is None:
        return None
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        raise TestbedError(f"--cores must be like 0-3 or 0,2, got {text!r}") from None
    if not cores:
        raise TestbedError(f"--cores names no core: {text!r}")
    return sorted(set(cores))
