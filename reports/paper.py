"""A report folder from MLflow alone: the paper's tables (Markdown, CSV, LaTeX) and figures (PNG).

``tapp report`` and the paper_table flow both call ``write_report``, so the same runs give the same files.
Figures: step-time bars over all methods (with each measured median's confidence interval); test accuracy against
training time (``accuracy_vs_time.png``; a language model's test perplexity, ``perplexity_vs_time.png``) where plans
were trained; step time against computing power and throughput
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
from mlflow.exceptions import MlflowException

from reports import runs, schema
from reports.accuracy import accuracy_table, perplexity_table
from reports.published import paper_comparison_table
from reports.report_folders import check_report_folder, claim_report_folder
from reports.sections import batch_size_table, computing_power_table
from reports.tables import (
    Table,
    communication_share_table,
    method_order,
    model_label,
    row_order,
    step_time_table,
    stored_ratios_of,
)
from tapp_core.cost.estimate import Estimate
from tapp_core.planners.base import PAPER_METHODS, method_label


@dataclass
class Tables:
    step_time: Table
    communication_share: Table
    accuracy: Table
    perplexity: Table
    """The language models' accuracy table, their test perplexity: written where it has rows."""
    computing_power: Table
    batch_size: Table
    paper_comparison: Table
    evaluations: pd.DataFrame
    """The evaluation runs the tables were built from (one per model, cluster, batch size, method)."""
    trainings: pd.DataFrame = field(default_factory=pd.DataFrame)
    """The train runs the accuracy table was built from (one per model, cluster, batch size, dataset, method)."""

    def all(self) -> list[Table]:
        return [
            self.step_time,
            self.communication_share,
            self.accuracy,
            *([self.perplexity] if not self.perplexity.frame.empty else []),
            self.computing_power,
            self.batch_size,
            self.paper_comparison,
        ]

    def write(self, out: str | Path) -> list[Path]:
        return [path for table in self.all() for path in table.write(out)]


def build_tables(
    experiment: str, tracking_uri: str | None = None, within: str | None = None, tag: str = schema.EXPERIMENT_RUN
) -> Tables:
    """The tables of an MLflow experiment (or of the runs whose ``tag`` is ``within``: one experiment or sweep)."""
    client = MlflowClient(tracking_uri)
    evaluations = runs.evaluations(client, experiment, within, tag)
    if evaluations.empty:
        scope = f" with {tag} {within}" if within else ""
        raise runs.ReportError(f"MLflow experiment {experiment!r} has no finished evaluation runs{scope}")
    trainings = runs.trainings(client, experiment, within, tag)
    untrained = runs.untrained(client, experiment, within, tag)
    stored = runs.stored_ratios(client, evaluations)  # the ratios every view of an experiment shows
    ratios = {m: stored_ratios_of(stored, m) for m in PAPER_METHODS if m != "tapp"}
    return Tables(
        step_time=step_time_table(evaluations, ratios["bsp"]),
        communication_share=communication_share_table(evaluations),
        accuracy=accuracy_table(trainings, untrained),
        perplexity=perplexity_table(trainings, untrained),
        computing_power=computing_power_table(evaluations, ratios),
        batch_size=batch_size_table(evaluations),
        paper_comparison=paper_comparison_table(evaluations, ratios),
        evaluations=evaluations,
        trainings=trainings,
    )


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
    """Write the tables and figures of an MLflow experiment (or of the runs whose ``tag`` is ``within``) to ``out``,
    a folder that holds no other experiment's report (``reports.report_folders``)."""
    folder = Path(out)
    check_report_folder(folder, experiment)
    tables = build_tables(experiment, tracking_uri, within, tag)
    claim_report_folder(folder, experiment, within)
    report = Report(folder, tables, tables.write(folder))
    client = MlflowClient(tracking_uri)
    report.figure_files.append(step_time_figure(tables.evaluations, folder / "step_time.png"))
    report.figure_files += section_figures(client, tables, folder)
    for stage in runs.search_stages(client, experiment, within, tag):
        figure = reward_figure(client, experiment, stage, folder)
        if figure is not None:
            report.figure_files.append(figure)
    for row in tables.evaluations[tables.evaluations[schema.METHOD] == "tapp"].itertuples(index=False):
        key = (str(row.model), str(row.cluster), row.batch_size)
        report.figure_files.append(gantt_figure(client, str(row.run_id), key, folder))
    return report


def _slug(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "_".join(str(p) for p in parts))


def _group(model: str, cluster: str, batch_size: object) -> str:
    return f"{model_label(model)}\n{cluster}, batch {batch_size}"


def step_time_figure(evaluations: pd.DataFrame, path: Path) -> Path:
    """Every method's step time per (model, cluster, batch size); methods whose plan runs the same as an earlier
    method's (``measurement_from``: one measurement) share its bar, named ``SingleCPU = Oracle``."""
    from reports.figures import method_colour, step_time_bars

    shared = evaluations[schema.MEASUREMENT_FROM].fillna("") if schema.MEASUREMENT_FROM in evaluations else None
    names: dict[tuple[str, str, str, str], str] = {}
    for r in evaluations.itertuples(index=False):
        source = str(getattr(r, schema.MEASUREMENT_FROM, "") or "")
        if source:
            key = (str(r.model), str(r.cluster), str(r.batch_size), source)
            names[key] = names.get(key, method_label(source)) + f" = {method_label(str(r.method))}"
    shown = evaluations[shared == ""] if shared is not None else evaluations
    frame = pd.DataFrame(
        {
            "group": [_group(str(r.model), str(r.cluster), r.batch_size) for r in shown.itertuples(index=False)],
            "method": [
                names.get((str(r.model), str(r.cluster), str(r.batch_size), str(r.method)), method_label(str(r.method)))
                for r in shown.itertuples(index=False)
            ],
            "order": [method_label(m) for m in shown[schema.METHOD]],
            "colour": [method_colour(str(m)) for m in shown[schema.METHOD]],
            "step_time_s": shown[schema.STEP_TIME],
            "low_s": shown[schema.STEP_TIME_LOW],
            "high_s": shown[schema.STEP_TIME_HIGH],
        }
    )
    labels = (method_label(m) for m in method_order(evaluations[schema.METHOD], paper_always=False))
    order = {label: i for i, label in enumerate(labels)}
    frame = frame.sort_values("order", key=lambda s: s.map(order), kind="stable").drop(columns="order")
    asynchronous = "schedule" in evaluations and bool((evaluations["schedule"] == "async").any())
    note = (
        "synchronous plans: one step of the whole mini-batch; asynchronous: the steady-state time per mini-batch"
        if asynchronous
        else "every plan synchronous: one step of the whole mini-batch"
    )
    return step_time_bars(frame, path, title="Training time per mini-batch by method", note=note)


def section_figures(client: MlflowClient, tables: Tables, folder: Path) -> list[Path]:
    """The time-to-accuracy figure where plans were trained (a language model's: time to perplexity); the computing-power figure where a cluster's family
    was run at two powers or more; the batch-size figure where a model ran on a cluster at two batch sizes or
    more."""
    from reports.accuracy import curve_frame, language_model_rows
    from reports.paper_figures import accuracy_vs_time, batch_size_figure, computing_power_figure

    written = []
    trainings = tables.trainings
    if not trainings.empty:
        curves = {str(r): runs.accuracy_curve(client, str(r)) for r in trainings["run_id"]}
        language = language_model_rows(trainings)
        for perplexity, name in ((False, "accuracy_vs_time.png"), (True, "perplexity_vs_time.png")):
            chosen = trainings[language == perplexity]
            if not chosen.empty:
                written.append(accuracy_vs_time(curve_frame(curves, chosen), folder / name, perplexity))
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
    model, cluster, batch = (stage.tags.get(t, "") for t in schema.KEY_COLUMNS)
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
        local = client.download_artifacts(run_id, schema.ESTIMATE_ARTIFACT, tmp)
        predicted = Estimate.from_dict(json.loads(Path(local).read_text()))
    model, cluster, batch = key
    path = folder / f"gantt_tapp_{_slug(model, cluster, f'b{batch}')}.png"
    gantt(predicted, path, title=f"TAPP's plan for {model_label(model)} on {cluster}, batch {batch} (estimated)")
    return path
