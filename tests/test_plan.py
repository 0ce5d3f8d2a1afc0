import dataclasses
from pathlib import Path

import pytest

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.model.graph import SharedParameter
from tapp_core.model.workload import OptimizerConfig
from tapp_core.plan.plan import (
    RUNTIME_BYTES,
    TRACE_SAMPLES,
    Plan,
    PlanError,
    check_edges,
    check_layers,
    model_trace_bytes,
    single_stage_plan,
    stage_memory_bytes,
    stage_memory_terms,
)
from tests.factories import chain_library, library_from_edges, make_cluster


def two_stage(**overrides: object) -> Plan:
    fields: dict[str, object] = {
        "model": "toy",
        "batch_size": 8,
        "micro_batches": 2,
        "schedule": "gpipe",
        "stage_of_layer": (0, 0, 1, 1),
        "stage_devices": (("d0",), ("d1",)),
    }
    fields.update(overrides)
    return Plan.from_dict(fields)


def test_json_round_trip_and_stable_id(tmp_path: Path) -> None:
    plan = two_stage(planner="even", notes={"why": "test"})
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.id == plan.id
    assert Plan.load(plan.save(tmp_path / "p.json")) == plan
    # The id is the content: planner name and notes do not change it; any placement change does.
    assert two_stage(planner="other").id == plan.id
    assert two_stage(stage_of_layer=(0, 1, 1, 1)).id != plan.id
    assert len(plan.id) == 12


def test_plan_file_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
    bad.write_text('{"model": "toy"}')
    with pytest.raises(PlanError, match="lacks field"):
        Plan.load(bad)
    tampered = two_stage().to_dict() | {"micro_batches": 4}
    with pytest.raises(PlanError, match="hashes to"):
        Plan.from_dict(tampered)


def test_valid_plan_passes() -> None:
    validate(two_stage(), CostContext(chain_library(4), make_cluster([1, 1])))


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (two_stage(stage_of_layer=(0, 0, 1)), r"layer 3 \(l3\) is missing from the plan"),
        (two_stage(stage_of_layer=(0, 1, 0, 1)), r"edge l1 -> l2 runs backward: stage 1 feeds stage 0"),
        (two_stage(stage_devices=(("d0",), ("gpu9",))), r"stage 1 uses unknown device 'gpu9'"),
        (two_stage(stage_devices=(("d0",), ("d0",))), r"device 'd0' is used by two stages \(0 and 1\)"),
        (two_stage(stage_devices=(("d0", "d0"), ("d1",))), r"device 'd0' is used twice by stage 0"),
        (two_stage(stage_devices=(("d0",), ())), r"stage 1 has no device"),
        (two_stage(stage_of_layer=(0, 0, 0, 0)), r"stage 1 has no layer"),
        (two_stage(stage_of_layer=(0, 0, 1, 1, 1)), r"plan places 5 layers but the layer library has 4"),
        (two_stage(batch_size=0), r"batch size \(0\) and micro-batches \(2\) must be positive"),
        (two_stage(micro_batches=3), r"batch size 8 is not divisible by 3 micro-batches"),
        (two_stage(stage_of_layer=(0, 0, 1, 2)), r"layer 3 \(l3\) is on stage 2"),
        (two_stage(model="other"), r"plan is for model 'other'"),
        (
            two_stage(micro_batches=4, stage_devices=(("d0",), ("d1", "d2", "d3"))),
            r"device 'd3' of stage 1 gets no sample of the micro-batch of 2",
        ),
    ],
)
def test_invalid_plans_name_the_problem(plan: Plan, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        validate(plan, CostContext(chain_library(4), make_cluster([1, 1, 1, 1])))


def test_schedule_is_checked_when_the_plan_is_made() -> None:
    with pytest.raises(PlanError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b, async"):
        two_stage(schedule="zigzag")
    with pytest.raises(PlanError, match=r"plan <plan>: unknown schedule 'zigzag'"):
        Plan.from_dict(two_stage().to_dict() | {"schedule": "zigzag", "id": None})
    assert two_stage(schedule="async").pipeline_schedule.stashes_weights(0, 2, 2)
    assert not two_stage(schedule="async", staleness=0).pipeline_schedule.stashes_weights(0, 2, 2)
    with pytest.raises(PlanError, match=r"schedule 'gpipe' takes no staleness \(only async does\)"):
        two_stage(staleness=1)


def test_layer_and_edge_checks_work_on_any_graph() -> None:
    """The parts take plain indices and a naming function, so a traced graph's edges can use them too."""
    names = ["in", "conv", "relu", "fc"].__getitem__
    edges = [(0, 1), (1, 2), (2, 3), (0, 3)]
    check_layers((0, 0, 1, 1), 2, 4, names)
    check_edges((0, 0, 1, 1), edges, names)
    with pytest.raises(PlanError, match=r"edge conv -> relu runs backward: stage 1 feeds stage 0"):
        check_edges((0, 1, 0, 1), edges, names)
    with pytest.raises(PlanError, match=r"plan places 3 layers but the traced model has 4: layer 3 \(fc\) is missing"):
        check_layers((0, 0, 1), 2, 4, names, "the traced model")
    with pytest.raises(PlanError, match=r"layer 2 \(relu\) is on stage -1, but stages are 0..1"):
        check_layers((0, 0, -1, 1), 2, 4, names)
    check_edges((0,), [], names)


def test_memory_exceeded_names_device() -> None:
    library = chain_library(4, param_bytes=[2**30] * 4)
    # 3 x 2 GiB of training state, a layer's 1 GiB gradient before it is added (2 micro-batches) and the runtime
    with pytest.raises(
        PlanError,
        match=r"out of memory on device 'd0': stage 0 needs 7\.01 GiB \(training state 6\.00 GiB, "
        r"gradient transient 1\.00 GiB, runtime 7\.00 MiB, .*\), the device has 4\.00 GiB",
    ):
        validate(two_stage(), CostContext(library, make_cluster([1, 1], memory="4GiB")))
    # under AdamW (two moments a parameter) the same stage needs 2 GiB more
    adamw = CostContext(library, make_cluster([1, 1], memory="4GiB"), optimizer=OptimizerConfig(name="AdamW"))
    with pytest.raises(PlanError, match=r"stage 0 needs 9\.01 GiB \(training state 8\.00 GiB"):
        validate(two_stage(), adamw)


def test_skip_edge_may_jump_stages() -> None:
    library = library_from_edges(4, [(0, 1), (1, 2), (2, 3), (0, 3)])
    plan = two_stage(stage_of_layer=(0, 1, 1, 2), stage_devices=(("d0",), ("d1",), ("d2",)))
    validate(plan, CostContext(library, make_cluster([1, 1, 1])))


def test_memory_by_schedule() -> None:
    # 2 layers, 1 byte of params each, 10 bytes of activations per sample each; 4 micro-batches of 2 samples.
    library = chain_library(2, param_bytes=[1, 1], activation_bytes=[10, 10])
    gpipe = Plan("toy", 8, 4, "gpipe", (0, 1), (("d0",), ("d1",)))
    ofob = Plan("toy", 8, 4, "1f1b", (0, 1), (("d0",), ("d1",)))
    asyn = Plan("toy", 8, 4, "async", (0, 1), (("d0",), ("d1",)))

    # Per micro-batch in flight a stage keeps its inputs (stage 0: the model's 3072-byte input per sample; stage 1:
    # layer 0's 10 bytes) and its layer's output, 10 bytes per sample, for 2 samples.
    def terms(plan: Plan, stage: int) -> dict[str, float]:
        (only,) = stage_memory_terms(plan, library, stage).values()
        return only

    first = (library.input_bytes + 10) * 2
    # gpipe holds all 4 micro-batches
    assert terms(gpipe, 0)["activations"] == 4 * first and terms(gpipe, 0)["stashed weights"] == 0
    # 1f1b stage 0 of 2 holds 2 in flight; the last stage 1
    assert terms(ofob, 0)["activations"] == 2 * first
    assert terms(ofob, 1)["activations"] == 1 * (10 + 10) * 2
    # async also stashes the weight versions its in-flight micro-batches ran on (2 at most), each dropped at the
    # update after its last backward, before the next forward makes one (gradients.StageGradients): 2 of 1 byte
    assert terms(asyn, 0)["activations"] == 2 * first and terms(asyn, 0)["stashed weights"] == 2
    # one micro-batch a step: each version's gradient is taken as made, none is added to another
    single = dataclasses.replace(asyn, micro_batches=1)
    assert terms(single, 0)["stashed weights"] > 0 and terms(single, 0)["gradient transient"] == 0
    # with staleness 0 it is 1f1b: no version stashed
    assert terms(dataclasses.replace(asyn, staleness=0), 0) == terms(ofob, 0)
    # the total is the terms' sum, the runtime's fixed bytes among them
    assert stage_memory_bytes(ofob, library, 1)["d1"] == int(sum(terms(ofob, 1).values()))
    assert terms(ofob, 1)["runtime"] == RUNTIME_BYTES and terms(ofob, 1)["training state"] == 3
    # the optimiser's state follows the workload's optimiser: AdamW's two moments make 4 bytes a parameter byte
    adamw = OptimizerConfig(name="AdamW").state_per_param
    assert stage_memory_terms(ofob, library, 1, adamw)["d1"]["training state"] == 4


def test_the_model_trace_is_the_peak_of_a_stage_that_needs_less() -> None:
    # Cutting the model for a plan, a rank holds every layer output of TRACE_SAMPLES samples at once beside the
    # runtime's own: 16 + 4 MiB a sample here, before the stage is built. A small last stage's peak is that; a large
    # first stage's, its own.
    library = chain_library(3, param_bytes=[1, 1, 1], activation_bytes=[16 * 2**20, 4 * 2**20, 8], batch_size=2)
    plan = Plan("toy", 2, 1, "1f1b", (0, 0, 1), (("d0",), ("d1",)))
    assert model_trace_bytes(library) == TRACE_SAMPLES * (20 * 2**20 + 8)
    (last,) = stage_memory_terms(plan, library, 1).values()
    assert last["model trace"] > 0
    assert sum(last.values()) == pytest.approx(RUNTIME_BYTES + model_trace_bytes(library))
    (first,) = stage_memory_terms(plan, library, 0).values()
    assert first["model trace"] == 0 and sum(first.values()) > RUNTIME_BYTES + model_trace_bytes(library)


def test_rows_follow_the_shares_and_single_stage() -> None:
    even = single_stage_plan(chain_library(3), ["d0", "d1"], batch_size=8)
    assert even.rows(0) == ((0, 4), (4, 8))
    uneven = dataclasses.replace(even, batch_size=7, stage_shares=((0.75, 0.25),))
    assert uneven.rows(0) == ((0, 5), (5, 7))  # 5.25 and 1.75: the spare sample to the larger remainder
    assert Plan.from_json(uneven.to_json()) == uneven
    with pytest.raises(PlanError, match=r"device 'd1' of stage 0 gets no sample"):
        validate(dataclasses.replace(even, batch_size=1), CostContext(chain_library(3), make_cluster([1, 1])))
    library = chain_library(3)
    bsp = single_stage_plan(library, ["d0", "d1"], planner="bsp")
    assert bsp.n_stages == 1 and bsp.stage_devices == (("d0", "d1"),) and bsp.stage_of_layer == (0, 0, 0)
    validate(bsp, CostContext(library, make_cluster([1, 1])))


def test_shares_must_fit_their_groups() -> None:
    with pytest.raises(PlanError, match=r"stage 1: 2 shares for 1 devices"):
        two_stage(stage_shares=((1.0,), (0.5, 0.5)))
    with pytest.raises(PlanError, match=r"shares must sum to 1"):
        validate(
            two_stage(stage_devices=(("d0",), ("d1", "d2")), stage_shares=((1.0,), (0.5, 0.2))),
            CostContext(chain_library(4), make_cluster([1, 1, 1])),
        )


def test_every_field_survives_json_and_the_id_is_its_content() -> None:
    plan = two_stage(
        schedule="async",
        staleness=1,
        stage_devices=(("d0",), ("d1", "d2")),
        stage_shares=((1.0,), (0.75, 0.25)),
        signatures={"2": "col", "3": "row"},
        bucket_bytes=0,
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.id == plan.id
    assert again.signatures == ((2, "col"), (3, "row")) and again.staleness == 1 and again.bucket_bytes == 0
    assert plan.describe() == (
        "d0 (layers 0-1) | d1+d2 (layers 2-3; 0.75/0.25; layer 2 col, layer 3 row), m=2, async (staleness 1)"
    )
    assert (
        Plan("m", 8, 1, "1f1b", (0, 1, 0, 1), (("d0",), ("d1",))).describe()
        == "d0 (2 layers) | d1 (2 layers), m=1, 1f1b"
    )
    assert two_stage().id == two_stage(signatures={"2": "data"}).id, "data is every layer's default: no field"


def test_a_frozen_shared_weights_second_copy_is_a_weight_alone() -> None:
    """A frozen weight read on two stages (a frozen embedding tied to its head): the second stage's copy holds no
    gradient and no optimiser state, and no update steps it; a trained one's copy has both."""
    library = chain_library(4, param_bytes=[1000, 8, 8, 8], activation_bytes=[10] * 4)
    library.layers = [dataclasses.replace(library.layers[0], frozen_bytes=1000), *library.layers[1:]]
    plan = Plan("toy", 8, 1, "gpipe", (0, 0, 1, 1), (("d0",), ("d1",)))
    adamw = 2
    for trained, per_byte in ((False, 1), (True, 2 + adamw)):  # weights; or weights, gradients, AdamW's two
        library.shared = (SharedParameter("embed.weight", (0, 3), 1000, trained=trained),)
        terms = stage_memory_terms(plan, library, 1, adamw)["d1"]
        assert terms["training state"] == per_byte * 1000 + (2 + adamw) * 16  # and its own two layers' 16 bytes


def test_a_frozen_prefix_keeps_no_activations_but_what_its_first_trained_layer_reads() -> None:
    """A fine-tuned model's frozen backbone builds no autograd graph (its backward profiled at 0): its outputs are
    freed once used, save the last one, which the first trained layer keeps for its weights' gradient. Measured on
    VGG-16 with its features frozen (bench/memory.py --library): counting them put the estimate 187 % over."""
    library = chain_library(4, param_bytes=[8, 8, 8, 8], activation_bytes=[100, 200, 300, 400])
    library.layers = [
        dataclasses.replace(x, frozen_bytes=8, backward_s=0.0, backward_fixed_s=0.0) if x.index < 2 else x
        for x in library.layers
    ]
    assert library.read_by_backward() == (False, True, True, True)
    one = Plan("toy", 8, 1, "gpipe", (0, 0, 1, 1), (("d0",), ("d1",)))
    first, second = (stage_memory_terms(one, library, s)[f"d{s}"] for s in (0, 1))
    assert first["activations"] == 8 * (library.input_bytes + 200)  # layer 0's output is not kept
    assert first["training state"] == 16 and first["backward working memory"] == 2 * 200 * 8  # at work, though
    assert second["activations"] == 8 * (200 + 300 + 400)
    # what a stage sends on the runtime keeps until its backward, read or not
    early = dataclasses.replace(one, stage_of_layer=(0, 1, 1, 1))
    assert stage_memory_terms(early, library, 0)["d0"]["activations"] == 8 * (library.input_bytes + 100)


def test_measured_saved_tensors_count_instead_of_what_a_backward_reads() -> None:
    """A profiled library says which outputs autograd keeps and what else it keeps of a layer's forward
    (``tapp_core.profile.saved``): the model counts those, and an output sent to another stage all the same."""
    library = chain_library(4, param_bytes=[8, 8, 8, 8], activation_bytes=[100, 200, 300, 400])
    kept = (True, False, True, False)
    library.layers = [
        dataclasses.replace(x, output_saved=kept[x.index], saved_bytes=10 * x.index) for x in library.layers
    ]
    one = Plan("toy", 8, 1, "gpipe", (0, 0, 1, 1), (("d0",), ("d1",)))
    first, second = (stage_memory_terms(one, library, s)[f"d{s}"]["activations"] for s in (0, 1))
    # layer 1's output is not kept by autograd, but the runtime holds it until the backward: it crosses the cut
    assert first == 8 * (library.input_bytes + 100 + 0 + 200 + 10)
    assert second == 8 * (200 + 300 + 20 + 30)  # the stage's input, layer 2's output and the extras
