"""``paper_table``: the paper's tables and figures rebuilt from an MLflow experiment alone.

It writes the same files as ``tapp report --experiment NAME --out DIR`` (both call ``reports.paper.write_report``)
and records them in a report run of the experiment.
"""

from __future__ import annotations

from prefect import flow

from reports.paper import Report
from reports.report_folders import experiment_report_folder
from tasks.report import paper_report
from tasks.tracking import DEFAULT_EXPERIMENT, check_tracking


@flow(name="paper-table", flow_run_name="paper-table-{experiment}")
def paper_table(
    experiment: str = DEFAULT_EXPERIMENT, out: str | None = None, tracking_uri: str | None = None
) -> Report:
    """Tables (Markdown, CSV, LaTeX) and figures (PNG) of every finished evaluation in ``experiment``, in ``out``
    (default: ``out/<experiment>/report``, as ``tapp report``)."""
    folder = out if out is not None else str(experiment_report_folder(experiment))
    return paper_report(experiment, folder, check_tracking(tracking_uri))
