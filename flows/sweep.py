"""``benchmark_sweep``: a list of experiment configurations run one after another as ``tapp_experiment``
subflows, then one report.

A sweep is a ``SweepConfig``: the experiment settings (``ExperimentSettings``) with lists of models, clusters,
computing powers and batch sizes; its ``configurations()`` are the experiments, in order. Experiments run one after
another (their measurements must not share the cores). A failed experiment is recorded and the sweep goes on; the
sweep fails at the end if any did.

Every run of the sweep carries the ``sweep_run`` tag: the id of the sweep's first run. An interrupted sweep resumes
(``resume_from``: its run) at its first unfinished configuration: a new sweep run, tagged ``resumed_from``, reads
the sweep's configuration back from the old one's ``config.json``, skips the configurations that finished, continues
the search of one that was interrupted, and reports the whole sweep (``tapp sweep --resume RUN_ID``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow

from flows.experiment import check_inputs, interrupted_run, tapp_experiment
from reports import schema
from reports.paper import write_report
from reports.report_folders import check_report_folder
from tasks import prefect_ui
from tasks.config import ExperimentConfig, SweepConfig
from tasks.progress import StageProgress
from tasks.tracking import DEFAULT_EXPERIMENT, check_tracking, code_version, tracked_run

SWEEP_STAGE = "sweep"
"""The sweep's progress stage: ``start LABEL`` before a configuration runs, ``done LABEL`` (or ``failed LABEL``)
after it (the command line draws a bar per configuration from them)."""


class SweepIncomplete(RuntimeError):
    """Some experiments of the sweep failed; the report holds the others."""


@dataclass
class SweepResult:
    run_id: str
    report_dir: Path
    step_time_table: str
    failed: list[str] = field(default_factory=list)
    sweep_id: str = ""
    """The ``sweep_run`` tag of every run of the sweep: its first run's id (``run_id`` when not resumed)."""


def configuration_label(config: ExperimentConfig) -> str:
    return f"{config.model} on {config.target.name}, batch {config.batch_size}"


def sweep_run_name() -> str:
    """``sweep-MODELS-MODE``, e.g. ``sweep-alexnet-vgg16-measured``."""
    from prefect.runtime import flow_run

    sweep = flow_run.parameters.get("sweep")
    values = sweep.model_dump() if isinstance(sweep, SweepConfig) else dict(sweep or {})
    models = "-".join(values.get("models") or SweepConfig.model_fields["models"].default)
    return f"sweep-{models}-{'measured' if values.get('measure', True) else 'estimated'}"


@dataclass(frozen=True)
class Resumed:
    """What an interrupted sweep left: its id (its first run's), the run resumed, its finished configurations, and
    its interrupted experiment runs."""

    sweep_id: str
    run_id: str
    finished: frozenset[int]
    interrupted: dict[int, str]


def resume_sweep(uri: str, run_id: str, experiment: str) -> tuple[SweepConfig, Resumed]:
    """The configuration of sweep run ``run_id`` (``last``: the latest of ``experiment``), read back from its
    ``config.json``, and what it finished; a ``TrackingError`` when there is no such run or it is not interrupted."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run, text = interrupted_run(
        client, uri, run_id, experiment, schema.SWEEP, "a sweep's run (the one `tapp sweep` prints)"
    )
    run_id = run.info.run_id
    sweep = SweepConfig.from_json(text, f"--resume: run {run_id}'s {schema.CONFIG_ARTIFACT}")
    sweep_id = run.data.tags.get(schema.SWEEP_RUN, run_id)
    query = f"tags.{schema.KIND} = '{schema.EXPERIMENT}' and tags.{schema.SWEEP_RUN} = '{sweep_id}'"
    finished: set[int] = set()
    interrupted: dict[int, tuple[int, str]] = {}
    for found in client.search_runs([run.info.experiment_id], query, max_results=10000):
        index = int(found.data.tags.get(schema.SWEEP_INDEX, "-1"))
        if found.info.status == "FINISHED":
            finished.add(index)
        elif found.info.status in ("FAILED", "KILLED"):
            latest = interrupted.get(index)
            if latest is None or found.info.start_time > latest[0]:
                interrupted[index] = (found.info.start_time, found.info.run_id)
    left = {i: r for i, (_, r) in interrupted.items() if i not in finished}
    return sweep, Resumed(sweep_id, run_id, frozenset(finished), left)


@flow(name="benchmark-sweep", flow_run_name=sweep_run_name)
def benchmark_sweep(
    sweep: SweepConfig | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    out: str = "out/sweep",
    tracking_uri: str | None = None,
    resume_from: str | None = None,
) -> SweepResult:
    """Every configuration of ``sweep`` (None: the defaults) as a ``tapp_experiment`` subflow, all tagged with this
    sweep; one report at the end (also the sweep run's description in MLflow, and its ``tapp-sweep-result``
    artifact in Prefect). ``resume_from`` (an interrupted sweep's run) goes on where it stopped, with its own
    configuration (``sweep`` is then not used)."""
    uri = check_tracking(tracking_uri)
    resumed = Resumed("", "", frozenset(), {})
    if resume_from is not None:
        sweep, resumed = resume_sweep(uri, resume_from, experiment)
    sweep = sweep or SweepConfig()
    prefect_ui.quiet_task_states()
    configurations = sweep.configurations()
    check_report_folder(out, experiment)  # every input checked before any run exists
    for config in configurations:
        check_inputs(config, uri)
    tags = {schema.KIND: schema.SWEEP, schema.DATASET: sweep.dataset, schema.SEED: str(sweep.seed)}
    tags |= {schema.CODE_VERSION: code_version(), **({schema.RESUMED_FROM: resumed.run_id} if resumed.run_id else {})}
    with tracked_run(schema.SWEEP_NAME, tags, experiment=experiment, uri=uri) as run:
        sweep_id = resumed.sweep_id or run.run_id
        run.set_tags({schema.SWEEP_RUN: sweep_id})
        run.log_params(sweep_params(sweep))
        run.log_text(sweep.to_json(), schema.CONFIG_ARTIFACT)
        failed = _run_configurations(configurations, resumed, sweep_id, experiment, out, uri)
        run.log_metrics({"experiments": len(configurations), "failed_experiments": len(failed)})
        report = write_report(experiment, out, uri, within=sweep_id, tag=schema.SWEEP_RUN)
        for path in (*report.table_files, *report.figure_files):
            run.log_file(path, "report")
        table = report.tables.step_time.to_markdown()
        failures = f"\n\nFailed experiments: {'; '.join(failed)}." if failed else ""
        run.set_note(f"### Benchmark sweep: {len(configurations)} experiments\n\n{table}{failures}\n")
        prefect_ui.log(
            f"{len(configurations)} experiments reported; the step-time table is the artifact tapp-sweep-result."
        )
        prefect_ui.markdown_artifact("tapp-sweep-result", table + failures, "the sweep's step-time table")
        if failed:
            raise SweepIncomplete(f"failed experiments: {'; '.join(failed)}; report of the others in {out}")
    return SweepResult(run.run_id, report.folder, table, failed, sweep_id)


def sweep_params(sweep: SweepConfig) -> dict[str, Any]:
    """The sweep's MLflow parameters: every setting, the lists comma-separated (``config.json`` holds it whole)."""
    shown = sweep.model_dump(mode="json", exclude={"clusters"})
    shown["clusters"] = ",".join(c.name for c in sweep.clusters)
    for name in ("models", "batch_sizes", "powers", "methods", "schedules"):
        if shown.get(name) is not None:
            shown[name] = ",".join(str(v) for v in shown[name])
    return shown


def _run_configurations(
    configurations: list[ExperimentConfig], resumed: Resumed, sweep_id: str, experiment: str, out: str, uri: str
) -> list[str]:
    """Run every configuration the sweep has not finished, in order; returns the failed ones' labels."""
    failed: list[str] = []
    progress = StageProgress(SWEEP_STAGE, len(configurations), "sweep configurations")
    for index, config in enumerate(configurations):
        label = configuration_label(config)
        if index in resumed.finished:
            progress.update(index + 1, f"done {label} (finished before)")
            continue
        progress.update(index, f"start {label}")
        folder = f"{config.model}_{config.target.name}_b{config.batch_size}"
        state = tapp_experiment(
            config=config,
            experiment=experiment,
            out=str(Path(out) / "experiments" / folder),
            tracking_uri=uri,
            sweep_run=sweep_id,
            sweep_index=index,
            resume_from=resumed.interrupted.get(index),
            return_state=True,
        )
        if not state.is_completed():
            failed.append(label)
        progress.update(index + 1, f"{'done' if state.is_completed() else 'failed'} {label}")
    return failed
