"""Every cut of every traced graph gives stages that take and make exactly the cut values their programs route
(``tapp_core.plan.program.crossings``), on the small registered models and on models written as PyTorch users write
them (``tests.user_models``): a value used on several later stages, a skip across any cut, a cut inside a block,
shapes read from tensors, views and in-place operations. Without MPI: the check is the engine's own
(``engine.check_routes``), run on every stage of each split."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import torch

from tapp_core.model.graph import layer_nodes
from tapp_core.model.workload import build_traced_workload, workload_of
from tapp_core.model.zoo import build_traced_model
from tapp_core.plan.plan import Plan, PlanError
from tapp_core.plan.program import plan_programs
from tapp_core.plan.ties import plan_ties
from tapp_core.runtime.engine import check_routes
from tapp_core.runtime.launch import check_before_launch
from tapp_core.runtime.stage import ModelGraph, Stage, split_stages
from tests.output_models import OUTPUT_MODELS
from tests.tuple_models import TUPLE_MODELS
from tests.user_models import USER_MODELS
from tests.wild_models import WILD_MODELS

if TYPE_CHECKING:
    from tapp_core.runtime import WorkerPool

TIED = "tests.user_models:tied"
MODELS = ("mlp", "tiny_cnn", "tiny_branchy", "tiny_vit", *USER_MODELS, *TUPLE_MODELS, *WILD_MODELS, *OUTPUT_MODELS)
PLANS_PER_MODEL = 4


def stages_of(n_layers: int, cuts: tuple[int, ...]) -> list[int]:
    return [sum(layer >= cut for cut in cuts) for layer in range(n_layers)]


def drawn_cuts(graph: ModelGraph, seed: int) -> list[tuple[int, ...]]:
    """Seeded draws of one, two and three cuts, redrawn where one would carry a value that no cut can
    (``ModelGraph.refusals``: the rule refuses such plans; ``bench/fuzz_cuts.py`` runs many more, on MPI ranks)."""
    rng = random.Random(seed)
    n_layers, refused = len(graph.specs), dict(graph.refusals)
    drawn: list[tuple[int, ...]] = []
    while len(drawn) < PLANS_PER_MODEL:
        cuts = tuple(sorted(rng.sample(range(1, n_layers), rng.choice((1, 2, 3)))))
        stage_of = stages_of(n_layers, cuts)
        if all(stage_of[u] == stage_of[v] for u, v in graph.layer_edges if u in refused):
            drawn.append(cuts)
    return drawn


@pytest.mark.parametrize("model", MODELS)
def test_every_cut_routes_what_its_stages_take(model: str) -> None:
    workload = workload_of(model)
    traced = build_traced_workload(workload)  # as the ranks trace it: exported where torch.fx cannot (nanoGPT)
    graph = ModelGraph.of(traced, workload.feed)
    n_layers = len(layer_nodes(traced))
    for cuts in drawn_cuts(graph, seed=len(model)):
        stage_of = stages_of(n_layers, cuts)
        n_stages = len(cuts) + 1
        split, pipeline = split_stages(traced, stage_of, n_stages)
        plan = Plan(model, 8, 2, "1f1b", tuple(stage_of), tuple((f"d{s}",) for s in range(n_stages)))
        programs = plan_programs(plan, graph.edges, graph.param_bytes, 1)
        for program in programs:
            stage = Stage(
                program.stage, split.get_submodule(f"submod_{program.stage}"), pipeline, torch.device("cpu"), traced
            )
            check_routes(program, stage)


def test_a_cut_between_the_users_of_a_tied_weight_gives_each_stage_a_copy_and_their_programs_a_tie() -> None:
    """Issue 32, item 2: the weight lives on both stages (equal copies, not one tensor), and both programs sum its
    gradient among both devices before the update, not in a stage's bucket."""
    traced = build_traced_model(TIED)
    graph = ModelGraph.of(traced)
    n_layers = len(layer_nodes(traced))
    stage_of = stages_of(n_layers, (n_layers // 2,))
    split, pipeline = split_stages(traced, stage_of, 2)
    stages = [Stage(s, split.get_submodule(f"submod_{s}"), pipeline, torch.device("cpu"), traced) for s in (0, 1)]
    copies = [stage.named_parameters()["embed.weight"] for stage in stages]
    assert copies[0] is not copies[1]
    torch.testing.assert_close(copies[0], copies[1], rtol=0, atol=0)
    plan = Plan(TIED, 8, 2, "1f1b", tuple(stage_of), (("d0", "d1"), ("d2",)))
    programs = plan_programs(plan, graph.edges, graph.param_bytes, 1, shared=graph.shared)
    for program in programs:
        (tie,) = program.ties
        assert (tie.name, tie.devices, tie.nbytes) == ("embed.weight", (0, 1, 2), 24 * 128 * 4)
        actions = [a.kind for a in program.actions()]
        assert actions[-2:] == ["tie", "update"]
    bucketed = sum(b.nbytes for b in programs[0].buckets)
    assert bucketed == sum(graph.param_bytes[i] for i in plan.stage_layers(0)) - 24 * 128 * 4


def test_the_user_resnet_cut_inside_a_block_takes_the_block_input_on_both_stages() -> None:
    """The reported failure: a block's closing ReLU feeds the next block's first conv (stage 1) and its residual
    add (stage 2); before the fix stage 2 took another layer's output under the same name."""
    model = USER_MODELS[0]
    traced = build_traced_model(model)
    nodes = layer_nodes(traced)
    relu = next(i for i, n in enumerate(nodes) if n.name == "relu_2")
    add = next(i for i, n in enumerate(nodes) if n.name == "add_1")
    _, pipeline = split_stages(traced, stages_of(len(nodes), (relu + 1, add)), 3)
    crossing = [v for v in pipeline.values if v.layer == relu]
    assert len(crossing) == 1 and crossing[0].consumers == (1, 2)


MPI_CASES = [
    # id, model, schedule, cuts (as layer names: a stage starts at each), stage devices
    # the reported one: inside a block, the block's input feeding stage 1 and stage 2
    ("resnet-inside-a-block-gpipe-3", USER_MODELS[0], "gpipe", ("layers_1_conv1", "add_1"), 3),
    # after the fused qkv's permute (samples on dimension 1), then inside the in-place scaled scores
    ("vit-after-permute-1f1b-3", USER_MODELS[1], "1f1b", ("getitem_4", "mul"), 3),
    # a residual add feeding two layers of the next stage
    ("vit-after-residual-add-gpipe-2", USER_MODELS[1], "gpipe", ("blocks_0_norm2",), 2),
    # `torch.arange(n, device=x.device)` on the next stage: a size and a device cross (found by a user's text model)
    ("encoder-after-device-1f1b-2", "tests.wild_models:torch_encoder", "1f1b", ("arange",), 2),
]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("model", "schedule", "starts", "n_stages"), [c[1:] for c in MPI_CASES], ids=[c[0] for c in MPI_CASES]
)
def test_the_reported_cuts_train_like_one_device(
    request: pytest.FixtureRequest, model: str, schedule: str, starts: tuple[str, ...], n_stages: int
) -> None:
    from tests.test_runtime_correctness import BATCH, MICRO_BATCHES, trains_like_one_device

    names = [node.name for node in layer_nodes(build_traced_model(model))]
    stage_of = stages_of(len(names), tuple(names.index(start) for start in starts))
    devices = tuple((f"d{s}",) for s in range(n_stages))
    plan = Plan(model, BATCH, MICRO_BATCHES, schedule, tuple(stage_of), devices)
    trains_like_one_device(request.getfixturevalue(f"pool{n_stages}"), plan, rel=1e-4)


def cut_pairs(n_layers: int) -> list[tuple[int, int]]:
    """Cuts two by two, so that every position between two layers is a cut of one 3-stage plan."""
    return [(cut, cut + 1) if cut + 1 < n_layers else (cut - 1, cut) for cut in range(1, n_layers, 2)]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_every_cut_of_a_model_of_tuples_trains_like_one_device(request: pytest.FixtureRequest) -> None:
    """``tests.tuple_models``: chunk, split, a GRU's ``(out, h)`` (h with its samples on dimension 1), a
    ``(values, indices)`` pair and a flattened (batch * positions, channels) tensor; each crosses every cut after it,
    packed as one tensor of samples (``tapp_core.model.crossing``). Each plan's parameters and per-step losses
    are one device's."""
    from tests.test_runtime_correctness import BATCH, MICRO_BATCHES, trains_like_one_device

    model = TUPLE_MODELS[0]
    n_layers = len(layer_nodes(build_traced_model(model)))
    pool = request.getfixturevalue("pool3")
    for i, cuts in enumerate(cut_pairs(n_layers)):
        schedule = ("1f1b", "gpipe")[i % 2]
        plan = Plan(
            model, BATCH, MICRO_BATCHES, schedule, tuple(stages_of(n_layers, cuts)), (("d0",), ("d1",), ("d2",))
        )
        trains_like_one_device(pool, plan, rel=1e-4)


TIED_LINEAR = "tests.user_models:tied_linear"
TIED_CASES = [
    # id, model, schedule, cuts (a stage starts at each layer index), stage devices, shares
    ("tied-1f1b-2-even", TIED, "1f1b", (6,), (("d0",), ("d1",)), ()),
    ("tied-gpipe-2-uneven", TIED, "gpipe", (5,), (("d0",), ("d1",)), ()),
    # the tie joins stages 1 and 2; stage 0 holds no copy
    ("tied-1f1b-3-uneven", TIED, "1f1b", (3, 8), (("d0",), ("d1",), ("d2",)), ()),
    # the tie joins stages 0 and 2, across stage 1
    ("tied-gpipe-3-across-a-stage", TIED, "gpipe", (5, 8), (("d0",), ("d1",), ("d2",)), ()),
    # data parallel within a holder stage (unequal rows) and the tie across stages
    ("tied-replicated-holder-1f1b", TIED, "1f1b", (6,), (("d0", "d2"), ("d1",)), ((0.75, 0.25), (1.0,))),
    ("tied-replicated-last-gpipe", TIED, "gpipe", (5,), (("d0",), ("d1", "d2")), ()),
    ("tied-linear-head-1f1b-2", TIED_LINEAR, "1f1b", (7,), (("d0",), ("d1",)), ()),
    ("tied-linear-head-gpipe-3", TIED_LINEAR, "gpipe", (4, 9), (("d0",), ("d1",), ("d2",)), ()),
]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("model", "schedule", "cuts", "devices", "shares"), [c[1:] for c in TIED_CASES], ids=[c[0] for c in TIED_CASES]
)
def test_a_tied_weight_split_across_stages_trains_like_one_device(
    pool3: WorkerPool,
    model: str,
    schedule: str,
    cuts: tuple[int, ...],
    devices: tuple[tuple[str, ...], ...],
    shares: tuple[tuple[float, ...], ...],
) -> None:
    """Issue 32, item 2: each holder's copy takes the summed gradient, so the copies stay equal and the plan's
    parameters and per-step losses are one device's."""
    from tests.test_runtime_correctness import (
        BATCH,
        MICRO_BATCHES,
        OPTIMIZER,
        SEED,
        STEPS,
        assert_same_parameters,
        reference,
    )  # fmt: skip

    stage_of = stages_of(len(layer_nodes(build_traced_model(model))), cuts)
    plan = Plan(model, BATCH, MICRO_BATCHES, schedule, tuple(stage_of), devices, stage_shares=shares)
    assert plan_ties(plan.stage_of_layer, ModelGraph.of(build_traced_model(model)).shared), "the plan must tie"
    check_before_launch(plan, pool3.cluster, model)
    measurement, parameters = pool3.run_steps(
        plan, steps=STEPS, warmup=1, seed=SEED, optimizer=OPTIMIZER, collect_parameters=True
    )
    assert measurement.ok, measurement.error
    want, want_losses = reference(model, MICRO_BATCHES)
    assert_same_parameters(with_aliases(parameters, model), want, model)
    assert measurement.extra["losses"] == pytest.approx(want_losses, rel=1e-4)


def with_aliases(parameters: dict[str, torch.Tensor], model: str) -> dict[str, torch.Tensor]:
    """``parameters`` under every name the model gives each (a weight tied by assignment has two: the runtime names
    it by the last, as the state dict does, and ``named_parameters`` by the first)."""
    names: dict[int, list[str]] = {}
    for name, param in build_traced_model(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    aliases = {name: group for group in names.values() for name in group}
    return {alias: tensor for name, tensor in parameters.items() for alias in aliases.get(name, [name])}


def test_an_asynchronous_plan_that_ties_a_weight_is_refused_before_any_rank_starts() -> None:
    from tests.factories import plain_cluster

    stage_of = stages_of(len(layer_nodes(build_traced_model(TIED))), (6,))
    plan = Plan(TIED, 16, 4, "async", tuple(stage_of), (("d0",), ("d1",)))
    with pytest.raises(PlanError, match=r"parameter 'embed.weight' is used on stages 0, 1, and the async schedule"):
        check_before_launch(plan, plain_cluster(2), TIED)
