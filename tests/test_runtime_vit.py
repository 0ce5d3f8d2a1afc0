"""A model written as Transformers usually are runs wherever a plan cuts it: the ViT's class token and position
embedding (parameters the model reads itself, through fx ``get_attr`` nodes) and the shapes it reads from its input.

The parameters belong to the stage of the layers that use them (the profiler charges their bytes there), are
trained there and all-reduced among that stage's replicas; a parameter used on two stages is refused by name. A
shape read on one stage and used on a later one is rebuilt there from the micro-batch's samples instead of being
sent, and neither the runtime's programs nor the cost model's route it. Every cut of ``tiny_vit`` is split and run
stage by stage here; real MPI runs on 2 and 3 ranks, with cuts around both parameters' users and inside attention,
train like one device (synchronous and asynchronous); and the whole path (profile, plan, simulate, measure, train)
runs on 2 ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate, simulated_programs
from tapp_core.measure.metrics import run_length
from tapp_core.model.graph import layer_nodes, parameter_users, trace_model
from tapp_core.model.zoo import build_traced_model
from tapp_core.plan.plan import Plan
from tapp_core.planners import get_planner
from tapp_core.profile.library import LayerLibrary
from tapp_core.profile.profiler import ProfileRequest, profile_model
from tapp_core.runtime import WorkerPool
from tapp_core.runtime.stage import ModelGraph, Stage, StageError, split_stages
from tests.factories import plain_cluster
from tests.test_runtime_correctness import (
    BATCH,
    MICRO_BATCHES,
    OPTIMIZER,
    SEED,
    STEPS,
    assert_same_parameters,
    async_reference,
    reference,
)

MODEL = "tiny_vit"
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cuts_before(model: str, *names: str) -> tuple[int, ...]:
    """Stage of every layer when stage s starts at the layer named ``names[s-1]``."""
    layers = [node.name for node in layer_nodes(build_traced_model(model))]
    cuts = [layers.index(name) for name in names]
    return tuple(sum(layer >= cut for cut in cuts) for layer in range(len(layers)))


def run_stage_by_stage(traced: torch.fx.GraphModule, stage_of_layer: Sequence[int], x: torch.Tensor) -> torch.Tensor:
    """Split, build every stage as a rank does, and run them in order passing the cut values, as the engine does;
    every parameter of the model must belong to exactly one stage."""
    n_stages = max(stage_of_layer) + 1
    split, graph = split_stages(traced, stage_of_layer, n_stages)
    stages = [Stage(s, split.get_submodule(f"submod_{s}"), graph, CPU, traced) for s in range(n_stages)]
    owned = [name for stage in stages for name in stage.named_parameters()]
    assert sorted(owned) == sorted(name for name, _ in traced.named_parameters()), "a parameter has no stage or two"
    values: dict[int, torch.Tensor] = {}
    for stage in stages:
        outputs = stage.forward([x if v.producer == -1 else values[v.index] for v in stage.inputs])
        assert all(isinstance(o, torch.Tensor) and o.shape[0] == x.shape[0] for o in outputs)
        values.update({v.index: o for v, o in zip(stage.outputs, outputs, strict=True)})
    return values[graph.output]


def test_every_cut_of_the_vit_runs_like_the_whole_model() -> None:
    traced = build_traced_model(MODEL)
    n_layers = len(layer_nodes(traced))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = traced(x)
        for cut in range(1, n_layers):
            got = run_stage_by_stage(traced, [int(i >= cut) for i in range(n_layers)], x)
            torch.testing.assert_close(got, want, msg=lambda m, c=cut: f"cut before layer {c}: {m}")


def test_three_stage_cuts_through_the_embedding_and_the_first_attention() -> None:
    """Stages of shape reads only, a class token on a stage of its own, a batch size crossing two cuts."""
    traced = build_traced_model(MODEL)
    names = [node.name for node in layer_nodes(traced)]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = traced(x)
        for a, b in itertools.combinations(range(1, names.index("blocks_0_attn_k") + 1), 2):
            stage_of_layer = [int(i >= a) + int(i >= b) for i in range(len(names))]
            torch.testing.assert_close(run_stage_by_stage(traced, stage_of_layer, x), want)


def test_the_parameters_belong_to_the_layers_that_use_them() -> None:
    traced = build_traced_model(MODEL)
    names = [node.name for node in layer_nodes(traced)]
    users = {param: [names[i] for i in layers] for param, layers in parameter_users(traced).items()}
    assert users["cls_token"] == ["expand"]
    assert users["pos_embed"] == ["add"]
    assert users["blocks.0.attn.q.weight"] == ["blocks_0_attn_q"]
    assert set(users) == {name for name, _ in traced.named_parameters()}


class TwoReads(nn.Module):
    """A parameter and a buffer the model reads itself, each used by two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 10)
        self.bias = nn.Parameter(torch.randn(10))
        self.register_buffer("scale", torch.full((10,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x.flatten(1)) * self.scale)
        h = torch.tanh(h + self.bias)
        return h * self.scale - self.bias


def test_a_parameter_used_on_two_stages_is_held_by_both_and_a_buffer_is_copied() -> None:
    traced = trace_model(TwoReads())
    names = [node.name for node in layer_nodes(traced)]  # flatten fc mul relu add tanh mul_1 sub
    x = torch.randn(2, 3, 32, 32)
    # The bias's users (add, sub) on two stages: each holds a copy of it (a tie; tests/test_cuts.py trains such
    # cuts like one device), so the split is made.
    split_stages(traced, [int(i >= names.index("tanh")) for i in range(len(names))], 2)
    # The buffer's users (mul, mul_1) on two stages: a constant, copied to each.
    stage_of_layer = [int(i >= names.index("add")) for i in range(len(names))]
    with torch.no_grad():
        torch.testing.assert_close(run_stage_by_stage(traced, stage_of_layer, x), traced(x))


class SquaredBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = x.shape[0] * x.shape[0]
        h = self.fc(x.flatten(1))
        return h + torch.zeros(pairs).sum()


def test_a_shape_that_is_no_affine_function_of_the_samples_cannot_cross_a_cut() -> None:
    traced = trace_model(SquaredBatch())
    names = [node.name for node in layer_nodes(traced)]
    stage_of_layer = [int(i >= names.index("flatten")) for i in range(len(names))]
    with pytest.raises(StageError, match=r"value 'mul' crossing a stage cut is a shape .*4 at 2 samples.*move the cut"):
        split_stages(traced, stage_of_layer, 2)


@pytest.fixture(scope="module")
def library() -> LayerLibrary:
    return profile_model(ProfileRequest(MODEL, BATCH, threads=1, repeats=1, warmup=1))


def test_shapes_cross_no_cut_in_the_cost_model_or_the_runtime(library: LayerLibrary) -> None:
    """Both derive the same programs: only edges that carry a tensor are routed, never a shape read."""
    traced = build_traced_model(MODEL)
    assert library.tensor_edges() == list(ModelGraph.of(traced).edges)
    shapes = {layer.name for layer in library.layers if not layer.outputs_tensor}
    assert {"getattr_1", "getitem", "getattr_2", "getitem_1", "getitem_2", "getitem_3"} <= shapes
    assert not shapes & {"expand", "cat", "getitem_27", "view"}  # getitem_27: the class token's row, x[:, 0]
    plan = Plan(MODEL, BATCH, MICRO_BATCHES, "1f1b", cuts_before(MODEL, "matmul"), (("d0",), ("d1",)))
    routed = {
        library.layers[layer].name
        for program in simulated_programs(plan, library)
        for routes in program.sends.values()
        for route in routes
        for layer in route.values
    }
    assert routed and not routed & shapes
    _, graph = split_stages(traced, plan.stage_of_layer, 2)
    assert routed == {library.layers[v.layer].name for v in graph.values if v.producer == 0 and v.consumers}


# --- Real MPI ranks ---------------------------------------------------------------------------------------------


VIT_CASES = [
    # id, pool, schedule, the layers each later stage starts at, stage devices
    ("after-pos-embed-user-1f1b", "pool2", "1f1b", ("blocks_0_norm1",), (("d0",), ("d1",))),
    ("after-cls-token-user-gpipe", "pool2", "gpipe", ("cat",), (("d0",), ("d1",))),
    ("batch-size-crosses-to-cls-token-1f1b", "pool2", "1f1b", ("expand",), (("d0",), ("d1",))),
    ("inside-attention-gpipe", "pool2", "gpipe", ("matmul",), (("d0",), ("d1",))),
    ("bsp-replicas-allreduce-both", "pool2", "gpipe", (), (("d0", "d1"),)),
    (
        "shape-reads-only-middle-1f1b-3",
        "pool3",
        "1f1b",
        ("getattr_2", "view"),  # q's shape read, between q and its view into heads
        (("d0",), ("d1",), ("d2",)),
    ),
    ("replicated-embedding-stage-1f1b-3", "pool3", "1f1b", ("blocks_0_attn_k",), (("d0", "d2"), ("d1",))),
]


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("pool_name", "schedule", "starts", "devices"), [c[1:] for c in VIT_CASES], ids=[c[0] for c in VIT_CASES]
)
def test_vit_pipeline_trains_like_one_device(
    request: pytest.FixtureRequest,
    pool_name: str,
    schedule: str,
    starts: tuple[str, ...],
    devices: tuple[tuple[str, ...], ...],
) -> None:
    pool: WorkerPool = request.getfixturevalue(pool_name)
    plan = Plan(MODEL, BATCH, MICRO_BATCHES, schedule, cuts_before(MODEL, *starts), devices)  # type: ignore[arg-type]
    measurement, parameters = pool.run_steps(
        plan, steps=STEPS, warmup=1, seed=SEED, optimizer=OPTIMIZER, collect_parameters=True
    )
    assert measurement.ok, measurement.error
    want, want_losses = reference(MODEL, MICRO_BATCHES)
    assert {"cls_token", "pos_embed"} <= set(parameters)
    assert_same_parameters(parameters, want, MODEL)
    assert measurement.extra["losses"] == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_vit_async_pipeline_uses_the_weights_of_each_forward(pool2: WorkerPool) -> None:
    """The class token and position embedding are stashed with their stage's weights, like a layer's."""
    stage_of_layer = cuts_before(MODEL, "cat")
    cut = (stage_of_layer.index(1),)
    plan = Plan(MODEL, BATCH, MICRO_BATCHES, "async", stage_of_layer, (("d0",), ("d1",)))
    measurement, parameters = pool2.run_steps(
        plan, steps=STEPS, warmup=1, seed=SEED, optimizer=OPTIMIZER, collect_parameters=True
    )
    assert measurement.ok, measurement.error
    ran, _, _ = run_length(plan.pipeline_schedule, plan.n_stages, MICRO_BATCHES, STEPS, 1)  # fill and drain too
    want = async_reference(MODEL, cut, 2, steps=ran)
    assert_same_parameters(parameters, want, MODEL)
    synchronous, _ = reference(MODEL, MICRO_BATCHES)
    assert not torch.allclose(want["cls_token"], synchronous["cls_token"], rtol=0, atol=1e-6), "no stale weights"


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_vit_profile_plan_simulate_measure_and_train_on_two_ranks(pool2: WorkerPool, library: LayerLibrary) -> None:
    cluster = plain_cluster(2)
    assert library.param_bytes == sum(p.numel() * 4 for p in build_traced_model(MODEL).parameters())
    plan = get_planner("even").plan(CostContext(library, cluster))
    assert plan.n_stages == 2, "the even split must cut the model for this test to show anything"
    validate(plan, CostContext(library, cluster))
    assert estimate(plan, CostContext(library, cluster)).step_time_s > 0
    measurement = pool2.measure(plan, steps=3, warmup=1, seed=SEED)
    assert measurement.ok, measurement.error
    result = pool2.train(plan, dataset="synthetic", epochs=1, steps_per_epoch=4, seed=SEED, optimizer=OPTIMIZER)
    assert result.ok, result.error
    assert len(result.epoch_losses) == 1 and 0.0 <= result.test_accuracy <= 1.0
