"""Megatron's attention and MLP splits as SBP signatures on the ViT (issue 23), in the layout pass alone.

q, k, v ``col`` and the projection ``row``, fc1 ``col`` and fc2 ``row``: the layout pass carries the feature split
of q, k and v through the view into heads, the transposes, both batched matmuls, the scaling and the softmax with
no collective, in whole heads (a unit it reads from the view's shapes); a split that cannot give every device a
whole head is refused, naming the layer. The MPI runs of these plans are in ``test_runtime_sbp``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.model.zoo import build_traced_model
from tapp_core.plan.placement import (
    BROADCAST,
    MODEL_INPUT,
    PARTIAL_SUM,
    SAMPLES,
    LayerSpec,
    Split,
    split_ranges,
    stage_layouts,
)
from tapp_core.plan.plan import (
    Plan,
    PlanError,
    check_signatures,
    single_stage_plan,
    stage_memory_bytes,
    stage_memory_terms,
)
from tapp_core.planners.patterns import pattern_signatures
from tapp_core.profile.profiler import ProfileRequest, profile_model
from tapp_core.runtime.stage import ModelGraph
from tests.factories import plain_cluster
from tests.test_runtime_sbp import megatron

SPECS = ModelGraph.of(build_traced_model("tiny_vit")).specs
INDEX = {spec.name: spec.index for spec in SPECS}
ALL = range(len(SPECS))


def block_changes(devices: int, block: int) -> list[tuple[str, str, str, str, str, tuple[str, ...]]]:
    """The changes of one block: (reader, value, forward, backward, target, other readers)."""
    layouts = stage_layouts(SPECS, ALL, megatron("tiny_vit"), devices)
    lo, hi = INDEX[f"blocks_{block}_norm1"], INDEX[f"blocks_{block}_mlp_fc2"] + 1
    return [
        (SPECS[c.layer].name, SPECS[c.value].name, c.forward, c.backward, str(c.target),
         tuple(SPECS[r].name for r in c.readers))
        for c in layouts.changes if lo <= c.value < hi or lo <= c.layer < hi
    ]  # fmt: skip


@pytest.mark.parametrize("devices", [2, 3])
def test_a_megatron_block_exchanges_once_per_split_pair(devices: int) -> None:
    """Forward: the block's input gathered once for q, k and v together; nothing between q/k/v and the projection
    (the heads stay split); the projection's partial sum reduce-scattered into the residual; the same around the
    MLP. Backward, the adjoints: the input gradients of q, k, v (and of fc1) are summed across the group
    (reduce-scatter), the residual's gradient gathered. Per split pair that is Megatron's one allreduce of the
    activation forward and one backward, with the residual stream and LayerNorms held by samples between."""
    b = "blocks_1"
    assert block_changes(devices, 1) == [
        (f"{b}_attn_q", f"{b}_norm1", "allgather", "reduce_scatter", "B", (f"{b}_attn_k", f"{b}_attn_v")),
        ("add_3", f"{b}_attn_proj", "reduce_scatter", "allgather", "S(0)", ()),
        (f"{b}_mlp_fc1", f"{b}_norm2", "allgather", "reduce_scatter", "B", ()),
        ("add_4", f"{b}_mlp_fc2", "reduce_scatter", "allgather", "S(0)", ()),
    ]


def test_the_heads_stay_split_from_q_k_v_to_the_projection() -> None:
    layouts = stage_layouts(SPECS, ALL, megatron("tiny_vit"), 2)
    b = "blocks_0"
    first, last = INDEX[f"{b}_attn_q"], INDEX[f"{b}_attn_proj"]
    tensors = [x for x in range(first, last) if SPECS[x].shape and SPECS[x].op != "getattr"]
    for x in tensors:  # (T, D) split along D, (T, H, hd) along H, (H, T, hd) and (H, T, T) along H
        assert isinstance(layouts.outputs[x], Split) and layouts.outputs[x].dim in (1, 2), SPECS[x].name
        assert layouts.split(x), SPECS[x].name  # its work is split by the shares: the cost model's compute
    assert layouts.outputs[INDEX["softmax"]] == Split(1)  # the heads' dimension of (H, T, T)
    assert layouts.outputs[last] == PARTIAL_SUM and layouts.weights[last] == Split(1)
    assert {SPECS[x].name: u for x, u in layouts.units.items()} == {
        f"blocks_{i}_attn_{n}": 8 for i in (0, 1) for n in "qkv"
    }  # whole heads of 8 features; the MLP has no unit
    assert layouts.inputs[INDEX[f"{b}_norm1"]] == SAMPLES and layouts.inputs[INDEX[f"{b}_attn_q"]] == BROADCAST


def test_uneven_shares_round_to_whole_heads() -> None:
    assert split_ranges(32, (0.45, 0.3, 0.25), unit=8) == ((0, 16), (16, 24), (24, 32))  # heads 2/1/1
    assert split_ranges(32, (0.45, 0.3, 0.25)) == ((0, 14), (14, 24), (24, 32))  # not on heads


@pytest.mark.parametrize(
    ("devices", "shares"),
    [(5, ()), (4, ((0.85, 0.05, 0.05, 0.05),))],
    ids=["five-devices-four-heads", "uneven-shares-leaving-a-device-no-head"],
)
def test_a_split_that_cannot_fall_on_whole_heads_is_refused_naming_the_layer(
    devices: int, shares: tuple[tuple[float, ...], ...]
) -> None:
    names = tuple(f"d{i}" for i in range(devices))
    plan = Plan("tiny_vit", 16, 1, "gpipe", (0,) * len(SPECS), (names,), stage_shares=shares,
                signatures=tuple(megatron("tiny_vit").items()))  # fmt: skip
    with pytest.raises(
        PlanError, match="layer blocks_0_attn_q: its split of 32 features must fall on whole units of 8"
    ):
        check_signatures(plan, SPECS)


def spec(index: int, op: str, inputs: tuple[int, ...], shape: tuple[int, ...], axes: tuple[int, ...] = ()) -> LayerSpec:
    return LayerSpec(index, f"l{index}", op, inputs, shape, op == "Linear", axes)


def test_a_view_that_merges_the_split_with_an_earlier_dimension_gathers_it_first() -> None:
    layers = [
        spec(0, "Linear", (MODEL_INPUT,), (4, 12)),
        spec(1, "view", (0,), (48,)),  # (T, D) -> (T * D): the split no longer holds a contiguous range
        spec(2, "Linear", (1,), (10,)),
    ]
    layouts = stage_layouts(layers, range(3), {0: "col"}, 2)
    assert [(c.layer, c.forward) for c in layouts.changes] == [(1, "all_to_all")]  # S(2) -> S(0)
    assert 1 not in layouts.carried


def test_a_softmax_along_the_split_dimension_or_without_known_axes_does_not_carry_it() -> None:
    for axes in ((2,), ()):
        layers = [spec(0, "Linear", (MODEL_INPUT,), (4, 12)), spec(1, "softmax", (0,), (4, 12), axes)]
        layouts = stage_layouts(layers, range(2), {0: "col"}, 2)
        assert 1 not in layouts.carried and layouts.inputs[1] == SAMPLES


def test_the_library_records_the_axes_the_traced_graph_reads() -> None:
    library = profile_model(ProfileRequest("tiny_vit", 4, repeats=1, warmup=0))
    assert library.specs() == SPECS
    assert SPECS[INDEX["softmax"]].axes == (3,) and SPECS[INDEX["transpose_4"]].axes == (2, 3)


def test_the_megatron_pattern_finds_the_attention_and_mlp_pairs_from_the_graph() -> None:
    """What the planners try (``patterns.PATTERNS``): the hand-written signatures, found by the layout pass; the
    patch embedding and the head, which no row layer pairs with, stay data parallel."""
    splittable = [spec.index for spec in SPECS if spec.op in ("Linear", "Conv2d")]
    found = pattern_signatures("megatron", splittable, {}, SPECS)
    assert {x: s for x, s in found.items() if s != "data"} == megatron("tiny_vit")
    assert pattern_signatures("megatron", splittable, {}) == dict.fromkeys(splittable, "data")  # no specs: data


def test_the_cost_model_and_the_memory_check_follow_a_megatron_plan() -> None:
    """Estimated like any plan (compute split by the shares where the layers are split, the changes' collectives),
    and memory as the layouts hold each tensor."""
    library = profile_model(ProfileRequest("tiny_vit", 8, repeats=1, warmup=0))
    cluster = plain_cluster(2)
    data = single_stage_plan(library, ["d0", "d1"])
    split = dataclasses.replace(data, signatures=tuple(megatron("tiny_vit").items()))
    validate(split, CostContext(library, cluster))
    estimated = estimate(split, CostContext(library, cluster))
    assert math.isfinite(estimated.step_time_s) and estimated.step_time_s > 0
    assert estimated.communication_share > 0  # the allgathers and reduce-scatters of every block
    # Memory: each device holds its share of the split weights, and every row of what it holds Broadcast or
    # PartialSum (the inputs gathered for q, k, v and fc1, the partial sums): on tiny_vit at 8 samples the
    # activations outweigh the weights, so the split stage's activations and training state need more than a
    # replica's (which reduces more gradients in its buckets).
    mine, replica = stage_memory_terms(split, library, 0), stage_memory_terms(data, library, 0)
    weights = sum(x.param_bytes for x in library.layers)
    split_weights = sum(library.layers[x].param_bytes for x in megatron("tiny_vit"))
    assert 0 < split_weights < weights

    def held(terms: dict[str, float]) -> float:
        return terms["activations"] + terms["training state"]

    assert all(held(mine[d]) > held(replica[d]) > weights for d in ("d0", "d1"))
    assert all(mine[d]["gradient buckets"] < replica[d]["gradient buckets"] for d in ("d0", "d1"))
    assert stage_memory_bytes(split, library, 0)["d0"] == int(sum(mine["d0"].values()))
