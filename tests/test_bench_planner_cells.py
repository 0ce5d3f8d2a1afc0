"""How issue 14's benchmark judges a cell: single-device rows, the gaps, the other planners' time limit."""

import dataclasses
import math
import time

from bench.planner_cells import (
    RL_ALONE,
    Cell,
    Result,
    Settings,
    rl_alone_options,
    run_cell,
    run_with_time_limit,
    single_device_results,
    summary_figures,
)
from bench.random_clusters import random_clusters
from tapp_core.cost.context import CostContext
from tapp_core.planners import get_planner
from tapp_core.platform.cluster import Cluster, parse_cluster
from tests.factories import chain_library


def _cluster(speeds: list[float], memory: str = "1GiB") -> Cluster:
    devices = [{"name": f"d{i}", "speed": s, "memory": memory} for i, s in enumerate(speeds)]
    return parse_cluster({"name": "t", "devices": devices, "links": {"bandwidth": "1Gbit/s", "latency": "50us"}})


def test_single_device_results_mark_devices_the_model_does_not_fit() -> None:
    library = chain_library(4, param_bytes=[100 * 2**20] * 4)  # 1.2 GiB of training state
    cluster = parse_cluster(
        {
            "name": "t",
            "devices": [{"name": "big", "memory": "8GiB"}, {"name": "small", "speed": 4, "memory": "1GiB"}],
            "links": {"bandwidth": "1Gbit/s", "latency": "50us"},
        }
    )
    results = {r.planner: r for r in single_device_results(library, cluster)}
    assert math.isfinite(results["single:big"].step_time_s) and results["single:big"].plan is not None
    assert results["single:big"].plan.micro_batches == 1, "one device: extra micro-batches only add per-call costs"
    assert results["single:small"].step_time_s == math.inf and results["single:small"].note.startswith("n/a")


def test_a_single_device_may_fit_only_with_more_micro_batches_under_1f1b() -> None:
    library = chain_library(4, activation_bytes=[40 * 2**20] * 4)  # 160 MiB a sample: 1.25 GiB for the batch of 8
    cluster = parse_cluster(
        {
            "name": "t",
            "devices": [{"name": "small", "memory": "1GiB"}],
            "links": {"bandwidth": "1Gbit/s", "latency": "50us"},
        }
    )
    (result,) = single_device_results(library, cluster, "1f1b")
    assert result.plan is not None and result.plan.micro_batches == 2 and result.plan.schedule == "1f1b"
    (gpipe,) = single_device_results(library, cluster, "gpipe")
    assert gpipe.plan is None, "GPipe keeps every micro-batch's activations: the whole batch never fits"


def _cell(times: dict[str, float], proved: bool = True) -> Cell:
    cell = Cell("m", random_clusters(1, 1)[0])
    for name, t in times.items():
        result = Result(name, t, wall_s=1.0)
        if name == "oracle":
            library = chain_library(2)
            plan = get_planner("single").plan(CostContext(library, _cluster([1.0])))
            result.plan = dataclasses.replace(plan, notes={"proved_optimal": proved})
        cell.results.append(result)
    return cell


def test_gaps_are_to_the_right_references() -> None:
    cell = _cell({"oracle": 1.0, "tapp": 1.1, RL_ALONE: 1.5, "autoddl": 1.2, "single": 1.3, "single:d0": 1.05})
    assert math.isclose(cell.gap("tapp", "oracle"), 0.1)
    assert math.isclose(cell.gap("tapp", "single"), 1.1 / 1.05 - 1)
    assert math.isclose(cell.gap("tapp", "other"), 1.1 / 1.2 - 1)
    assert math.isclose(cell.gap("tapp", "known"), 0.1)
    unproved = _cell({"oracle": 1.0, "tapp": 1.1, "autoddl": 1.2}, proved=False)
    assert unproved.gap("tapp", "oracle") is None
    assert math.isclose(unproved.gap("tapp", "known"), 0.1), "an unproved oracle's plan is still a known plan"


def test_summary_takes_the_oracle_gaps_only_where_it_proved() -> None:
    cells = [
        _cell({"oracle": 1.0, "tapp": 1.02, "autoddl": 1.0}),
        _cell({"oracle": 1.0, "tapp": 1.5, "autoddl": 2.0}, proved=False),
        _cell({"oracle": 1.0, "tapp": 1.04, "autoddl": 1.1}),
    ]
    figures = summary_figures(cells, "tapp")
    assert figures["proved_cells"] == 2
    assert math.isclose(figures["median_oracle"], 0.03)
    assert math.isclose(figures["worst_known"][0], 0.5)
    assert math.isclose(figures["worst_other"][0], 0.02)


def _slow_plan() -> object:
    time.sleep(30)
    raise AssertionError("not reached")


def test_run_with_time_limit_kills_a_planner_that_runs_too_long() -> None:
    started = time.perf_counter()
    outcome = run_with_time_limit(_slow_plan, 0.5)  # type: ignore[arg-type]
    assert isinstance(outcome, str) and "timed out" in outcome
    assert time.perf_counter() - started < 10
    library, cluster = chain_library(4), _cluster([1.0, 0.5])
    plan = run_with_time_limit(lambda: get_planner("pipetorch").plan(CostContext(library, cluster)), 60)
    assert not isinstance(plan, str) and plan == get_planner("pipetorch").plan(CostContext(library, cluster))


def test_the_rl_alone_row_switches_off_the_warm_start_and_the_polish() -> None:
    assert rl_alone_options() == {"polish": False, "warm_start": False}
    library, cluster = chain_library(6), _cluster([1.0, 0.5, 0.25])
    settings = Settings(tapp_rounds=2, tapp_time_limit_s=30, planners=("tapp", RL_ALONE), single_devices=False)
    cell = run_cell(library, cluster, settings)
    full, alone = cell.get("tapp"), cell.get(RL_ALONE)
    assert full is not None and alone is not None and full.plan is not None and alone.plan is not None
    assert alone.plan.notes["warm_start"] == {} and alone.plan.notes["polish_gain"] == 0.0
    assert alone.note.startswith("RL alone: polish=False, warm_start=False")
    winner = full.plan.notes["warm_start_winner"]
    assert isinstance(winner, str) and f": {winner} " in full.note and "rounds in" in full.note
    assert full.step_time_s <= alone.step_time_s
