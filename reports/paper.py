"""A report folder from MLflow alone: the paper's tables (Markdown, CSV, LaTeX) and figures (PNG).

``tapp report`` and the paper_table flow both call ``write_report``, so the same runs give the same files.
Figures: step-time bars over all methods (with each measured median's confidence interval); test accuracy against
training time (``accuracy_vs_time.png``) where plans were trained; step time against computing power and throughput
against batch size (section 5.2.2) where the runs vary them; and per (model, cluster, batch size) the search's
reward curve and the Gantt chart of TAPP's chosen plan (redrawn from the estimate logged with its evaluation run).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from mlflow import MlflowClient

from reports import runs
from reports.tables import Tables, build_tables, method_order, model_label, row_order
from tapp_core import schema
from tapp_core.costmodel import Estimate
from tapp_core.planners.base import method_label


@dataclass
class Report:
    folder: Path
    tables: Tables
    table_files: list[Path]
    figure_files: list[Path] = field(default_factory=list)


def write_report(
    experiment: str,
    out: str | Path,
    tracking_uri: str | None = None,
    within: str | None = None,
    tag: str = schema.EXPERIMENT_RUN,
) -> Report:
    """Write the tables and figures of an MLflow experiment (or of the runs whose ``tag`` is ``within``) to ``out``."""
    folder = Path(out)
    tables = build_tables(experiment, tracking_uri, within, tag)
    report = Report(folder, tables, tables.write(folder))
    client = MlflowClient(tracking_uri)
    report.figure_files.append(step_time_figure(tables.evaluations, folder / "step_time.png"))
    report.figure_files += section_figures(client, tables, folder)
    for stage in runs.search_stages(client, experiment, within, tag):
        history = runs.round_history(client, stage.run_id)
        if not history.empty:
            report.figure_files.append(reward_figure(stage, history, folder))
    for row in tables.evaluations[tables.evaluations[schema.METHOD] == "tapp"].itertuples(index=False):
        key = (str(row.model), str(row.cluster), row.batch_size)
        report.figure_files.append(gantt_figure(client, str(row.run_id), key, folder))
    return report


def _slug(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "_".join(str(p) for p in parts))


def _group(model: str, cluster: str, batch_size: object) -> str:
    return f"{model_label(model)}\n{cluster}, batch {batch_size}"


def step_time_figure(evaluations: pd.DataFrame, path: Path) -> Path:
    from reports.figures import step_time_bars

    frame = pd.DataFrame(
        {
            "group": [_group(str(r.model), str(r.cluster), r.batch_size) for r in evaluations.itertuples(index=False)],
            "method": [method_label(m) for m in evaluations[schema.METHOD]],
            "step_time_s": evaluations[schema.STEP_TIME],
            "low_s": evaluations[schema.STEP_TIME_LOW],
            "high_s": evaluations[schema.STEP_TIME_HIGH],
        }
    )
    labels = (method_label(m) for m in method_order(evaluations[schema.METHOD], paper_always=False))
    order = {label: i for i, label in enumerate(labels)}
    frame = frame.sort_values("method", key=lambda s: s.map(order), kind="stable")
    return step_time_bars(frame, path, title="Single-step training time by method")


def section_figures(client: MlflowClient, tables: Tables, folder: Path) -> list[Path]:
    """The time-to-accuracy figure where plans were trained; the computing-power figure where a cluster's family
    was run at two powers or more; the batch-size figure where a model ran on a cluster at two batch sizes or
    more."""
    from reports.accuracy import curve_frame
    from reports.paper_figures import accuracy_vs_time, batch_size_figure, computing_power_figure

    written = []
    trainings = tables.trainings
    if not trainings.empty:
        curves = {str(r): runs.accuracy_curve(client, str(r)) for r in trainings["run_id"]}
        written.append(accuracy_vs_time(curve_frame(curves, trainings), folder / "accuracy_vs_time.png"))
    evaluations = _ordered(tables.evaluations)
    families = evaluations.groupby(["model", schema.BASE_CLUSTER, schema.BATCH_SIZE])[schema.POWER].nunique()
    if (families > 1).any():
        written.append(computing_power_figure(_power_points(evaluations), folder / "computing_power.png"))
    sizes = evaluations.groupby(["model", schema.CLUSTER])[schema.BATCH_SIZE].nunique()
    if (sizes > 1).any():
        written.append(batch_size_figure(_batch_points(evaluations), folder / "batch_size.png"))
    return written


def _ordered(evaluations: pd.DataFrame) -> pd.DataFrame:
    """The evaluations in the tables' row order, methods in their column order (the figures' panels and legend)."""
    rank = {m: i for i, m in enumerate(method_order(evaluations[schema.METHOD], paper_always=False))}
    by_method = evaluations.sort_values(schema.METHOD, key=lambda s: s.map(rank), kind="stable")
    return row_order(by_method)


def _power_points(evaluations: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "group": [
                f"{model_label(str(r.model))} on {getattr(r, schema.BASE_CLUSTER)}, batch {r.batch_size}"
                for r in evaluations.itertuples(index=False)
            ],
            "method": [method_label(str(m)) for m in evaluations[schema.METHOD]],
            "power": evaluations[schema.POWER],
            "step_time_s": evaluations[schema.STEP_TIME],
            "low_s": evaluations[schema.STEP_TIME_LOW],
            "high_s": evaluations[schema.STEP_TIME_HIGH],
        }
    )


def _batch_points(evaluations: pd.DataFrame) -> pd.DataFrame:
    batch = evaluations[schema.BATCH_SIZE].astype(float)
    return pd.DataFrame(
        {
            "group": [f"{model_label(str(r.model))} on {r.cluster}" for r in evaluations.itertuples(index=False)],
            "method": [method_label(str(m)) for m in evaluations[schema.METHOD]],
            "batch_size": evaluations[schema.BATCH_SIZE],
            "images_per_s": batch / evaluations[schema.STEP_TIME],
            "low": batch / evaluations[schema.STEP_TIME_HIGH],
            "high": batch / evaluations[schema.STEP_TIME_LOW],
        }
    )


def reward_figure(stage: runs.RunRow, history: pd.DataFrame, folder: Path) -> Path:
    from reports.figures import reward_curve

    model, cluster, batch = (stage.tags.get(t, "") for t in schema.KEY_COLUMNS)
    title = f"TAPP search: {model_label(model)} on {cluster}, batch {batch}"
    return reward_curve(history, folder / f"reward_curve_{_slug(model, cluster, 'b' + batch)}.png", title=title)


def gantt_figure(client: MlflowClient, run_id: str, key: tuple[str, str, object], folder: Path) -> Path:
    """The timeline of the estimate logged by TAPP's evaluation run ``run_id``; ``key`` is (model, cluster, batch)."""
    from reports.figures import gantt

    with tempfile.TemporaryDirectory(prefix="tapp-estimate-") as tmp:
        local = client.download_artifacts(run_id, schema.ESTIMATE_ARTIFACT, tmp)
        predicted = Estimate.from_dict(json.loads(Path(local).read_text()))
    model, cluster, batch = key
    path = folder / f"gantt_tapp_{_slug(model, cluster, f'b{batch}')}.png"
    gantt(predicted, path, title=f"TAPP's plan for {model_label(model)} on {cluster}, batch {batch} (estimated)")
    return path
