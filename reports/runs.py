"""How reports read back what TAPP wrote into MLflow (``reports.schema`` names it): runs as rows and frames."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException

from reports import schema
from tapp_core.errors import TappError


class ReportError(TappError):
    """Runs that cannot make a report: an unknown experiment, or one with no finished evaluation."""


@dataclass(frozen=True)
class RunRow:
    run_id: str
    parent_run_id: str
    status: str
    start_time: int
    tags: dict[str, str]
    metrics: dict[str, float]
    params: dict[str, str]

    @classmethod
    def of(cls, run: Run) -> RunRow:
        tags = dict(run.data.tags)
        return cls(
            run_id=run.info.run_id,
            parent_run_id=tags.get("mlflow.parentRunId", ""),
            status=run.info.status,
            start_time=int(run.info.start_time or 0),
            tags=tags,
            metrics=dict(run.data.metrics),
            params=dict(run.data.params),
        )


def experiment_ids(client: MlflowClient, experiment: str) -> list[str]:
    found = client.get_experiment_by_name(experiment)
    if found is None:
        known = sorted(e.name for e in client.search_experiments())
        raise ReportError(
            f"no MLflow experiment named {experiment!r} in {client.tracking_uri}; known: {', '.join(known)}"
        )
    return [found.experiment_id]


def search(client: MlflowClient, experiment: str, filter_string: str) -> Iterator[RunRow]:
    """Every run of the experiment matching ``filter_string`` (all pages)."""
    ids = experiment_ids(client, experiment)
    token: str | None = None
    while True:
        page = client.search_runs(ids, filter_string=filter_string, max_results=1000, page_token=token)
        yield from (RunRow.of(run) for run in page)
        token = page.token
        if not token:
            break


def finished_runs(
    client: MlflowClient, experiment: str, kind: str, within: str | None = None, tag: str = schema.EXPERIMENT_RUN
) -> list[RunRow]:
    """FINISHED runs of one kind; ``within`` keeps those whose ``tag`` equals it (one experiment or sweep)."""
    query = f"tags.{schema.KIND} = '{kind}' and attributes.status = 'FINISHED'"
    if within:
        query += f" and tags.{tag} = '{within}'"
    return list(search(client, experiment, query))


def latest_per_key(rows: Iterable[RunRow], key_tags: tuple[str, ...]) -> list[RunRow]:
    """The most recent run for each combination of ``key_tags`` (ties broken by run id, so the choice is stable)."""
    chosen: dict[tuple[str, ...], RunRow] = {}
    for row in rows:
        key = tuple(row.tags.get(t, "") for t in key_tags)
        current = chosen.get(key)
        if current is None or (row.start_time, row.run_id) > (current.start_time, current.run_id):
            chosen[key] = row
    return list(chosen.values())


def frame(
    rows: Iterable[RunRow],
    tag_columns: tuple[str, ...],
    metric_columns: tuple[str, ...],
    param_columns: tuple[str, ...] = (),
) -> pd.DataFrame:
    """One row per run: the chosen tags (batch size as int; a run of no computing-power family is its own family at
    power 1), the chosen metrics (NaN when absent), the chosen parameters, and the run id."""
    records = []
    for row in rows:
        record: dict[str, object] = {t: row.tags.get(t, "") for t in tag_columns}
        if schema.BATCH_SIZE in record:
            record[schema.BATCH_SIZE] = int(row.tags.get(schema.BATCH_SIZE) or 0)
        if schema.BASE_CLUSTER in record:
            record[schema.BASE_CLUSTER] = row.tags.get(schema.BASE_CLUSTER) or row.tags.get(schema.CLUSTER, "")
        if schema.POWER in record:
            record[schema.POWER] = float(row.tags.get(schema.POWER) or 1.0)
        record.update({m: row.metrics.get(m, float("nan")) for m in metric_columns})
        record.update({p: row.params.get(p, "") for p in param_columns})
        record["run_id"] = row.run_id
        record["start_time"] = row.start_time
        records.append(record)
    columns = [*tag_columns, *metric_columns, *param_columns, "run_id", "start_time"]
    return pd.DataFrame(records, columns=columns)


def evaluations(
    client: MlflowClient, experiment: str, within: str | None = None, tag: str = schema.EXPERIMENT_RUN
) -> pd.DataFrame:
    """The latest FINISHED evaluation per (model, cluster, batch size, method): tags, step times, shares."""
    rows = latest_per_key(
        finished_runs(client, experiment, schema.EVALUATION, within, tag), (*schema.KEY_COLUMNS, schema.METHOD)
    )
    return frame(
        rows,
        (
            *schema.KEY_COLUMNS,
            schema.METHOD,
            schema.STEP_TIME_SOURCE,
            schema.EXPERIMENT_RUN,
            schema.RACE_ID,
            schema.MEASUREMENT_FROM,
            schema.BEST_GROUP,
            schema.BASE_CLUSTER,
            schema.POWER,
        ),
        (
            schema.STEP_TIME,
            schema.MEASURED_STEP_TIME,
            schema.ESTIMATED_STEP_TIME,
            schema.STEP_TIME_LOW,
            schema.STEP_TIME_HIGH,
            schema.STEP_TIME_COVERAGE,
            schema.RACE_ROUNDS,
            schema.COMMUNICATION_SHARE,
            schema.MEASURED_COMMUNICATION_SHARE,
            schema.ESTIMATED_COMMUNICATION_SHARE,
            schema.LOAD_BEFORE,
            schema.LOAD_AFTER,
            schema.HOST_CPUS,
            schema.HOST_RANKS,
            schema.HOST_OTHER_CPU,
        ),
        ("schedule",),
    )


RATIO_COLUMNS = (*schema.KEY_COLUMNS, "method", "median", "low", "high", "is")


def stored_result(client: MlflowClient, run_id: str) -> dict[str, object] | None:
    """The result an experiment's parent run stored (``schema.RESULT_ARTIFACT``, ``tasks.summary.result_record``);
    None for a run that stored none (made before results were stored, or not an experiment)."""
    with tempfile.TemporaryDirectory(prefix="tapp-result-") as tmp:
        try:
            data = json.loads(Path(client.download_artifacts(run_id, schema.RESULT_ARTIFACT, tmp)).read_text())
        except (MlflowException, OSError, ValueError):
            return None
    return data if isinstance(data, dict) else None


def stored_ratios(client: MlflowClient, evaluations: pd.DataFrame) -> pd.DataFrame:
    """Each method's step time over TAPP's as its experiment's stored result says it (``RATIO_COLUMNS``: the keys,
    the method, the ratio with its interval, and which ratio it is), for the evaluations whose TAPP run and own run
    came from that one experiment. Read, never recomputed: the report shows the number every other view shows."""
    rows = []
    for key, group in evaluations.groupby(list(schema.KEY_COLUMNS), sort=False):
        parents = {str(r.method): str(getattr(r, schema.EXPERIMENT_RUN) or "") for r in group.itertuples(index=False)}
        parent = parents.get("tapp", "")
        result = stored_result(client, parent) if parent else None
        records = result.get("methods", []) if result is not None else []
        for record in records if isinstance(records, list) else []:
            method = str(record.get("method", ""))
            if method == "tapp" or parents.get(method) != parent:
                continue
            values = [_float(record.get(k)) for k in ("vs_tapp", "vs_tapp_low", "vs_tapp_high")]
            rows.append([*key, method, *values, str(record.get("vs_tapp_is", ""))])
    return pd.DataFrame(rows, columns=list(RATIO_COLUMNS))


def _float(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def trainings(
    client: MlflowClient, experiment: str, within: str | None = None, tag: str = schema.EXPERIMENT_RUN
) -> pd.DataFrame:
    """The latest FINISHED train run per (model, cluster, batch size, dataset, method): its accuracy (a language
    model's perplexity), how long it trained, on what, and with which schedule."""
    rows = latest_per_key(
        finished_runs(client, experiment, schema.TRAIN, within, tag),
        (*schema.KEY_COLUMNS, schema.DATASET, schema.METHOD),
    )
    tags = (*schema.KEY_COLUMNS, schema.DATASET, schema.METHOD, schema.SCHEDULE, schema.STALENESS, schema.TRAINED_AS)
    metrics = (
        schema.TEST_ACCURACY,
        schema.TEST_PERPLEXITY,
        schema.TRAIN_TIME,
        schema.TRAIN_STEPS,
        "test_samples",
        "epochs",
    )
    params = (
        "plan_schedule",
        "plan_staleness",
        "train_budget_s",
        "steps_per_epoch",
        "train_samples",
        "optimizer",
        "lr",
    )
    return frame(rows, tags, metrics, params)


def accuracy_curve(client: MlflowClient, run_id: str) -> pd.DataFrame:
    """A train run's accuracy curve: per test evaluation (``point``), the training time and steps until then and
    the test accuracy (a language model's: its test perplexity)."""
    names = (schema.CURVE_TIME, schema.CURVE_STEPS, schema.CURVE_ACCURACY, schema.CURVE_PERPLEXITY)
    series = {name: {m.step: m.value for m in client.get_metric_history(run_id, name)} for name in names}
    points = sorted({*series[schema.CURVE_ACCURACY], *series[schema.CURVE_PERPLEXITY]})
    data = {"point": points, **{name: [values.get(p, float("nan")) for p in points] for name, values in series.items()}}
    return pd.DataFrame(data)


def untrained(
    client: MlflowClient, experiment: str, within: str | None = None, tag: str = schema.EXPERIMENT_RUN
) -> dict[tuple[str, str, int], str]:
    """Why the latest experiment of each (model, cluster, batch size) trained nothing, where it did not."""
    query = f"tags.{schema.KIND} = '{schema.EXPERIMENT}'" + (f" and tags.{tag} = '{within}'" if within else "")
    rows = latest_per_key(search(client, experiment, query), schema.KEY_COLUMNS)
    return {
        (r.tags.get(schema.MODEL, ""), r.tags.get(schema.CLUSTER, ""), int(r.tags.get(schema.BATCH_SIZE) or 0)): reason
        for r in rows
        if (reason := r.tags.get(schema.TRAINING_SKIPPED))
    }


def search_stages(
    client: MlflowClient, experiment: str, within: str | None = None, tag: str = schema.EXPERIMENT_RUN
) -> list[RunRow]:
    """The latest FINISHED search stage per (model, cluster, batch size)."""
    rows = [
        r
        for r in finished_runs(client, experiment, schema.STAGE_RUN, within, tag)
        if r.tags.get(schema.STAGE) == "search"
    ]
    return sorted(
        latest_per_key(rows, schema.KEY_COLUMNS), key=lambda r: tuple(r.tags.get(t, "") for t in schema.KEY_COLUMNS)
    )


def sampling_stage(client: MlflowClient, experiment: str, search_stage: RunRow) -> RunRow | None:
    """The FINISHED sampling stage of the experiment run that ``search_stage`` belongs to (its measured rounds, its
    sampled plans and final race), if there is one."""
    parent = search_stage.tags.get(schema.EXPERIMENT_RUN)
    if not parent:
        return None
    stages = finished_runs(client, experiment, schema.STAGE_RUN, parent)
    found = [r for r in stages if r.tags.get(schema.STAGE) == "sampling"]
    return max(found, key=lambda r: (r.start_time, r.run_id), default=None)


def round_history(client: MlflowClient, run_id: str) -> pd.DataFrame:
    """Per-round search metrics of one search stage run: a ``round`` column and one column per metric."""
    series: dict[str, dict[int, float]] = {}
    for name in schema.ROUND_METRICS:
        series[name] = {m.step: m.value for m in client.get_metric_history(run_id, name)}
    rounds = sorted({step for values in series.values() for step in values})
    data = {
        "round": rounds,
        **{name: [series[name].get(r, float("nan")) for r in rounds] for name in schema.ROUND_METRICS},
    }
    return pd.DataFrame(data)
