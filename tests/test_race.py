"""Races: the statistics (order-statistics intervals, best group, stopping) on synthetic samples with known answers,
and a real race of tiny plans on MPI workers. No timing bars: bench/race_repeatability.py prints those."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tapp_core.cost.context import CostContext
from tapp_core.measure.metrics import Measurement, host_overloaded
from tapp_core.measure.races import (
    MAX_ROUNDS,
    SEPARATED,
    TIME_BUDGET,
    OtherWork,
    RaceOptions,
    RoundSteps,
    pooled_rounds,
    rounds_count,
    run_race,
)
from tapp_core.measure.stats import best_group, median_interval, order_statistic_rank, paired_ratio_interval, separated
from tapp_core.plan.plan import Plan
from tapp_core.planners import get_planner
from tapp_core.planners.tapp import MeasuredReward, TappPlanner
from tapp_core.planners.tapp.search import FINAL_CANDIDATES
from tapp_core.platform.cluster import load_cluster, parse_cluster
from tapp_core.platform.hosts import rank_cores
from tapp_core.runtime import WorkerPool
from tapp_core.runtime.pool_race import race
from tests.test_planners_common import chain_library, small_cluster
from tests.test_runtime_faulty_models import FAULT_LAYER_STAGES

MLP_LAYERS = 6


def mlp_plan(*stage_devices: tuple[str, ...], micro_batches: int = 2) -> Plan:
    """An mlp plan over ``stage_devices``, its layers cut evenly."""
    stages = len(stage_devices)
    stage_of_layer = tuple(layer * stages // MLP_LAYERS for layer in range(MLP_LAYERS))
    return Plan("mlp", 16, micro_batches, "1f1b", stage_of_layer, stage_devices)


ONE = mlp_plan(("cpu0",))
TWO = mlp_plan(("cpu0",), ("cpu1",))
THREE = mlp_plan(("cpu0",), ("cpu1",), ("cpu2",))


# --- statistics -----------------------------------------------------------------------------------------------


def test_order_statistic_intervals_have_their_exact_binomial_coverage() -> None:
    assert order_statistic_rank(4) == (1, 0.875)  # the whole range of 4 covers less than 90 %
    assert order_statistic_rank(5) == (1, 0.9375)
    assert order_statistic_rank(8) == (2, 1 - 2 * 9 / 256)
    assert order_statistic_rank(13) == (4, 1 - 2 * (1 + 13 + 78 + 286) / 2**13)
    interval = median_interval([0.5, 0.1, 0.4, 0.2, 0.3, 0.9, 0.7, 0.8])
    assert (interval.low, interval.median, interval.high) == (0.2, 0.45, 0.8)
    assert interval.half_width == pytest.approx(0.3)


def test_the_interval_covers_the_true_median_of_a_bimodal_distribution_as_often_as_it_says() -> None:
    """Two modes (0.30 s and 0.39 s, as this host's step times); the true median is 0.30's mode's upper end."""
    draw = random.Random(7)

    def step() -> float:
        return draw.gauss(0.30, 0.01) if draw.random() < 0.6 else draw.gauss(0.39, 0.01)

    population = sorted(step() for _ in range(200_000))
    true_median = population[len(population) // 2]
    trials = 2000
    intervals = [median_interval([step() for _ in range(10)]) for _ in range(trials)]
    covered = sum(1 for iv in intervals if iv.low <= true_median <= iv.high)
    assert intervals[0].coverage == pytest.approx(0.9785, abs=1e-4)
    assert covered / trials > 0.96  # 0.9785 expected; the estimate's standard error is 0.003


def test_paired_ratios_cancel_what_the_rounds_share() -> None:
    slow = {1: 2.0, 2: 4.0, 3: 6.0, 4: 2.2}
    fast = {1: 1.0, 2: 2.0, 3: 3.0, 5: 9.9}  # round 4 and 5 unpaired: left out
    ratio = paired_ratio_interval(slow, fast)
    assert ratio is not None and (ratio.low, ratio.median, ratio.high, ratio.samples) == (2.0, 2.0, 2.0, 3)
    assert paired_ratio_interval(slow, {9: 1.0}) is None


def test_the_best_group_is_every_interval_overlapping_the_best() -> None:
    a, b, c = median_interval([1.0, 1.1, 1.2]), median_interval([1.15, 1.3, 1.4]), median_interval([1.3, 1.5, 1.6])
    assert best_group([c, None, a, b]) == [2, 3]
    assert not separated([a, b, c])
    assert separated([a, c]) and not separated([a]) and best_group([None]) == []


def test_an_overloaded_host_is_one_where_others_took_its_cpu_else_one_with_a_high_load() -> None:
    assert host_overloaded(0.4, 0.5, 0.5, cpus=2, ranks=3)  # others took 40 % of the CPU time
    assert not host_overloaded(0.1, 5.0, 5.0, cpus=2, ranks=3)  # the load was the race's own (and the last one's)
    assert not host_overloaded(math.nan, 0.5, 3.5, cpus=2, ranks=3)  # not counted: the load average decides
    assert host_overloaded(math.nan, 2.5, 3.0, cpus=2, ranks=3)
    assert host_overloaded(math.nan, 1.0, 5.5, cpus=2, ranks=3)
    assert not host_overloaded(math.nan, math.nan, 9.0, cpus=2, ranks=3)


def test_the_cpu_time_of_other_processes_is_counted() -> None:
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"]
    )
    try:
        others = OtherWork(lambda: [])
        time.sleep(1.0)
        mine = OtherWork(lambda: [busy.pid])
        time.sleep(0.2)
        share, share_without_it = others.share(), mine.share()
    finally:
        busy.wait()
    cpus = os.cpu_count() or 1
    assert share > 0.5 / cpus  # a busy loop of about one core, counted as another's work
    assert share_without_it < share  # named as ours, it is not


# --- the protocol on synthetic rounds -------------------------------------------------------------------------


class Synthetic:
    """A round runner with known answers: each plan's step time is its base time times a per-round noise."""

    def __init__(self, base: dict[str, float], noise: float = 0.02, fail: dict[str, int] | None = None) -> None:
        self.base, self.noise, self.fail = base, noise, fail or {}
        self.calls: list[str] = []
        self.draw = random.Random(3)

    def __call__(self, plan: Plan) -> Measurement:
        self.calls.append(plan.id)
        runs = self.calls.count(plan.id)
        if self.fail.get(plan.id) == runs:
            return Measurement.failed(plan.id, "rank 1 was killed")
        seconds = self.base[plan.id] * (1 + self.noise * (2 * self.draw.random() - 1))
        return Measurement(plan_id=plan.id, step_time_s=seconds, step_times_s=[9.0, seconds], extra={"warmup": 1})


def test_a_clear_winner_stops_the_race_at_its_first_verdict() -> None:
    runner = Synthetic({ONE.id: 1.0, TWO.id: 2.0, THREE.id: 3.0})
    result = run_race(runner, [ONE, TWO, THREE], RaceOptions(min_rounds=5, max_rounds=20))
    assert (result.rounds, result.stop) == (5, SEPARATED)
    assert result.winner() == ONE and result.best_group() == [ONE]
    assert [m.rounds for m in result.measurements] == [5, 5, 5]
    for measured in result.measurements:
        interval = measured.interval
        assert interval is not None and interval.low <= measured.step_time_s <= interval.high
        assert measured.step_times_s == list(measured.round_step_times_s.values())  # warm-ups left out
    assert all(sorted(order) == sorted([ONE.id, TWO.id, THREE.id]) for order in result.orders)
    assert len({tuple(order) for order in result.orders}) > 1  # the order changes from round to round


def test_plans_inside_the_noise_race_on_the_loser_stops_and_fewer_devices_win_the_tie() -> None:
    runner = Synthetic({THREE.id: 1.0, ONE.id: 1.005, TWO.id: 1.5})
    result = run_race(runner, [THREE, ONE, TWO], RaceOptions(min_rounds=5, max_rounds=9))
    assert (result.rounds, result.stop) == (9, MAX_ROUNDS)
    assert runner.calls.count(TWO.id) == 5  # wholly slower after 5 rounds: it stopped running
    assert {p.id for p in result.best_group()} == {ONE.id, THREE.id}
    assert result.winner() == ONE  # one device against three, at the same speed
    ratio = result.ratio(TWO.id, THREE.id)
    assert ratio is not None and ratio.samples == 5 and ratio.low <= 1.5 / 1.0 * 1.05


def test_a_failing_plan_is_reported_failed_and_the_race_goes_on() -> None:
    runner = Synthetic({ONE.id: 1.0, TWO.id: 1.01, THREE.id: 0.5}, fail={THREE.id: 2})
    result = run_race(runner, [ONE, TWO, THREE], RaceOptions(min_rounds=3, max_rounds=4))
    failed = result.measurement(THREE.id)
    assert not failed.ok and failed.error == "failed in round 2: rank 1 was killed"
    assert runner.calls.count(THREE.id) == 2 and result.rounds == 4
    assert {p.id for p in result.best_group()} == {ONE.id, TWO.id}


def test_identical_plans_race_once_and_the_budget_ends_a_race() -> None:
    runner = Synthetic({ONE.id: 1.0, TWO.id: 1.0})
    twin = dataclasses.replace(ONE, planner="oracle")
    result = run_race(runner, [ONE, twin, TWO], RaceOptions(min_rounds=1, max_rounds=50, budget_s=1e-9))
    assert [p.id for p in result.plans] == [ONE.id, TWO.id]
    assert (result.rounds, result.stop) == (1, TIME_BUDGET)
    assert result.measurement(twin.id) is result.measurement(ONE.id)


def test_rounds_of_two_races_pool_into_one_interval() -> None:
    first = run_race(Synthetic({ONE.id: 1.0}), [ONE], RaceOptions(min_rounds=3, max_rounds=3))
    second = run_race(Synthetic({ONE.id: 1.0}), [ONE], RaceOptions(min_rounds=5, max_rounds=5))
    pooled = pooled_rounds(first.measurements[0], second.measurements[0])
    assert pooled.rounds == 8 and sorted(pooled.round_step_times_s) == list(range(1, 9))
    expected = median_interval([*first.measurements[0].step_times_s, *second.measurements[0].step_times_s])
    assert (pooled.step_time_s, pooled.interval_low_s, pooled.interval_high_s) == (
        expected.median,
        expected.low,
        expected.high,
    )


def test_ranks_are_pinned_only_where_every_thread_has_a_core() -> None:
    local = load_cluster("local").devices  # three one-thread ranks
    assert [rank_cores(local, r, [0, 1, 2, 3]) for r in range(3)] == [(0,), (1,), (2,)]
    assert rank_cores(local, 0, [0, 1]) is None
    two_hosts = parse_cluster(
        {
            "name": "two",
            "devices": [
                {"name": "a", "memory": "1GiB", "threads": 2, "host": "n1"},
                {"name": "b", "memory": "1GiB", "threads": 2, "host": "n2"},
                {"name": "c", "memory": "1GiB", "threads": 1, "host": "n1"},
            ],
            "links": {"bandwidth": "1Gbit/s", "latency": 0},
        }
    )
    assert [rank_cores(two_hosts.devices, r, [4, 5, 6]) for r in range(3)] == [(4, 5), (4, 5), (6,)]


# --- the search's measured reward and final choice --------------------------------------------------------------


class FlatPool:
    """Every plan measures ``seconds[plan.id]`` (default 1.0) within +-1 %: a search's plans all tie unless told."""

    def __init__(self, seconds: dict[str, float] | None = None) -> None:
        self.seconds = seconds or {}
        self.calls: list[str] = []
        self.draw = random.Random(11)

    def measure(self, plan: Plan) -> Measurement:
        self.calls.append(plan.id)
        noise = 1 + 0.01 * (2 * self.draw.random() - 1)
        return Measurement(plan_id=plan.id, step_time_s=self.seconds.get(plan.id, 1.0) * noise)


def test_a_reward_near_the_best_gets_more_rounds_before_the_policy_trusts_it() -> None:
    library, cluster = chain_library(), small_cluster()
    first, far, near = (get_planner(name).plan(CostContext(library, cluster)) for name in ("single", "bsp", "even"))
    pool = FlatPool({first.id: 1.0, far.id: 2.0, near.id: 1.05})
    reward = MeasuredReward(pool, CostContext(library, cluster), confirm=RaceOptions(min_rounds=3, max_rounds=3))

    reward.step_times([first])  # the first plan is the best so far: confirmed alone
    assert pool.calls.count(first.id) == 1 + 3
    reward.step_times([far, far])  # twice the best: its one round is its reward
    assert pool.calls.count(far.id) == 1 and far.id not in reward.confirmed
    (seconds,) = reward.step_times([near])  # within 10 % of the best: raced against it for 3 more rounds
    assert pool.calls.count(near.id) == 1 + 3 and pool.calls.count(first.id) == 1 + 3 + 3
    assert reward.measurements[near.id].rounds == 4 and reward.measurements[first.id].rounds == 7
    assert seconds == reward.measurements[near.id].step_time_s == pytest.approx(1.05, rel=0.02)
    assert reward.step_times([near]) == [seconds] and pool.calls.count(near.id) == 4  # known: not measured again


def test_a_measured_search_ends_in_a_race_won_by_the_lowest_pooled_median_among_the_tied() -> None:
    library, cluster = chain_library(), small_cluster()
    pool = FlatPool()  # every plan ties within the noise
    search = TappPlanner(reward="hybrid", rounds=4, measured_rounds=2, population=2, samples_per_round=5).search(
        CostContext(library, cluster), measurer=pool
    )
    list(search.rounds())
    chosen = search.finish()
    race = search.final_race
    # the best by measurement and by estimate, the warm start's best, then the best of each schedule while there is room
    assert race is not None and 2 <= len(race.plans) <= FINAL_CANDIDATES
    assert race.plans[0].id in search.measured.measurements  # a measured plan races first
    assert str(chosen.notes["chosen_by"]).startswith(f"race of {len(race.plans)} candidates")
    assert chosen.planner == "tapp"
    summary = chosen.notes["final_race"]
    assert isinstance(summary, dict) and summary["winner"] == chosen.id
    tied = race.best_group()
    assert len(tied) > 1 and chosen.id in {p.id for p in tied}
    pooled = search.measured.step_times(tied)  # every round of each, the search's and the race's
    assert pooled[[p.id for p in tied].index(chosen.id)] == min(pooled)


def test_a_search_that_measured_nothing_is_chosen_by_the_cost_model() -> None:
    library, cluster = chain_library(), small_cluster()
    search = TappPlanner(rounds=2, population=1, samples_per_round=4).search(CostContext(library, cluster))
    list(search.rounds())
    assert search.finish().notes["chosen_by"] == "cost model" and search.final_race is None


# --- a real race on MPI workers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(load_cluster("local")) as workers:
        yield workers


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_real_race_of_tiny_plans_on_the_workers(pool: WorkerPool) -> None:
    raising = Plan(
        "tests.test_runtime_faulty_models:raising",
        16,
        2,
        "gpipe",
        FAULT_LAYER_STAGES,
        (("cpu0",), ("cpu1",), ("cpu2",)),
    )
    seen: list[int] = []
    result = race(
        pool,
        [ONE, THREE, raising, ONE],
        options=RaceOptions(min_rounds=2, max_rounds=3, eliminate=False),
        steps=RoundSteps(steps=2, warmup=1, timeout_s=60),
        on_round=lambda number, _: seen.append(number),
    )
    assert [p.id for p in result.plans] == [ONE.id, THREE.id, raising.id]
    assert 2 <= result.rounds <= 3 and seen == list(range(1, result.rounds + 1))
    failed = result.measurement(raising.id)
    assert not failed.ok and "failed in round 1" in (failed.error or "") and "deliberate failure" in failed.error
    for plan in (ONE, THREE):
        measured = result.measurement(plan.id)
        assert measured.ok, measured.error
        assert measured.rounds == result.rounds and len(measured.step_times_s) == 2 * result.rounds
        interval = measured.interval
        assert interval is not None and interval.low <= measured.step_time_s <= interval.high
        assert math.isfinite(measured.load_before) and math.isfinite(measured.load_after)
        assert measured.host_cpus >= 1 and measured.host_ranks == 3 and measured.emulated
        assert 0.0 <= measured.other_cpu_share <= 1.0  # the ranks' own CPU time is not counted as others'
    assert result.winner() in (ONE, THREE)
    assert all(order.count(raising.id) == (1 if n == 0 else 0) for n, order in enumerate(result.orders))


def test_a_count_of_rounds_is_singular_for_one():
    assert [rounds_count(n) for n in (0, 1, 2)] == ["0 rounds", "1 round", "2 rounds"]
