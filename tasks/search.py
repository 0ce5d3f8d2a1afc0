"""TAPP's search as Prefect tasks: one task per policy-gradient round, resumed from the previous round's checkpoint.

Two stages share one search (and one checkpoint file):

- ``search_stage``: the rounds rewarded by the cost model (TAPP's pre-training);
- ``sampling_stage``: the last rounds of the hybrid reward, where each round's best samples (by the cost model)
  are measured on the cluster's MPI workers (raced: a sample near the best measured so far runs more rounds
  against it) and the policy learns from the measurements; then the final choice, a race among the best
  candidates. A round whose worker pool fails is retried from the checkpoint of the round before.

Each stage has its own nested MLflow run: per-round metrics (mean reward, best step time, entropy), the policy
checkpoint (``policy/search.pt``, logged after every round), and every sampled plan with its estimate and, if
measured, its measurement and the round it was first measured in. The sampling stage also tells what the search
found (``tasks.summary.SearchStory``: its best plans by the cost model and by measurement, the final race, and why
TAPP split or did not), which the experiment's result shows everywhere.

An interrupted experiment resumes from its last logged checkpoint (``fetch_checkpoint`` puts it where the search
keeps its checkpoint; ``search_stage`` then goes on from the round after it): ``tapp run --resume RUN_ID``.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.cache_policies import NO_CACHE

from reports import schema
from reports.numbers import rounded, seconds
from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.errors import TappError
from tapp_core.measure.metrics import Measurement
from tapp_core.plan.plan import Plan, single_stage_plan
from tapp_core.planners import PlannerError, get_planner, planner_options
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.tapp import (
    MeasuredReward,
    Measurer,
    RoundReport,
    SearchOptions,
    SimulatedReward,
    TappPlanner,
    TappSearch,
)
from tapp_core.planners.tapp.rewards import SimulatedState
from tasks.config import DEFAULT_MEASURED_ROUNDS, DEFAULT_SIMULATED_ROUNDS, ExperimentConfig
from tasks.evaluate import planner_choices
from tasks.measure import RuntimeSettings, pool_failed
from tasks.prefect_ui import SAMPLED_PLANS_KEY, table_artifact
from tasks.progress import StageProgress
from tasks.summary import FinalRace, PlanTime, SearchStory, plan_shape
from tasks.tracking import ExperimentTags, RunRef, TrackedRun, tracked_run

CHECKPOINT_ARTIFACT = "policy"
CHECKPOINT_FILE = "search.pt"


def _flow_options() -> SearchOptions:
    return SearchOptions(reward="hybrid", rounds=DEFAULT_SIMULATED_ROUNDS + DEFAULT_MEASURED_ROUNDS)


@dataclass(frozen=True)
class SearchBudget:
    """The flow's search: TAPP's search options (``options``: the planner's defaults with the fields the experiment
    sets overridden by name, ``flows.experiment.search_budget``) and how sampled plans are measured. Its default is
    a small budget: the whole default experiment must finish in minutes on two cores."""

    options: SearchOptions = field(default_factory=_flow_options)
    measured_steps: int = 4
    """Training steps per race round of a sampled plan, the first a warm-up (a sample runs one round, a near-best
    one more: ``MeasuredReward``). The chosen plan is raced again against every method in the final evaluation."""
    measured_timeout_s: float = 120.0
    """A sampled plan slower than this is failed and penalised: the search learns it is bad without waiting."""

    def __post_init__(self) -> None:
        if self.options.simulated_rounds < 1:
            raise PlannerError(
                f"the search's rounds on the cost model ({self.options.simulated_rounds}) must be at least 1"
            )
        if self.measured_steps < 2:
            raise PlannerError(
                f"a sampled measurement needs at least 2 steps, one of them a warm-up (got {self.measured_steps})"
            )

    def sampling_runtime(self, runtime: RuntimeSettings) -> RuntimeSettings:
        return dataclasses.replace(runtime, steps=self.measured_steps, warmup=1, timeout_s=self.measured_timeout_s)

    def planner(
        self,
        batch_size: int | None = None,
        seed: int = 0,
        *,
        checkpoint: Path | None = None,
        measurer: Measurer | None = None,
        **choices: object,
    ) -> TappPlanner:
        """The TAPP planner with these search options, the ``choices`` it accepts (the schedule options,
        ``planner_choices``), and its own defaults for the rest."""
        accepted = planner_options("tapp")
        options = {k: v for k, v in choices.items() if k in accepted and v is not None}
        named = {**options, **self.options.option_values()}
        planner = get_planner(
            "tapp",
            **named,
            batch_size=batch_size,
            seed=seed,
            checkpoint=checkpoint,
            measurer=measurer,
        )
        assert isinstance(planner, TappPlanner)
        return planner


class RecordingState(TypedDict):
    inner: SimulatedState
    plans: list[dict[str, object]]


class RecordingReward:
    """A reward source that also keeps every distinct plan it was asked about (for the sampled-plans table)."""

    def __init__(self, inner: SimulatedReward) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.plans: dict[str, Plan] = {}

    @property
    def evaluations(self) -> int:
        return self.inner.evaluations

    def step_times(self, plans: Sequence[Plan]) -> list[float]:
        for plan in plans:
            self.plans.setdefault(plan.id, plan)
        return self.inner.step_times(plans)

    def state(self) -> RecordingState:
        return {"inner": self.inner.state(), "plans": [p.to_dict() for p in self.plans.values()]}

    def load_state(self, state: RecordingState) -> None:
        self.inner.load_state(state["inner"])
        self.plans = {str(p["id"]): Plan.from_dict(p) for p in state["plans"]}


class SearchSession:
    """The experiment's TAPP search across its Prefect tasks, owned by the flow (``search_stage`` opens it, the
    round tasks and ``sampling_stage`` are given it): the planner, what it searches on, and the search itself,
    kept in memory between rounds (resuming from the checkpoint costs more than a round)."""

    def __init__(self, planner: TappPlanner, context: CostContext) -> None:
        if planner.checkpoint is None:
            raise ValueError("the flow's search keeps a checkpoint: its planner needs one")
        self.planner = planner
        self.context = context
        self.checkpoint = Path(planner.checkpoint)
        self.first_measured: dict[str, int] = {}
        """Plan id -> the round it was first measured in (by this process: a resumed search's earlier plans count
        from the round it resumed at)."""
        self._search: TappSearch | None = None

    def search(self, at_round: int | None = None) -> TappSearch:
        """The search: the one in memory if it is at ``at_round`` (None: at any), else the planner's, resumed from
        the checkpoint if there is one; its cost-model reward source keeps every plan it was asked about
        (``RecordingReward``)."""
        live = self._search
        if live is not None and (at_round is None or live.round == at_round):
            return live
        planner = dataclasses.replace(self.planner, resume=self.checkpoint.is_file())
        recording = RecordingReward(planner.simulated_reward(self.context))
        self._search = planner.search(self.context, simulated=recording)
        return self._search

    def forget(self) -> None:
        """Drop the search in memory: the next ``search`` resumes from the checkpoint."""
        self._search = None


def _recording(search: TappSearch) -> RecordingReward:
    """The search's cost model, which knows every distinct plan it was asked about (``SearchSession``'s)."""
    assert isinstance(search.simulated, RecordingReward)
    return search.simulated


def _measurements(search: TappSearch) -> Mapping[str, Measurement]:
    return search.measured.measurements if isinstance(search.measured, MeasuredReward) else {}


@task(
    name="search-round",
    task_run_name="search-round-{round_number}",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=pool_failed,
    cache_policy=NO_CACHE,
)
def search_round(round_number: int, session: SearchSession) -> RoundReport:
    """One policy-gradient round of the session's search, saved to its checkpoint. Retried when the worker pool
    failed; the round restarts from the last checkpoint."""
    search = session.search(round_number - 1)
    if search.round != round_number - 1:
        raise RuntimeError(f"checkpoint {session.checkpoint} is at round {search.round}, not {round_number - 1}")
    try:
        report = search.run_round()
        for plan_id in _measurements(search):
            session.first_measured.setdefault(plan_id, round_number)
        return report
    except BaseException:
        session.forget()  # half a round may have changed it: a retry resumes from the last checkpoint
        raise


def round_metrics(report: RoundReport) -> dict[str, float]:
    """A round's metrics, the step times named by their source: the cost model's estimate in a simulated round, one
    race round's measurement in a measured one (``schema.round_step_time_names``)."""
    best_so_far, round_best = schema.round_step_time_names(report.phase)
    return {
        "reward_mean": report.mean_reward,
        best_so_far: report.best_step_time_s,
        round_best: report.round_best_step_time_s,
        "entropy": report.entropy,
        "evaluations": report.evaluations,
        "failures": report.failures,
    }


def _run_rounds(run: TrackedRun, session: SearchSession, rounds: range, stage: str) -> None:
    progress = StageProgress(stage, len(rounds), f"TAPP {stage} rounds")
    for done, number in enumerate(rounds, start=1):
        report = search_round(number, session)
        run.log_metrics(round_metrics(report), step=number)
        run.log_file(session.checkpoint, CHECKPOINT_ARTIFACT)  # every round: an interrupted experiment resumes from it
        how = "estimated" if report.phase == "simulated" else "measured, one race round each"
        progress.update(done, f"round {number}: its fastest sample {seconds(report.round_best_step_time_s)} s ({how})")


def search_stage(
    parent: RunRef,
    tags: ExperimentTags,
    context: CostContext,
    experiment: ExperimentConfig,
    budget: SearchBudget,
    workdir: Path,
    measurer: Measurer | None,
) -> SearchSession:
    """The cost-model rounds, one task each, in the ``search`` stage run; the checkpoint lives in ``workdir``. A
    checkpoint already there (``fetch_checkpoint``) is resumed: the rounds go on from the one after it. ``measurer``
    measures the sampled plans of a hybrid search (``tapp_core.runtime.pool_race.PoolRounds``). Returns the
    session that ``sampling_stage`` goes on with."""
    planner = budget.planner(
        experiment.batch_size,
        experiment.seed,
        checkpoint=workdir / CHECKPOINT_FILE,
        measurer=measurer,
        **planner_choices(experiment),
    )
    session = SearchSession(planner, context)
    search = session.search()
    with tracked_run("search", tags.child(parent, schema.STAGE_RUN, stage="search"), parent=parent) as run:
        run.log_params({f"search_{k}": v for k, v in search.config.to_dict().items() if k != "policy"})
        run.log_params({f"policy_{k}": v for k, v in search.config.policy.__dict__.items()})
        if search.history:
            run.log_params({"resumed_at_round": len(search.history)})
        _run_rounds(run, session, range(len(search.history) + 1, planner.simulated_rounds + 1), "search")
        run.log_metrics({"rounds": planner.simulated_rounds})
    return session


def fetch_checkpoint(uri: str, experiment_run: str, workdir: Path) -> int | None:
    """Put the latest search checkpoint that the experiment run ``experiment_run`` logged (its sampling stage's,
    else its search stage's) in ``workdir``, where ``search_stage`` resumes it; returns its round, or None when the
    run logged none (it was interrupted before its first round ended). The file is read with the safe loader."""
    from tapp_core.planners.tapp.search import read_checkpoint

    client = MlflowClient(uri)
    experiment_id = client.get_run(experiment_run).info.experiment_id
    query = f"tags.{schema.EXPERIMENT_RUN} = '{experiment_run}' and tags.{schema.KIND} = '{schema.STAGE_RUN}'"
    stages = {run.data.tags.get(schema.STAGE): run.info.run_id for run in client.search_runs([experiment_id], query)}
    for stage in ("sampling", "search"):
        if stage not in stages:
            continue
        try:
            downloaded = client.download_artifacts(
                stages[stage], f"{CHECKPOINT_ARTIFACT}/{CHECKPOINT_FILE}", str(workdir / "download")
            )
        except (MlflowException, OSError):
            continue  # the stage had not finished a round
        target = workdir / CHECKPOINT_FILE
        shutil.move(downloaded, target)
        return int(read_checkpoint(target)["round"])
    return None


@dataclass(frozen=True)
class SearchOutcome:
    """TAPP's chosen plan and what its search found."""

    plan: Plan
    story: SearchStory


def sampling_stage(parent: RunRef, tags: ExperimentTags, session: SearchSession) -> SearchOutcome:
    """The measured rounds (if any) in the ``sampling`` stage run; returns TAPP's chosen plan and the search's story.

    The chosen plan is the search's (``TappSearch.finish``, as the TAPP planner's): when anything was measured, the
    winner of a race among the best candidates by estimate and by measurement (``search/final_race.json``), else the
    best by the cost model after the polish (a local search from the population's best plans). Its notes carry the
    whole search's time (``search_wall_s``: rounds, warm start, polish and final race), which is TAPP's planning time.
    Every plan the search sampled is logged with its estimate and measurement (``search/sampled_plans.csv``), and
    the story (``search/story.json``).
    """
    search = session.search()
    config, context = search.config, session.context
    measured_rounds = config.rounds - search.round if config.reward != "simulated" else 0
    with tracked_run("sampling", tags.child(parent, schema.STAGE_RUN, stage="sampling"), parent=parent) as run:
        first = search.round + 1
        if measured_rounds > 0:
            _run_rounds(run, session, range(first, first + measured_rounds), "sampling")
        search = session.search()
        session.forget()
        chosen = search.finish()
        final = search.final_race
        search_s = search.elapsed_s + (final.elapsed_s if final is not None else 0.0)
        chosen = dataclasses.replace(chosen, notes={**chosen.notes, "search_wall_s": search_s})
        measurements = _measurements(search)
        recording = _recording(search)
        table = sampled_plans(
            recording.plans.values(), measurements, recording.inner.evaluator, chosen, session.first_measured
        )
        story = search_story(search, chosen, table, measurements, context)
        _record_sampling(run, search, chosen, table, story)
    return SearchOutcome(chosen, story)


def _record_sampling(
    run: TrackedRun, search: TappSearch, chosen: Plan, table: pd.DataFrame, story: SearchStory
) -> None:
    """The sampling stage's run: the sampled plans, the chosen plan, the final race, the story and its numbers."""
    if search.polish_gain is not None:
        run.log_metrics({"polish_gain": search.polish_gain})
    run.log_table(table, "search/sampled_plans.csv")
    shown = shown_plans(table)
    what = "every plan" if len(shown) == len(table) else f"{len(shown)} of the {len(table)} plans"
    table_artifact(
        SAMPLED_PLANS_KEY,
        shown,
        f"{what} the search sampled (the chosen, every measured one, the fastest by estimate): estimate, and"
        " measurement if taken; all of them in the sampling run's MLflow artifact search/sampled_plans.csv",
    )
    run.log_dict(chosen.to_dict(), "search/chosen_plan.json")
    final = search.final_race
    if final is not None:  # its winner: the plan the search took from it (``_final_race``), as the story says
        noted = chosen.notes.get("final_race")
        run.log_dict(noted if isinstance(noted, dict) else final.summary(), "search/final_race.json")
        run.log_metrics({"final_race_rounds": final.rounds, "final_race_candidates": len(final.plans)})
    run.log_dict(dataclasses.asdict(story), "search/story.json")
    best_measured, best_simulated = story.best_measured, story.best_simulated
    run.log_metrics(
        {
            "sampled_plans": len(table),
            "measured_plans": int(table["measured"].sum()),
            "search_s": rounded(story.search_s),
            "best_measured_step_time_s": rounded(best_measured.step_time_s) if best_measured else None,
            "best_measured_step_time_low_s": rounded(best_measured.low_s) if best_measured else None,
            "best_measured_step_time_high_s": rounded(best_measured.high_s) if best_measured else None,
            "best_estimated_step_time_s": rounded(best_simulated.step_time_s) if best_simulated else None,
        }
    )
    run.set_tags({"chosen_plan": chosen.id, "chosen_by": str(chosen.notes.get("chosen_by", ""))})


def search_story(
    search: TappSearch,
    chosen: Plan,
    table: pd.DataFrame,
    measurements: Mapping[str, Measurement],
    context: CostContext,
) -> SearchStory:
    """What the search found: its best plans by estimate and by measurement (``table``, ``measurements``), the final
    race, and the best plan over several devices beside the best single device (both estimated)."""
    estimated = table[table["estimated_step_time_s"] < math.inf]
    best_simulated = _row_time(estimated.nsmallest(1, "estimated_step_time_s"), "estimated_step_time_s")
    measured_ok = {k: m for k, m in measurements.items() if m.ok and m.interval is not None}
    best_measured = None
    if measured_ok:
        plan_id, measured = min(measured_ok.items(), key=lambda item: item[1].step_time_s)
        row = table[table["plan_id"] == plan_id]
        shape, devices = (str(row["shape"].iloc[0]), int(row["devices"].iloc[0])) if len(row) else (plan_id, 0)
        best_measured = PlanTime(
            plan_id, shape, devices, measured.step_time_s, measured.interval_low_s, measured.interval_high_s,
            measured.rounds,
        )  # fmt: skip
    pipelines = estimated[estimated["devices"] > 1]
    predicted = estimate(chosen, context).step_time_s
    return SearchStory(
        rounds=search.round,
        measured_rounds=sum(1 for r in search.history if r.phase == "measured"),
        search_s=_number(chosen.notes.get("search_wall_s"), search.elapsed_s),
        chosen=PlanTime.of(chosen, predicted),
        chosen_by=str(chosen.notes.get("chosen_by", "")),
        best_simulated=best_simulated,
        best_measured=best_measured,
        sampling_overloaded=any(m.overloaded for m in measured_ok.values()),
        final_race=_final_race(search, chosen),
        best_pipeline=_row_time(pipelines.nsmallest(1, "estimated_step_time_s"), "estimated_step_time_s"),
        best_single=best_single_device(context),
    )


def _number(value: object, default: float) -> float:
    return float(value) if isinstance(value, int | float) else default


def _row_time(rows: pd.DataFrame, column: str) -> PlanTime | None:
    """The first row of a sampled-plans table as a ``PlanTime`` (its estimate), None when there is none."""
    if rows.empty:
        return None
    row = rows.iloc[0]
    return PlanTime(str(row["plan_id"]), str(row["shape"]), int(row["devices"]), float(row[column]))


def _final_race(search: TappSearch, chosen: Plan) -> FinalRace | None:
    """The final race, its winner the plan the search chose from it (named in ``chosen``'s notes: among the plans the
    race could not tell apart, TAPP takes the lowest median over all their measured rounds, ``TappSearch``), else
    the race's own winner."""
    race = search.final_race
    if race is None:
        return None
    noted = chosen.notes.get("final_race")
    named = noted.get("winner") if isinstance(noted, dict) else None
    winner = next((p for p in race.plans if p.id == named), None) or race.winner()
    won = None
    if winner is not None:
        measured = race.measurement(winner.id)
        won = PlanTime.of(winner, measured.step_time_s, measured.interval, measured.rounds)
    return FinalRace(len(race.plans), race.rounds, race.stop, race.overloaded, won, len(race.best_group()))


def best_single_device(context: CostContext) -> PlanTime | None:
    """The fastest plan of the whole model on one device of ``cluster``, by estimate (devices it does not fit are
    skipped); None when it fits none."""
    best: PlanTime | None = None
    for device in context.cluster.devices:
        plan = single_stage_plan(context.library, [device.name], planner="single")
        try:
            validate(plan, context)
            predicted = estimate(plan, context).step_time_s
        except TappError:
            continue
        if best is None or predicted < best.step_time_s:
            best = PlanTime.of(plan, predicted)
    return best


SHOWN_PLANS = 1000
"""The most sampled plans the Prefect artifact shows beside the chosen and the measured ones: a larger model's search
samples thousands, and Prefect refuses an event over 1.5 MB (the GPT's 2,329 plans made 1.54 MB)."""


def shown_plans(table: pd.DataFrame, most: int = SHOWN_PLANS) -> pd.DataFrame:
    """The rows of ``sampled_plans``'s table (sorted by estimate) that Prefect's artifact shows: the chosen plan,
    every measured one, and the fastest ``most`` by estimate."""
    fastest = pd.Series(range(len(table)), index=table.index) < most
    return table[fastest | table["chosen"] | table["measured"]]


def sampled_plans(
    plans: Iterable[Plan],
    measurements: Mapping[str, Measurement],
    evaluator: PlanEvaluator,
    chosen: Plan,
    first_measured: Mapping[str, int] | None = None,
) -> pd.DataFrame:
    """Every distinct plan the search sampled (``plans``): shape, the cost model's estimate (``evaluator``'s, the
    search's own, which estimated each plan once), the measurement if taken (``measurements``, by plan id: its
    median over every round it ran, and the interval) and the search round it was first measured in
    (``first_measured``; empty for a plan measured only in the final race)."""
    first_measured = first_measured or {}
    rows = []
    for plan in plans:
        try:
            validate(plan, evaluator.context)
            predicted = evaluator.terms(plan)
            estimated, share, estimate_error = predicted.step_time_s, predicted.communication_share, ""
        except TappError as exc:  # a sampled plan that cannot run: the search penalised it, it has no estimate
            estimated, share, estimate_error = math.inf, math.nan, str(exc)
        result = measurements.get(plan.id)
        rows.append(
            {
                "plan_id": plan.id,
                "chosen": plan.id == chosen.id,
                "shape": plan_shape(plan),
                "devices": len(plan.devices),
                "stages": plan.n_stages,
                "stage_devices": " | ".join("+".join(d) for d in plan.stage_devices),
                "micro_batches": plan.micro_batches,
                "schedule": plan.schedule,
                "estimated_step_time_s": estimated,
                "estimated_communication_share": share,
                "measured": result is not None,
                "measured_step_time_s": result.step_time_s if result is not None and result.ok else math.nan,
                "measured_step_time_low_s": result.interval_low_s if result is not None else math.nan,
                "measured_step_time_high_s": result.interval_high_s if result is not None else math.nan,
                "measured_rounds": result.rounds if result is not None else 0,
                "measured_round": first_measured.get(plan.id, math.nan),
                "measured_communication_share": result.communication_share if result is not None else math.nan,
                "error": estimate_error or ((result.error or "") if result is not None else ""),
            }
        )
    return pd.DataFrame(rows).sort_values(["estimated_step_time_s", "plan_id"], kind="stable").reset_index(drop=True)
