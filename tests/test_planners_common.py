"""Every planner through the registry, on small synthetic graphs: valid plans, options, errors."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from tapp_core.cost.checks import validate
from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.planners import PLANNER_NAMES, PlannerError, SearchProgress, get_planner, planner_options
from tapp_core.planners.base import DoesNotFit
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.profile.library import Layer, LayerLibrary

MB = 2**20


def synthetic_library(edges: list[tuple[int, int]], times_ms: list[float], model: str = "synthetic") -> LayerLibrary:
    """A library over the DAG ``edges`` (layers in topological order); heavier layers get more parameters."""
    n = len(times_ms)
    successors: list[list[int]] = [[] for _ in range(n)]
    predecessors: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        successors[u].append(v)
        predecessors[v].append(u)
    ops = ["Conv2d", "ReLU", "MaxPool2d", "Linear", "add", "cat", "flatten", "Sigmoid"]
    layers = [
        Layer(
            index=i,
            name=f"layer{i}",
            op=ops[i % len(ops)],
            successors=tuple(successors[i]),
            predecessors=tuple(predecessors[i]),
            flops=1e6 * times_ms[i],
            param_bytes=int(0.2 * MB * times_ms[i]) if i % 3 == 0 else 0,
            activation_bytes=4096 * (1 + i % 4),
            output_shape=(64, 16),
            forward_s=times_ms[i] * 1e-3 / 3,
            backward_s=times_ms[i] * 2e-3 / 3,
        )
        for i in range(n)
    ]
    return LayerLibrary(
        model=model,
        batch_size=64,
        device="cpu",
        threads=1,
        layers=layers,
        input_bytes=3 * 32 * 32 * 4,
        whole_model_s=sum(times_ms) * 1e-3,
    )


def chain_library(times_ms: list[float] | None = None) -> LayerLibrary:
    times = times_ms or [4, 1, 6, 2, 8, 1, 5, 3, 7, 2, 4, 1]
    return synthetic_library([(i, i + 1) for i in range(len(times) - 1)], times, "chain")


def branchy_library() -> LayerLibrary:
    """stem(0) -> a1(1) -> a2(2) ; stem -> b1(3) ; cat(4) of a2, b1 ; mix(5) ; add(6) of mix and stem ; head 7..9."""
    edges = [(0, 1), (1, 2), (0, 3), (2, 4), (3, 4), (4, 5), (5, 6), (0, 6), (6, 7), (7, 8), (8, 9)]
    return synthetic_library(edges, [5, 3, 4, 6, 1, 7, 1, 4, 6, 2], "branchy")


def with_fixed_parts(library: LayerLibrary, share: float) -> LayerLibrary:
    """The library with ``share`` of every layer's time made per call (independent of the samples)."""
    layers = [
        dataclasses.replace(layer, forward_fixed_s=share * layer.forward_s, backward_fixed_s=share * layer.backward_s)
        for layer in library.layers
    ]
    return dataclasses.replace(library, layers=layers)


def small_cluster(speeds: tuple[float, ...] = (1.0, 0.5, 0.25), slow_pair: bool = True, gpu: bool = False) -> Cluster:
    """Devices d0, d1, ... of these speeds (d1 a GPU with ``gpu``), the last two on a slow link."""
    names = [f"d{i}" for i in range(len(speeds))]
    overrides = [{"between": names[-2:], "bandwidth": "100Mbit/s", "latency": "50us"}] if slow_pair else []
    kinds = ["cuda" if gpu and n == "d1" else "cpu" for n in names]
    return parse_cluster(
        {
            "name": "small",
            "devices": [
                {"name": n, "kind": k, "speed": s, "memory": "4GiB"}
                for n, k, s in zip(names, kinds, speeds, strict=True)
            ],
            "links": {"bandwidth": "1Gbit/s", "latency": "50us", "overrides": overrides},
        }
    )


QUICK = {
    "tapp": {"rounds": 6, "population": 2, "samples_per_round": 8},
    "tapp-rl": {"rounds": 6, "population": 2, "samples_per_round": 8},
    "oracle": {},
    "autoddl": {"max_sweeps": 3},
}


@pytest.mark.parametrize("name", PLANNER_NAMES)
@pytest.mark.parametrize("make_library", [chain_library, branchy_library])
def test_every_planner_returns_a_valid_plan(name: str, make_library) -> None:
    library, cluster = make_library(), small_cluster(gpu=name == "single-gpu")
    plan = get_planner(name, micro_batches=(1, 2, 4), **QUICK.get(name, {})).plan(CostContext(library, cluster))
    validate(plan, CostContext(library, cluster))
    assert plan.planner == name
    assert plan.micro_batches in (1, 2, 4)
    assert math.isclose(plan.notes["estimated_step_time_s"], estimate(plan, CostContext(library, cluster)).step_time_s)
    assert plan.notes["search_wall_s"] >= 0 and plan.notes["evaluations"] >= 0


def test_no_contiguous_plan_beats_the_oracle() -> None:
    library, cluster = chain_library(), small_cluster()
    both = ("1f1b", "async")
    best = get_planner("oracle", micro_batches=(1, 2, 4), schedules=both).plan(CostContext(library, cluster))
    assert best.notes["proved_optimal"] is True and set(best.notes["schedule_estimates_s"]) == set(both)
    for name in ("even", "pipetorch", "autoddl", "tapp"):  # all of them build contiguous plans
        options = {"schedules": both, **QUICK.get(name, {})}
        plan = get_planner(name, micro_batches=(1, 2, 4), **options).plan(CostContext(library, cluster))
        assert all(a <= b for a, b in itertools.pairwise(plan.stage_of_layer))
        assert plan.notes["estimated_step_time_s"] >= best.notes["estimated_step_time_s"] - 1e-12, name


def test_single_takes_the_fastest_device_and_bsp_all_that_divide_the_batch() -> None:
    library = chain_library()
    single = get_planner("single-cpu").plan(CostContext(library, small_cluster((0.5, 2.0, 1.0))))
    assert (single.stage_devices, single.planner) == ((("d1",),), "single-cpu")
    with_gpu = small_cluster((0.5, 2.0, 1.0), gpu=True)
    assert get_planner("single-cpu").plan(CostContext(library, with_gpu)).stage_devices == (("d2",),)
    assert get_planner("single-gpu").plan(CostContext(library, with_gpu)).stage_devices == (("d1",),)
    assert get_planner("single").plan(CostContext(library, with_gpu)).stage_devices == (
        ("d1",),
    )  # the old name: any kind
    with pytest.raises(PlannerError, match="no cuda device of cluster 'small'"):
        get_planner("single-gpu").plan(CostContext(library, small_cluster()))
    bsp = get_planner("bsp").plan(CostContext(library, small_cluster((0.5, 2.0, 1.0))))
    assert bsp.stage_devices == (("d1", "d2"),)  # three do not divide 64: the slowest is left out
    assert bsp.notes["left_out"] == ["d0"]


def test_unknown_planner_or_option_is_a_clear_error() -> None:
    with pytest.raises(PlannerError, match="unknown planner 'nope'"):
        get_planner("nope")
    with pytest.raises(PlannerError, match=r"has no option\(s\) rounds; it accepts: .*schedule"):
        get_planner("even", rounds=3)
    with pytest.raises(PlannerError, match="unknown schedule"):
        get_planner("pipetorch", schedule="zigzag")
    with pytest.raises(PlannerError, match="divides the batch size 64"):
        get_planner("even", micro_batches=(3, 5)).plan(CostContext(chain_library(), small_cluster()))


def test_options_are_listed_with_their_defaults() -> None:
    options = planner_options("tapp")
    assert options["reward"] == "simulated" and options["schedule"] == "1f1b" and "progress" in options
    assert "max_blocks" in planner_options("oracle")
    assert set(planner_options("single-cpu")) == {
        "batch_size",
        "micro_batches",
        "schedule",
        "schedules",
        "staleness",
        "seed",
        "progress",
    }


def test_progress_is_reported_once_per_round() -> None:
    seen: list[SearchProgress] = []
    get_planner("tapp", rounds=4, population=1, samples_per_round=4).plan(
        CostContext(chain_library(), small_cluster()), progress=seen.append
    )
    assert [p.round for p in seen] == [1, 2, 3, 4]
    assert all(p.total_rounds == 4 and p.phase == "simulated" and p.entropy is not None for p in seen)
    assert seen[-1].best_step_time_s <= seen[0].best_step_time_s


def test_budget_caps_reward_evaluations() -> None:
    plan = get_planner("tapp", rounds=50, population=1, samples_per_round=8).plan(
        CostContext(chain_library(), small_cluster()), budget=20
    )
    assert 20 <= plan.notes["evaluations"] < 20 + 8
    with pytest.raises(PlannerError, match="budget must be a positive"):
        get_planner("autoddl").plan(CostContext(chain_library(), small_cluster()), budget=0)


@pytest.mark.parametrize("name", ["single-cpu", "bsp", "pipetorch", "pipedream", "pipeline-cd", "autoddl", "oracle"])
def test_a_planner_with_no_plan_under_the_memory_says_it_does_not_fit(name: str) -> None:
    """Not a failure of the method: ``DoesNotFit``, which an experiment shows as such (``tasks.evaluate.Unfit``)."""
    cluster = small_cluster()
    tiny = cluster.model_copy(update={"devices": tuple(d.model_copy(update={"memory": 64}) for d in cluster.devices)})
    with pytest.raises(DoesNotFit, match="memory"):
        get_planner(name, micro_batches=(1, 2), **QUICK.get(name, {})).plan(CostContext(chain_library(), tiny))
