"""Each device's estimated memory over the step (``tapp_core.cost.memory_curve``): the memory model's terms on the
cost model's timeline, kept in the estimate's JSON and drawn under the Gantt figure's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from reports.figures import gantt
from tapp_core.cost.context import CostContext
from tapp_core.cost.estimate import Estimate
from tapp_core.cost.simulation import estimate
from tapp_core.plan.plan import Plan, stage_memory_terms
from tests.factories import chain_library, make_cluster

MiB = 2**20
LIBRARY = chain_library(4, param_bytes=[2 * MiB] * 4, activation_bytes=[MiB] * 4, batch_size=8)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
def test_a_device_s_memory_rises_with_its_forwards_falls_with_its_backwards_and_peaks_at_the_estimate(
    schedule: str,
) -> None:
    plan = Plan("toy", 8, 4, schedule, (0, 0, 1, 1), (("d0",), ("d1",)))
    predicted = estimate(plan, CostContext(LIBRARY, make_cluster([1.0, 0.5])))
    curves = predicted.memory_over_time
    assert set(curves) == {"d0", "d1"}
    for stage, device in enumerate(("d0", "d1")):
        terms = stage_memory_terms(plan, LIBRARY, stage)[device]
        curve = curves[device]
        times = [t for t, _ in curve]
        assert times == sorted(times) and len(set(times)) == len(times)
        held = [b for _, b in curve]
        start = sum(terms.values()) - terms["activations"] - terms["backward working memory"]
        start -= terms["gradient transient"] + terms["model trace"]
        assert held[0] == pytest.approx(start)
        assert max(held) == pytest.approx(predicted.peak_memory_bytes[device] - terms["model trace"], abs=1)
        assert held[-1] == pytest.approx(start)  # every micro-batch's activations given back
        assert min(held) >= start - 1


def test_gpipe_holds_every_micro_batch_at_once_and_1f1b_fewer() -> None:
    def highest(schedule: str) -> float:
        plan = Plan("toy", 8, 4, schedule, (0, 0, 1, 1), (("d0",), ("d1",)))
        return max(b for _, b in estimate(plan, CostContext(LIBRARY, make_cluster([1.0, 1.0]))).memory_over_time["d0"])

    assert highest("gpipe") > highest("1f1b")


def test_the_curves_and_the_plan_s_memory_travel_in_the_estimate_s_json() -> None:
    plan = Plan("toy", 8, 2, "1f1b", (0, 0, 1, 1), (("d0",), ("d1",)))
    predicted = estimate(plan, CostContext(LIBRARY, make_cluster([1.0, 1.0], memory="64MiB")))
    again = Estimate.from_dict(json.loads(predicted.to_json()))
    assert dict(again.memory_over_time) == dict(predicted.memory_over_time)
    assert again.plan_memory_bytes == {"d0": 64 * MiB, "d1": 64 * MiB}
    older = json.loads(predicted.to_json())
    del older["memory_over_time"], older["plan_memory_bytes"]
    assert Estimate.from_dict(older).memory_over_time == {}  # an estimate logged before them still reads
    with pytest.raises(ValueError, match="memory_over_time of 'd0'"):
        Estimate.from_dict({**older, "memory_over_time": {"d0": [[0.0]]}})


def test_the_gantt_figure_draws_the_memory_panel_under_the_rows(tmp_path: Path) -> None:
    plan = Plan("toy", 8, 4, "1f1b", (0, 0, 1, 1), (("d0",), ("d1",)))
    predicted = estimate(plan, CostContext(LIBRARY, make_cluster([1.0, 1.0], memory="64MiB")))
    with_panel = imread(gantt(predicted, tmp_path / "with.png"))
    without = imread(gantt(list(predicted.timeline), tmp_path / "without.png"))
    assert with_panel.shape[0] > without.shape[0] and with_panel.shape[1] == without.shape[1]
    roomy = estimate(plan, CostContext(LIBRARY, make_cluster([1.0, 1.0], memory="64GiB")))  # drawn in MiB instead
    assert imread(gantt(roomy, tmp_path / "roomy.png")).shape == with_panel.shape
