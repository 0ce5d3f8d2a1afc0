"""How a layer's output crosses a cut (``tapp_core.model.crossing``): the layouts it is packed in, and the outputs
that cannot cross, refused by the rule (``tapp_core.plan.rule``) with the reason, from the traced model and from
the layer library alike. Without MPI (``tests/test_cuts.py`` runs every cut of ``tests.tuple_models`` on ranks)."""

from __future__ import annotations

import functools

import pytest
import torch

from tapp_core.model.crossing import CUT_SAMPLES, cut_facts, pack, unpack
from tapp_core.model.graph import layer_nodes
from tapp_core.model.workload import example_input
from tapp_core.model.zoo import build_traced_model
from tapp_core.plan.plan import Plan, PlanError
from tapp_core.plan.rule import ModelFacts, check_runs
from tapp_core.profile.library import LayerLibrary
from tapp_core.profile.profiler import ProfileRequest, profile_model
from tapp_core.runtime.stage import ModelGraph, StageError, split_stages
from tests.tuple_models import TUPLE_MODELS

ROWS = TUPLE_MODELS[0]
AWKWARD = "tests.tuple_models:awkward"
BATCH = 8


@functools.cache
def rows_library() -> LayerLibrary:
    return profile_model(ProfileRequest(ROWS, BATCH, repeats=1, warmup=0))


@functools.cache
def awkward_library() -> LayerLibrary:
    return profile_model(ProfileRequest(AWKWARD, BATCH, repeats=1, warmup=0))


def layer_named(model: str, name: str) -> int:
    return [node.name for node in layer_nodes(build_traced_model(model))].index(name)


def test_a_flattened_batch_by_position_tensor_crosses_a_cut_in_its_samples_rows() -> None:
    """``second.reshape(-1, channels)``: (B*T, C), T rows per sample, which no shape guess tells from a tensor
    computed from weights alone; the data flow from the input does."""
    tokens = layer_named(ROWS, "reshape_1")
    library = rows_library()
    assert library.layers[tokens].output_shape == (BATCH * 4, 12)
    assert not ModelFacts.of_library(library).refusals
    assert not ModelGraph.of(build_traced_model(ROWS)).facts().refusals
    facts = cut_facts(build_traced_model(ROWS), example_input((3, 32, 32), CUT_SAMPLES))
    assert facts.layouts[tokens] == ("tensor", 0, 4, (12,), "float32")
    value = torch.arange(6 * 4 * 12.0).reshape(6 * 4, 12)
    packed = pack(value, facts.layouts[tokens])
    assert packed.shape == (6, 4, 12)
    torch.testing.assert_close(unpack(packed[2:5], facts.layouts[tokens]), value[2 * 4 : 5 * 4])
    n_layers = len(library.layers)
    check_runs(Plan(ROWS, BATCH, 2, "1f1b", tuple(int(i > tokens) for i in range(n_layers)), (("a",), ("b",))),
               ModelFacts.of_library(library))  # fmt: skip


def test_a_tuple_with_samples_on_another_dimension_packs_and_unpacks_whole() -> None:
    """A GRU's ``(out, h)``: out (B, T, H), h (1, B, H)."""
    facts = cut_facts(build_traced_model(ROWS), example_input((3, 32, 32), CUT_SAMPLES))
    layout = facts.layouts[layer_named(ROWS, "gru")]
    assert layout == ("tuple", (("tensor", 0, 1, (8, 12), "float32"), ("tensor", 1, 1, (1, 12), "float32")))
    out, h = torch.randn(5, 8, 12), torch.randn(1, 5, 12)
    packed = pack((out, h), layout)
    assert packed.shape == (5, 8 * 12 + 12)
    got_out, got_h = unpack(packed[1:3], layout)
    torch.testing.assert_close(got_out, out[1:3])
    torch.testing.assert_close(got_h, h[:, 1:3])


def test_a_pair_of_values_and_indices_crosses_in_float64_and_comes_back_as_it_was() -> None:
    """``x.max(dim=1)``: a ``torch.return_types.max`` of a float32 and an int64 tensor, read by ``.values``."""
    facts = cut_facts(build_traced_model(ROWS), example_input((3, 32, 32), CUT_SAMPLES))
    layout = facts.layouts[layer_named(ROWS, "max_1")]
    assert layout[0] == "torch.return_types:max"
    best = torch.randn(5, 4, 12).max(dim=1)
    packed = pack(best, layout)
    assert packed.dtype == torch.float64
    got = unpack(packed[1:4], layout)
    assert type(got) is type(best) and got.indices.dtype == torch.int64
    torch.testing.assert_close(got.values, best.values[1:4], rtol=0, atol=0)
    torch.testing.assert_close(got.indices, best.indices[1:4], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("t", "computed from weights and shapes alone"),
        ("reshape_1", "rows do not follow the samples"),
    ],
)
def test_an_output_that_cannot_cross_is_refused_by_the_rule_and_by_the_split_with_its_reason(
    name: str, reason: str
) -> None:
    traced = build_traced_model(AWKWARD)
    names = [node.name for node in layer_nodes(traced)]
    after = names.index(name) + 1
    stage_of = tuple(int(i >= after) for i in range(len(names)))
    plan = Plan(AWKWARD, BATCH, 2, "1f1b", stage_of, (("a",), ("b",)))
    for facts in (ModelGraph.of(traced).facts(), ModelFacts.of_library(awkward_library())):
        with pytest.raises(PlanError, match=f"the output of layer {name} cannot cross the cut .*{reason}"):
            check_runs(plan, facts)
    with pytest.raises(StageError, match=reason):
        split_stages(traced, stage_of, 2)
