"""The ``tapp`` command line.

One module per group of commands, registered here in the order ``tapp --help`` lists them:

- ``planning``: ``profile``, ``plan``, ``simulate`` (tapp_core alone: no workers, Prefect or MLflow);
- ``runtime``: ``measure``, ``train`` (a plan on MPI workers);
- ``experiments``: ``run`` (the Prefect flow, tracked in MLflow) and ``report`` (tables and figures from MLflow);
- ``common``: the consoles, the options several commands share, the layer library and plan they start from.

Every command turns a ``TappError`` (bad model, cluster, plan, data or library) into one red line on stderr and
exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import typer

from flows.cli import experiments, planning, runtime
from flows.cli.common import reports_user_errors

app = typer.Typer(add_completion=False, no_args_is_help=True, help=(__doc__ or "").splitlines()[0])

for _command in (
    planning.profile,
    planning.plan,
    planning.simulate,
    runtime.measure,
    runtime.train,
    experiments.run,
    experiments.report,
):
    app.command()(reports_user_errors(_command))

__all__ = ["app"]
