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
- ``accuracy``: test accuracy after training each method's plan, per dataset (``reports.accuracy``); ``perplexity``:
  the same for a language model, its test perplexity.
- ``computing_power`` and ``batch_size``: the TAPP paper's section 5.2.2 (``reports.sections``).
- ``paper_comparison``: the paper's reported figures beside ours, as ratios (``reports.published``).

CSV cells hold the MLflow metric values as logged (step times, intervals and speedups are logged rounded as every
view shows them, ``reports.numbers``); Markdown and LaTeX show them with ``reports.numbers`` too. The same runs give
byte-identical files, whoever writes them (``tapp report`` or the paper_table flow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import SupportsFloat

import pandas as pd

from reports import numbers, schema
from tapp_core.measure.metrics import host_overloaded
from tapp_core.measure.stats import Interval, best_group
from tapp_core.planners.base import PAPER_METHODS, PLANNER_NAMES, method_label, method_space

MODEL_ORDER: tuple[str, ...] = ("alexnet", "vgg16", "inception_v3")
MODEL_LABELS: dict[str, str] = {"alexnet": "AlexNet", "vgg16": "VGG-16", "inception_v3": "Inception-V3"}
SPEEDUP = "speedup BSP/TAPP"
ROW_LABELS: dict[str, str] = {
    "model": "model",
    "cluster": "cluster",
    "base_cluster": "cluster",
    "power": "power",
    "batch_size": "batch",
    "dataset": "dataset",
}
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
        if not (_missing(low) or _missing(high)) and self.formats[column] is percent:
            text = f"{text} {numbers.percent_bracket(_number(low), _number(high))}"
        elif not (_missing(low) or _missing(high)):
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


def row_order(frame: pd.DataFrame) -> pd.DataFrame:
    """The paper's models first, then by cluster, computing power (the full power first), batch size, dataset."""
    rank = {m: i for i, m in enumerate(MODEL_ORDER)}
    ordered = frame.assign(_rank=frame["model"].map(lambda m: rank.get(m, len(rank))))
    columns = ("model", "cluster", "base_cluster", "power", "batch_size", "dataset")
    by = ["_rank", *(c for c in columns if c in frame.columns)]
    ascending = [c != "power" for c in by]
    return ordered.sort_values(by, ascending=ascending, kind="stable").drop(columns="_rank").reset_index(drop=True)


def method_order(present: Iterable[str], paper_always: bool = True) -> list[str]:
    """The paper's methods in its column order (always, unless not ``paper_always``), then the registry's other
    methods present, in its order, then anything else present."""
    present = set(present)
    paper = [m for m in PAPER_METHODS if paper_always or m in present]
    known = [*paper, *(m for m in PLANNER_NAMES if m in present and m not in PAPER_METHODS)]
    return known + sorted(m for m in present if m not in known)


def pivot(
    frame: pd.DataFrame, keys: Sequence[str], value: str, companions: Mapping[str, str] | None = None
) -> tuple[pd.DataFrame, list[str]]:
    """One row per ``keys``, one column per method holding ``value``; each of ``companions`` (suffix -> metric) adds
    a ``<method><suffix>`` column right after its method's."""
    methods = method_order(frame["method"].unique())
    extra = dict(companions or {})
    columns = [f"{m}{suffix}" if suffix else m for m in methods for suffix in ("", *extra)]
    if frame.empty:
        wide = pd.DataFrame(columns=[*keys, *columns])
    else:
        metrics = [value, *extra.values()]
        table = frame.pivot_table(index=list(keys), columns="method", values=metrics, aggfunc="first", dropna=False)
        table = table[table.index.isin(frame.set_index(list(keys)).index)]  # the rows run, not every combination
        wide = pd.DataFrame(index=table.index)
        for method in methods:
            for suffix, metric in (("", value), *extra.items()):
                present = (metric, method) in table.columns
                wide[f"{method}{suffix}"] = table[(metric, method)] if present else float("nan")
        wide = wide.reset_index()
    wide = row_order(wide)
    wide["model"] = wide["model"].map(model_label)
    return wide, methods


def labelled(wide: pd.DataFrame, keys: Sequence[str], methods: Sequence[str]) -> pd.DataFrame:
    names = {k: ROW_LABELS[k] for k in keys}
    for method in methods:
        for suffix in ("", LOW, HIGH, BEST):
            names[f"{method}{suffix}"] = f"{method_label(method)}{suffix}"
    return wide.rename(columns=names)


def raced(evaluations: pd.DataFrame) -> bool:
    """Whether any evaluation has a race's interval."""
    return schema.STEP_TIME_LOW in evaluations and bool(evaluations[schema.STEP_TIME_LOW].notna().any())


BestTags = Mapping[tuple[str, str, int], Mapping[str, str]]
"""(model label, cluster, batch size) -> method -> its ``best_group`` tag."""


def best_tags(evaluations: pd.DataFrame) -> BestTags:
    """(model label, cluster, batch size) -> method -> its ``best_group`` tag (``true``/``false``; absent on runs made
    before the experiment's result tagged it)."""
    tags: dict[tuple[str, str, int], dict[str, str]] = {}
    if schema.BEST_GROUP not in evaluations:
        return tags
    for r in evaluations.itertuples(index=False):
        tag = str(getattr(r, schema.BEST_GROUP) or "")
        if tag:
            key = (model_label(str(r.model)), str(r.cluster), int(str(r.batch_size)))
            tags.setdefault(key, {})[str(r.method)] = tag
    return tags


def mark_best(wide: pd.DataFrame, methods: Sequence[str], tagged: BestTags | None = None) -> None:
    """Add ``<method> best`` columns: true for the methods of the row's best group, as the experiment's result tagged
    them (``tagged``, ``best_tags``); for rows without that tag, by ``tapp_core.measure.stats.best_group`` over the
    intervals."""
    tagged = tagged or {}
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


def speedup_columns(
    wide: pd.DataFrame, slower: str, ratios: pd.DataFrame | None
) -> tuple[pd.Series, pd.Series, pd.Series]:
    """TAPP's speedup over ``slower`` per row of ``wide`` (which has the key columns and a column per method): the
    paired per-round ratio and its interval where ``ratios`` (``paired_ratios``, or for BSP ``paired_speedups``: the
    speedup the experiment logged) has the row, else the ratio of the step times, with no interval."""
    value = wide[slower] / wide["tapp"] if slower in wide and "tapp" in wide else pd.Series(float("nan"), wide.index)
    low = pd.Series(float("nan"), index=wide.index)
    high = low.copy()
    if ratios is not None and not ratios.empty:
        shown = ratios.assign(model=ratios["model"].map(model_label))
        merged = wide[list(schema.KEY_COLUMNS)].merge(shown, on=list(schema.KEY_COLUMNS), how="left")
        paired = merged["median"].notna()
        value = value.where(~paired.to_numpy(), merged["median"].to_numpy())
        low, high = pd.Series(merged["low"].to_numpy(), wide.index), pd.Series(merged["high"].to_numpy(), wide.index)
    return value, low, high


def _insert_speedup(wide: pd.DataFrame, speedups: pd.DataFrame | None) -> None:
    """The BSP/TAPP column after TAPP's (``speedup_columns``)."""
    value, low, high = speedup_columns(wide, "bsp", speedups)
    after = max(i for i, c in enumerate(wide.columns) if str(c).startswith("tapp")) + 1
    for offset, (name, series) in enumerate(((SPEEDUP, value), (SPEEDUP + LOW, low), (SPEEDUP + HIGH, high))):
        wide.insert(after + offset, name, series.to_numpy())


def _source_notes(evaluations: pd.DataFrame) -> list[str]:
    sources = sorted(set(evaluations[schema.STEP_TIME_SOURCE]) - {""}) if not evaluations.empty else []
    if sources == ["measured"]:
        if not raced(evaluations):
            return ["Step times measured on the MPI runtime: median of the steps after warm-up, in seconds."]
        rounds = evaluations[schema.RACE_ROUNDS].dropna()
        span = f"{int(rounds.min())}" if rounds.min() == rounds.max() else f"{int(rounds.min())}–{int(rounds.max())}"
        return [
            "Step times measured on the MPI runtime, in seconds: every method's plan raced in one race of interleaved"
            f" rounds ({span} rounds per plan), each cell the median over its rounds with its confidence interval"
            " (order statistics over the rounds, at least 90 % coverage) after it in brackets. Bold: the fastest method"
            " and every method whose interval overlaps it; no winner is declared among them."
        ]
    estimated = evaluations[evaluations[schema.STEP_TIME_SOURCE] == "estimated"]
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
    shared = evaluations[evaluations[schema.MEASUREMENT_FROM].fillna("") != ""]
    for r in shared.itertuples(index=False):
        source = str(getattr(r, schema.MEASUREMENT_FROM))
        notes.append(
            f"{model_label(str(r.model))}: {method_label(str(r.method))} chose a plan that runs the same as "
            f"{method_label(source)}'s; it was raced once and both show its figure."
        )
    if speedups is not None and bool(speedups["low"].notna().any()):
        notes.append(
            f"{SPEEDUP}: the median of BSP/TAPP step-time ratios paired round by round (the {schema.RATIO_PAIRED}), then its"
            " interval [low, high], as the experiment's result stored it; it can differ from the ratio of the medians"
            " shown."
        )
    elif not evaluations.empty:
        notes.append(f"{SPEEDUP}: BSP's step time over TAPP's (the {schema.RATIO_OF_STEP_TIMES}).")
    for key, group in evaluations.groupby(list(schema.KEY_COLUMNS), sort=False):
        columns = [schema.HOST_OTHER_CPU, schema.LOAD_BEFORE, schema.LOAD_AFTER, schema.HOST_CPUS, schema.HOST_RANKS]
        loads = group[columns].dropna(subset=[schema.LOAD_BEFORE, schema.HOST_CPUS])
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
    keys = list(schema.KEY_COLUMNS)
    measured = raced(evaluations)
    companions = {LOW: schema.STEP_TIME_LOW, HIGH: schema.STEP_TIME_HIGH} if measured else {}
    wide, methods = pivot(evaluations, keys, schema.STEP_TIME, companions)
    if measured:
        mark_best(wide, methods, best_tags(evaluations))
    _insert_speedup(wide, speedups)
    if not measured:
        wide = wide.drop(columns=[SPEEDUP + LOW, SPEEDUP + HIGH])
    formats: dict[str, Formatter] = {method_label(m): seconds for m in methods}
    formats[SPEEDUP] = ratio
    return Table(
        name="step_time",
        title="Single-step training time (s)",
        frame=labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats=formats,
        notes=_source_notes(evaluations)
        + step_kind_notes(evaluations)
        + (_race_notes(evaluations, speedups) if not evaluations.empty else [])
        + space_notes(methods),
    )


def space_notes(methods: Sequence[str]) -> list[str]:
    """What each method searches (the registry's ``Space``), so that an optimum is read over its own space."""
    spaces = [f"{method_label(m)} {space.describe()}" for m in methods if (space := method_space(m)) is not None]
    return ["What each method searches: " + "; ".join(spaces) + "."] if spaces else []


def step_kind_notes(evaluations: pd.DataFrame) -> list[str]:
    """Which cells are an asynchronous plan's steady-state time per mini-batch (``tapp_core.measure.metrics.step_kind``)."""
    if evaluations.empty or "schedule" not in evaluations:
        return []
    asynchronous = evaluations[evaluations["schedule"] == "async"]
    if asynchronous.empty:
        return ["Every plan is synchronous (gpipe, 1f1b): each cell is the time per step of the whole mini-batch."]
    which = ", ".join(
        sorted({f"{model_label(str(r.model))}/{method_label(str(r.method))}" for r in asynchronous.itertuples()})
    )
    return [
        f"Asynchronous plans ({which}): the steady-state time per mini-batch over many mini-batches, the pipeline's"
        " fill and drain left out; the other cells: the time per step of the whole mini-batch. Both are what training"
        " pays per mini-batch, so they are compared alike."
    ]


def stored_ratios_of(stored: pd.DataFrame, method: str) -> pd.DataFrame:
    """``method``'s step time over TAPP's per (model, cluster, batch size), as the experiments' stored results say it
    (``runs.stored_ratios``): the rows ``speedup_columns`` takes."""
    return stored[stored["method"] == method].reset_index(drop=True)


def communication_share_table(evaluations: pd.DataFrame) -> Table:
    keys = list(schema.KEY_COLUMNS)
    wide, methods = pivot(evaluations, keys, schema.COMMUNICATION_SHARE)
    return Table(
        name="communication_share",
        title="Share of a step spent waiting on communication",
        frame=labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats={method_label(m): percent for m in methods},
        notes=["Mean over devices of the non-overlapped send/receive wait divided by the step time."],
    )
