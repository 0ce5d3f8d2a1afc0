"""The paper's tables, built from MLflow runs alone, each written as Markdown, CSV and LaTeX.

- ``step_time``: the TAPP paper's table. Rows: models (AlexNet, VGG-16, Inception-V3 first) on a cluster at a
  batch size; columns: SingleCPU, Pipe-Torch, BSP, TAPP, speedup BSP/TAPP, then the other planners. A measured
  cell is the median over the evaluation race's rounds, then its confidence interval ``[low, high]``; the best
  method and every method whose interval overlaps it are bold (the best group: no winner is declared inside it;
  read from each evaluation run's ``best_group`` tag, which the experiment's result set). The speedup is the one
  the experiment's result logged on its parent run: the median of BSP/TAPP per-round ratios, with its own
  interval. CSV holds each interval as ``<column> low`` and ``<column> high`` and the best group as
  ``<column> best``.
- ``communication_share``: the same rows and methods, the share of a step spent waiting on communication.
- ``accuracy``: test accuracy after training each method's plan, per dataset.

CSV cells hold the MLflow metric values as logged (step times, intervals and speedups are logged rounded as every
view shows them, ``reports.numbers``); Markdown and LaTeX show them with ``reports.numbers`` too. The same runs give
byte-identical files, whoever writes them (``tapp report`` or the paper_table flow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import SupportsFloat

import pandas as pd
from mlflow import MlflowClient

from reports import numbers, runs
from tapp_core.metrics import host_overloaded
from tapp_core.stats import Interval, best_group

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
LOW, HIGH, BEST = " low", " high", " best"
"""Suffixes of a value column's companions in the frame (and the CSV): its interval and its best-group mark."""

Formatter = Callable[[float], str]


seconds = numbers.seconds
ratio = numbers.ratio
percent = numbers.percent


@dataclass(frozen=True)
class Markup:
    """How a text format shows a mark."""

    bold: str
    escape: Callable[[str], str]


@dataclass
class Table:
    """One table: raw values in ``frame`` (label columns first), a formatter per value column, and notes.

    A value column ``c`` may have companions in the frame: ``c low`` and ``c high`` (its interval, shown as
    ``value [low, high]``) and ``c best`` (true: shown bold). Markdown and LaTeX show them in the cell; the CSV
    keeps every column apart, unrounded.
    """

    name: str
    title: str
    frame: pd.DataFrame
    label_columns: tuple[str, ...]
    formats: dict[str, Formatter]
    notes: list[str] = field(default_factory=list)

    @property
    def shown_columns(self) -> list[str]:
        companions = {f"{c}{suffix}" for c in self.formats for suffix in (LOW, HIGH, BEST)}
        return [str(c) for c in self.frame.columns if c not in companions]

    def cell(
        self, column: str, value: object, row: Mapping[str, object] | None = None, markup: Markup | None = None
    ) -> str:
        markup = markup or MARKDOWN
        if column in self.label_columns:
            return markup.escape(str(value))
        if _missing(value):
            return markup.escape(MISSING)
        text = self.formats[column](_number(value))
        row = row or {}
        low, high = row.get(f"{column}{LOW}"), row.get(f"{column}{HIGH}")
        if not (_missing(low) or _missing(high)):
            digits = numbers.RATIO_DIGITS if self.formats[column] is ratio else numbers.SIGNIFICANT_DIGITS
            text = numbers.with_interval(text, _number(low), _number(high), digits)
        text = markup.escape(text)
        if row.get(f"{column}{BEST}") is True:
            text = markup.bold.format(text)
        return text

    def text_rows(self, markup: Markup | None = None) -> list[list[str]]:
        columns = self.shown_columns
        rows = []
        for record in self.frame.to_dict("records"):
            named = {str(k): v for k, v in record.items()}
            rows.append([self.cell(c, named[c], named, markup) for c in columns])
        return rows

    def to_markdown(self) -> str:
        columns = self.shown_columns
        align = ["---" if c in self.label_columns else "---:" for c in columns]
        lines = [f"**{self.title}**", "", _md_row(columns), _md_row(align)]
        lines += [_md_row(row) for row in self.text_rows(MARKDOWN)]
        lines += ["", *(f"{note}  " for note in self.notes)] if self.notes else []
        return "\n".join(lines).rstrip() + "\n"

    def to_csv(self) -> str:
        return self.frame.to_csv(index=False, float_format=_shortest, lineterminator="\n")

    def to_latex(self) -> str:
        columns = self.shown_columns
        spec = "".join("l" if c in self.label_columns else "r" for c in columns)
        lines = [
            "\\begin{table}[t]",
            "\\centering",
            f"\\caption{{{_tex(self.title)}}}",
            f"\\label{{tab:{self.name.replace('_', '-')}}}",
            f"\\begin{{tabular}}{{{spec}}}",
            "\\toprule",
            " & ".join(_tex(c) for c in columns) + " \\\\",
            "\\midrule",
        ]
        lines += [" & ".join(row) + " \\\\" for row in self.text_rows(LATEX)]
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


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _number(value: object) -> float:
    if isinstance(value, str | SupportsFloat):
        return float(value)
    raise TypeError(f"table cell {value!r} is not a number")


def _shortest(value: object) -> str:
    """The shortest text that reads back as exactly this float."""
    return repr(_number(value))


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


_TEX_ESCAPES = {
    "&": "\\&",
    "%": "\\%",
    "$": "\\$",
    "#": "\\#",
    "_": "\\_",
    "{": "\\{",
    "}": "\\}",
    "–": "--",
    "±": "$\\pm$",
}


def _tex(text: str) -> str:
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in text)


MARKDOWN = Markup(bold="**{}**", escape=str)
LATEX = Markup(bold="\\textbf{{{}}}", escape=_tex)


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


def _pivot(
    frame: pd.DataFrame, keys: Sequence[str], value: str, companions: Mapping[str, str] | None = None
) -> tuple[pd.DataFrame, list[str]]:
    """One row per ``keys``, one column per method holding ``value``; each of ``companions`` (suffix -> metric) adds
    a ``<method><suffix>`` column right after its method's."""
    methods = _method_columns(list(frame["method"].unique()))
    extra = dict(companions or {})
    columns = [f"{m}{suffix}" if suffix else m for m in methods for suffix in ("", *extra)]
    if frame.empty:
        wide = pd.DataFrame(columns=[*keys, *columns])
    else:
        metrics = [value, *extra.values()]
        table = frame.pivot_table(index=list(keys), columns="method", values=metrics, aggfunc="first", dropna=False)
        wide = pd.DataFrame(index=table.index)
        for method in methods:
            for suffix, metric in (("", value), *extra.items()):
                present = (metric, method) in table.columns
                wide[f"{method}{suffix}"] = table[(metric, method)] if present else float("nan")
        wide = wide.reset_index()
    wide = _row_order(wide)
    wide["model"] = wide["model"].map(model_label)
    return wide, methods


def _labelled(wide: pd.DataFrame, keys: Sequence[str], methods: Sequence[str]) -> pd.DataFrame:
    names = {k: ROW_LABELS[k] for k in keys}
    for method in methods:
        for suffix in ("", LOW, HIGH, BEST):
            names[f"{method}{suffix}"] = f"{method_label(method)}{suffix}"
    return wide.rename(columns=names)


def _raced(evaluations: pd.DataFrame) -> bool:
    """Whether any evaluation has a race's interval."""
    return runs.STEP_TIME_LOW in evaluations and bool(evaluations[runs.STEP_TIME_LOW].notna().any())


def _best_tags(evaluations: pd.DataFrame) -> dict[tuple[str, str, int], dict[str, str]]:
    """(model label, cluster, batch size) -> method -> its ``best_group`` tag (``true``/``false``; absent on runs made
    before the experiment's result tagged it)."""
    tags: dict[tuple[str, str, int], dict[str, str]] = {}
    if runs.BEST_GROUP not in evaluations:
        return tags
    for r in evaluations.itertuples(index=False):
        tag = str(getattr(r, runs.BEST_GROUP) or "")
        if tag:
            tags.setdefault((model_label(str(r.model)), str(r.cluster), int(str(r.batch_size))), {})[str(r.method)] = (
                tag
            )
    return tags


def _mark_best(wide: pd.DataFrame, methods: Sequence[str], tagged: dict[tuple[str, str, int], dict[str, str]]) -> None:
    """Add ``<method> best`` columns: true for the methods of the row's best group, as the experiment's result tagged
    them (``tagged``, ``_best_tags``); for runs made before that tag, by ``tapp_core.stats.best_group`` over the
    intervals."""
    marks = {m: [False] * len(wide) for m in methods}
    for row in range(len(wide)):
        key = (str(wide.at[row, "model"]), str(wide.at[row, "cluster"]), int(str(wide.at[row, "batch_size"])))
        if key in tagged:
            for method in methods:
                marks[method][row] = tagged[key].get(method) == "true"
            continue
        intervals: list[Interval | None] = []
        for method in methods:
            median, low, high = (_number(wide.at[row, f"{method}{s}"]) for s in ("", LOW, HIGH))
            known = not any(math.isnan(v) for v in (median, low, high))
            intervals.append(Interval(median, low, high, 0, math.nan) if known else None)
        for index in best_group(intervals):
            marks[methods[index]][row] = True
    for method in methods:
        wide.insert(list(wide.columns).index(f"{method}{HIGH}") + 1, f"{method}{BEST}", marks[method])


def _insert_speedup(wide: pd.DataFrame, speedups: pd.DataFrame | None) -> None:
    """The BSP/TAPP column after TAPP's: the speedup the experiment logged (``paired_speedups``) where there is one,
    else the ratio of the step times."""
    value = wide["bsp"] / wide["tapp"]
    low = pd.Series(float("nan"), index=wide.index)
    high = low.copy()
    if speedups is not None and not speedups.empty:
        labelled = speedups.assign(model=speedups["model"].map(model_label))
        merged = wide[list(runs.KEY_COLUMNS)].merge(labelled, on=list(runs.KEY_COLUMNS), how="left")
        paired = merged["median"].notna()
        value = value.where(~paired, merged["median"])
        low, high = merged["low"], merged["high"]
    after = max(i for i, c in enumerate(wide.columns) if str(c).startswith("tapp")) + 1
    for offset, (name, series) in enumerate(((SPEEDUP, value), (SPEEDUP + LOW, low), (SPEEDUP + HIGH, high))):
        wide.insert(after + offset, name, series.to_numpy())


def _source_notes(evaluations: pd.DataFrame) -> list[str]:
    sources = sorted(set(evaluations[runs.STEP_TIME_SOURCE]) - {""}) if not evaluations.empty else []
    if sources == ["measured"]:
        if not _raced(evaluations):
            return ["Step times measured on the MPI runtime: median of the steps after warm-up, in seconds."]
        rounds = evaluations[runs.RACE_ROUNDS].dropna()
        span = f"{int(rounds.min())}" if rounds.min() == rounds.max() else f"{int(rounds.min())}–{int(rounds.max())}"
        return [
            "Step times measured on the MPI runtime, in seconds: every method's plan raced in one race of interleaved"
            f" rounds ({span} rounds per plan), each cell the median over its rounds with its confidence interval"
            " (order statistics over the rounds, at least 90 % coverage) after it in brackets. Bold: the fastest method"
            " and every method whose interval overlaps it; no winner is declared among them."
        ]
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


def _race_notes(evaluations: pd.DataFrame, speedups: pd.DataFrame | None) -> list[str]:
    """Which methods shared a plan (one measurement, one figure), the speedup's interval, and overloaded hosts."""
    notes = []
    shared = evaluations[evaluations[runs.MEASUREMENT_FROM].fillna("") != ""]
    for r in shared.itertuples(index=False):
        source = str(getattr(r, runs.MEASUREMENT_FROM))
        notes.append(
            f"{model_label(str(r.model))}: {method_label(str(r.method))} chose a plan that runs the same as "
            f"{method_label(source)}'s; it was raced once and both show its figure."
        )
    if speedups is not None and bool(speedups["low"].notna().any()):
        notes.append(
            f"{SPEEDUP}: the median of BSP/TAPP step-time ratios paired round by round, then its interval [low, high]."
        )
    for key, group in evaluations.groupby(list(runs.KEY_COLUMNS), sort=False):
        columns = [runs.HOST_OTHER_CPU, runs.LOAD_BEFORE, runs.LOAD_AFTER, runs.HOST_CPUS, runs.HOST_RANKS]
        loads = group[columns].dropna(subset=[runs.LOAD_BEFORE, runs.HOST_CPUS])
        if loads.empty:
            continue
        others, before, after, cpus, ranks = (float(v) for v in loads.max())
        if host_overloaded(others, before, after, int(cpus), int(ranks)):
            model, cluster, batch = key
            took = f"other processes took {others:.0%} of its CPU time; " if math.isfinite(others) else ""
            notes.append(
                f"WARNING: the race for {model_label(str(model))} on {cluster}, batch {batch}, ran on an overloaded "
                f"host ({took}1-minute load average {before:.1f} before, {after:.1f} after; {int(cpus)} cores, "
                f"{int(ranks)} ranks of its own): its intervals are wider and its medians higher than on a quiet host."
            )
    return notes


def step_time_table(evaluations: pd.DataFrame, speedups: pd.DataFrame | None = None) -> Table:
    """The paper's table; ``speedups`` (keys, median, low, high) holds the paired BSP/TAPP ratios of the races."""
    keys = list(runs.KEY_COLUMNS)
    raced = _raced(evaluations)
    companions = {LOW: runs.STEP_TIME_LOW, HIGH: runs.STEP_TIME_HIGH} if raced else {}
    wide, methods = _pivot(evaluations, keys, runs.STEP_TIME, companions)
    if raced:
        _mark_best(wide, methods, _best_tags(evaluations))
    _insert_speedup(wide, speedups)
    if not raced:
        wide = wide.drop(columns=[SPEEDUP + LOW, SPEEDUP + HIGH])
    formats: dict[str, Formatter] = {method_label(m): seconds for m in methods}
    formats[SPEEDUP] = ratio
    return Table(
        name="step_time",
        title="Single-step training time (s)",
        frame=_labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats=formats,
        notes=_source_notes(evaluations) + (_race_notes(evaluations, speedups) if not evaluations.empty else []),
    )


def paired_speedups(client: MlflowClient, evaluations: pd.DataFrame) -> pd.DataFrame:
    """Per (model, cluster, batch size) whose BSP and TAPP evaluations came from one experiment: the BSP/TAPP speedup
    its result logged on its parent run (``speedup_bsp_over_tapp``: the median of per-round step-time ratios, with
    its interval as ``_low``/``_high``, when both were raced; else the ratio of their step times; ``tasks.summary``),
    so that the report shows the number every other view shows."""
    rows = []
    for key, group in evaluations.groupby(list(runs.KEY_COLUMNS), sort=False):
        by_method = {str(r.method): r for r in group.itertuples(index=False)}
        bsp, tapp = by_method.get("bsp"), by_method.get("tapp")
        parent = str(getattr(tapp, runs.EXPERIMENT_RUN) or "") if tapp is not None else ""
        if bsp is None or not parent or getattr(bsp, runs.EXPERIMENT_RUN) != parent:
            continue
        logged = client.get_run(parent).data.metrics
        if runs.SPEEDUP in logged:
            low, high = (logged.get(f"{runs.SPEEDUP}{end}", math.nan) for end in ("_low", "_high"))
            rows.append(
                {
                    **dict(zip(runs.KEY_COLUMNS, key, strict=True)),
                    "median": logged[runs.SPEEDUP],
                    "low": low,
                    "high": high,
                }
            )
    return pd.DataFrame(rows, columns=[*runs.KEY_COLUMNS, "median", "low", "high"])


def _interval_columns(interval: Interval) -> dict[str, float]:
    return {"median": interval.median, "low": interval.low, "high": interval.high}


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
        step_time=step_time_table(evaluations, paired_speedups(client, evaluations)),
        communication_share=communication_share_table(evaluations),
        accuracy=accuracy_table(trainings),
        evaluations=evaluations,
    )
