"""TAPP: features, the monotone repair, the policy's samples, and the search's rewards, seeds and checkpoints."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.measure.metrics import Measurement
from tapp_core.plan.plan import Plan
from tapp_core.planners import PlannerError, get_planner, planner_options
from tapp_core.planners.base import DEFAULT_MICRO_BATCHES
from tapp_core.planners.evaluation import PlanEvaluator
from tapp_core.planners.space import contiguous_plan
from tapp_core.planners.tapp import (
    MeasuredReward,
    Polish,
    SearchConfig,
    SearchOptions,
    SimulatedReward,
    TappPlanner,
    TappSearch,
    TimedPlan,
)
from tapp_core.planners.tapp.features import (
    ABSENT_SUCCESSOR,
    DEVICE_FEATURES,
    OP_VOCABULARY,
    device_features,
    layer_features,
    model_needs,
    op_index,
)
from tapp_core.planners.tapp.policy import PolicyConfig, TappPolicy
from tapp_core.planners.tapp.polish import polish_starts
from tapp_core.planners.tapp.repair import compact, monotone_groups
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.profile.library import LayerLibrary
from tests.test_planners_common import branchy_library, chain_library, small_cluster


def test_op_dictionary_maps_known_ops_and_falls_back_to_unknown() -> None:
    assert OP_VOCABULARY[op_index("Conv2d")] == "Convolution"
    assert OP_VOCABULARY[op_index("relu")] == "Relu"
    assert OP_VOCABULARY[op_index("AdaptiveAvgPool2d")] == "Pooling"
    assert OP_VOCABULARY[op_index("Linear")] == "FullyConnected"
    assert OP_VOCABULARY[op_index("ZeroPad2d")] == "Padding"
    assert OP_VOCABULARY[op_index("Sigmoid")] == "Unknown"


def test_layer_features_are_normalised_and_mark_absent_successors() -> None:
    library = branchy_library()
    features = layer_features(library)
    assert features.metrics.min() >= 0 and features.metrics.max() <= 1
    n = len(library.layers)
    assert features.successors[0].tolist() == pytest.approx([2 / n, 4 / n])  # stem feeds layers 1 and 3 (ids 2, 4)
    assert features.successors[n - 1].tolist() == pytest.approx([ABSENT_SUCCESSOR, ABSENT_SUCCESSOR])
    assert features.successors[1].tolist() == pytest.approx([3 / n, ABSENT_SUCCESSOR])


def test_repair_is_the_cheapest_monotone_relabeling() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        n, groups = 6, 3
        labels = rng.integers(0, groups, (1, n))
        weights = rng.uniform(0.1, 1.0, n)
        out = monotone_groups(labels, weights, groups)[0]
        assert all(a <= b for a, b in itertools.pairwise(out))
        cost = float(np.sum(weights * (out != labels[0])))
        best = min(
            float(np.sum(weights * (np.array(y) != labels[0])))
            for y in itertools.product(range(groups), repeat=n)
            if all(a <= b for a, b in itertools.pairwise(y))
        )
        assert math.isclose(cost, best)
    already = np.array([[0, 0, 1, 1, 3, 3]])
    assert monotone_groups(already, np.ones(6), 4).tolist() == already.tolist()
    assert compact(already).tolist() == [[0, 0, 1, 1, 2, 2]]


@pytest.mark.parametrize("make_library", [chain_library, branchy_library])
def test_every_sample_is_a_valid_plan_with_no_device_twice(make_library: Callable[[], LayerLibrary]) -> None:
    library, cluster = make_library(), small_cluster((1.0, 1.0, 0.5, 0.5), slow_pair=False)
    policy = TappPolicy(
        CostContext(library, cluster), PolicyConfig(groups=4, replica_prior=0.0), (1, 2, 4, 8), 64, "1f1b"
    )
    sample = policy.sample(64, torch.Generator().manual_seed(0))
    for plan in sample.plans:
        assert len(set(plan.devices)) == len(plan.devices)
        assert all(64 // plan.micro_batches >= len(devices) for devices in plan.stage_devices)
        validate(plan, CostContext(library, cluster))
    assert any(len(devices) > 1 for plan in sample.plans for devices in plan.stage_devices)  # replicas are sampled
    assert len({plan.n_stages for plan in sample.plans}) > 1
    assert sample.log_prob.shape == (64,) and sample.log_prob.requires_grad and float(sample.entropy.detach()) > 0


def test_scoring_a_plan_reproduces_it_and_gives_gradients() -> None:
    library, cluster = branchy_library(), small_cluster()
    policy = TappPolicy(CostContext(library, cluster), PolicyConfig(groups=3), (1, 2, 4), 64, "gpipe")
    sample = policy.sample(8, torch.Generator().manual_seed(1))
    scored = policy.score(sample.plans)
    assert [p.id for p in scored.plans] == [p.id for p in sample.plans]
    torch.autograd.backward(scored.log_prob.sum())
    assert policy.partition.share_logits.grad is not None


def _search(tmp: Path | None = None, rounds: int = 4, seed: int = 0, **options: Any) -> TappSearch:
    library, cluster = chain_library(), small_cluster()
    config = SearchConfig(
        rounds=rounds,
        samples_per_round=6,
        population=2,
        exploit_every=2,
        seed=seed,
        micro_batch_choices=(1, 2, 4),
        policy=PolicyConfig(groups=3),
        **options,
    )
    simulated = SimulatedReward(PlanEvaluator(CostContext(library, cluster)))
    return TappSearch(CostContext(library, cluster), config, simulated, checkpoint=tmp)


def _trace(search: TappSearch) -> list[tuple[float, float, int]]:
    return [(r.mean_reward, r.best_step_time_s, r.evaluations) for r in search.history]


def test_a_search_is_reproducible_from_its_seed() -> None:
    first, second, other = _search(seed=5), _search(seed=5), _search(seed=6)
    for search in (first, second, other):
        list(search.rounds())
    assert _trace(first) == _trace(second)
    assert first.best_plan == second.best_plan
    assert _trace(first) != _trace(other)


def test_a_resumed_search_continues_exactly_where_it_stopped(tmp_path: Path) -> None:
    straight = _search(rounds=6)
    list(straight.rounds())
    interrupted = _search(tmp_path / "search.pt", rounds=6)
    for _ in range(3):
        interrupted.run_round()
    library, cluster = interrupted.library, interrupted.cluster
    resumed = TappSearch.resume(
        tmp_path / "search.pt",
        CostContext(library, cluster),
        SimulatedReward(PlanEvaluator(CostContext(library, cluster))),
    )
    assert resumed.round == 3
    list(resumed.rounds())
    assert _trace(resumed) == _trace(straight)
    assert resumed.best_plan == straight.best_plan


def test_the_planner_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    library, cluster = chain_library(), small_cluster()
    path = tmp_path / "tapp.pt"
    options = {"population": 1, "samples_per_round": 4, "checkpoint": path}
    get_planner("tapp", rounds=2, **options).plan(CostContext(library, cluster))
    assert path.is_file()
    resumed = get_planner("tapp", rounds=4, resume=True, **options).plan(CostContext(library, cluster))
    straight = get_planner("tapp", rounds=4, population=1, samples_per_round=4).plan(CostContext(library, cluster))
    assert resumed.notes["rounds"] == 4
    assert resumed == straight and resumed.notes["evaluations"] == straight.notes["evaluations"]
    with pytest.raises(PlannerError, match=r"cannot resume, checkpoint .* does not exist"):
        get_planner("tapp", resume=True, checkpoint=tmp_path / "missing.pt").plan(CostContext(library, cluster))


class FakePool:
    """Measures a plan as its estimate times 1.1, and fails every plan with more than two stages."""

    def __init__(self, evaluator: PlanEvaluator) -> None:
        self.evaluator = evaluator
        self.measured: list[str] = []

    def measure(self, plan: Plan) -> Measurement:
        self.measured.append(plan.id)
        if plan.n_stages > 2:
            return Measurement.failed(plan.id, "rank 2 was killed")
        return Measurement(plan_id=plan.id, step_time_s=1.1 * self.evaluator.step_time(plan))


def test_failed_measurements_are_penalised_not_fatal() -> None:
    library, cluster = chain_library(), small_cluster()
    pool = FakePool(PlanEvaluator(CostContext(library, cluster)))
    plan = get_planner("tapp", reward="measured", rounds=3, population=1, samples_per_round=6, measurer=pool).plan(
        CostContext(library, cluster)
    )
    assert plan.n_stages <= 2
    assert plan.notes["measured_evaluations"] == len(set(pool.measured)) > 0
    measured, estimated = plan.notes["best_measured_step_time_s"], plan.notes["estimated_step_time_s"]
    assert isinstance(measured, float) and isinstance(estimated, float)
    assert math.isclose(measured, 1.1 * estimated)


def test_hybrid_measures_only_the_best_candidates_of_its_last_rounds() -> None:
    library, cluster = chain_library(), small_cluster()
    pool = FakePool(PlanEvaluator(CostContext(library, cluster)))
    search = TappPlanner(
        reward="hybrid", rounds=6, measured_rounds=2, measured_per_round=1, population=2, samples_per_round=5
    ).search(CostContext(library, cluster), measurer=pool)
    phases = [r.phase for r in search.rounds()]
    assert phases == ["simulated"] * 4 + ["measured"] * 2
    assert 1 <= len(set(pool.measured)) <= 2 * 2 * 1  # distinct plans; a near-best one runs more rounds
    assert search.best_plan is not None and math.isfinite(search.best_time("measured"))
    search.finish()
    assert search.polish_gain is None  # a measured best is not polished on the cost model


@pytest.mark.parametrize("measured_rounds", [1, 2])
def test_only_the_last_round_screens_its_plans_without_confirming_them(measured_rounds: int) -> None:
    library, cluster = chain_library(), small_cluster()
    pool = FakePool(PlanEvaluator(CostContext(library, cluster)))
    search = TappPlanner(
        reward="hybrid", rounds=3, measured_rounds=measured_rounds, population=2, samples_per_round=5
    ).search(CostContext(library, cluster), measurer=pool)
    rounds = list(search.rounds())
    before_final = len(pool.measured)
    assert [r.phase for r in rounds][-measured_rounds:] == ["measured"] * measured_rounds
    if measured_rounds == 1:  # its final race follows: each plan one round, confirmed by that race
        assert pool.measured and len(pool.measured) == len(set(pool.measured))
    else:  # the first measured plan of an earlier round is raced for more rounds before the policy learns from it
        assert len(pool.measured) > len(set(pool.measured))
    search.finish()
    assert len(pool.measured) > before_final  # the final race


@pytest.mark.parametrize("warm_start", [False, True])
def test_a_hybrid_search_out_of_time_still_fine_tunes_on_measurements(warm_start: bool) -> None:
    library, cluster = chain_library(), small_cluster()
    pool = FakePool(PlanEvaluator(CostContext(library, cluster)))
    search = TappPlanner(
        reward="hybrid",
        rounds=50,
        measured_rounds=2,
        population=1,
        samples_per_round=4,
        time_limit_s=1e-9,
        warm_start=warm_start,
    ).search(CostContext(library, cluster), measurer=pool)
    phases = [r.phase for r in search.rounds()]
    # The warm start spends the time limit before the first round: no simulated round is left then.
    assert phases == ["simulated"] * (not warm_start) + ["measured", "measured"]
    assert pool.measured


def test_measured_reward_fails_plans_that_do_not_fit_without_running_them() -> None:
    library, cluster = chain_library(), small_cluster()
    pool = FakePool(PlanEvaluator(CostContext(library, cluster)))
    reward = MeasuredReward(pool, CostContext(library, cluster))
    plan = get_planner("single").plan(CostContext(library, cluster))
    # 3 devices but 2 samples in each of its 32 micro-batches: one device would get none
    too_big = dataclasses.replace(plan, stage_devices=(("d0", "d1", "d2"),), micro_batches=32)
    assert reward.step_times([too_big]) == [math.inf]
    assert pool.measured == []


def test_polish_leaves_a_plan_no_boundary_move_or_micro_batch_count_improves() -> None:
    search = _search(rounds=2)
    list(search.rounds())
    before = search.best_time("simulated")
    gain = search.polish(span=1)
    best = search.best["simulated"]
    assert best is not None
    after, plan = best.step_time_s, best.plan
    assert after <= before and math.isclose(gain, 1 - after / before)
    evaluator = search.simulated
    cuts = [plan.stage_of_layer.index(k) for k in range(1, plan.n_stages)]
    n = len(plan.stage_of_layer)
    for m in (1, 2, 4):
        assert evaluator.step_times([dataclasses.replace(plan, micro_batches=m)])[0] >= after
    for j, cut in enumerate(cuts):
        for moved in (cut - 1, cut + 1):
            others = cuts[:j] + cuts[j + 1 :]
            if 0 < moved < n and moved not in others:
                stages = tuple(int(x) for x in np.searchsorted(sorted([*others, moved]), np.arange(n), side="right"))
                if len(set(stages)) == plan.n_stages:
                    assert evaluator.step_times([dataclasses.replace(plan, stage_of_layer=stages)])[0] >= after


def _polish(search: TappSearch) -> Polish:
    config = search.config
    return Polish(search.context, search.simulated, config.micro_batch_choices, config.schedules, lambda: False)


def _relay_case() -> TappSearch:
    """Two equal devices and a slower spare one, where the optimum (the oracle's) ends in a one-layer stage on the
    spare device: the extra stage gives the two before it one more micro-batch in flight under 1F1B."""
    library = chain_library([1, 2, 1, 8, 2, 8, 2, 8, 2, 4])
    speeds = {"a": 1.0, "b": 1.0, "s": 0.5}
    cluster = parse_cluster(
        {
            "name": "relay",
            "devices": [{"name": n, "speed": v, "memory": "4GiB"} for n, v in speeds.items()],
            "links": {"bandwidth": "1Gbit/s", "latency": "50us"},
        }
    )
    config = SearchConfig(
        rounds=1, population=1, micro_batch_choices=(2, 4, 8), policy=PolicyConfig(groups=3), warm_start=False
    )
    return TappSearch(
        CostContext(library, cluster), config, SimulatedReward(PlanEvaluator(CostContext(library, cluster)))
    )


def test_relay_moves_insert_a_one_layer_stage_on_unused_devices() -> None:
    search = _relay_case()
    two = contiguous_plan(search.library, (6,), (("a",), ("b",)), 8, "1f1b", 64)
    moves = _polish(search).relay_moves(two, span=2)
    assert moves
    for move in moves:
        validate(move, CostContext(search.library, search.cluster))
        assert move.n_stages == 3 and move.micro_batches == 8
        relay = move.stage_devices[1]
        assert relay == ("s",) and move.stage_devices[0] == ("a",) and move.stage_devices[2] == ("b",)
        assert move.stage_of_layer.count(1) == 1
    relay_layers = sorted(move.stage_of_layer.index(1) for move in moves)
    assert relay_layers == [3, 4, 5, 6, 7, 8]  # beside the cut at 6 moved by 0, 1 or 2 layers either way
    whole = contiguous_plan(search.library, (6,), (("a",), ("b", "s")), 8, "1f1b", 64)
    assert _polish(search).relay_moves(whole, span=2) == []  # no device left over


def test_polish_finds_the_relay_stage_the_boundaries_alone_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    search = _relay_case()
    oracle = get_planner("oracle", schedules=("1f1b",), micro_batches=(2, 4, 8)).plan(
        CostContext(search.library, search.cluster)
    )
    assert oracle.n_stages == 3 and oracle.stage_of_layer.count(2) == 1  # the optimum ends in a relay
    optimum = search.simulated.step_times([oracle])[0]
    two = contiguous_plan(search.library, (6,), (("a",), ("b",)), 8, "1f1b", 64)
    search.best["simulated"] = TimedPlan(search.simulated.step_times([two])[0], two)
    with monkeypatch.context() as patch:
        patch.setattr(Polish, "relay_moves", lambda self, plan, span: [])
        search.polish()
    assert search.best_time("simulated") > optimum * 1.1  # stuck with two stages
    search.polish()
    assert search.best_time("simulated") == pytest.approx(optimum)


def test_polish_starts_from_every_policy_s_best_distinct_plans_and_the_warm_start() -> None:
    search = _search(rounds=6)
    list(search.rounds())
    starts = polish_starts(search.remembered("simulated"), 100)
    times = [start.step_time_s for start in starts]
    assert times == sorted(times) and times[0] == search.best_time("simulated")
    assert len({start.plan.id for start in starts}) == len(starts)
    best = search.best["simulated"]
    assert best is not None
    remembered = {e.plan.id for m in search.members for e in m.elite["simulated"]}
    warm = {c.timed.plan.id for c in search.warm}
    assert warm and {start.plan.id for start in starts} == remembered | warm | {best.plan.id}
    search.polish()
    assert search.best_time("simulated") <= min(times)


def test_the_planner_s_search_options_are_the_one_set_with_its_defaults() -> None:
    library, cluster = chain_library(), small_cluster()
    defaults = SearchOptions().option_values()
    listed = planner_options("tapp")
    assert {name: listed[name] for name in defaults} == defaults
    config = TappPlanner(seed=3, micro_batches=(1, 2, 4, 5)).config(CostContext(library, cluster), budget=100)
    assert config.option_values() == defaults
    assert (config.seed, config.budget, config.micro_batch_choices, config.policy.groups) == (3, 100, (1, 2, 4), 3)
    assert SearchConfig.from_dict(config.to_dict()) == config  # as a checkpoint keeps it
    assert SearchConfig().micro_batch_choices == DEFAULT_MICRO_BATCHES


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"reward": "magic"}, "reward must be one of simulated, measured, hybrid, got 'magic'"),
        ({"rounds": 0}, "rounds must be at least 1, got 0"),
        ({"measured_per_round": 0}, "measured_per_round must be at least 1, got 0"),
        ({"measured_rounds": -1}, "measured_rounds must be at least 0, got -1"),
    ],
)
def test_a_bad_search_option_is_one_clear_error(options: dict[str, Any], message: str) -> None:
    with pytest.raises(PlannerError, match=re.escape(f"TAPP search: {message}")):
        get_planner("tapp", **options)
    with pytest.raises(PlannerError, match=re.escape(message)):
        SearchConfig(**options)


def test_finish_polishes_only_when_asked_and_nothing_was_measured() -> None:
    polished, unpolished = _search(rounds=2), _search(rounds=2, polish=False)
    for search in (polished, unpolished):
        list(search.rounds())
    gain = polished.finish().notes["polish_gain"]
    assert polished.polish_gain is not None and gain == polished.polish_gain
    assert polished.best_time("simulated") <= unpolished.best_time("simulated")
    assert unpolished.finish().notes["polish_gain"] == 0.0 and unpolished.polish_gain is None


def _islands(isolated: bool) -> Cluster:
    """Two fast devices and two islands of slow ones (joined by a 30 Mbit/s link); ``fast`` sits behind 40 Mbit/s
    links when ``isolated``, ``peer`` is always well connected; ``tiny`` has too little memory for the model."""
    devices = [
        {"name": "fast", "speed": 4.0, "memory": "8GiB"},
        {"name": "peer", "speed": 2.0, "memory": "8GiB"},
        {"name": "a0", "speed": 1.0, "memory": "8GiB"},
        {"name": "a1", "speed": 1.0, "memory": "8GiB"},
        {"name": "tiny", "speed": 1.0, "memory": "1MiB"},
    ]
    overrides = [{"between": ["a0", "a1", "peer"], "bandwidth": "10Gbit/s", "latency": "50us"}]
    overrides += [{"between": [x, "tiny"], "bandwidth": "30Mbit/s", "latency": "500us"} for x in ("a0", "a1", "peer")]
    if isolated:
        overrides += [
            {"between": ["fast", x], "bandwidth": "40Mbit/s", "latency": "500us"} for x in ("peer", "a0", "a1", "tiny")
        ]
    else:
        overrides += [{"between": ["fast", "peer"], "bandwidth": "10Gbit/s", "latency": "50us"}]
    return parse_cluster(
        {
            "name": "islands",
            "devices": devices,
            "links": {"bandwidth": "1Gbit/s", "latency": "50us", "overrides": overrides},
        }
    )


def test_device_features_tell_a_fast_isolated_device_from_a_connected_one() -> None:
    library = chain_library()
    needs = model_needs(library, (1, 2, 4), 64, "1f1b")
    column = {name: i for i, name in enumerate(DEVICE_FEATURES)}
    isolated = device_features(_islands(True), needs)
    connected = device_features(_islands(False), needs)
    fast, peer, tiny = 0, 1, 4
    for name in ("link_to_fastest", "best_link", "mean_link"):
        assert isolated[fast, column[name]] < connected[fast, column[name]], name
    for name in ("best_link", "mean_link"):
        # The slowest link out of the others (the 30 Mbit/s one to tiny) must not make them look worse connected.
        assert isolated[fast, column[name]] < isolated[peer, column[name]], name
    assert isolated[fast, column["communication"]] > connected[fast, column["communication"]]
    assert isolated[fast, column["speed"]] == 0 and isolated[peer, column["speed"]] < 0
    assert isolated[fast, column["fits_alone"]] == 1 and isolated[tiny, column["fits_alone"]] == 0
    assert isolated[tiny, column["memory"]] < isolated[fast, column["memory"]]
    assert isolated.abs().max() <= 1


def test_a_fresh_policy_samples_single_device_plans() -> None:
    library = chain_library()
    cluster = small_cluster(tuple(1.0 - 0.1 * i for i in range(8)), slow_pair=False)
    policy = TappPolicy(CostContext(library, cluster), PolicyConfig(groups=8), (1, 2, 4), 64, "1f1b")
    plans = policy.sample(400, torch.Generator().manual_seed(0)).plans
    stages = {plan.n_stages for plan in plans}
    assert {1, 2, 8} <= stages
    alone = [plan for plan in plans if len(plan.devices) == 1]
    assert len(alone) >= 10 and all(plan.n_stages == 1 for plan in alone)
    assert {plan.devices[0] for plan in alone} >= {"d0"}, "the fastest device alone is among them"
    assert policy.can_express(alone[0]) and all(validate(plan, CostContext(library, cluster)) is None for plan in alone)


def test_the_warm_start_is_in_the_notes_and_can_be_switched_off() -> None:
    library, cluster = chain_library(), _islands(True)
    warm = get_planner("tapp", rounds=1, population=2, samples_per_round=4, polish=False).plan(
        CostContext(library, cluster)
    )
    cold = get_planner("tapp", rounds=1, population=2, samples_per_round=4, polish=False, warm_start=False).plan(
        CostContext(library, cluster)
    )
    candidates = warm.notes["warm_start"]
    assert isinstance(candidates, dict)
    assert {"single:fast", "single:peer", "bsp", "pipedream", "autoddl"} <= set(candidates)
    assert "single:tiny" not in candidates, "the model does not fit tiny alone"
    assert "even" not in candidates, "the even split puts a stage on tiny, where it does not fit"
    assert warm.notes["warm_start_winner"] == min(candidates, key=candidates.__getitem__)
    assert warm.notes["estimated_step_time_s"] <= min(candidates.values())
    assert float(warm.notes["warm_start_s"]) > 0  # type: ignore[arg-type]
    assert cold.notes["warm_start"] == {} and cold.notes["warm_start_winner"] is None
    assert cold.notes["warm_start_s"] == 0


def test_the_time_limit_covers_the_polish() -> None:
    spent, left = (_search(rounds=2, warm_start=False, time_limit_s=1000.0) for _ in range(2))
    for search in (spent, left):
        list(search.rounds())
    spent.elapsed_s = 1000.0  # the rounds used up the whole limit
    assert spent.polish() == 0.0 and spent.polish_s < 1.0
    assert left.polish() > 0.0, "with time left the same polish improves the plan"
    assert left.elapsed_s > left.history[-1].elapsed_s, "the polish's time counts against the limit"


def test_a_search_out_of_time_skips_the_rounds_and_the_polish() -> None:
    library, cluster = chain_library(), _islands(True)
    plan = get_planner("tapp", rounds=50, population=2, samples_per_round=4, time_limit_s=1e-6).plan(
        CostContext(library, cluster)
    )
    assert plan.notes["rounds"] == 0, "the warm start used up the rounds' share of the limit"
    assert plan.notes["polish_gain"] == 0.0
    warm = plan.notes["warm_start"]
    assert isinstance(warm, dict) and plan.notes["estimated_step_time_s"] == min(warm.values())


def test_a_polish_stopped_early_keeps_the_best_it_found() -> None:
    search = _search(rounds=3, warm_start=False)
    list(search.rounds())
    starts = polish_starts(search.remembered("simulated"))
    evaluations = search.simulated.evaluations
    polish = Polish(
        search.context,
        search.simulated,
        search.config.micro_batch_choices,
        search.config.schedules,
        lambda: search.simulated.evaluations >= evaluations + 30,
    )
    best = polish.run(starts[0], starts)
    assert best.step_time_s <= starts[0].step_time_s
    assert search.simulated.evaluations < evaluations + 30 + 400, "it stopped soon after its budget ran out"
