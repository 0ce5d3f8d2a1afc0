"""The paper's tables, built from MLflow runs alone, each written as Markdown, CSV and LaTeX.

- ``step_time``: the TAPP paper's table. Rows: models (AlexNet, VGG-16, Inception-V3 first) on a cluster at a
  batch size; columns: SingleCPU, Pipe-Torch, BSP, TAPP, speedup BSP/TAPP, then the other planners.
- ``communication_share``: the same rows and methods, the share of a step spent waiting on communication.
- ``accuracy``: test accuracy after training each method's plan, per dataset.

CSV cells hold the MLflow metric values unrounded; Markdown and LaTeX round them for reading. The same runs give
byte-identical files, whoever writes them (``tapp report`` or the paper_table flow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import SupportsFloat

import pandas as pd
from mlflow import MlflowClient

from reports import runs

PAPER_METHODS: tuple[str, ...] = ("single-cpu", "pipetorch", "bsp", "tapp")
OTHER_METHODS: tuple[str, ...] = ("single-gpu", "even", "pipedream", "autoddl", "oracle")
METHOD_LABELS: dict[str, str] = {
    "single-cpu": "SingleCPU",
    "single-gpu": "SingleGPU",
    "pipetorch": "Pipe-Torch",
    "bsp": "BSP",
    "tapp": "TAPP",
    "even": "Even split",
    "pipedream": "PipeDream/APapo",
    "autoddl": "AutoDDL",
    "oracle": "Oracle",
}
MODEL_ORDER: tuple[str, ...] = ("alexnet", "vgg16", "inception_v3")
MODEL_LABELS: dict[str, str] = {"alexnet": "AlexNet", "vgg16": "VGG-16", "inception_v3": "Inception-V3"}
SPEEDUP = "speedup BSP/TAPP"
ROW_LABELS: dict[str, str] = {"model": "model", "cluster": "cluster", "batch_size": "batch", "dataset": "dataset"}
MISSING = "–"
FORMATS = ("md", "csv", "tex")

Formatter = Callable[[float], str]


def seconds(value: float) -> str:
    return f"{value:.3f}"


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


@dataclass
class Table:
    """One table: raw values in ``frame`` (label columns first), a formatter per value column, and notes."""

    name: str
    title: str
    frame: pd.DataFrame
    label_columns: tuple[str, ...]
    formats: dict[str, Formatter]
    notes: list[str] = field(default_factory=list)

    def cell(self, column: str, value: object) -> str:
        if column in self.label_columns:
            return str(value)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return MISSING
        return self.formats[column](_number(value))

    def text_rows(self) -> list[list[str]]:
        return [
            [self.cell(c, v) for c, v in zip(self.frame.columns, row, strict=True)]
            for row in self.frame.itertuples(index=False)
        ]

    def to_markdown(self) -> str:
        header = [str(c) for c in self.frame.columns]
        align = ["---" if c in self.label_columns else "---:" for c in self.frame.columns]
        lines = [f"**{self.title}**", "", _md_row(header), _md_row(align)]
        lines += [_md_row(row) for row in self.text_rows()]
        lines += ["", *(f"{note}  " for note in self.notes)] if self.notes else []
        return "\n".join(lines).rstrip() + "\n"

    def to_csv(self) -> str:
        return self.frame.to_csv(index=False, float_format=_shortest, lineterminator="\n")

    def to_latex(self) -> str:
        spec = "".join("l" if c in self.label_columns else "r" for c in self.frame.columns)
        lines = [
            "\\begin{table}[t]",
            "\\centering",
            f"\\caption{{{_tex(self.title)}}}",
            f"\\label{{tab:{self.name.replace('_', '-')}}}",
            f"\\begin{{tabular}}{{{spec}}}",
            "\\toprule",
            " & ".join(_tex(str(c)) for c in self.frame.columns) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(_tex(cell) for cell in row) + " \\\\" for row in self.text_rows()]
        lines += ["\\bottomrule", "\\end{tabular}"]
        lines += [f"\\par\\smallskip\\footnotesize {_tex(note)}" for note in self.notes]
        lines += ["\\end{table}"]
        return "\n".join(lines) + "\n"

    def write(self, out: str | Path) -> list[Path]:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for suffix, text in (("md", self.to_markdown()), ("csv", self.to_csv()), ("tex", self.to_latex())):
            path = folder / f"{self.name}.{suffix}"
            path.write_text(text)
            written.append(path)
        return written


def _number(value: object) -> float:
    if isinstance(value, str | SupportsFloat):
        return float(value)
    raise TypeError(f"table cell {value!r} is not a number")


def _shortest(value: object) -> str:
    """The shortest text that reads back as exactly this float."""
    return repr(_number(value))


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


_TEX_ESCAPES = {"&": "\\&", "%": "\\%", "$": "\\$", "#": "\\#", "_": "\\_", "{": "\\{", "}": "\\}", "–": "--"}


def _tex(text: str) -> str:
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in text)


def model_label(model: str) -> str:
    return MODEL_LABELS.get(model, model)


def method_label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


def _row_order(frame: pd.DataFrame) -> pd.DataFrame:
    rank = {m: i for i, m in enumerate(MODEL_ORDER)}
    ordered = frame.assign(_rank=frame["model"].map(lambda m: rank.get(m, len(rank))))
    by = ["_rank", *(c for c in ("model", "cluster", "batch_size", "dataset") if c in frame.columns)]
    return ordered.sort_values(by, kind="stable").drop(columns="_rank").reset_index(drop=True)


def _method_columns(present: Sequence[str]) -> list[str]:
    """The paper's methods always, then the other known planners present, then anything else present."""
    known = [*PAPER_METHODS, *(m for m in OTHER_METHODS if m in present)]
    return known + sorted(m for m in set(present) if m not in known)


def _pivot(frame: pd.DataFrame, keys: Sequence[str], value: str) -> tuple[pd.DataFrame, list[str]]:
    methods = _method_columns(list(frame["method"].unique()))
    if frame.empty:
        wide = pd.DataFrame(columns=[*keys, *methods])
    else:
        wide = frame.pivot_table(index=list(keys), columns="method", values=value, aggfunc="first", dropna=False)
        wide = wide.reindex(columns=methods).reset_index()
        wide.columns.name = None
    wide = _row_order(wide)
    wide["model"] = wide["model"].map(model_label)
    return wide, methods


def _labelled(wide: pd.DataFrame, keys: Sequence[str], methods: Sequence[str]) -> pd.DataFrame:
    return wide.rename(columns={**{k: ROW_LABELS[k] for k in keys}, **{m: method_label(m) for m in methods}})


def _source_notes(evaluations: pd.DataFrame) -> list[str]:
    sources = sorted(set(evaluations[runs.STEP_TIME_SOURCE]) - {""}) if not evaluations.empty else []
    if sources == ["measured"]:
        return ["Step times measured on the MPI runtime: median of the steps after warm-up, in seconds."]
    estimated = evaluations[evaluations[runs.STEP_TIME_SOURCE] == "estimated"]
    if not estimated.empty:
        which = ", ".join(
            sorted(
                {
                    f"{model_label(str(r.model))}/{method_label(str(r.method))}"
                    for r in estimated.itertuples(index=False)
                }
            )
        )
        return [f"Step times in seconds; estimated by the cost model (not measured) for: {which}."]
    return ["Step times in seconds."]


def step_time_table(evaluations: pd.DataFrame) -> Table:
    keys = list(runs.KEY_COLUMNS)
    wide, methods = _pivot(evaluations, keys, runs.STEP_TIME)
    speedup = wide["bsp"] / wide["tapp"]
    position = list(wide.columns).index("tapp") + 1
    wide.insert(position, SPEEDUP, speedup)
    formats: dict[str, Formatter] = {method_label(m): seconds for m in methods}
    formats[SPEEDUP] = ratio
    return Table(
        name="step_time",
        title="Single-step training time (s)",
        frame=_labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats=formats,
        notes=_source_notes(evaluations),
    )


def communication_share_table(evaluations: pd.DataFrame) -> Table:
    keys = list(runs.KEY_COLUMNS)
    wide, methods = _pivot(evaluations, keys, runs.COMMUNICATION_SHARE)
    return Table(
        name="communication_share",
        title="Share of a step spent waiting on communication",
        frame=_labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats={method_label(m): percent for m in methods},
        notes=["Mean over devices of the non-overlapped send/receive wait divided by the step time."],
    )


def accuracy_table(trainings: pd.DataFrame) -> Table:
    keys = [*runs.KEY_COLUMNS, runs.DATASET]
    wide, methods = _pivot(trainings, keys, runs.TEST_ACCURACY)
    notes = ["Test accuracy after training each method's plan."]
    if not trainings.empty and (trainings[runs.DATASET] == "synthetic").any():
        notes.append("Rows on the synthetic dataset are random labels: their accuracy means nothing.")
    if trainings.empty:
        notes.append("No training runs in this experiment (run with --train-epochs and real data).")
    return Table(
        name="accuracy",
        title="Test accuracy",
        frame=_labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats={method_label(m): percent for m in methods},
        notes=notes,
    )


@dataclass
class Tables:
    step_time: Table
    communication_share: Table
    accuracy: Table
    evaluations: pd.DataFrame
    """The evaluation runs the tables were built from (one per model, cluster, batch size, method)."""

    def all(self) -> list[Table]:
        return [self.step_time, self.communication_share, self.accuracy]

    def write(self, out: str | Path) -> list[Path]:
        return [path for table in self.all() for path in table.write(out)]


def build_tables(
    experiment: str, tracking_uri: str | None = None, within: str | None = None, tag: str = runs.EXPERIMENT_RUN
) -> Tables:
    """The tables of an MLflow experiment (or of the runs whose ``tag`` is ``within``: one experiment or sweep)."""
    client = MlflowClient(tracking_uri)
    evaluations = runs.evaluations(client, experiment, within, tag)
    if evaluations.empty:
        scope = f" with {tag} {within}" if within else ""
        raise runs.ReportError(f"MLflow experiment {experiment!r} has no finished evaluation runs{scope}")
    trainings = runs.trainings(client, experiment, within, tag)
    return Tables(
        step_time=step_time_table(evaluations),
        communication_share=communication_share_table(evaluations),
        accuracy=accuracy_table(trainings),
        evaluations=evaluations,
    )
