"""The runtime's parts that need no MPI: schedules, routes between replicas, stage cutting, emulation,
batches, result assembly and the mpiexec command."""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from typing import Any

import pytest
import torch

from tapp_core.model.graph import MODEL_INPUT
from tapp_core.model.workload import RunSpec, workload_of
from tapp_core.model.zoo import build_traced_model
from tapp_core.plan.placement import even_shares, row_routes, split_ranges
from tapp_core.plan.plan import Plan, PlanError
from tapp_core.plan.schedules import Action, Async, GPipe, OneFOneB, schedule_for
from tapp_core.platform.cluster import parse_cluster
from tapp_core.runtime.batches import IGNORED_LABEL, IteratorBatches, SyntheticBatches, pad_batch
from tapp_core.runtime.emulation import Emulation
from tapp_core.runtime.jobs import MeasureJob, PlanSetup, PrepareJob, TrainJob
from tapp_core.runtime.optim import OptimizerConfig, make_optimizer, predicted_weights, stage_lr
from tapp_core.runtime.pool import check_runnable, mpiexec_command
from tapp_core.runtime.results import RankResult, assemble_measurement, assemble_reply, first_error
from tapp_core.runtime.stage import StageError, StageFactory, split_stages


def kinds(actions: list[Action]) -> str:
    return " ".join(f"{a.kind[0].upper()}{a.index}" for a in actions)


def test_gpipe_fills_then_drains_last_micro_batch_first() -> None:
    assert kinds(GPipe().compute_order(0, 2, 3, 1)) == "F0 F1 F2 B2 B1 B0 U0"
    assert kinds(GPipe().compute_order(1, 2, 2, 2)) == "F0 F1 B1 B0 U0 F2 F3 B3 B2 U1"


def test_one_f_one_b_keeps_at_most_stages_minus_stage_in_flight() -> None:
    assert kinds(OneFOneB().compute_order(0, 3, 4, 1)) == "F0 F1 F2 B0 F3 B1 B2 B3 U0"
    assert kinds(OneFOneB().compute_order(2, 3, 4, 1)) == "F0 B0 F1 B1 F2 B2 F3 B3 U0"
    for stage in range(3):
        in_flight = peak = 0
        for action in OneFOneB().compute_order(stage, 3, 8, 1):
            in_flight += {"forward": 1, "backward": -1, "update": 0}[action.kind]
            peak = max(peak, in_flight)
        assert peak == 3 - stage


def test_async_runs_across_steps_and_updates_after_each_steps_last_backward() -> None:
    actions = Async().compute_order(0, 2, 2, 2)
    assert kinds(actions) == "F0 F1 B0 F2 B1 U0 F3 B2 B3 U1"
    # F2 (step 1) runs before U0: on the old weights, hence weight stashing.
    assert Async().stashes_weights(0, 2, 2) and not Async().synchronous
    assert kinds(Async().compute_order(1, 2, 2, 2)) == "F0 B0 F1 B1 U0 F2 B2 F3 B3 U1"


@pytest.mark.parametrize(
    ("spec", "stages", "micro_batches", "delays"),
    [
        ("1f1b", 3, 1, [0, 0, 0]),
        ("gpipe", 3, 4, [0, 0, 0]),
        ("async:0", 3, 1, [0, 0, 0]),
        ("async:1", 3, 1, [1, 1, 0]),
        ("async:2", 3, 1, [2, 1, 0]),
        ("async", 3, 1, [2, 1, 0]),  # the default: as deep as the pipeline
        ("async:2", 4, 1, [2, 2, 1, 0]),
        ("async", 3, 4, [1, 1, 0]),  # with 4 micro-batches a step, a gradient waits for one update at most
    ],
)
def test_each_stages_delay_follows_from_the_schedule_and_the_bound(
    spec: str, stages: int, micro_batches: int, delays: list[int]
) -> None:
    name, _, bound = spec.partition(":")
    schedule = schedule_for(name, int(bound) if bound else None)
    assert [schedule.delay(s, stages, micro_batches) for s in range(stages)] == delays


@pytest.mark.parametrize(
    ("spec", "rates"),
    [("1f1b", [1, 1, 1]), ("async:0", [1, 1, 1]), ("async:1", [1 / 2, 1 / 2, 1]), ("async:2", [1 / 3, 1 / 2, 1])],
)
def test_a_stages_learning_rate_is_divided_by_its_delay_plus_one(spec: str, rates: list[float]) -> None:
    """3 stages, one micro-batch a step: the rates follow the delays (2, 1, 0 at K = 2); K = 0 and the synchronous
    schedules keep the configured rate on every stage, and so does every schedule with the compensation off."""
    name, _, bound = spec.partition(":")
    schedule = schedule_for(name, int(bound) if bound else None)
    on, off = OptimizerConfig(lr=0.06), OptimizerConfig(lr=0.06, stale_compensation=False)
    delays = [schedule.delay(s, 3, 1) for s in range(3)]
    assert [stage_lr(on, d) for d in delays] == pytest.approx([0.06 * r for r in rates])
    assert [stage_lr(off, d) for d in delays] == [0.06] * 3
    weight = torch.nn.Parameter(torch.zeros(2))
    assert make_optimizer([weight], on, delays[0]).param_groups[0]["lr"] == pytest.approx(0.06 * rates[0])


def test_stale_compensation_predicts_weights_as_many_updates_ahead_as_the_stages_delay() -> None:
    """The rule: w - d * lr * v (v: SGD's momentum velocity); d = 0 (every stage of a synchronous schedule, the last
    of an asynchronous one), no velocity yet, or SGD without momentum: the weights as they are."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5))
    sgd = make_optimizer([weight], OptimizerConfig(lr=0.1, momentum=0.9))
    for delay in (0, 1, 2):
        assert torch.equal(predicted_weights(sgd, {"w": weight}, delay)["w"], weight.detach())  # no velocity yet
    for _ in range(2):
        weight.grad = torch.randn(5)
        sgd.step()
    velocity = sgd.state[weight]["momentum_buffer"]
    for delay in (0, 1, 2):
        predicted = predicted_weights(sgd, {"w": weight}, delay)["w"]
        torch.testing.assert_close(predicted, weight.detach() - delay * 0.1 * velocity)
        assert not predicted.requires_grad and predicted.data_ptr() != weight.data_ptr()
    plain = torch.nn.Parameter(torch.randn(5))
    no_momentum = make_optimizer([plain], OptimizerConfig(lr=0.1, momentum=0.0))
    plain.grad = torch.randn(5)
    no_momentum.step()
    assert torch.equal(predicted_weights(no_momentum, {"w": plain}, 2)["w"], plain.detach())
    assert OptimizerConfig().stale_compensation, "on by default"


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match="gpipe, 1f1b, async"):
        schedule_for("zero-bubble")


def test_routes_between_unequal_groups_cover_every_row_once() -> None:
    routes = row_routes(6, even_shares(2), even_shares(3))
    assert split_ranges(6, even_shares(3))[1] == (2, 4)
    assert [(r.sender, r.receiver, r.lo, r.hi) for r in routes] == [
        (0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)
    ]  # fmt: skip
    uneven = row_routes(7, (0.5, 0.5), (0.6, 0.2, 0.2))
    assert sorted(i for r in uneven for i in range(r.lo, r.hi)) == list(range(7))


def test_split_reports_values_crossing_cuts_and_skipping_stages() -> None:
    traced = build_traced_model("tiny_branchy")
    _, graph = split_stages(traced, (0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2), 3)
    by_name = {v.name: v for v in graph.values}
    assert graph.values[0].producer == MODEL_INPUT and graph.stage_inputs[0] == (0,)
    skip = next(v for v in graph.values if v.producer == 0 and v.consumers == (1, 2))
    assert skip.sample_shape == (8, 16, 16) and skip.requires_grad
    assert graph.values[graph.output].producer == 2 and graph.values[graph.output].sample_shape == (10,)
    assert len(by_name) == len(graph.values)


def test_split_rejects_bad_assignments_with_the_layer_named() -> None:
    traced = build_traced_model("mlp")
    with pytest.raises(StageError, match="plan places 5 layers but the traced model has 6"):
        split_stages(traced, (0, 0, 0, 1, 1), 2)
    with pytest.raises(StageError, match=r"edge fc1 -> relu1 runs backward"):
        split_stages(traced, (0, 1, 0, 1, 1, 1), 2)
    with pytest.raises(StageError, match="stage 1 has no layer"):
        split_stages(traced, (0, 0, 0, 2, 2, 2), 3)


def test_stages_start_from_the_seeds_weights_whatever_ran_before() -> None:
    factory = StageFactory()
    stage = factory.stage("mlp", 0, (0, 0, 0, 1, 1, 1), 2, 0, torch.device("cpu"))
    first = {n: p.detach().clone() for n, p in stage.named_parameters().items()}
    with torch.no_grad():
        for p in stage.named_parameters().values():
            p.add_(1.0)
    again = factory.stage("mlp", 0, (0, 0, 0, 1, 1, 1), 2, 0, torch.device("cpu"))
    assert set(first) == {"fc1.weight", "fc1.bias"}
    for name, tensor in again.named_parameters().items():
        torch.testing.assert_close(tensor.detach(), first[name])


def test_a_stage_s_tensors_go_with_it() -> None:
    """The cached split keeps no reference to the stages copied from it (torch.fx makes a graph's last taker its
    owner): a rank that ran a plan does not hold its stage's parameters, gradients and optimiser state into the next."""
    factory = StageFactory()
    stage = factory.stage("mlp", 0, (0, 0, 0, 1, 1, 1), 2, 0, torch.device("cpu"))
    weight = weakref.ref(next(iter(stage.named_parameters().values())))
    del stage
    gc.collect()
    assert weight() is None


def test_a_model_is_traced_once_whatever_it_trains_on_and_with() -> None:
    factory = StageFactory()
    plain = workload_of("mlp")
    trained = dataclasses.replace(plain, optimizer=OptimizerConfig(name="AdamW"), data="synthetic")
    assert factory.traced(trained, 0) is factory.traced(plain, 0)
    assert factory.split(trained, 0, (0, 0, 0, 1, 1, 1), 2) is factory.split(plain, 0, (0, 0, 0, 1, 1, 1), 2)


def test_slowdown_sleeps_the_extra_compute() -> None:
    emulation = Emulation(enabled=True, slowdown=3.0)
    start = time.perf_counter()
    assert emulation.slow_down(0.02) == pytest.approx(0.06)
    assert time.perf_counter() - start >= 0.04
    assert Emulation(enabled=False, slowdown=3.0).slow_down(0.02) == 0.02


def test_slowdown_scales_the_work_not_the_wait_for_a_core() -> None:
    emulation = Emulation(enabled=True, slowdown=3.0)
    # 20 ms of wall time of which the process computed 10 ms (it waited for a core the rest): 3 x 10 ms in all
    start = time.perf_counter()
    assert emulation.slow_down(0.02, cpu_s=0.01) == pytest.approx(0.03)
    assert time.perf_counter() - start >= 0.01
    assert emulation.slow_down(0.02, cpu_s=0.05) == pytest.approx(0.06)  # several threads: the wall time
    assert emulation.slow_down(0.05, cpu_s=0.01) == pytest.approx(0.05)  # waited longer than 3 x the work: no sleep


def test_messages_on_one_link_queue_behind_each_other() -> None:
    cluster = parse_cluster(
        {
            "name": "c",
            "devices": [{"name": "a", "memory": "1GiB"}, {"name": "b", "memory": "1GiB"}],
            "links": {"bandwidth": "8Mbit/s", "latency": "1ms"},
        }
    )
    emulation = Emulation.for_rank(cluster, ["a", "b"], 0, enabled=True)
    before = time.monotonic()
    first = emulation.send_ready_at(1, 10_000)  # 1 ms + 10 kB at 1 MB/s = 11 ms
    second = emulation.send_ready_at(1, 10_000)
    assert first - before == pytest.approx(0.011, abs=2e-3)
    assert second - first == pytest.approx(0.011, abs=1e-6)
    assert Emulation.for_rank(cluster, ["a", "b"], 0, enabled=False).send_ready_at(1, 10_000) == 0.0


def test_synthetic_batches_are_a_function_of_seed_and_step() -> None:
    a, b = SyntheticBatches(4, seed=1), SyntheticBatches(4, seed=1)
    torch.testing.assert_close(a.get(3)[0], b.get(3)[0])
    assert not torch.equal(a.get(3)[0], a.get(4)[0])
    assert a.get(0)[0].shape == (4, 3, 32, 32) and a.get(0)[1].dtype == torch.int64


def test_iterator_batches_pad_the_last_batch_with_ignored_labels() -> None:
    data = [(torch.ones(4, 2), torch.zeros(4, dtype=torch.int64)), (torch.ones(3, 2), torch.ones(3, dtype=torch.int64))]
    batches = IteratorBatches(data, batch_size=4)
    x, y = batches.get(1)
    assert x.shape == (4, 2) and y.tolist() == [1, 1, 1, IGNORED_LABEL]
    assert batches.get(0)[1].tolist() == [0, 0, 0, 0]
    assert pad_batch(torch.ones(4, 2), torch.zeros(4), 4)[0].shape == (4, 2)


def rank(rank: int, stage: int, **fields: Any) -> RankResult:
    return RankResult(
        job=1, rank=rank, device=f"d{rank}", status=str(fields.pop("status", "ok")), stage=stage, **fields
    )


def test_measurement_takes_the_slowest_rank_per_step_and_medians_after_warmup() -> None:
    results = [
        rank(
            0,
            0,
            step_s=[9.0, 1.0, 2.0, 3.0],
            compute_s=[1, 0.5, 0.6, 0.7],
            wait_s=[0, 0.1, 0.2, 0.3],
            blocked_s=[0] * 4,
        ),
        rank(
            1,
            1,
            step_s=[9.0, 1.5, 1.0, 1.0],
            compute_s=[1, 0.9, 0.8, 0.7],
            wait_s=[0, 0.0, 0.0, 0.0],
            blocked_s=[0] * 4,
            loss=[4.0, 3.0, 2.0, 1.0],
        ),
        rank(2, -1, status="idle"),
    ]
    m = assemble_measurement("p", results, warmup=1, emulated=True, plan_stages=2)
    assert m.step_times_s == [9.0, 1.5, 2.0, 3.0]
    assert m.step_time_s == 2.0
    assert m.stage_compute_s == [0.6, 0.8]
    assert m.communication_s == {"d0": 0.2, "d1": 0.0}
    assert m.communication_share == pytest.approx((0.2 / 2.0 + 0.0) / 2)
    assert m.loss == 1.0 and m.emulated and m.ok


def test_the_reported_error_is_the_root_cause_not_the_aborts() -> None:
    results = [
        rank(0, 0, status="error", error_kind="aborted", error="rank 1 (d1, stage 1) failed: boom"),
        rank(1, 1, status="error", error_kind="exception", error="RuntimeError: boom"),
        rank(2, 2, status="error", error_kind="timeout", error="the plan ran past its time limit"),
    ]
    assert first_error(results) == "rank 1 (d1, stage 1) failed: RuntimeError: boom"
    assert (
        first_error([rank(0, 0, status="error", error_kind="out of memory", error="x")])
        == "out of memory on rank 0 (d0, stage 0): x"
    )
    assert first_error([rank(0, 0)]) is None


def test_each_job_type_gets_its_own_reply() -> None:
    setup = PlanSetup(
        plan=Plan("mlp", 8, 2, "gpipe", (0, 0, 0, 1, 1, 1), (("d0",), ("d1",))),
        spec=RunSpec.of("mlp", dataset="synthetic", optimizer=OptimizerConfig()),
        emulate=True,
    )
    prepared = assemble_reply(PrepareJob(id=3, model="mlp", seed=0, timeout_s=1), [rank(0, -1, setup_s=0.5)])
    assert (prepared.id, prepared.error, prepared.setup_s, prepared.measurement) == (3, None, 0.5, None)

    steps = {"step_s": [1.0, 1.0], "compute_s": [0.5, 0.5], "wait_s": [0.0, 0.0], "blocked_s": [0.0, 0.0]}
    first = rank(0, 0, parameters={"a": torch.zeros(1)}, **steps)
    last = rank(1, 1, parameters={"b": torch.ones(1)}, loss=[2.0, 1.0], **steps)
    job = MeasureJob(id=4, timeout_s=1, setup=setup, steps=2, warmup=1, collect_parameters=True)
    measured = assemble_reply(job, [first, last])
    assert measured.measurement is not None and measured.measurement.ok and measured.measurement.emulated
    assert measured.measurement.loss == 1.0 and measured.train is None
    assert sorted(measured.parameters) == ["a", "b"]
    uncollected = assemble_reply(MeasureJob(id=5, timeout_s=1, setup=setup, steps=2, warmup=1), [first, last])
    assert uncollected.parameters == {}

    epoch = {"train_loss": 1.5, "time_s": 2.0, "correct": 3, "samples": 4, "test_loss_sum": 2.0}
    train = TrainJob(id=6, timeout_s=1, setup=setup)
    trained = assemble_reply(train, [rank(0, 0, epochs=[epoch]), rank(1, 1, epochs=[epoch])])
    assert trained.train is not None and trained.measurement is None
    assert trained.train.test_accuracy == 0.75 and trained.train.synthetic and trained.train.plan_id == setup.plan.id


def test_mpiexec_puts_each_rank_on_its_devices_host() -> None:
    cluster = parse_cluster(
        {
            "name": "c",
            "devices": [
                {"name": "a", "memory": "1GiB", "host": "n1"},
                {"name": "b", "memory": "1GiB", "host": "n1"},
                {"name": "c", "memory": "1GiB", "host": "n2"},
            ],
            "links": {"bandwidth": "1Gbit/s", "latency": "1us"},
        }
    )
    command = mpiexec_command(cluster, ["prog"], mpiexec="mpiexec")
    assert command == ["mpiexec", "-n", "3", "-hosts", "n1:2,n2:1", "prog"]


def test_plans_that_cannot_run_are_refused_before_the_workers() -> None:
    cluster = parse_cluster(
        {
            "name": "c",
            "devices": [{"name": "a", "memory": "1GiB"}, {"name": "b", "memory": "1GiB"}],
            "links": {"bandwidth": "1Gbit/s", "latency": "1us"},
        }
    )
    with pytest.raises(PlanError, match="unknown device 'z'"):
        check_runnable(Plan("mlp", 8, 2, "gpipe", (0,) * 6, (("z",),)), cluster)
    with pytest.raises(PlanError, match="not divisible by 3"):
        check_runnable(Plan("mlp", 8, 3, "gpipe", (0,) * 6, (("a",),)), cluster)
    with pytest.raises(PlanError, match="device 'b' of stage 0 gets no sample of the micro-batch of 1"):
        check_runnable(Plan("mlp", 2, 2, "gpipe", (0,) * 6, (("a", "b"),)), cluster)


def test_stages_own_their_parameters_and_never_change_the_cached_model() -> None:
    """A stage moved to another device (``meta`` stands in for a GPU) or trained leaves the factory's cached
    model where and as it was, so the next plan's split still runs on the CPU (issue 12, failure 2)."""
    factory = StageFactory()
    cached = factory.traced("tiny_cnn", 0)
    before = {name: (t, t.detach().clone()) for name, t in cached.state_dict(keep_vars=True).items()}
    moved = factory.stage("tiny_cnn", 0, (0, 0, 0, 1, 1, 1, 1), 2, 0, torch.device("meta"))
    assert {p.device.type for p in moved.module.parameters()} == {"meta"}
    assert set(moved.named_state()) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}
    trained = factory.stage("tiny_cnn", 0, (0, 0, 0, 0, 0, 1, 1), 2, 1, torch.device("cpu"))
    with torch.no_grad():
        for p in trained.named_parameters().values():
            p.add_(1.0)
    for name, tensor in cached.state_dict(keep_vars=True).items():
        original, values = before[name]
        assert tensor is original and tensor.device.type == "cpu", name
        torch.testing.assert_close(tensor.detach(), values)
    shared = {id(t) for t in cached.state_dict(keep_vars=True).values()}
    assert not shared & {id(t) for t in trained.module.state_dict(keep_vars=True).values()}
    factory.stage("tiny_cnn", 0, (0, 0, 1, 1, 1, 1, 1), 2, 0, torch.device("cpu"))  # a new split traces on the CPU
