"""Each method's space, said: the registry declares what every planner searches, and the views read it."""

from __future__ import annotations

import dataclasses

from tapp_core.plan.plan import Plan
from tapp_core.planners.base import PLANNER_NAMES, Space, method_space
from tapp_core.planners.tapp.options import SearchOptions
from tasks.config import ExperimentConfig
from tasks.evaluate import method_options, rl_alone_options
from tasks.summary import build_result, markdown, method_view, space_sentences
from tests.test_summary import LINKS, estimated, evaluation


def test_every_planner_declares_its_space_and_the_oracle_reads_as_an_optimum_over_it() -> None:
    for name in PLANNER_NAMES:
        assert isinstance(method_space(name), Space), name
    oracle = method_space("oracle")
    assert oracle is not None
    assert oracle.describe() == (
        "optimal over pipelines of replicated stages (1f1b, async) without split layers or uneven shares"
    )
    assert method_space("single-cpu").describe().startswith("searches one device")  # type: ignore[union-attr]
    assert method_space("not-a-method") is None


def test_a_space_holds_a_plan_by_schedule_stages_replicas_split_layers_and_shares() -> None:
    pipeline = Plan("m", 8, 1, "async", (0, 0, 1, 1), (("d0",), ("d1", "d2")))
    oracle, pipetorch, single = method_space("oracle"), method_space("pipetorch"), method_space("single-cpu")
    assert oracle is not None and pipetorch is not None and single is not None
    assert oracle.holds(pipeline) and not pipetorch.holds(pipeline)  # replicas, and async
    assert not oracle.holds(dataclasses.replace(pipeline, signatures=((2, "col"),)))  # a split layer
    assert not oracle.holds(dataclasses.replace(pipeline, stage_shares=((1.0,), (0.7, 0.3))))
    assert method_space("tapp").holds(dataclasses.replace(pipeline, signatures=((2, "col"),)))  # type: ignore[union-attr]
    assert not single.holds(pipeline)


def test_the_views_say_each_space_and_when_a_space_holds_a_faster_plan() -> None:
    evaluations = estimated(("single-cpu", 0.3))
    evaluations["tapp"] = evaluation("tapp", 0.2, measured=False, schedule="1f1b")
    evaluations["oracle"] = evaluation("oracle", 0.25, devices=("cpu0", "cpu1"), measured=False)
    result = build_result("m", evaluations, LINKS)
    lines = space_sentences(result)
    assert lines[0].startswith("What each method searches: ") and "oracle: optimal over pipelines" in lines[0]
    # TAPP's plan (one device) lies in the oracle's space, and it is faster: said, with why.
    assert (
        "oracle's space holds tapp's faster plan (0.2000 s against its 0.2500 s): its optimum is the cost model's."
        in lines
    )
    assert not any(line.startswith("single-cpu's space") for line in lines)  # its space is 1f1b... of one device:
    # TAPP's plan is on cpu0 alone too, but it runs the same as single-cpu's (gpipe and 1f1b alike on one stage)
    assert lines[0] in markdown(result)
    oracle = result.method("oracle")
    assert oracle is not None and "Its space: optimal over pipelines" in method_view(result, oracle)[1]


def test_an_oracle_cut_short_by_its_time_limit_is_said_not_proved() -> None:
    evaluations = estimated(("single-cpu", 0.3))
    cut = evaluation("oracle", 0.25, devices=("cpu0", "cpu1"), measured=False)
    evaluations["oracle"] = dataclasses.replace(
        cut, plan=dataclasses.replace(cut.plan, notes={**cut.plan.notes, "proved_optimal": False})
    )
    line = space_sentences(build_result("m", evaluations, LINKS))[0]
    assert "oracle: optimal over pipelines of replicated stages (1f1b, async) without split layers or uneven " in line
    assert "shares (not proved: its time limit cut the search short, and its plan is the best it found)" in line
    proved = dataclasses.replace(cut, plan=dataclasses.replace(cut.plan, notes={"proved_optimal": True}))
    assert "not proved" not in space_sentences(build_result("m", {**evaluations, "oracle": proved}, LINKS))[0]


def test_an_experiment_gives_the_oracle_the_time_limit_of_tapps_search() -> None:
    config = ExperimentConfig()
    assert method_options("oracle", config)["time_limit_s"] == SearchOptions().time_limit_s
    assert "time_limit_s" not in method_options("pipedream", config)
    assert method_options("tapp-rl", config)["time_limit_s"] == rl_alone_options(config)["time_limit_s"]
