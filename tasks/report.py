"""The report stage: the experiment's tables and figures, written to a folder and logged to MLflow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import task

from reports import schema
from reports.paper import Report, write_report
from tasks.progress import StageProgress
from tasks.tracking import DEFAULT_EXPERIMENT, ExperimentTags, RunRef, code_version, tracked_run


@dataclass(frozen=True)
class ReportRun:
    """A written report and the MLflow run that holds its files (under ``report/``)."""

    report: Report
    run_id: str


@task(name="report", task_run_name="report")
def report_experiment(
    parent: RunRef, tags: ExperimentTags, out: str | Path, experiment: str = DEFAULT_EXPERIMENT
) -> ReportRun:
    """Tables and figures of this experiment's runs only (read back from MLflow), in ``out`` and under ``report/``."""
    progress = StageProgress("report", 1, "tables and figures from MLflow")
    with tracked_run("report", tags.child(parent, schema.STAGE_RUN, stage="report"), parent=parent) as run:
        report = write_report(experiment, out, parent.tracking_uri, within=parent.run_id)
        for path in (*report.table_files, *report.figure_files):
            run.log_file(path, "report")
        run.log_metrics({"files": len(report.table_files) + len(report.figure_files)})
    progress.update(
        1, f"{len(report.table_files)} table files and {len(report.figure_files)} figures in {report.folder}"
    )
    return ReportRun(report, run.run_id)


@task(name="paper-report", task_run_name="paper-report")
def paper_report(experiment: str, out: str | Path, tracking_uri: str) -> Report:
    """Tables and figures of a whole MLflow experiment, in ``out`` and in a report run of that experiment."""
    report = write_report(experiment, out, tracking_uri)
    tags = {schema.KIND: schema.REPORT, schema.CODE_VERSION: code_version()}
    with tracked_run(schema.REPORT_NAME, tags, experiment=experiment, uri=tracking_uri) as run:
        for path in (*report.table_files, *report.figure_files):
            run.log_file(path, "report")
        run.log_metrics({"evaluations": len(report.tables.evaluations)})
    return report
