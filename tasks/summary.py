"""An experiment's result, computed once, and every view of it.

``build_result`` computes each fact once: the verdict (the best group of a race, or the fastest estimate), every
method's step time with its interval, the BSP/TAPP speedup (the median of per-round ratios when both were raced),
which methods chose plans that run the same (``tapp_core.plan.plan.same_execution``: raced once, shown as one), what
TAPP's search found (``SearchStory``) and how long it took. The views only render that ``Result``:

- ``markdown``: the parent run's description in MLflow and the ``tapp-result`` artifact in Prefect;
- ``sentences``: plain sentences for the terminal and Prefect's log (no Markdown markup);
- ``markdown_table`` / ``table_records``: the table of methods (the terminal, the description; Prefect's
  ``tapp-evaluation`` table and MLflow's ``evaluation.json``);
- ``parent_metrics`` and ``method_view``: what MLflow shows raw (metrics, run names, run descriptions), rounded
  as everywhere else (``reports.numbers``).

Every number is shown through ``reports.numbers``: step times with 4 significant digits, a median with its
interval as ``0.1948 [0.1946, 0.1994]`` (never a symmetric ``±``), ratios with 3.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from reports import numbers, schema
from reports.numbers import percent, ratio, ratio_interval, rounded, seconds, seconds_interval
from tapp_core.measure.races import RaceResult, rounds_count
from tapp_core.measure.stats import Interval, Proportion, best_group
from tapp_core.plan.plan import Plan
from tapp_core.planners.base import method_space
from tasks.evaluate import Evaluation, raced_plan

STEP_TIME_MEANING = (
    "Step time, in seconds: for a synchronous plan (gpipe, 1f1b), the time per step of the whole mini-batch; for an"
    " asynchronous plan (async), the steady-state time per mini-batch over many, the pipeline's fill and drain left"
    " out (tapp_core.measure.metrics.step_kind): both are what a user training for an epoch pays per mini-batch, so they are"
    " compared alike. Measured: the median over the rounds of one"
    " race of every method's plan, then its confidence interval [low, high] (order statistics over the rounds, at"
    " least 90 % coverage); the best group is the fastest method and every method whose interval overlaps it, and"
    " no winner is declared inside it. Estimated: the cost model's figure, which has no interval. vs TAPP: the"
    " method's step time over TAPP's, each ratio saying which it is: the median of per-round ratios (with its"
    " interval) when both were raced in one race, which can differ from the ratio of the two medians shown beside it;"
    " else the ratio of the two step times."
)

PAIRED = schema.RATIO_PAIRED
OF_STEP_TIMES = schema.RATIO_OF_STEP_TIMES


@dataclass(frozen=True)
class Links:
    """Where to look further: MLflow pages (``None`` when unknown) and the report's folder."""

    report_folder: str
    report_run: str | None = None
    """The report run's ``report/`` artifacts in the MLflow UI."""
    runs_view: str | None = None
    """The runs list in TAPP's saved view."""
    flow_run: str | None = None
    """The Prefect flow run's page."""


def plan_shape(plan: Plan) -> str:
    """A plan in one line, as every command says it (``Plan.describe``): ``cpu0 | cpu1+cpu2, m=2, 1f1b``."""
    return plan.describe()


def _cell(text: str) -> str:
    """``text`` in a Markdown table's cell: a ``|`` (between a plan's stages) escaped, so it splits no cell."""
    return text.replace("|", "\\|")


def plan_line(plan: Plan, estimated_step_time_s: float | None = None) -> str:
    """A plan in one line, with its id (and its estimate)."""
    text = f"plan {plan.id}: {plan_shape(plan)}"
    if estimated_step_time_s is not None:
        text += f"; estimated {seconds(estimated_step_time_s)} s per step"
    return text


@dataclass(frozen=True)
class PlanTime:
    """A plan and its step time: the cost model's estimate (``rounds`` 0), or a measured median over ``rounds``
    race rounds with its interval."""

    plan_id: str
    shape: str
    devices: int
    step_time_s: float
    low_s: float = math.nan
    high_s: float = math.nan
    rounds: int = 0

    @classmethod
    def of(cls, plan: Plan, step_time_s: float, interval: Interval | None = None, rounds: int = 0) -> PlanTime:
        low, high = (interval.low, interval.high) if interval is not None else (math.nan, math.nan)
        return cls(plan.id, plan_shape(plan), len(plan.devices), step_time_s, low, high, rounds)

    @property
    def measured(self) -> bool:
        return self.rounds > 0

    def time_text(self) -> str:
        """``0.1948 [0.1946, 0.1994] s measured over 6 rounds`` or ``0.1816 s estimated``."""
        if self.measured:
            interval = seconds_interval(self.step_time_s, self.low_s, self.high_s)
            return f"{interval} s measured over {rounds_count(self.rounds)}"
        return f"{seconds(self.step_time_s)} s estimated"


@dataclass(frozen=True)
class FinalRace:
    """The race among the search's best candidates that chose TAPP's plan."""

    candidates: int
    rounds: int
    stop: str
    overloaded: bool
    winner: PlanTime | None
    tied: int
    """Plans in the race's best group (TAPP takes the one with the lowest median over all its measured rounds)."""


@dataclass(frozen=True)
class SearchStory:
    """What TAPP's search did and found (``tasks.search.sampling_stage`` tells it)."""

    rounds: int
    measured_rounds: int
    search_s: float
    """The whole search: its rounds (measured ones included), warm start, polish and final race."""
    chosen: PlanTime
    """TAPP's chosen plan, by the cost model's estimate."""
    chosen_by: str
    best_simulated: PlanTime | None
    best_measured: PlanTime | None
    """The measured sample with the lowest median (every round it ran pooled), with its interval."""
    sampling_overloaded: bool
    """Whether any measurement while sampling ran on an overloaded host (its times run high)."""
    final_race: FinalRace | None
    best_pipeline: PlanTime | None
    """The best plan over more than one device the search sampled, by estimate."""
    best_single: PlanTime | None
    """The best single-device plan of the cluster, by estimate."""

    @property
    def split(self) -> bool:
        return self.chosen.devices > 1


def search_sentences(story: SearchStory) -> list[str]:
    """The search in a few plain sentences: how long, its best plans, the final race, and TAPP's answer."""
    simulated = story.rounds - story.measured_rounds
    sentences = [
        f"TAPP's search took {story.search_s:.1f} s: {story.rounds} rounds, {simulated} on the cost model and "
        f"{story.measured_rounds} measured on the workers."
    ]
    if story.best_simulated is not None:
        best = story.best_simulated
        sentences.append(f"Its best plan by the cost model: {best.shape}, {best.time_text()}.")
    if story.best_measured is not None:
        best = story.best_measured
        load = " (on an overloaded host: its times run high)" if story.sampling_overloaded else ""
        sentences.append(f"Its best plan measured while sampling: {best.shape}, {best.time_text()}{load}.")
    race = story.final_race
    if race is not None and race.winner is not None:
        load = ", on an overloaded host" if race.overloaded else ""
        tied = (
            f"; {race.tied} tied within the noise and the one with the lowest median over all its measured rounds "
            "was taken"
            if race.tied > 1
            else ""
        )
        rounds = rounds_count(race.rounds)
        sentences.append(
            f"The search's final race of {race.candidates} candidates ({rounds}, stopped: {race.stop}{load}) chose "
            f"{race.winner.shape}, {race.winner.time_text()}{tied}."
        )
    sentences.append(_answer(story))
    return sentences


def _answer(story: SearchStory) -> str:
    pipeline, single = story.best_pipeline, story.best_single
    beside = f" against {seconds(single.step_time_s)} s on the best single device ({single.shape})" if single else ""
    if story.split:
        return f"TAPP's answer: split, {story.chosen.shape}, estimated {seconds(story.chosen.step_time_s)} s{beside}."
    if pipeline is None:
        return "TAPP's answer: do not split; no plan over several devices fitted the cluster."
    single_text = f"{seconds(single.step_time_s)} s ({single.shape})" if single else "–"
    why = ""
    if single is not None and pipeline.step_time_s < single.step_time_s and story.final_race is not None:
        why = (
            " The cost model rated the split faster; measured, the single device was as fast or faster (the final "
            "race's winner)."
        )
    return (
        f"TAPP's answer: do not split ({story.chosen.shape}). The best plan over several devices it found was "
        f"estimated at {seconds(pipeline.step_time_s)} s ({pipeline.shape}), the best single device at {single_text}."
        + why
    )


@dataclass(frozen=True)
class MethodResult:
    """One evaluated method as every view shows it (values unrounded; the views round them)."""

    method: str
    step_time_s: float
    low_s: float
    high_s: float
    """The measured median's interval; NaN for an estimate (it has none)."""
    measured: bool
    best: bool
    """In the best group: the race's (intervals overlapping the fastest's), else the fastest estimate(s)."""
    vs_tapp: Speedup
    communication_share: float
    plan: Plan
    same_as: str | None
    """An earlier method whose plan runs the same (``same_execution``): raced once, one figure."""
    run_id: str
    planning_s: float
    rounds: int = 0
    """The evaluation race's rounds its median is over (0: estimated)."""

    @property
    def source(self) -> str:
        return "measured" if self.measured else "estimated"

    @property
    def relative_to_tapp(self) -> float:
        return self.vs_tapp.median

    @property
    def time_text(self) -> str:
        """``0.1948 [0.1946, 0.1994]`` when measured, ``0.1948`` for an estimate."""
        return seconds_interval(self.step_time_s, self.low_s, self.high_s)


@dataclass(frozen=True)
class Speedup:
    """A method's step time over TAPP's (BSP's: the speedup): the median of per-round ratios with its interval when
    both were raced in one race (``paired``), else the ratio of their step times. ``of_step_times`` is the ratio of
    the two step times shown, in either case."""

    median: float
    low: float = math.nan
    high: float = math.nan
    paired: bool = False
    of_step_times: float = math.nan

    @property
    def kind(self) -> str:
        """Which ratio ``median`` is (``PAIRED`` or ``OF_STEP_TIMES``)."""
        return PAIRED if self.paired else OF_STEP_TIMES

    @property
    def text(self) -> str:
        return ratio_interval(self.median, self.low, self.high)

    @property
    def said(self) -> str:
        """``1.49x [1.40, 1.55] (median of per-round ratios; ratio of the medians 1.37x)`` or ``2.00x (ratio of step
        times)``."""
        if self.paired:
            return f"{self.text} ({PAIRED}; ratio of the medians {ratio(self.of_step_times)})"
        return f"{self.text} ({OF_STEP_TIMES})"


@dataclass(frozen=True)
class Accuracy:
    """A trained method's test accuracy with its interval, after ``train_samples`` training samples; ``trained_as``:
    the method whose training it shares (the same computation), if another's. A language model's accuracy is over
    its predicted positions (the next token), and it has a test ``perplexity`` (lower is better) beside it."""

    method: str
    accuracy: Proportion
    train_samples: int
    trained_as: str | None = None
    perplexity: float | None = None
    """A language model's test perplexity (exp of its mean test loss per position); None for a classifier."""

    @property
    def text(self) -> str:
        shared = f" ({self.trained_as}'s training)" if self.trained_as else ""
        if self.perplexity is not None:
            return f"{self.method} perplexity {numbers.perplexity(self.perplexity)}, accuracy {self.accuracy.text()}{shared}"
        return f"{self.method} {self.accuracy.text()}{shared}"


@dataclass(frozen=True)
class Result:
    """One experiment's result: every fact every view shows, computed once (``build_result``)."""

    title: str
    methods: tuple[MethodResult, ...]
    """Fastest first (TAPP first among equals)."""
    speedup: Speedup | None
    search: SearchStory | None
    links: Links
    failed: tuple[str, ...] = ()
    race_rounds: int = 0
    race_overloaded: bool = False
    accuracy: tuple[Accuracy, ...] = ()
    """The trained methods' test accuracy, in training order (empty: nothing was trained)."""
    unfit: tuple[tuple[str, str], ...] = ()
    """(method, why) of each method with no plan that fits the cluster's memory (``tasks.evaluate.Unfit``)."""
    verdict: str = field(default="", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", _verdict(self))

    @property
    def raced(self) -> bool:
        return any(m.measured for m in self.methods)

    def method(self, name: str) -> MethodResult | None:
        return next((m for m in self.methods if m.method == name), None)

    @property
    def best_group(self) -> list[str]:
        return [m.method for m in self.methods if m.best]


# --- Computing it once -------------------------------------------------------------------------------------------


def build_result(
    title: str,
    evaluations: Mapping[str, Evaluation],
    links: Links,
    race: RaceResult | None = None,
    search: SearchStory | None = None,
    failed: Sequence[str] = (),
    accuracy: Sequence[Accuracy] = (),
    unfit: Mapping[str, str] | None = None,
) -> Result:
    """The result of an experiment whose methods ended as ``evaluations`` (in evaluation order), measured in
    ``race`` (None: estimated), with TAPP's ``search`` and the trained methods' ``accuracy``."""
    intervals = [e.ok_measurement.interval if e.ok_measurement is not None else None for e in evaluations.values()]
    if any(i is not None for i in intervals):
        best = {list(evaluations)[i] for i in best_group(intervals)}
    else:
        fastest = min((e.step_time_s for e in evaluations.values()), default=math.nan)
        best = {m for m, e in evaluations.items() if e.step_time_s == fastest}
    first_of: dict[str, str] = {}
    rows = []
    for (method, evaluation), interval in zip(evaluations.items(), intervals, strict=True):
        first = first_of.setdefault(evaluation.plan.execution_id, method)
        rows.append(
            MethodResult(
                method=method,
                step_time_s=evaluation.step_time_s,
                low_s=interval.low if interval is not None else math.nan,
                high_s=interval.high if interval is not None else math.nan,
                measured=evaluation.measured,
                best=method in best,
                vs_tapp=_relative(evaluation, evaluations.get("tapp"), race),
                communication_share=evaluation.communication_share,
                plan=evaluation.plan,
                same_as=first if first != method else None,
                run_id=evaluation.run_id,
                planning_s=evaluation.planning_wall_s,
                rounds=interval.samples if interval is not None else 0,
            )
        )
    ordered = sorted(rows, key=lambda r: (r.step_time_s, r.method != "tapp", r.method))
    speedup = _relative(evaluations["bsp"], evaluations["tapp"], race) if {"bsp", "tapp"} <= set(evaluations) else None
    return Result(
        title,
        tuple(ordered),
        speedup,
        search,
        links,
        tuple(failed),
        race_rounds=race.rounds if race is not None else 0,
        race_overloaded=race.overloaded if race is not None else False,
        accuracy=tuple(accuracy),
        unfit=tuple((unfit or {}).items()),
    )


def _relative(evaluation: Evaluation, tapp: Evaluation | None, race: RaceResult | None) -> Speedup:
    """``evaluation``'s step time over TAPP's: paired round by round when the race ran both."""
    if tapp is None:
        return Speedup(math.nan)
    of_step_times = evaluation.step_time_s / tapp.step_time_s
    mine, theirs = raced_plan(race, evaluation.plan), raced_plan(race, tapp.plan)
    if race is not None and mine is not None and theirs is not None and evaluation.measured and tapp.measured:
        paired = race.ratio(mine.id, theirs.id)
        if paired is not None:
            return Speedup(paired.median, paired.low, paired.high, paired=True, of_step_times=of_step_times)
    return Speedup(of_step_times, of_step_times=of_step_times)


# --- The verdict -------------------------------------------------------------------------------------------------


def _verdict(result: Result) -> str:
    """One plain sentence or two: the best group (raced) or the fastest (estimated), where TAPP stands, BSP/TAPP,
    and what failed."""
    methods = result.methods
    if not methods:
        unfit = f" No plan fits the memory: {', '.join(m for m, _ in result.unfit)}." if result.unfit else ""
        return "No method finished." + unfit + (f" Failed: {', '.join(result.failed)}." if result.failed else "")
    text = _raced_verdict(result) if result.raced else _estimated_verdict(result)
    if result.speedup is not None:
        text += f" BSP/TAPP: {result.speedup.said}."
    if result.unfit:
        text += f" No plan fits the memory: {', '.join(method for method, _ in result.unfit)}."
    if result.failed:
        text += f" Failed: {', '.join(result.failed)} (see their runs)."
    return text


def _group_text(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _plans_of(methods: Sequence[MethodResult]) -> list[list[MethodResult]]:
    """``methods`` by the plan they run (``same_execution``), in order: one entry per plan."""
    plans: dict[str, list[MethodResult]] = {}
    for m in methods:
        plans.setdefault(m.plan.execution_id, []).append(m)
    return list(plans.values())


def _names(methods: Sequence[MethodResult]) -> str:
    """``tapp``; ``tapp = single-cpu`` for methods whose plans run the same."""
    return " = ".join(m.method for m in methods)


def _raced_verdict(result: Result) -> str:
    group = [m for m in result.methods if m.best]
    plans = _plans_of(group)
    names = _group_text([_names(p) for p in plans])
    if len(plans) == 1:
        one = " (one plan, raced once)" if len(group) > 1 else ""
        text = f"Fastest: {names}{one}, {group[0].time_text} s per step, its interval clear of every other's (raced)."
    else:
        span = [m.step_time_s for m in group]
        text = (
            f"Best group: {names}, medians {seconds(min(span))}–{seconds(max(span))} s per step, within the noise "
            "of each other (raced): no winner among them."
        )
    return text + _tapp_place(result, group)


def _estimated_verdict(result: Result) -> str:
    group = [m for m in result.methods if m.best]
    plans = _plans_of(group)
    names = _group_text([_names(p) for p in plans])
    tied = " (equal estimates)" if len(plans) > 1 else (" (one plan)" if len(group) > 1 else "")
    text = f"Fastest: {names}{tied}, {seconds(group[0].step_time_s)} s per step (estimated by the cost model)."
    return text + _tapp_place(result, group)


def _tapp_place(result: Result, group: Sequence[MethodResult]) -> str:
    tapp = result.method("tapp")
    if tapp is None or (len(_plans_of(group)) == 1 and tapp.best):
        return ""
    if tapp.best:
        return " TAPP is in the best group." if result.raced else ""
    place = 1 + sum(m.step_time_s < tapp.step_time_s for m in result.methods)
    where = "not in the best group, " if result.raced else ""
    return f" TAPP: {tapp.time_text} s, {where}place {place} of {len(result.methods)}."


# --- Views -------------------------------------------------------------------------------------------------------


def same_plan_sentences(result: Result) -> list[str]:
    """Which methods chose plans that run the same as an earlier method's."""
    sentences = []
    for m in result.methods:
        if m.same_as is None:
            continue
        original = result.method(m.same_as)
        how = "the same plan" if original is not None and original.plan.id == m.plan.id else "a plan that runs the same"
        detail = f" ({plan_shape(m.plan)}: one stage, one micro-batch, only the schedule label differs)"
        detail = detail if how != "the same plan" else ""
        raced = "it was raced once and both show its figure" if m.measured else "both show its estimate"
        sentences.append(f"{m.method} chose {how} as {m.same_as}{detail}: {raced}.")
    return sentences


def space_sentences(result: Result) -> list[str]:
    """What each method searched, and where a method's space holds another's faster plan (by the figures shown):
    a search that missed it, or an optimum over the cost model that the measurement contradicts."""
    spaces = [
        f"{m.method}: {space.describe()}{_unproved(m.plan)}"
        for m in result.methods
        if (space := method_space(m.method))
    ]
    lines = ["What each method searches: " + "; ".join(spaces) + "."] if spaces else []
    for mine in result.methods:
        space = method_space(mine.method)
        faster = [
            other
            for other in result.methods
            if space is not None
            and _clearly_faster(other, mine)
            and other.plan.execution_id != mine.plan.execution_id
            and space.holds(other.plan)
        ]
        if faster:
            why = (
                "its optimum is the cost model's" if space is not None and space.exhaustive else "its search missed it"
            )
            lines.append(
                f"{mine.method}'s space holds {_names(faster[:1])}'s faster plan ({faster[0].time_text} s against its"
                f" {mine.time_text} s): {why}."
            )
    return lines


def _unproved(plan: Plan) -> str:
    """What an exhaustive search cut short by its limit says of its plan ("" for any other)."""
    if plan.notes.get("proved_optimal") is False:
        return " (not proved: its time limit cut the search short, and its plan is the best it found)"
    return ""


def _clearly_faster(one: MethodResult, other: MethodResult) -> bool:
    """``one`` faster than ``other``: beyond the noise (intervals apart) when both were measured."""
    if one.measured and other.measured and math.isfinite(one.high_s) and math.isfinite(other.low_s):
        return one.high_s < other.low_s
    return one.step_time_s < other.step_time_s


def accuracy_sentence(result: Result) -> str:
    """The trained methods' test accuracy in one sentence ("" when nothing was trained)."""
    if not result.accuracy:
        return ""
    language = result.accuracy[0].perplexity is not None
    unit = "training sequences" if language else "training images"
    samples = {a.train_samples for a in result.accuracy}
    after = f"after {samples.pop():,} {unit} each" if len(samples) == 1 else "after unequal training"
    tested = result.accuracy[0].accuracy
    what, over = (
        ("Test perplexity and next-token accuracy", "predicted positions")
        if language
        else ("Test accuracy", "test images")
    )
    return (
        f"{what} {after} ({tested.confidence:.0%} Wilson interval over {tested.trials:,} {over}): "
        + "; ".join(a.text for a in result.accuracy)
        + "."
    )


def sentences(result: Result) -> list[str]:
    """The result in plain sentences (terminal, Prefect's log): the verdict, the search, shared plans, the accuracy,
    the host."""
    lines = [result.verdict]
    if result.search is not None:
        lines += search_sentences(result.search)
    lines += same_plan_sentences(result)
    lines += space_sentences(result)
    lines += [accuracy_sentence(result)] if result.accuracy else []
    if result.race_overloaded:
        lines.append("WARNING: the evaluation race ran on an overloaded host: its intervals are wider and its medians")
        lines[-1] += " higher than on a quiet host."
    return lines


UNFIT = "does not fit"
"""The step time cell of a method with no plan that fits the cluster's memory."""
TABLE_COLUMNS = (
    ("method", "---"),
    ("step time (s)", "---:"),
    ("source", "---"),
    ("best group", "---"),
    ("vs TAPP", "---:"),
    ("communication", "---:"),
    ("plan", "---"),
    ("same as", "---"),
)


def vs_tapp_kind(result: Result) -> str:
    """Which ratio the "vs TAPP" column holds: ``PAIRED`` when any method was raced against TAPP, else
    ``OF_STEP_TIMES``; a cell of the other kind says its own."""
    return PAIRED if any(m.vs_tapp.paired for m in result.methods) else OF_STEP_TIMES


def vs_tapp_text(result: Result, method: MethodResult) -> str:
    """The "vs TAPP" cell: the ratio, with its own kind when it is not the column's."""
    text = ratio(method.relative_to_tapp)
    return text if method.vs_tapp.kind == vs_tapp_kind(result) else f"{text} ({method.vs_tapp.kind})"


def markdown_table(result: Result) -> str:
    """The table of methods in Markdown: step time (median [low, high] when raced), bold in the best group; the
    "vs TAPP" column says which ratio it holds."""
    names = [f"vs TAPP ({vs_tapp_kind(result)})" if name == "vs TAPP" else name for name, _ in TABLE_COLUMNS]
    lines = [_md_row(names), _md_row([align for _, align in TABLE_COLUMNS])]
    for m in result.methods:
        time = f"**{m.time_text}**" if m.best else m.time_text
        cells = [
            m.method,
            time,
            m.source,
            "yes" if m.best else "",
            vs_tapp_text(result, m),
            percent(m.communication_share),
            _cell(plan_shape(m.plan)),
            m.same_as or "",
        ]
        lines.append(_md_row(cells))
    for method, reason in result.unfit:
        lines.append(_md_row([method, UNFIT, "", "", "", "", _cell(reason), ""]))
    return "\n".join(lines)


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table_records(result: Result) -> list[dict[str, object]]:
    """One record per method, fastest first, as shown (rounded); the interval as text and as numbers."""
    records: list[dict[str, object]] = []
    for m in result.methods:
        records.append(
            {
                "method": m.method,
                "step time (s)": m.time_text,
                "step_time_s": rounded(m.step_time_s),
                "step_time_low_s": rounded(m.low_s),
                "step_time_high_s": rounded(m.high_s),
                "source": m.source,
                "best_group": m.best,
                "vs_tapp": rounded(m.relative_to_tapp, numbers.RATIO_DIGITS),
                "vs_tapp_low": rounded(m.vs_tapp.low, numbers.RATIO_DIGITS),
                "vs_tapp_high": rounded(m.vs_tapp.high, numbers.RATIO_DIGITS),
                "vs_tapp_is": m.vs_tapp.kind,
                "vs_tapp_ratio_of_step_times": rounded(m.vs_tapp.of_step_times, numbers.RATIO_DIGITS),
                "communication_share": rounded(m.communication_share),
                "plan": plan_shape(m.plan),
                "same_as": m.same_as or "",
                "planning_s": rounded(m.planning_s),
                "plan_id": m.plan.id,
                "run_id": m.run_id,
            }
        )
    for method, reason in result.unfit:
        records.append({"method": method, "step time (s)": UNFIT, "source": "", "best_group": False, "plan": reason})
    return records


def markdown(result: Result) -> str:
    """The whole text (the parent run's description, Prefect's ``tapp-result``): title, verdict, the search, the
    table, shared plans, what the numbers mean, links."""
    parts = [f"### {result.title}", "", f"**{result.verdict}**", ""]
    if result.search is not None:
        parts += [*(f"- {sentence}" for sentence in search_sentences(result.search)), ""]
    parts += [markdown_table(result), ""]
    extra = same_plan_sentences(result) + (sentences(result)[-1:] if result.race_overloaded else [])
    if extra:
        parts += [" ".join(extra), ""]
    tapp = result.method("tapp")
    if tapp is not None:
        parts += [f"TAPP's {plan_line(tapp.plan)}.", ""]
    parts += [" ".join(space_sentences(result)), ""] if result.methods else []
    if result.accuracy:
        parts += [accuracy_sentence(result), ""]
    parts.append(STEP_TIME_MEANING)
    links = result.links
    report = f"[tables and figures]({links.report_run})" if links.report_run else "tables and figures"
    parts += ["", f"Report: {report}, also written to `{links.report_folder}`."]
    if links.runs_view:
        parts.append(f"All method runs, fastest first (TAPP first among equals): [runs view]({links.runs_view}).")
    if links.flow_run:
        parts.append(f"Prefect flow run: [{links.flow_run}]({links.flow_run}).")
    return "\n".join(parts) + "\n"


def parent_metrics(result: Result) -> dict[str, float]:
    """The headline numbers for the parent run, rounded as shown (MLflow shows metrics raw). Each name says its
    source: ``<method>_measured_step_time_s`` (the evaluation race's median, with ``_low_s``/``_high_s``) or
    ``<method>_estimated_step_time_s``; the speedup's names say which ratio; the search's figures start with
    ``search_`` and name their stage and rounds."""
    metrics: dict[str, float] = {}
    for m in result.methods:
        metrics[f"{m.method}_{m.source}_step_time_s"] = rounded(m.step_time_s)
        if m.measured:
            metrics[f"{m.method}_measured_step_time_low_s"] = rounded(m.low_s)
            metrics[f"{m.method}_measured_step_time_high_s"] = rounded(m.high_s)
    if result.raced:
        metrics["evaluation_race_rounds"] = result.race_rounds
    if result.speedup is not None:
        metrics[schema.SPEEDUP_OF_STEP_TIMES] = rounded(result.speedup.of_step_times, numbers.RATIO_DIGITS)
        if result.speedup.paired:
            for end, value in (
                ("", result.speedup.median),
                ("_low", result.speedup.low),
                ("_high", result.speedup.high),
            ):
                metrics[f"{schema.SPEEDUP_PAIRED}{end}"] = rounded(value, numbers.RATIO_DIGITS)
    for trained in result.accuracy:
        metrics[f"{trained.method}_test_accuracy"] = rounded(trained.accuracy.value)
        metrics[f"{trained.method}_test_accuracy_low"] = rounded(trained.accuracy.low)
        metrics[f"{trained.method}_test_accuracy_high"] = rounded(trained.accuracy.high)
        if trained.perplexity is not None:
            metrics[f"{trained.method}_test_perplexity"] = rounded(trained.perplexity)
    if result.search is not None:
        metrics.update(_search_metrics(result.search))
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def _search_metrics(story: SearchStory) -> dict[str, float]:
    """The search's own figures, named as the search's: its rounds, its best estimate, its best measurement while
    sampling (over that plan's measured rounds) and its final race's winner (over the final race's rounds)."""
    metrics = {
        "tapp_search_s": rounded(story.search_s),
        "search_rounds": story.rounds,
        "search_measured_rounds": story.measured_rounds,
    }
    if story.best_simulated is not None:
        metrics["search_best_estimated_step_time_s"] = rounded(story.best_simulated.step_time_s)
    named = [("search_sampling_best", story.best_measured)]
    if story.final_race is not None:
        named.append(("search_final_race_winner", story.final_race.winner))
    for prefix, best in named:
        if best is not None:
            metrics[f"{prefix}_measured_step_time_s"] = rounded(best.step_time_s)
            metrics[f"{prefix}_measured_step_time_low_s"] = rounded(best.low_s)
            metrics[f"{prefix}_measured_step_time_high_s"] = rounded(best.high_s)
            metrics[f"{prefix}_measured_rounds"] = best.rounds
    return metrics


def method_view(result: Result, method: MethodResult) -> tuple[str, str]:
    """(run name, run description) of a method's MLflow run: the name carries its step time, so that MLflow's
    default columns and its charts' legends show it."""
    name = f"{method.method} {method.time_text} s" + ("" if method.measured else " (estimated)")
    source = (
        f"measured in the evaluation race over {rounds_count(method.rounds)}"
        if method.measured
        else "estimated by the cost model"
    )
    lines = [f"**{method.method}**: {method.time_text} s per step ({source})."]
    if method.best:
        lines.append("In the best group." if result.raced else "Fastest estimate.")
    lines.append(f"Plan {method.plan.id}: {plan_shape(method.plan)}.")
    space = method_space(method.method)
    if space is not None:
        lines.append(f"Its space: {space.describe()}.")
    if method.same_as is not None:
        lines.append(f"It runs the same as {method.same_as}'s plan: one measurement for both.")
    if math.isfinite(method.planning_s):
        scope = " (the whole search)" if method.method == "tapp" else ""
        lines.append(f"Planned in {method.planning_s:.3g} s{scope}.")
    lines.append(f"Verdict of the experiment: {result.verdict}")
    return name, "\n\n".join(lines) + "\n"


# --- Stored with the run -----------------------------------------------------------------------------------------


def result_record(result: Result) -> dict[str, object]:
    """The result as plain data, the parent run's ``result.json`` (``schema.RESULT_ARTIFACT``): what the report reads
    instead of computing it again. Numbers are rounded as every view shows them; each ratio says which it is."""
    speedup = result.speedup
    record = {
        "title": result.title,
        "verdict": result.verdict,
        "raced": result.raced,
        "race_rounds": result.race_rounds,
        "race_overloaded": result.race_overloaded,
        "best_group": result.best_group,
        "failed": list(result.failed),
        "vs_tapp_is": vs_tapp_kind(result),
        "methods": table_records(result),
        "speedup_bsp_over_tapp": _ratio_record(speedup) if speedup is not None else None,
        "accuracy": [_accuracy_record(trained) for trained in result.accuracy],
    }
    return {key: _plain(value) for key, value in record.items()}


def _accuracy_record(trained: Accuracy) -> dict[str, object]:
    tested = trained.accuracy
    return {
        "method": trained.method,
        "test_accuracy": rounded(tested.value),
        "low": rounded(tested.low),
        "high": rounded(tested.high),
        "interval": f"Wilson {tested.confidence:.0%}",
        "test_samples": tested.trials,
        "train_samples": trained.train_samples,
        "trained_as": trained.trained_as,
    } | ({"test_perplexity": rounded(trained.perplexity)} if trained.perplexity is not None else {})


def _plain(value: object) -> object:
    """``value`` with every NaN or infinity as None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _ratio_record(speedup: Speedup) -> dict[str, object]:
    digits = numbers.RATIO_DIGITS
    return {
        "median": rounded(speedup.median, digits),
        "low": rounded(speedup.low, digits),
        "high": rounded(speedup.high, digits),
        "is": speedup.kind,
        "ratio_of_step_times": rounded(speedup.of_step_times, digits),
    }
