"""The TAPP paper's section 5.2.2, from MLflow runs alone: TAPP under different computing power, and under different
batch sizes.

- ``computing_power``: one row per (model, cluster family, batch size, power), the family being the clusters
  derived from one cluster file with its slow devices' speed scaled by the power (``Cluster.scaled``, ``tapp sweep
  --power 1 0.5 0.25``): each method's step time, and TAPP's speedup over BSP and over Pipe-Torch (the paired
  per-round ratios of the race, with their intervals, where the methods were raced; else the ratio of the step
  times).
- ``batch_size``: one row per (model, cluster, batch size): each method's step time and its throughput in images
  per second (the batch over the step time; an interval's ends give the throughput's).

A measured cell is the race's median, then its interval [low, high], as in the step-time table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from reports import schema
from reports.tables import (
    HIGH,
    LOW,
    ROW_LABELS,
    Formatter,
    Table,
    labelled,
    pivot,
    raced,
    ratio,
    seconds,
    speedup_columns,
    step_kind_notes,
)
from tapp_core.planners.base import method_label

POWER_KEYS = ("model", schema.BASE_CLUSTER, schema.POWER, schema.BATCH_SIZE)
SPEEDUP_OVER = {"bsp": "TAPP over BSP", "pipetorch": "TAPP over Pipe-Torch"}
"""The computing-power table's speedup columns: TAPP's, over each of these methods."""
THROUGHPUT = " img/s"


def _how(evaluations: pd.DataFrame, measured: bool) -> str:
    """How the step times were had, for a table's note."""
    if measured:
        return ", each the race's median, then its interval [low, high]."
    estimated = bool((evaluations[schema.STEP_TIME_SOURCE] == "estimated").any())
    return ", estimated by the cost model where not measured." if estimated else ", measured."


def _step_times(evaluations: pd.DataFrame, keys: Sequence[str]) -> tuple[pd.DataFrame, list[str], bool]:
    """Each method's step time per row of ``keys`` (the cluster kept, to pair the races' ratios), its interval when
    raced."""
    measured = raced(evaluations)
    companions = {LOW: schema.STEP_TIME_LOW, HIGH: schema.STEP_TIME_HIGH} if measured else {}
    wide, methods = pivot(evaluations, keys, schema.STEP_TIME, companions)
    return wide, methods, measured


def computing_power_table(evaluations: pd.DataFrame, ratios: Mapping[str, pd.DataFrame]) -> Table:
    """``ratios``: per method, its paired step-time ratios over TAPP's (``paired_ratios``)."""
    keys = [*POWER_KEYS, schema.CLUSTER]
    wide, methods, measured = _step_times(evaluations, keys)
    for method, name in SPEEDUP_OVER.items():
        value, low, high = speedup_columns(wide, method, ratios.get(method))
        wide[name] = value.to_numpy()
        if measured:
            wide[name + LOW], wide[name + HIGH] = low.to_numpy(), high.to_numpy()
    wide = wide.drop(columns=[schema.CLUSTER])
    formats: dict[str, Formatter] = {method_label(m): seconds for m in methods}
    formats |= {name: ratio for name in SPEEDUP_OVER.values()}
    frame = labelled(wide, POWER_KEYS, methods)
    power = ROW_LABELS[schema.POWER]
    notes = [
        "Each cluster's family: the cluster with its slow devices (those slower than its median device) at the "
        "power's share of their speed; power 1 is the cluster as written. Step times in seconds"
        + _how(evaluations, measured),
        "TAPP over X: X's step time over TAPP's"
        + (
            ", the median of their ratios paired round by round in the race, then its interval [low, high]."
            if measured
            else "."
        ),
    ]
    return Table(
        name="computing_power",
        title="Step time under different computing power (TAPP paper, section 5.2.2)",
        frame=frame.assign(**{power: frame[power].map(lambda p: f"{float(p):g}")}),
        label_columns=tuple(ROW_LABELS[k] for k in POWER_KEYS),
        formats=formats,
        notes=notes + step_kind_notes(evaluations),
    )


def batch_size_table(evaluations: pd.DataFrame) -> Table:
    """Each method's step time and throughput per (model, cluster, batch size)."""
    keys = list(schema.KEY_COLUMNS)
    wide, methods, measured = _step_times(evaluations, keys)
    columns: list[str] = list(keys)
    for method in methods:
        wide[method + THROUGHPUT] = wide[schema.BATCH_SIZE] / wide[method]
        columns += [method, *([method + LOW, method + HIGH] if measured else []), method + THROUGHPUT]
        if measured:  # the throughput's interval: the batch over the step time's ends, swapped
            wide[method + THROUGHPUT + LOW] = wide[schema.BATCH_SIZE] / wide[method + HIGH]
            wide[method + THROUGHPUT + HIGH] = wide[schema.BATCH_SIZE] / wide[method + LOW]
            columns += [method + THROUGHPUT + LOW, method + THROUGHPUT + HIGH]
    frame = labelled(wide[columns], keys, methods)
    frame = frame.rename(columns=_throughput_labels(methods))
    formats: dict[str, Formatter] = {}
    for method in methods:
        formats[method_label(method)] = seconds
        formats[method_label(method) + THROUGHPUT] = images_per_second
    return Table(
        name="batch_size",
        title="Step time (s) and throughput (images/s) under different batch sizes (TAPP paper, section 5.2.2)",
        frame=frame,
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats=formats,
        notes=[
            "Throughput: the batch size over the step time; step times in seconds"
            + _how(evaluations, measured)
            + (" The throughput's interval is the batch over the step time's." if measured else ""),
            *step_kind_notes(evaluations),
        ],
    )


def _throughput_labels(methods: Sequence[str]) -> dict[str, str]:
    names = {}
    for method in methods:
        for suffix in ("", LOW, HIGH):
            names[f"{method}{THROUGHPUT}{suffix}"] = f"{method_label(method)}{THROUGHPUT}{suffix}"
    return names


def images_per_second(value: float) -> str:
    return f"{value:.1f}"
