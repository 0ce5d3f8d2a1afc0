"""The one rule of what the runtime runs (``tapp_core.plan.rule``), and the property that every planner keeps it:
every planner of the registry, on every registered model, every example, the tied models and the models written as
their authors publish them (``tests.wild_models``), on ``local``,
``hetero4`` and a seeded random cluster, returns only plans that the runtime's own check passes
(``runtime.launch.check_before_launch`` with stages: the rule, the programs, and each stage built and routed, as the
ranks would, without starting any). Issue 32, item 2's bar: zero refused plans.

Libraries are profiled once per model at a small batch (one timed step: their times only shape the plans); TAPP
runs a few rounds. What is checked is the plan, never its speed.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from pathlib import Path

import pytest

from bench.random_clusters import random_clusters
from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.formulas import allreduce_s
from tapp_core.cost.simulation import estimate
from tapp_core.model.graph import GROUPED_CONV2D
from tapp_core.model.zoo import MODEL_NAMES
from tapp_core.plan.plan import Plan, PlanError, stage_memory_bytes
from tapp_core.plan.rule import ModelFacts, check_runs
from tapp_core.plan.ties import plan_ties, tied_copy_bytes
from tapp_core.planners import PLANNER_NAMES, PlannerError, get_planner
from tapp_core.platform.cluster import Cluster, load_cluster
from tapp_core.profile.library import LayerLibrary
from tapp_core.profile.profiler import ProfileRequest, profile_model
from tapp_core.runtime.launch import check_before_launch
from tapp_core.runtime.stage import StageFactory
from tests.output_models import OUTPUT_MODELS
from tests.wild_models import WILD_MODELS

ZOO_EXAMPLES = {"hf_gpt2.py": "transformers"}
"""Examples that need an optional extra (``pip install -e '.[zoo]'``): the module each imports."""
EXAMPLES = tuple(
    pytest.param(
        f"examples/{path.name}:build",
        marks=pytest.mark.skipif(
            path.name in ZOO_EXAMPLES and importlib.util.find_spec(ZOO_EXAMPLES[path.name]) is None,
            reason="the zoo extra is not installed (pip install -e '.[zoo]')",
        ),
    )
    for path in sorted(Path("examples").glob("*.py"))
)
TIED = ("tests.user_models:tied", "tests.user_models:tied_linear")
AWKWARD = "tests.tuple_models:awkward"
"""Outputs that cannot cross a cut: the planners must read the library's refusals."""
LARGE = ("alexnet", "vgg16", "inception_v3", "vit")
"""Registered models of tens to hundreds of layers: a minute or more each on a busy shared host (marked slow)."""
MODELS = (
    *(pytest.param(m, marks=pytest.mark.slow) if m in LARGE else m for m in MODEL_NAMES),
    *EXAMPLES,
    *TIED,
    AWKWARD,
    *WILD_MODELS,
    *OUTPUT_MODELS,
)
BATCH = 8
BUDGET = 60
"""Cost-model evaluations a searching planner may spend (the coordinate descents' and TAPP's)."""
PLANNER_OPTIONS: dict[str, dict[str, object]] = {
    "tapp": {"rounds": 2, "population": 1, "samples_per_round": 4, "time_limit_s": 2.0},
    "oracle": {"time_limit_s": 1.0},
}
"""Few rounds for TAPP, a time limit for the exhaustive search: the plans' validity is what is tested."""


@functools.cache
def library(model: str) -> LayerLibrary:
    return profile_model(ProfileRequest(model, BATCH, repeats=1, warmup=0))


@functools.cache
def clusters() -> tuple[Cluster, ...]:
    return (load_cluster("local"), load_cluster("hetero4"), random_clusters(1, seed=32, devices=4)[0])


@pytest.fixture(scope="module")
def stages() -> StageFactory:
    return StageFactory()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_no_planner_returns_a_plan_the_runtime_refuses(model: str, stages: StageFactory) -> None:
    refused: list[str] = []
    checked: set[str] = set()
    for cluster in clusters():
        context = CostContext(library(model), cluster)
        for name in PLANNER_NAMES:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = get_planner(name, **PLANNER_OPTIONS.get(name, {})).plan(context, budget=BUDGET)
            except PlannerError:
                continue  # no plan (no GPU in the cluster, no device that holds the model): nothing to refuse
            if plan.id in checked:
                continue
            checked.add(plan.id)
            try:
                check_before_launch(plan, cluster, model, stages=stages)
            except PlanError as exc:
                refused.append(f"{name} on {cluster.name}: {exc}")
    assert not refused, "\n".join(refused)
    assert checked


# ---------------------------------------------------------------------------------------------------------------
# The rule and the cost of a tie, on the tied model's library

TIED_MODEL = TIED[0]


def tied_plan(schedule: str = "1f1b", devices: tuple[tuple[str, ...], ...] = (("cpu0",), ("cpu1",))) -> Plan:
    n_layers = len(library(TIED_MODEL).layers)
    stage_of = tuple(0 if layer < n_layers // 2 else 1 for layer in range(n_layers))
    return Plan(TIED_MODEL, BATCH, 2, schedule, stage_of, devices)


def test_the_rule_refuses_a_tie_on_an_asynchronous_schedule_and_validate_asks_it() -> None:
    facts = ModelFacts.of_library(library(TIED_MODEL))
    check_runs(tied_plan(), facts)
    with pytest.raises(PlanError, match=r"'embed.weight' is used on stages 0, 1, and the async schedule"):
        check_runs(tied_plan("async"), facts)
    with pytest.raises(PlanError, match="needs a synchronous schedule"):
        validate(tied_plan("async"), CostContext(library(TIED_MODEL), load_cluster("local")))


def test_the_rule_refuses_a_split_signature_on_a_layer_of_a_shared_parameter() -> None:
    """The embedding split by rows on a stage that also reads its weight whole (``F.linear(z, embed.weight.t())``):
    each device would read its share as the whole weight, and train wrong without an error (found by the fuzz)."""
    lib = library(TIED_MODEL)
    embed = next(layer.index for layer in lib.layers if layer.name == "embed")
    one_stage = tuple(0 for _ in lib.layers)
    plan = Plan(TIED_MODEL, BATCH, 2, "1f1b", one_stage, (("cpu0", "cpu1"),), signatures=((embed, "row"),))
    with pytest.raises(PlanError, match=r"'embed.weight' is shared by layers .*: a shared parameter is held whole"):
        check_runs(plan, ModelFacts.of_library(lib))


def test_each_holder_counts_its_copy_in_memory_and_the_tie_is_charged_its_allreduce() -> None:
    lib = library(TIED_MODEL)
    plan = tied_plan()
    ((tie,),) = (plan_ties(plan.stage_of_layer, lib.shared),)
    assert tie.stages == (0, 1) and tie.nbytes == 24 * 128 * 4
    assert list(tied_copy_bytes(plan.stage_of_layer, 2, lib.shared)) == [0, tie.nbytes]
    untied = LayerLibrary(**{**lib.__dict__, "shared": ()})
    with_copy, without = stage_memory_bytes(plan, lib, 1), stage_memory_bytes(plan, untied, 1)
    assert with_copy["cpu1"] - without["cpu1"] >= 3 * tie.nbytes  # weights, gradient and momentum
    cluster = load_cluster("local")
    context = CostContext(lib, cluster)
    tied_estimate, untied_estimate = estimate(plan, context), estimate(plan, CostContext(untied, cluster))
    tie_s = allreduce_s(cluster, ["cpu0", "cpu1"], float(tie.nbytes), context.calibration, context.terms)
    assert tie_s > 0
    assert tied_estimate.step_time_s - untied_estimate.step_time_s >= tie_s * (1 - 1e-9)
    ties = [op for op in tied_estimate.timeline if op.kind == "reduce"]
    assert {op.device for op in ties} == {"cpu0", "cpu1"}
    assert all(op.end - op.start == pytest.approx(tie_s) for op in ties)


@pytest.mark.parametrize("signature", ["col", "row"])
def test_a_grouped_convolution_is_refused_a_split_signature_before_launch(signature: str, stages: StageFactory) -> None:
    """A depthwise Conv2d (``groups`` = its channels) reads only its own channels: splitting its weight as a plain
    Conv2d's would be wrong, and the ranks refused it at launch after the check had passed it (found by the fuzz)."""
    model = "tests.wild_models:convmixer"
    lib = library(model)
    depthwise = next(layer for layer in lib.layers if layer.name == "_3_0_fn_0")
    assert depthwise.op == GROUPED_CONV2D
    plan = Plan(
        model,
        BATCH,
        2,
        "1f1b",
        tuple(0 for _ in lib.layers),
        (("cpu0", "cpu1"),),
        signatures=((depthwise.index, signature),),
    )
    with pytest.raises(PlanError, match=rf"layer _3_0_fn_0 \(GroupedConv2d\) cannot run signature '{signature}'"):
        check_before_launch(plan, load_cluster("local"), model, stages=stages)
