"""The ``tapp`` command line.

One module per group of commands, registered here in the order ``tapp --help`` lists them:

- ``planning``: ``profile``, ``plan``, ``simulate`` (tapp_core alone: no workers, Prefect or MLflow);
- ``runtime``: ``measure``, ``train`` (a plan on MPI workers);
- ``hardware``: ``calibrate`` (the cost model's calibration, measured on this machine) and ``cluster detect``
  (the cluster file of this host);
- ``testbed``: ``testbed up``, ``testbed down`` (a real cluster of several hosts on this one);
- ``experiments``: ``run`` (the Prefect flow, tracked in MLflow), ``sweep`` (a list of experiments) and ``report``
  (tables and figures from MLflow);
- ``common``: the consoles, the options several commands share, the layer library and plan they start from.

Every command turns a ``TappError`` (bad model, cluster, plan, data or library) into one red line on stderr and
exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from flows.cli import experiments, hardware, planning, runtime, testbed
from flows.cli.common import ManyValuesCommand, console, reports_user_errors

HELP = (
    "TAPP: split the training of a deep network into a pipeline across unequal devices, measure the plan on MPI "
    "workers, and compare it with the baselines in MLflow.\n\n"
    "Start with `tapp run` (the whole experiment); `tapp plan`, `tapp simulate` and `tapp measure` do one step each."
)

app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP, rich_markup_mode="markdown")


def tapp_version() -> str:
    """The installed package's version, and the checkout's git commit when there is one."""
    from tasks.tracking import code_version

    try:
        installed = version("tapp")
    except PackageNotFoundError:
        installed = "unknown"
    commit = code_version()
    return f"tapp {installed}" + (f" ({commit})" if commit != "unknown" else "")


def _print_version(asked: bool) -> None:
    if asked:
        console.print(tapp_version(), highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """TAPP's command line (the ``tapp`` entry point)."""


for _command in (
    planning.profile,
    planning.plan,
    planning.simulate,
    runtime.measure,
    runtime.train,
    runtime.export,
    hardware.calibrate,
    experiments.run,
    experiments.sweep,
    experiments.report,
):
    app.command(cls=ManyValuesCommand)(reports_user_errors(_command))
app.add_typer(hardware.cluster_app, name="cluster")
app.add_typer(testbed.testbed_app, name="testbed")

__all__ = ["app", "tapp_version"]
