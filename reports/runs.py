"""What TAPP writes into MLflow (tag keys, run kinds, metric names) and how reports read it back.

This is the one schema shared by the writers (tasks/) and the readers (the tables and figures here): a table is
a query over runs by these tags, so a UI filter such as ``tags.method = 'tapp' and tags.model = 'vgg16'`` and the
paper table see the same runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run

from tapp_core.errors import TappError

# Tag keys
KIND = "run_kind"
STAGE = "stage"
MODEL = "model"
METHOD = "method"
CLUSTER = "cluster"
BATCH_SIZE = "batch_size"
SEED = "seed"
DATASET = "dataset"
EMULATED = "emulated"
CODE_VERSION = "code_version"
EXPERIMENT_RUN = "experiment_run"
"""On every run of one tapp_experiment: the id of its parent run (so one experiment's runs are one filter)."""
SWEEP_RUN = "sweep_run"
STEP_TIME_SOURCE = "step_time_source"
"""``measured`` (runtime, median over race rounds) or ``estimated`` (cost model): where ``step_time_s`` came from."""
RACE_ID = "race_id"
"""The race an evaluation's measurement came from: runs of one race pair round by round."""
RACE_STOP = "race_stop"
HOST_OVERLOADED = "host_overloaded"
BEST_GROUP = "best_group"
"""``true`` on an evaluation whose interval overlaps the fastest method's in its race (``tapp_core.stats``)."""
MEASUREMENT_FROM = "measurement_from"
"""Tag of an evaluation whose plan is an earlier method's: the method whose measurement it shares."""
ERROR = "error"

# Run kinds
EXPERIMENT = "experiment"
STAGE_RUN = "stage"
EVALUATION = "evaluation"
TRAIN = "train"
REPORT = "report"
SWEEP = "sweep"

# Metrics of an evaluation run
STEP_TIME = "step_time_s"
"""The step time every view shows: the measured median, else the estimate, rounded as shown (``reports.numbers``)."""
STEP_TIME_MS = "step_time_ms"
"""The same in milliseconds, for MLflow's bar chart (its labels keep two decimals)."""
MEASURED_STEP_TIME = "measured_step_time_s"
ESTIMATED_STEP_TIME = "estimated_step_time_s"
COMMUNICATION_SHARE = "communication_share"
MEASURED_COMMUNICATION_SHARE = "measured_communication_share"
ESTIMATED_COMMUNICATION_SHARE = "estimated_communication_share"
STEP_TIME_LOW = "step_time_low_s"
STEP_TIME_HIGH = "step_time_high_s"
"""The confidence interval of the measured median (order statistics over the race's rounds)."""
STEP_TIME_COVERAGE = "step_time_coverage"
RACE_ROUNDS = "race_rounds"
ROUND_STEP_TIME = "race_round_step_time_s"
"""One value per race round (step = the round's number in its race)."""
LOAD_BEFORE = "host_load_before"
LOAD_AFTER = "host_load_after"
HOST_CPUS = "host_cpus"
HOST_RANKS = "host_ranks"
HOST_OTHER_CPU = "host_other_cpu_share"
"""The share of the host's CPU time other processes than the race's own took while it ran."""
# Metrics of an experiment run
SPEEDUP = "speedup_bsp_over_tapp"
"""The median of BSP/TAPP per-round step-time ratios in the evaluation race (``_low``, ``_high``: its interval)."""
# Metrics of a train run
TEST_ACCURACY = "test_accuracy"
# Metrics of the search stage, one value per round (step = round)
ROUND_METRICS = ("reward_mean", "best_step_time_s", "round_best_step_time_s", "entropy")

# Artifacts of an evaluation run
PLAN_ARTIFACT = "plan.json"
ESTIMATE_ARTIFACT = "estimate.json"

KEY_COLUMNS = ("model", "cluster", "batch_size")


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
    client: MlflowClient, experiment: str, kind: str, within: str | None = None, tag: str = EXPERIMENT_RUN
) -> list[RunRow]:
    """FINISHED runs of one kind; ``within`` keeps those whose ``tag`` equals it (one experiment or sweep)."""
    query = f"tags.{KIND} = '{kind}' and attributes.status = 'FINISHED'"
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


def frame(rows: Iterable[RunRow], tag_columns: tuple[str, ...], metric_columns: tuple[str, ...]) -> pd.DataFrame:
    """One row per run: the chosen tags (batch size as int), the chosen metrics (NaN when absent), and the run id."""
    records = []
    for row in rows:
        record: dict[str, object] = {t: row.tags.get(t, "") for t in tag_columns}
        if BATCH_SIZE in record:
            record[BATCH_SIZE] = int(row.tags.get(BATCH_SIZE) or 0)
        record.update({m: row.metrics.get(m, float("nan")) for m in metric_columns})
        record["run_id"] = row.run_id
        record["start_time"] = row.start_time
        records.append(record)
    return pd.DataFrame(records, columns=[*tag_columns, *metric_columns, "run_id", "start_time"])


def evaluations(
    client: MlflowClient, experiment: str, within: str | None = None, tag: str = EXPERIMENT_RUN
) -> pd.DataFrame:
    """The latest FINISHED evaluation per (model, cluster, batch size, method): tags, step times, shares."""
    rows = latest_per_key(finished_runs(client, experiment, EVALUATION, within, tag), (*KEY_COLUMNS, METHOD))
    return frame(
        rows,
        (*KEY_COLUMNS, METHOD, STEP_TIME_SOURCE, EXPERIMENT_RUN, RACE_ID, MEASUREMENT_FROM, BEST_GROUP),
        (
            STEP_TIME,
            MEASURED_STEP_TIME,
            ESTIMATED_STEP_TIME,
            STEP_TIME_LOW,
            STEP_TIME_HIGH,
            STEP_TIME_COVERAGE,
            RACE_ROUNDS,
            COMMUNICATION_SHARE,
            MEASURED_COMMUNICATION_SHARE,
            ESTIMATED_COMMUNICATION_SHARE,
            LOAD_BEFORE,
            LOAD_AFTER,
            HOST_CPUS,
            HOST_RANKS,
            HOST_OTHER_CPU,
        ),
    )


def round_step_times(client: MlflowClient, run_id: str) -> dict[int, float]:
    """An evaluation run's step time in each round of its race (round number -> seconds); empty when not raced."""
    return {m.step: m.value for m in client.get_metric_history(run_id, ROUND_STEP_TIME)}


def trainings(
    client: MlflowClient, experiment: str, within: str | None = None, tag: str = EXPERIMENT_RUN
) -> pd.DataFrame:
    """The latest FINISHED train run per (model, cluster, batch size, dataset, method)."""
    rows = latest_per_key(finished_runs(client, experiment, TRAIN, within, tag), (*KEY_COLUMNS, DATASET, METHOD))
    return frame(rows, (*KEY_COLUMNS, DATASET, METHOD), (TEST_ACCURACY, "epochs"))


def search_stages(
    client: MlflowClient, experiment: str, within: str | None = None, tag: str = EXPERIMENT_RUN
) -> list[RunRow]:
    """The latest FINISHED search stage per (model, cluster, batch size)."""
    rows = [r for r in finished_runs(client, experiment, STAGE_RUN, within, tag) if r.tags.get(STAGE) == "search"]
    return sorted(latest_per_key(rows, KEY_COLUMNS), key=lambda r: tuple(r.tags.get(t, "") for t in KEY_COLUMNS))


def sampling_stage(client: MlflowClient, experiment: str, search_stage: RunRow) -> RunRow | None:
    """The FINISHED sampling stage of the experiment run that ``search_stage`` belongs to (its measured rounds, its
    sampled plans and final race), if there is one."""
    parent = search_stage.tags.get(EXPERIMENT_RUN)
    if not parent:
        return None
    found = [r for r in finished_runs(client, experiment, STAGE_RUN, parent) if r.tags.get(STAGE) == "sampling"]
    return max(found, key=lambda r: (r.start_time, r.run_id), default=None)


def round_history(client: MlflowClient, run_id: str) -> pd.DataFrame:
    """Per-round search metrics of one search stage run: a ``round`` column and one column per metric."""
    series: dict[str, dict[int, float]] = {}
    for name in ROUND_METRICS:
        series[name] = {m.step: m.value for m in client.get_metric_history(run_id, name)}
    rounds = sorted({step for values in series.values() for step in values})
    data = {"round": rounds, **{name: [series[name].get(r, float("nan")) for r in rounds] for name in ROUND_METRICS}}
    return pd.DataFrame(data)
