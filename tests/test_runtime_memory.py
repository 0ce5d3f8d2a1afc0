"""A rank's own memory (``KindCalibration.runtime_memory_bytes``): what it holds before a plan's first tensor is left
aside from the device's ``memory`` wherever a plan's memory is checked (``CostContext.plan_memory``): the checks,
the planners' screen and the search's features agree, and the calibration measures a device that cannot hold the
whole model on a batch that it can hold."""

from __future__ import annotations

import dataclasses

import pytest

from tapp_core.cost.calibration import Calibration, KindCalibration
from tapp_core.cost.checks import check_memory
from tapp_core.cost.context import CostContext
from tapp_core.plan.plan import OutOfMemory, Plan, stage_memory_bytes
from tapp_core.planners import get_planner
from tapp_core.planners.evaluation import MemoryScreen
from tapp_core.planners.tapp.features import device_features, model_needs
from tapp_core.platform.kinds import device_kind
from tapp_core.runtime.calibrator import CalibrationRunError, fitting_batch
from tests.factories import chain_library, make_cluster

MiB = 2**20
LIBRARY = chain_library(6, param_bytes=[4 * MiB] * 6, activation_bytes=[MiB] * 6, batch_size=8)


def whole(batch_size: int = 8) -> Plan:
    return Plan("toy", batch_size, 1, "gpipe", (0,) * 6, (("d0",),))


def with_rank(memory: int, rank: int, devices: int = 1) -> CostContext:
    cluster = make_cluster([1.0] * devices, memory=f"{memory}B")
    kind = device_kind(cluster.devices[0]).name
    return CostContext(LIBRARY, cluster, Calibration(kinds={kind: KindCalibration(runtime_memory_bytes=rank)}))


def test_a_plan_gets_the_device_s_memory_less_its_rank_s_own() -> None:
    need = stage_memory_bytes(whole(), LIBRARY, 0)["d0"]
    assert with_rank(need, 0).plan_memory == {"d0": need}
    check_memory(whole(), with_rank(need, 0))
    tight = with_rank(need + 100 * MiB, 100 * MiB + 1)
    assert tight.plan_memory == {"d0": need - 1}
    with pytest.raises(OutOfMemory, match=r"out of memory on device 'd0'.* less its rank's own 100\.00 MiB"):
        check_memory(whole(), tight)
    assert with_rank(MiB, 2 * MiB).plan_memory == {"d0": 0}  # never negative


@pytest.mark.parametrize("rank", [0, 30 * MiB, 60 * MiB])
def test_the_planners_screen_agrees_with_the_check(rank: int) -> None:
    context = with_rank(160 * MiB, rank, devices=3)
    screen = MemoryScreen(context)
    plans = [
        Plan("toy", 8, m, "1f1b", cuts, devices)
        for m in (1, 2)
        for cuts, devices in [
            ((0,) * 6, (("d0",),)),
            ((0, 0, 0, 1, 1, 1), (("d0",), ("d1",))),
            ((0, 0, 1, 1, 2, 2), (("d0",), ("d1",), ("d2",))),
            ((0,) * 6, (("d0", "d1", "d2"),)),
        ]
    ]
    verdicts = []
    for plan in plans:
        try:
            check_memory(plan, context)
            fits = True
        except OutOfMemory:
            fits = False
        assert screen.fits(plan) == fits, plan.describe(LIBRARY)
        verdicts.append(fits)
    assert any(verdicts) and (rank == 0 or not all(verdicts))


def test_a_planner_keeps_within_what_the_ranks_leave() -> None:
    need = stage_memory_bytes(whole(), LIBRARY, 0)["d0"]
    roomy, tight = with_rank(need + 50 * MiB, 0, devices=2), with_rank(need + 50 * MiB, 50 * MiB + 1, devices=2)
    assert get_planner("single").plan(roomy).n_stages == 1
    plan = get_planner("pipedream").plan(tight)
    assert plan.n_stages == 2 or len(plan.stage_devices[0]) == 2
    check_memory(plan, tight)


def test_the_search_sees_the_memory_a_plan_gets() -> None:
    context = with_rank(80 * MiB, 60 * MiB, devices=2)
    needs = model_needs(LIBRARY, (1,), 8, "1f1b")
    whole_memory = device_features(context.cluster, needs)
    plan_memory = device_features(context.cluster, needs, memory=context.plan_memory)
    assert bool((plan_memory[:, 1] < whole_memory[:, 1]).all())


def test_the_calibration_measures_a_device_too_small_for_the_model_on_a_batch_it_holds() -> None:
    rank = 100 * MiB
    need = {b: stage_memory_bytes(whole(b), LIBRARY, 0)["d0"] for b in (8, 4)}
    assert need[8] > need[4]
    assert fitting_batch(with_rank(rank + need[8], 0), "d0", rank) == 8
    assert fitting_batch(with_rank(rank + need[4], 0), "d0", rank) == 4
    with pytest.raises(CalibrationRunError, match="no batch of the model fits d0"):
        fitting_batch(with_rank(rank + need[4] - 1, 0), "d0", rank)


def test_a_calibration_keeps_the_rank_s_memory(tmp_path: object) -> None:
    figures = KindCalibration(runtime_memory_bytes=123.0 * MiB)
    calibration = Calibration(kinds={"cpu-t1": figures})
    again = Calibration.from_dict(calibration.to_dict())
    assert again.for_kind("cpu-t1").runtime_memory_bytes == 123.0 * MiB
    with pytest.raises(Exception, match="runtime_memory_bytes must be >= 0"):
        dataclasses.replace(figures, runtime_memory_bytes=-1.0)
