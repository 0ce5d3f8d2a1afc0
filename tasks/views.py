"""The experiment's result (``tasks.summary.Result``) put where people look: MLflow and Prefect.

Nothing here computes a fact: every number comes from the ``Result`` and is shown through ``tasks.summary``'s
views, so that the terminal (``flows.cli``), MLflow and Prefect agree with each other and with the report.

- **MLflow**, the parent run: the result as plain data (``result.json``, ``summary.result_record``: what the report
  reads rather than computing it again), its description (``summary.markdown``), the headline metrics (rounded as shown),
  the params ``tapp_plan`` and ``best_group``, the table of methods (``evaluation.csv``/``.json``), every chosen
  plan (``plans/``) and the report's figures (``figures/``). Each method's run: its name carries its step time
  and interval (MLflow's default columns and its charts' legends then show them), its description says what it
  is, its place in the result (``schema.PLACE``, the runs view's sort key), its ``best_group`` tag and its colour (``mlflow.runColor``, the project's palette).
- **Prefect**: the result as plain sentences in the flow run's log; the ``tapp-result`` (Markdown) and
  ``tapp-evaluation`` (table) artifacts, and a link to the parent run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from reports import schema
from reports.figures import method_colour
from tasks import prefect_ui, summary
from tasks.tracking import RUN_COLOR_TAG, RunRef, TrackedRun, run_url

FIGURES_ARTIFACT = "figures"


def record_numbers(parent: TrackedRun, result: summary.Result) -> None:
    """The result's numbers on the parent run (metrics, params, the table of methods, the plans) and on each
    method's run (name, description, ``best_group`` tag, colour): what the report then reads back."""
    parent.log_metrics(summary.parent_metrics(result))
    parent.log_dict(summary.result_record(result), schema.RESULT_ARTIFACT)  # what the report reads
    tapp = result.method("tapp")
    parent.log_params(
        {
            "best_group": ",".join(result.best_group),
            **({"tapp_plan": summary.plan_line(tapp.plan)} if tapp is not None else {}),
        }
    )
    if result.methods:  # as shown (rounded); also as evaluation.json, the table mlflow.load_table reads
        parent.log_table(pd.DataFrame(summary.table_records(result)), "evaluation.csv")
    for place, method in enumerate(result.methods, start=1):
        parent.log_dict(method.plan.to_dict(), f"plans/{method.method}.json")
        name, note = summary.method_view(result, method)
        run = TrackedRun(RunRef(parent.ref.tracking_uri, parent.ref.experiment_id, method.run_id), parent.client)
        run.log_metrics({schema.PLACE: place})
        run.client.update_run(method.run_id, name=name)
        run.set_note(note)
        run.set_tags({schema.BEST_GROUP: str(method.best).lower(), RUN_COLOR_TAG: method_colour(method.method)})


def record_text(parent: TrackedRun, result: summary.Result, figures: Iterable[Path] = ()) -> None:
    """The parent run's description (the whole result, with its links) and the report's figures."""
    parent.set_note(summary.markdown(result))
    for figure in figures:
        parent.log_file(figure, FIGURES_ARTIFACT)


def show_result(result: summary.Result, ui: str, parent: TrackedRun, title: str) -> None:
    """The result in Prefect: plain sentences in the log, the Markdown and table artifacts, the link to MLflow."""
    for sentence in summary.sentences(result):
        prefect_ui.log(sentence)
    prefect_ui.log(
        f"The table of methods is the artifact {prefect_ui.EVALUATION_KEY}; the whole result, {prefect_ui.RESULT_KEY}."
    )
    prefect_ui.markdown_artifact(prefect_ui.RESULT_KEY, summary.markdown(result), title)
    prefect_ui.table_artifact(
        prefect_ui.EVALUATION_KEY,
        summary.table_records(result),
        "one row per method, fastest first: step time (median [low, high] when raced), best group, plan",
    )
    ref = parent.ref
    prefect_ui.link_artifact(
        prefect_ui.MLFLOW_RUN_KEY,
        run_url(ui, ref.experiment_id, ref.run_id),
        f"MLflow run {ref.run_id}",
        f"the experiment's parent run in the MLflow UI at {ui}",
    )
