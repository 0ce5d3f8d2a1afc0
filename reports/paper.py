"""A report folder from MLflow alone: the paper's tables (Markdown, CSV, LaTeX) and figures (PNG).

``tapp report`` and the paper_table flow both call ``write_report``, so the same runs give the same files.
Figures: step-time bars over all methods (with each measured median's confidence interval), and per (model, cluster, batch size) the search's reward curve and the
Gantt chart of TAPP's chosen plan (redrawn from the estimate logged with its evaluation run).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from reports import runs
from reports.folders import check_report_folder, claim_report_folder
from reports.tables import Tables, build_tables, method_label, model_label
from tapp_core.costmodel import Estimate


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
    tag: str = runs.EXPERIMENT_RUN,
) -> Report:
    """Write the tables and figures of an MLflow experiment (or of the runs whose ``tag`` is ``within``) to ``out``,
    a folder that holds no other experiment's report (``reports.folders``)."""
    folder = Path(out)
    check_report_folder(folder, experiment)
    tables = build_tables(experiment, tracking_uri, within, tag)
    claim_report_folder(folder, experiment, within)
    report = Report(folder, tables, tables.write(folder))
    client = MlflowClient(tracking_uri)
    report.figure_files.append(step_time_figure(tables.evaluations, folder / "step_time.png"))
    for stage in runs.search_stages(client, experiment, within, tag):
        figure = reward_figure(client, experiment, stage, folder)
        if figure is not None:
            report.figure_files.append(figure)
    for row in tables.evaluations[tables.evaluations[runs.METHOD] == "tapp"].itertuples(index=False):
        key = (str(row.model), str(row.cluster), row.batch_size)
        report.figure_files.append(gantt_figure(client, str(row.run_id), key, folder))
    return report


def _slug(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "_".join(str(p) for p in parts))


def _group(model: str, cluster: str, batch_size: object) -> str:
    return f"{model_label(model)}\n{cluster}, batch {batch_size}"


def step_time_figure(evaluations: pd.DataFrame, path: Path) -> Path:
    from reports.figures import method_colour, step_time_bars

    frame = pd.DataFrame(
        {
            "group": [_group(str(r.model), str(r.cluster), r.batch_size) for r in evaluations.itertuples(index=False)],
            "method": [method_label(m) for m in evaluations[runs.METHOD]],
            "colour": [method_colour(str(m)) for m in evaluations[runs.METHOD]],
            "step_time_s": evaluations[runs.STEP_TIME],
            "low_s": evaluations[runs.STEP_TIME_LOW],
            "high_s": evaluations[runs.STEP_TIME_HIGH],
        }
    )
    order = {label: i for i, label in enumerate(method_label(m) for m in _method_order(evaluations[runs.METHOD]))}
    frame = frame.sort_values("method", key=lambda s: s.map(order), kind="stable")
    return step_time_bars(frame, path, title="Single-step training time by method")


def _method_order(methods: pd.Series) -> list[str]:
    from reports.tables import OTHER_METHODS, PAPER_METHODS

    present = set(methods)
    known = [m for m in (*PAPER_METHODS, *OTHER_METHODS) if m in present]
    return known + sorted(present - set(known))


def reward_figure(client: MlflowClient, experiment: str, stage: runs.RunRow, folder: Path) -> Path | None:
    """The search's figure: every round of the ``search`` stage run and of the ``sampling`` stage run of the same
    experiment run (the measured rounds), the measured samples (``search/sampled_plans.csv``) and the final race
    (``search/final_race.json``); None when the search logged no round."""
    from reports.figures import reward_curve

    history = runs.round_history(client, stage.run_id).assign(phase="simulated")
    sampling = runs.sampling_stage(client, experiment, stage)
    samples, final = None, None
    if sampling is not None:
        measured = runs.round_history(client, sampling.run_id).assign(phase="measured")
        history = pd.concat([history, measured], ignore_index=True) if not measured.empty else history
        samples = _artifact_csv(client, sampling.run_id, "search/sampled_plans.csv")
        final = _artifact_json(client, sampling.run_id, "search/final_race.json")
    if history.empty:
        return None
    model, cluster, batch = (stage.tags.get(t, "") for t in runs.KEY_COLUMNS)
    title = f"TAPP search: {model_label(model)} on {cluster}, batch {batch}"
    path = folder / f"reward_curve_{_slug(model, cluster, 'b' + batch)}.png"
    return reward_curve(history.sort_values("round", kind="stable"), path, title, samples, final)


def _artifact_csv(client: MlflowClient, run_id: str, path: str) -> pd.DataFrame | None:
    with tempfile.TemporaryDirectory(prefix="tapp-artifact-") as tmp:
        try:
            return pd.read_csv(client.download_artifacts(run_id, path, tmp))
        except (MlflowException, OSError, ValueError):
            return None


def _artifact_json(client: MlflowClient, run_id: str, path: str) -> dict[str, object] | None:
    with tempfile.TemporaryDirectory(prefix="tapp-artifact-") as tmp:
        try:
            data = json.loads(Path(client.download_artifacts(run_id, path, tmp)).read_text())
        except (MlflowException, OSError, ValueError):
            return None
    return data if isinstance(data, dict) else None


def gantt_figure(client: MlflowClient, run_id: str, key: tuple[str, str, object], folder: Path) -> Path:
    """The timeline of the estimate logged by TAPP's evaluation run ``run_id``; ``key`` is (model, cluster, batch)."""
    from reports.figures import gantt

    with tempfile.TemporaryDirectory(prefix="tapp-estimate-") as tmp:
        local = client.download_artifacts(run_id, runs.ESTIMATE_ARTIFACT, tmp)
        predicted = Estimate.from_dict(json.loads(Path(local).read_text()))
    model, cluster, batch = key
    path = folder / f"gantt_tapp_{_slug(model, cluster, f'b{batch}')}.png"
    gantt(predicted, path, title=f"TAPP's plan for {model_label(model)} on {cluster}, batch {batch} (estimated)")
    return path
