"""The TAPP paper's reported figures beside ours: which of its claims hold here.

The paper (Mao et al., Appl. Sci. 2021, 11, 4785; ``../shared/seeds/000_*.txt``, its table of single-step
training times on a CPU cluster) reports step times in seconds on its own hardware; ours are on other hardware. So
each figure is compared as a ratio, which hardware does not set: each method's step time over TAPP's (the speedup
of TAPP over it). A claim is "TAPP is faster than X"; it holds here where our ratio lies above 1 beyond the noise
(its interval from the race, when raced), is a tie where the interval holds 1, and fails where it lies below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from reports import schema
from reports.tables import (
    HIGH,
    LOW,
    ROW_LABELS,
    Table,
    model_label,
    ratio,
    row_order,
    speedup_columns,
    step_kind_notes,
)
from tapp_core.planners.base import PAPER_METHODS, method_label

PAPER_STEP_TIMES: dict[str, dict[str, float]] = {
    "alexnet": {"single-cpu": 0.811, "pipetorch": 0.675, "bsp": 0.803, "tapp": 0.602},
    "vgg16": {"single-cpu": 1.972, "pipetorch": 1.634, "bsp": 1.865, "tapp": 1.432},
    "inception_v3": {"single-cpu": 0.985, "pipetorch": 0.632, "bsp": 0.914, "tapp": 0.614},
}
"""The paper's table of single-step training time (s) on its CPU cluster, per model and method."""
PAPER_SPEEDUPS: dict[str, float] = {"alexnet": 1.33, "vgg16": 1.30, "inception_v3": 1.49}
"""The paper's reported speedup BSP/TAPP per model (its table's last column)."""
CLAIM = "TAPP faster than"
PAPER, OURS, AGAINST, HOLDS = "paper", "ours", "ours / paper", "holds here"


def paper_comparison_table(evaluations: pd.DataFrame, ratios: Mapping[str, pd.DataFrame]) -> Table:
    """Per (model, cluster, batch size) we evaluated, and per model of the paper we did not: for each of the
    paper's baselines, TAPP's speedup over it in the paper and here, their ratio, and whether the claim holds.
    ``ratios``: per method, its paired step-time ratios over TAPP's (``paired_ratios``)."""
    keys = list(schema.KEY_COLUMNS)
    ours = _ours(evaluations, ratios)
    rows = []
    for key in _keys(evaluations):
        model = key[0]
        for method in (m for m in PAPER_METHODS if m != "tapp"):
            paper = _paper_ratio(model, method)
            value, low, high = ours.get((key[0], key[1], key[2], method), (math.nan, math.nan, math.nan))
            rows.append(
                {
                    **dict(zip(keys, (model_label(model), *key[1:]), strict=True)),
                    CLAIM: method_label(method),
                    PAPER: paper,
                    OURS: value,
                    OURS + LOW: low,
                    OURS + HIGH: high,
                    AGAINST: value / paper if not math.isnan(paper) else math.nan,
                    HOLDS: verdict(value, low, high),
                }
            )
    columns = [*keys, CLAIM, PAPER, OURS, OURS + LOW, OURS + HIGH, AGAINST, HOLDS]
    frame = pd.DataFrame(rows, columns=columns).rename(columns={k: ROW_LABELS[k] for k in keys})
    return Table(
        name="paper_comparison",
        title="The TAPP paper's step-time table beside ours: TAPP's speedup over each baseline",
        frame=frame,
        label_columns=(*(ROW_LABELS[k] for k in keys), CLAIM, HOLDS),
        formats={PAPER: ratio, OURS: ratio, AGAINST: ratio},
        notes=_notes(evaluations) + step_kind_notes(evaluations),
    )


def _keys(evaluations: pd.DataFrame) -> list[tuple[str, str, object]]:
    """Our (model, cluster, batch size) rows in the tables' order, then the paper's models we did not run."""
    ordered = row_order(evaluations[list(schema.KEY_COLUMNS)].drop_duplicates())
    columns = (ordered[c].tolist() for c in schema.KEY_COLUMNS)
    keys: list[tuple[str, str, object]] = [(str(m), str(c), int(b)) for m, c, b in zip(*columns, strict=True)]
    ran = {k[0] for k in keys}
    return keys + [(model, "–", "–") for model in PAPER_STEP_TIMES if model not in ran]


def _paper_ratio(model: str, method: str) -> float:
    figures = PAPER_STEP_TIMES.get(model)
    return figures[method] / figures["tapp"] if figures is not None else math.nan


def _ours(
    evaluations: pd.DataFrame, ratios: Mapping[str, pd.DataFrame]
) -> dict[tuple[str, str, object, str], tuple[float, float, float]]:
    """Our speedup of TAPP over each paper baseline, per (model, cluster, batch size, method): (value, low, high)."""
    keys = list(schema.KEY_COLUMNS)
    wide = evaluations.pivot_table(index=keys, columns="method", values=schema.STEP_TIME, aggfunc="first")
    wide = wide.reset_index()
    wide.columns = [str(c) for c in wide.columns]
    shown = wide.assign(model=wide["model"].map(model_label))
    found: dict[tuple[str, str, object, str], tuple[float, float, float]] = {}
    for method in (m for m in PAPER_METHODS if m != "tapp"):
        value, low, high = speedup_columns(shown, method, ratios.get(method))
        rows = zip(*(wide[c].tolist() for c in schema.KEY_COLUMNS), strict=True)
        for index, (model, cluster, batch) in enumerate(rows):
            key = (str(model), str(cluster), int(batch), method)
            found[key] = (float(value.iloc[index]), float(low.iloc[index]), float(high.iloc[index]))
    return found


def verdict(value: float, low: float, high: float) -> str:
    """Whether "TAPP is faster" holds for a speedup ``value`` with interval [``low``, ``high``] (NaN: none)."""
    if math.isnan(value):
        return "not run here"
    if math.isnan(low) or math.isnan(high):
        return "yes (estimated)" if value > 1 else "no (estimated)"
    if low > 1:
        return "yes"
    if high < 1:
        return "no: TAPP is slower"
    return "no: a tie within the noise"


def _notes(evaluations: pd.DataFrame) -> list[str]:
    speedups = ", ".join(f"{model_label(m)} {v:.2f}x" for m, v in PAPER_SPEEDUPS.items())
    raced = schema.STEP_TIME_LOW in evaluations and bool(evaluations[schema.STEP_TIME_LOW].notna().any())
    return [
        "Each figure is a baseline's step time over TAPP's: the paper's from its table of single-step training time "
        "on a CPU cluster (Mao et al., Appl. Sci. 2021, 11, 4785), ours from this report's step-time table. The "
        f"paper's reported speedups BSP/TAPP ({speedups}) are its BSP row.",
        "ours / paper: our speedup over the paper's (1: the same; a model the paper did not run has none).",
        "Holds here: yes when our speedup lies above 1 beyond the noise"
        + (" (its interval, from ratios paired round by round in the race)" if raced else "")
        + "; a tie when its interval holds 1; estimated where the step times are the cost model's.",
    ]
