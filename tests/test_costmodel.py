"""The cost model against cases worked out by hand (the arithmetic is in the comments), to 1e-9.

Units in the hand-built clusters: bandwidth in bytes/s, latency in seconds, memory in bytes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from reports.figures import gantt
from tapp_core.cost.calibration import (
    DEFAULT_CALIBRATION,
    Calibration,
    CalibrationError,
    KindCalibration,
    StepPoint,
    fit_compute,
)
from tapp_core.cost.context import CostContext
from tapp_core.cost.estimate import NO_MICRO_BATCH, Estimate, TimelineOp, breakdown
from tapp_core.cost.simulation import estimate
from tapp_core.measure.step import communication_share
from tapp_core.plan.plan import BUCKET_COPIES, Plan, PlanError, single_stage_plan, stage_memory_terms
from tapp_core.platform.cluster import Cluster, parse_cluster
from tapp_core.profile.library import Layer, LayerLibrary

TOL = 1e-9


def library(
    edges: Sequence[tuple[int, int]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    activation_bytes: Sequence[int],
    param_bytes: Sequence[int] | None = None,
    batch_size: int = 1,
) -> LayerLibrary:
    n = len(forward_s)
    params = param_bytes or [0] * n
    layers = [
        Layer(
            index=i,
            name=f"l{i}",
            op="Linear",
            successors=tuple(v for u, v in edges if u == i),
            predecessors=tuple(u for u, v in edges if v == i),
            flops=1.0,
            param_bytes=params[i],
            activation_bytes=activation_bytes[i],
            output_shape=(batch_size, 1),
            forward_s=forward_s[i],
            backward_s=backward_s[i],
        )
        for i in range(n)
    ]
    return LayerLibrary(
        model="hand",
        batch_size=batch_size,
        device="cpu",
        threads=1,
        layers=layers,
        input_bytes=4,
        whole_model_s=sum(forward_s) + sum(backward_s),
    )


def chain(n: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n - 1)]


def cluster(
    speeds: Sequence[float],
    bandwidth: float = 100.0,
    latency: float = 0.0,
    overrides: Sequence[dict[str, object]] = (),
) -> Cluster:
    return parse_cluster(
        {
            "name": "hand",
            "devices": [{"name": f"d{i}", "speed": s, "memory": 10**9} for i, s in enumerate(speeds)],
            "links": {"bandwidth": bandwidth, "latency": latency, "overrides": list(overrides)},
        }
    )


def plan(
    stage_of_layer: Sequence[int],
    stage_devices: Sequence[Sequence[str]],
    batch_size: int,
    micro_batches: int,
    schedule: str = "gpipe",
) -> Plan:
    return Plan(
        model="hand",
        batch_size=batch_size,
        micro_batches=micro_batches,
        schedule=schedule,
        stage_of_layer=tuple(stage_of_layer),
        stage_devices=tuple(tuple(d) for d in stage_devices),
    )


def ops(result: Estimate, device: str, kind: str) -> list[tuple[float, float]]:
    return [(op.start, op.end) for op in result.timeline if op.device == device and op.kind == kind]


def flat(value: object) -> list[float]:
    if isinstance(value, list | tuple):
        return [x for item in value for x in flat(item)]
    assert isinstance(value, int | float), value
    return [float(value)]


def assert_close(actual: object, expected: object) -> None:
    """Numbers, or (nested) lists of numbers such as [(start, end), ...], equal to within TOL."""
    if isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple) and len(actual) == len(expected), f"{actual} != {expected}"
    assert flat(actual) == pytest.approx(flat(expected), abs=TOL), f"{actual} != {expected}"


def assert_breakdown(result: Estimate, device: str, compute: float, communication: float, idle: float) -> None:
    assert_close(result.compute_s[device], compute)
    assert_close(result.communication_s[device], communication)
    assert_close(result.idle_s[device], idle)


# --------------------------------------------------------------------------------------------------------------


def single_device_case() -> tuple[LayerLibrary, Cluster, Plan]:
    # Two layers, profiled at batch 4: forward 1 + 3 = 4 s, backward 2 + 6 = 8 s per 4 samples.
    lib = library(chain(2), [1.0, 3.0], [2.0, 6.0], [10, 20], param_bytes=[100, 300], batch_size=4)
    return lib, cluster([0.5]), single_stage_plan(lib, ["d0"], micro_batches=2, batch_size=8)


def test_single_device() -> None:
    lib, cl, p = single_device_case()
    result = estimate(p, CostContext(lib, cl))
    # Micro-batch = 8 / 2 = 4 samples; speed 0.5 doubles every time.
    # forward  = 4 s * (4/4) / 0.5 = 8 s;  backward = 8 s * (4/4) / 0.5 = 16 s.
    # gpipe: F0 [0,8] F1 [8,16] B1 [16,32] B0 [32,48], update takes 0 -> step 48.
    assert_close(result.step_time_s, 48.0)
    assert_close(ops(result, "d0", "forward"), [(0, 8), (8, 16)])
    assert_close(ops(result, "d0", "backward"), [(16, 32), (32, 48)])
    assert [op.micro_batch for op in result.timeline if op.kind == "backward"] == [1, 0]
    assert_breakdown(result, "d0", compute=48.0, communication=0.0, idle=0.0)
    # Memory: the memory model's (plan.stage_memory_terms): 3 * (100 + 300) state, 2 micro-batches in flight of
    # the input and (10 + 20) B of outputs per sample, 4 samples.
    (terms,) = stage_memory_terms(p, lib, 0).values()
    assert terms["training state"] == 1200 and terms["activations"] == 2 * (lib.input_bytes + 10 + 20) * 4
    assert result.peak_memory_bytes == {"d0": int(sum(terms.values()))}
    assert result.communication_share == 0.0


def test_frozen_parameters_are_held_but_never_summed_stepped_stashed_or_given_state() -> None:
    """A fine-tuned model (layer 0 frozen): its weights count once in memory; its gradients are never summed
    among replicas; the update steps, stashes and keeps optimiser state for the trained layer alone."""
    lib = library(chain(2), [3.0, 3.0], [6.0, 6.0], [10, 10], param_bytes=[300, 300], batch_size=6)
    frozen = dataclasses.replace(lib, layers=[dataclasses.replace(lib.layers[0], frozen_bytes=300), lib.layers[1]])
    assert (frozen.layers[0].trained_bytes, frozen.layers[1].trained_bytes) == (0, 300)
    cl = cluster([1.0, 1.0, 0.5], bandwidth=50.0, latency=0.2)
    bsp = single_stage_plan(lib, ["d0", "d1", "d2"], micro_batches=1)
    calibration = Calibration(update_s_per_param_byte=0.001)
    every, tuned = (estimate(bsp, CostContext(x, cl, calibration)) for x in (lib, frozen))
    # the allreduce of the trained 300 B: 2 * 2/3 * 300 / 50 + 2 * 2 * 0.2 = 8.8 s (of 600 B: 16.8 s)
    assert_close([end - start for start, end in ops(every, "d0", "reduce")], [16.8])
    assert_close([end - start for start, end in ops(tuned, "d0", "reduce")], [8.8])
    assert_close([end - start for start, end in ops(tuned, "d0", "update")], [0.3])  # 0.001 s a trained byte
    # memory: the weights (600 B), and a gradient and SGD's momentum of the trained 300 B
    terms = stage_memory_terms(bsp, frozen, 0)["d0"]
    assert terms["training state"] == 600 + 2 * 300 and terms["gradient buckets"] == BUCKET_COPIES * 300
    # an asynchronous stage stashes the versions of its trained weights alone
    asynchronous = plan([0, 1], [["d0"], ["d1"]], batch_size=6, micro_batches=2, schedule="async")
    first = stage_memory_terms(asynchronous, frozen, 0)["d0"]
    assert first["training state"] == 300 and first["stashed weights"] == 0
    assert stage_memory_terms(asynchronous, lib, 0)["d0"]["stashed weights"] > 0


def test_calibration_constants_enter_where_documented() -> None:
    lib, cl, p = single_device_case()
    calibration = Calibration(
        per_micro_batch_s=0.5, compute_scale=1.5, slowdown_exponent=2.0, update_s_per_param_byte=0.01, per_step_s=1.0
    )
    result = estimate(p, CostContext(lib, cl, calibration))
    # Effective slowdown (1/0.5)^2 = 4.
    # forward  = 4 s * 4 * 1.5 + 0.5 = 24.5;  backward = 8 s * 4 * 1.5 + 0.5 = 48.5
    # update   = 0.01 * 400 B * 4 + 1 (per step) = 17
    # step     = 2 * 24.5 + 2 * 48.5 + 17 = 163
    assert_close(result.step_time_s, 163.0)
    assert_close(ops(result, "d0", "update"), [(146.0, 163.0)])
    assert result.calibration == calibration


def test_two_stage_gpipe_two_micro_batches() -> None:
    # Layer 0 on d0 (speed 1), layer 1 on d1 (speed 2); profiled at batch 2.
    lib = library(chain(2), [2.0, 4.0], [4.0, 8.0], [100, 50], batch_size=2)
    cl = cluster([1.0, 2.0], bandwidth=200.0, latency=1.0)
    p = plan([0, 1], [["d0"], ["d1"]], batch_size=4, micro_batches=2)
    result = estimate(p, CostContext(lib, cl))
    # Micro-batch 2 samples. d0: F = 2 s, B = 4 s. d1: F = 4 / 2 = 2 s, B = 8 / 2 = 4 s.
    # Cut: layer 0's output, 100 B * 2 samples = 200 B: 1 s latency + 200 / 200 = 2 s per transfer, both ways.
    # d0: F0 [0,2] -> send [2,4];  F1 [2,4] -> send [4,6] (link free at 4: no queueing).
    # d1: F0 waits from 2 (sender done) to 4 -> recv 2 s; F0 [4,6]; F1 [6,8] (arrived at 6).
    #     B1 [8,12] -> send [12,14];  B0 [12,16] -> send [16,18]; update at 16.
    # d0: B1 needs mb 1's gradient: sent at 12, arrives 14 -> recv [12,14]; B1 [14,18];
    #     B0: arrives 18, d0 free at 18 -> no wait; B0 [18,22]. Step = 22.
    assert_close(result.step_time_s, 22.0)
    assert_close(ops(result, "d0", "send"), [(2, 4), (4, 6)])
    assert_close(ops(result, "d1", "forward"), [(4, 6), (6, 8)])
    assert_close(ops(result, "d1", "send"), [(12, 14), (16, 18)])
    assert_close(ops(result, "d0", "backward"), [(14, 18), (18, 22)])
    assert_close(ops(result, "d0", "recv"), [(12, 14)])
    assert_close(ops(result, "d1", "recv"), [(2, 4)])
    # compute 2+2+4+4 = 12 on each; communication 2 on each; idle 22 - 14 = 8.
    assert_breakdown(result, "d0", compute=12.0, communication=2.0, idle=8.0)
    assert_breakdown(result, "d1", compute=12.0, communication=2.0, idle=8.0)
    # Communication share = (2 + 2) / (2 devices * 22).
    assert_close(result.communication_share, 4.0 / 44.0)
    assert_close(result.communication_share, communication_share(result.communication_s, result.step_time_s))


def test_per_message_cost_and_bandwidth_scale() -> None:
    lib = library(chain(2), [2.0, 4.0], [4.0, 8.0], [100, 50], batch_size=2)
    cl = cluster([1.0, 2.0], bandwidth=200.0, latency=1.0)
    p = plan([0, 1], [["d0"], ["d1"]], batch_size=4, micro_batches=2)
    result = estimate(p, CostContext(lib, cl, Calibration(per_message_s=0.5, bandwidth_scale=0.5)))
    # Transfer = (1 + 0.5) + 200 B / (200 * 0.5) = 3.5 s.
    # d0: F0 [0,2] send [2,5.5]; F1 [2,4] send queued to [5.5,9].
    # d1: F0 [5.5,7.5]; F1 [9,11]; B1 [11,15] send [15,18.5]; B0 [15,19] send [19,22.5].
    # d0: B1 [18.5,22.5]; B0 [22.5,26.5].
    assert_close(ops(result, "d0", "send"), [(2, 5.5), (5.5, 9)])
    assert_close(result.step_time_s, 26.5)


def pipeline_3x4(schedule: str) -> Estimate:
    # Three stages of two layers on equal devices, 4 micro-batches of 1 sample: F = 0.5 + 0.5 = 1 s,
    # B = 1 + 1 = 2 s per stage. The tensor crossing each cut is empty (0 B) and links have no latency, so
    # transfers are instantaneous; each stage keeps 1000 B of activations per sample (the first layer's).
    lib = library(chain(6), [0.5] * 6, [1.0] * 6, [1000, 0] * 3)
    cl = cluster([1.0, 1.0, 1.0], latency=0.0)
    p = plan([0, 0, 1, 1, 2, 2], [["d0"], ["d1"], ["d2"]], batch_size=4, micro_batches=4, schedule=schedule)
    return estimate(p, CostContext(lib, cl))


def test_1f1b_matches_gpipe_in_time_but_not_memory() -> None:
    gpipe, one_f_one_b = pipeline_3x4("gpipe"), pipeline_3x4("1f1b")
    # gpipe: stage s runs F(m) in [s+m, s+m+1]; the last forward ends at 2+3+1 = 6. Backwards run in reverse:
    #   d2: B3..B0 in [6,14]; d1: B3 [8,10] .. B0 [14,16]; d0: B3 [10,12] .. B0 [16,18]. Step 18 = (M+S-1)(F+B).
    # 1f1b: d2 (1 warm-up): F0 [2,3] B0 [3,5] F1 [5,6] B1 [6,8] F2 [8,9] B2 [9,11] F3 [11,12] B3 [12,14].
    #   d1 (2): F0 [1,2] F1 [2,3] B0 [5,7] F2 [7,8] B1 [8,10] F3 [10,11] B2 [11,13] B3 [14,16].
    #   d0 (3): F0 [0,1] F1 [1,2] F2 [2,3] B0 [7,9] F3 [9,10] B1 [10,12] B2 [13,15] B3 [16,18]. Step 18 too.
    assert_close(gpipe.step_time_s, 18.0)
    assert_close(one_f_one_b.step_time_s, 18.0)
    assert_close(ops(gpipe, "d0", "backward"), [(10, 12), (12, 14), (14, 16), (16, 18)])
    assert_close(ops(one_f_one_b, "d1", "backward"), [(5, 7), (8, 10), (11, 13), (14, 16)])
    assert_close(ops(one_f_one_b, "d0", "forward"), [(0, 1), (1, 2), (2, 3), (9, 10)])
    order = [(op.kind[0], op.micro_batch) for op in one_f_one_b.timeline if op.device == "d1" and op.kind[0] in "fb"]
    assert order == [("f", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 1), ("f", 3), ("b", 2), ("b", 3)]
    # Same compute (4 * 1 + 4 * 2 = 12) and idle (18 - 12 = 6) on every device under both schedules.
    for result in (gpipe, one_f_one_b):
        for device in ("d0", "d1", "d2"):
            assert_breakdown(result, device, compute=12.0, communication=0.0, idle=6.0)
    # Memory: each micro-batch in flight holds what it took in and its outputs (at least 1000 B a sample), 1 sample,
    # no parameters. gpipe holds all 4 on every stage; 1f1b holds min(S - s, M) = 3, 2, 1: stages 0, 1 and 2 hold
    # one, two and three micro-batches less.
    saved = {d: gpipe.peak_memory_bytes[d] - one_f_one_b.peak_memory_bytes[d] for d in ("d0", "d1", "d2")}
    assert saved["d0"] >= 1000 and saved["d1"] >= 2000 and saved["d2"] == saved["d1"] * 3 // 2


def test_replicated_stage_allreduce() -> None:
    # Layer 0 (1 s forward, 2 s backward per sample) on d0; layer 1 (2 s / 4 s per sample, 1000 B of parameters)
    # replicated on d1 (speed 1) and d2 (speed 0.5). One micro-batch of 4 samples; replicas take 2 samples each.
    lib = library(chain(2), [4.0, 8.0], [8.0, 16.0], [100, 10], param_bytes=[0, 1000], batch_size=4)
    slow_pair = {"between": ["d1", "d2"], "bandwidth": 500.0, "latency": 0.5}
    cl = cluster([1.0, 1.0, 0.5], bandwidth=100.0, latency=1.0, overrides=[slow_pair])
    p = plan([0, 1], [["d0"], ["d1", "d2"]], batch_size=4, micro_batches=1)
    result = estimate(p, CostContext(lib, cl))
    # d0: F = 4 s, B = 8 s.  d1: F = 2 * 2 = 4, B = 2 * 4 = 8.  d2 (half speed): F = 8, B = 16.
    # Each replica gets its 2 samples: 100 B * 2 = 200 B -> 1 + 200/100 = 3 s, on separate links: [4,7] both.
    # d1: F [7,11] B [11,19], gradient to d0 [19,22].   d2: F [7,15] B [15,31], gradient to d0 [31,34].
    # Allreduce from max(19, 31) = 31: ring 2*(2-1)/2 * 1000 B / 500 + 2*(2-1) * 0.5 = 2 + 1 = 3 -> [31,34].
    # d0: B waits for both gradients; last sender done at 31, arrives 34 -> recv [31,34]; B [34,42]. Step 42.
    assert_close(result.step_time_s, 42.0)
    assert_close(ops(result, "d1", "allreduce"), [(31, 34)])
    assert_close(ops(result, "d2", "allreduce"), [(31, 34)])
    assert_close(ops(result, "d0", "backward"), [(34, 42)])
    assert_close(sorted(ops(result, "d0", "send")), [(4, 7), (4, 7)])
    # d0: compute 12, recv 3, idle 27.  d1: compute 12, recv 3 + allreduce 3, idle 42 - 18 = 24.
    # d2: compute 24, communication 6, idle 12.
    assert_breakdown(result, "d0", compute=12.0, communication=3.0, idle=27.0)
    assert_breakdown(result, "d1", compute=12.0, communication=6.0, idle=24.0)
    assert_breakdown(result, "d2", compute=24.0, communication=6.0, idle=12.0)
    # The replicas hold 3 * 1000 B of state and 1.5 * 1000 B of reduction buffers, d0 its inputs and outputs.
    assert result.peak_memory_bytes["d1"] == result.peak_memory_bytes["d2"] > result.peak_memory_bytes["d0"]


def test_fixed_parts_are_paid_once_per_call_whatever_the_samples() -> None:
    # One layer profiled at batch 8: forward 1.0 s of which 0.6 s fixed (0.05 s per sample beyond it), backward
    # 2.0 s of which 1.2 s fixed (0.1 s per sample). A replica's call pays the whole fixed part too.
    lib = library(chain(1), [1.0], [2.0], [10], batch_size=8)
    lib.layers[0] = dataclasses.replace(lib.layers[0], forward_fixed_s=0.6, backward_fixed_s=1.2)
    cl = cluster([1.0, 1.0])
    # 4 micro-batches of 2 samples on d0: F = 0.6 + 2 * 0.05 = 0.7, B = 1.2 + 2 * 0.1 = 1.4; 4 * 2.1 = 8.4.
    assert_close(estimate(plan([0], [["d0"]], batch_size=8, micro_batches=4), CostContext(lib, cl)).step_time_s, 8.4)
    # The whole batch in one call costs what was profiled: 1 + 2 = 3.
    assert_close(estimate(plan([0], [["d0"]], batch_size=8, micro_batches=1), CostContext(lib, cl)).step_time_s, 3.0)
    # BSP over two devices: each takes 4 samples, F = 0.6 + 0.2 = 0.8, B = 1.2 + 0.4 = 1.6 -> 2.4 (no params).
    assert_close(
        estimate(plan([0], [["d0", "d1"]], batch_size=8, micro_batches=1), CostContext(lib, cl)).step_time_s, 2.4
    )


def test_bsp_is_one_stage_on_every_device() -> None:
    # Two layers, 1 s forward and 2 s backward per sample in all, 600 B of parameters; batch 6 on 3 devices.
    lib = library(chain(2), [3.0, 3.0], [6.0, 6.0], [10, 10], param_bytes=[300, 300], batch_size=6)
    slow_pair = {"between": ["d1", "d2"], "bandwidth": 50.0, "latency": 0.2}
    cl = cluster([1.0, 1.0, 0.5], bandwidth=100.0, latency=0.1, overrides=[slow_pair])
    p = single_stage_plan(lib, ["d0", "d1", "d2"], micro_batches=1)
    result = estimate(p, CostContext(lib, cl, Calibration(update_s_per_param_byte=0.001)))
    # Each device takes 2 samples: d0, d1: F 2, B 4; d2 (half speed): F 4, B 8. No cut, so no transfers.
    # Allreduce from max(6, 6, 12) = 12 over the slowest link (50 B/s) with the largest latency (0.2 s):
    #   2*(3-1)/3 * 600 / 50 + 2*(3-1) * 0.2 = 16 + 0.8 = 16.8 -> [12, 28.8].
    # Update: 0.001 * 600 = 0.6 s on d0 and d1, 1.2 s on d2 -> step 28.8 + 1.2 = 30.
    assert_close(result.step_time_s, 30.0)
    assert_close(ops(result, "d0", "allreduce"), [(12, 28.8)])
    assert_close(ops(result, "d0", "update"), [(28.8, 29.4)])
    assert not ops(result, "d0", "send")
    assert_breakdown(result, "d0", compute=6.6, communication=16.8, idle=6.6)
    assert_breakdown(result, "d2", compute=13.2, communication=16.8, idle=0.0)
    # Communication share: 16.8 on all three devices out of 30.
    assert_close(result.communication_share, 16.8 / 30.0)


def test_skip_connection_is_sent_directly_once_per_stage() -> None:
    # 0 -> 1 -> 2 -> 3 with a skip 0 -> 2 and 0 -> 3: layer 0 feeds stage 1 and, directly, stage 2, whose two
    # layers both consume it (sent once). Stages: [0], [1], [2, 3] on d0, d1, d2; 1 sample, 1 micro-batch.
    edges = [(0, 1), (1, 2), (2, 3), (0, 2), (0, 3)]
    lib = library(edges, [1.0, 1.0, 0.5, 0.5], [2.0, 2.0, 1.0, 1.0], [100, 200, 10, 10])
    slow_skip = {"between": ["d0", "d2"], "bandwidth": 10.0, "latency": 0.0}
    cl = cluster([1.0, 1.0, 1.0], bandwidth=100.0, latency=0.0, overrides=[slow_skip])
    p = plan([0, 1, 2, 2], [["d0"], ["d1"], ["d2"]], batch_size=1, micro_batches=1)
    result = estimate(p, CostContext(lib, cl))
    # Every stage: F 1 s, B 2 s.
    # d0: F [0,1]; sends 100 B to d1 in 1 s [1,2] and 100 B straight to d2 over the slow link in 10 s [1,11].
    # d1: F [2,3]; sends 200 B to d2 [3,5].
    # d2: needs both; the last sender finished at 3 (d1), the skip arrives at 11 -> recv [3,11]; F [11,12]
    #     B [12,14]; gradients: 200 B to d1 [14,16], 100 B to d0 over the slow link [14,24].
    # d1: B waits from 14 to 16 -> recv [14,16]; B [16,18]; gradient to d0 [18,19].
    # d0: gradients from d1 (sent 18, arrives 19) and d2 (arrives 24): recv [18,24]; B [24,26]. Step 26.
    assert_close(result.step_time_s, 26.0)
    sends = {(op.device, op.peer): (op.start, op.end) for op in result.timeline if op.kind == "send"}
    assert_close(sends[("d0", "d2")], (1, 11))
    assert_close(sends[("d2", "d0")], (14, 24))
    assert len([op for op in result.timeline if op.kind == "send" and op.device == "d0"]) == 2
    assert_close(ops(result, "d2", "recv"), [(3, 11)])
    assert [op.peer for op in result.timeline if op.kind == "recv" and op.device == "d2"] == ["d0"]
    assert_close(ops(result, "d0", "backward"), [(24, 26)])
    assert_breakdown(result, "d0", compute=3.0, communication=6.0, idle=17.0)


def test_several_tensors_across_one_cut_pay_one_latency_each() -> None:
    # 0 -> 1, 0 -> 2, 1 -> 2 with stages [0, 0, 1]: layers 0 and 1 both send to stage 1 (two tensors).
    lib = library([(0, 1), (0, 2), (1, 2)], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [100, 300, 10])
    cl = cluster([1.0, 1.0], bandwidth=100.0, latency=0.5)
    p = plan([0, 0, 1], [["d0"], ["d1"]], batch_size=1, micro_batches=1)
    result = estimate(p, CostContext(lib, cl))
    # d0: F = 2 s. Transfer = 2 tensors * 0.5 s + (100 + 300) B / 100 = 5 s -> [2,7]. d1: F [7,8] B [8,9].
    # Gradient back [9,14]; d0: B [14,16]. Step 16.
    assert_close(ops(result, "d0", "send"), [(2, 7)])
    assert_close(result.step_time_s, 16.0)


def test_replicas_exchange_overlapping_sample_ranges() -> None:
    # Stage 0 on 2 replicas (samples [0,3), [3,6)), stage 1 on 3 replicas ([0,2), [2,4), [4,6)).
    lib = library(chain(2), [6.0, 6.0], [6.0, 6.0], [100, 10], batch_size=6)
    cl = cluster([1.0] * 5, bandwidth=100.0, latency=0.0)
    p = plan([0, 1], [["d0", "d1"], ["d2", "d3", "d4"]], batch_size=6, micro_batches=1)
    result = estimate(p, CostContext(lib, cl))
    # Shared samples: d0->d2 2, d0->d3 1, d1->d3 1, d1->d4 2; 100 B per sample at 100 B/s -> 1 s per sample.
    # Stage 0 replicas: F = 6 s * 3/6 = 3 s, so sends start at 3.
    sends = {(op.device, op.peer): op.end - op.start for op in result.timeline if op.kind == "send" and op.stage == 0}
    assert sends == pytest.approx({("d0", "d2"): 2.0, ("d0", "d3"): 1.0, ("d1", "d3"): 1.0, ("d1", "d4"): 2.0})


def test_slow_link_queues_messages() -> None:
    # Two stages, 1 s forward and 1 s backward each per micro-batch of 1 sample; 3 micro-batches.
    # The cut carries 300 B at 100 B/s: 3 s per transfer, longer than the compute that produces it.
    lib = library(chain(2), [1.0, 1.0], [1.0, 1.0], [300, 10])
    cl = cluster([1.0, 1.0], bandwidth=100.0, latency=0.0)
    p = plan([0, 1], [["d0"], ["d1"]], batch_size=3, micro_batches=3)
    result = estimate(p, CostContext(lib, cl))
    # d0: F0 [0,1] F1 [1,2] F2 [2,3]; the link takes one at a time: sends [1,4], [4,7], [7,10].
    # d1: F0 [4,5] (recv [1,4]); F1 arrives 7, d1 free at 5 -> recv [5,7], F1 [7,8]; F2: recv [8,10], F2 [10,11].
    #     B2 [11,12] B1 [12,13] B0 [13,14]; gradients queue the same way: [12,15], [15,18], [18,21].
    # d0: B2: sender done at 12, arrives 15 -> recv [12,15], B2 [15,16]; B1 recv [16,18] B1 [18,19];
    #     B0 recv [19,21] B0 [21,22]. Step 22.
    assert_close(ops(result, "d0", "send"), [(1, 4), (4, 7), (7, 10)])
    assert_close(ops(result, "d1", "send"), [(12, 15), (15, 18), (18, 21)])
    assert_close(ops(result, "d1", "forward"), [(4, 5), (7, 8), (10, 11)])
    assert_close(result.step_time_s, 22.0)
    # compute 6; communication 3 + 2 + 2 = 7; idle 22 - 13 = 9, on both devices.
    assert_breakdown(result, "d0", compute=6.0, communication=7.0, idle=9.0)
    assert_breakdown(result, "d1", compute=6.0, communication=7.0, idle=9.0)


def test_async_steady_state() -> None:
    # d0 (speed 1): F 1, B 1; d1 (speed 0.5): F 2, B 2; 2 micro-batches of 1 sample; instantaneous transfers
    # (the cut tensor is empty, no latency); every device pays 1 s per step at its update (per_step_s).
    lib = library(chain(2), [1.0, 1.0], [1.0, 1.0], [0, 10])
    cl = cluster([1.0, 0.5], latency=0.0)
    p = plan([0, 1], [["d0"], ["d1"]], batch_size=2, micro_batches=2, schedule="async")
    result = estimate(p, CostContext(lib, cl, Calibration(per_step_s=1.0)))
    # Micro-batches are numbered across iterations (g = 2 * iteration + m). d0 warms up with 2 forwards.
    # d0: F0 [0,1] F1 [1,2]              d1: F0 [1,3] B0 [3,5]
    # d0: B0 [5,6] F2 [6,7]              d1: F1 [5,7] B1 [7,9] U0 [9,10]
    # d0: B1 [9,10] U0 [10,11] F3 [11,12] d1: F2 [10,12] B2 [12,14] F3 [14,16] B3 [16,18] U1 [18,19]
    # d0: B2 [14,15] F4 [15,16] B3 [18,19] U1 [19,20] F5 [20,21]
    # d1: F4 [19,21] B4 [21,23] F5 [23,25] B5 [25,27] U2 [27,28];  d0: ... U2 [28,29] F7 [29,30]
    # From iteration 1 on, everything repeats 9 s later: d1 never waits (2 * (2 + 2) + 1 = 9 s of work),
    # d0 works 2 * (1 + 1) + 1 = 5 s of every 9. Iterations end at 11, 20, 29, ...
    assert_close(result.step_time_s, 9.0)
    updates = sorted(op.end for op in result.timeline if op.kind == "update" and op.device == "d0")
    assert_close(updates[:3], [11.0, 20.0, 29.0])
    assert_close(ops(result, "d1", "forward")[:4], [(1, 3), (5, 7), (10, 12), (14, 16)])
    assert_breakdown(result, "d1", compute=9.0, communication=0.0, idle=0.0)
    assert_breakdown(result, "d0", compute=5.0, communication=0.0, idle=4.0)
    # Weight stashing: stage 0 keeps S - s = 2 micro-batches and weight versions in flight.
    assert {op.iteration for op in result.timeline} >= {0, 1, 2, 3}
    # The same plan synchronously (gpipe) flushes every step, so it is slower.
    synchronous = estimate(
        plan([0, 1], [["d0"], ["d1"]], 2, 2, "gpipe"), CostContext(lib, cl, Calibration(per_step_s=1.0))
    )
    # gpipe: d0 F0 [0,1] F1 [1,2]; d1 F0 [1,3] F1 [3,5] B1 [5,7] B0 [7,9] U [9,10];
    #        d0 B1 [7,8] B0 [9,10] U [10,11]. Step 11.
    assert_close(synchronous.step_time_s, 11.0)


# --------------------------------------------------------------------------------------------------------------


def test_breakdown_adds_up_to_the_step_on_a_bigger_plan() -> None:
    edges = [*chain(8), (1, 4), (2, 6)]
    lib = library(edges, [0.3, 0.7, 0.2, 0.9, 0.4, 0.6, 0.5, 0.1], [0.6, 1.4, 0.4, 1.8, 0.8, 1.2, 1.0, 0.2],
                  [400, 300, 200, 500, 100, 250, 50, 10], param_bytes=[100] * 8, batch_size=8)  # fmt: skip
    cl = cluster([1.0, 0.8, 0.5, 0.25, 1.0], bandwidth=1000.0, latency=0.01)
    for schedule in ("gpipe", "1f1b", "async"):
        p = plan([0, 0, 1, 1, 2, 2, 3, 3], [["d0"], ["d1", "d4"], ["d2"], ["d3"]], 16, 4, schedule)
        result = estimate(p, CostContext(lib, cl, Calibration(update_s_per_param_byte=1e-3, per_message_s=1e-3)))
        assert result.step_time_s > 0
        for device in p.devices:
            total = result.compute_s[device] + result.communication_s[device] + result.idle_s[device]
            assert_close(total, result.step_time_s)
        again = breakdown(result.timeline, p.devices, (0.0, result.step_time_s)) if schedule != "async" else None
        if again is not None:
            assert again == (result.compute_s, result.communication_s, result.idle_s)


def test_estimate_round_trips_through_json() -> None:
    lib, cl, p = single_device_case()
    result = estimate(p, CostContext(lib, cl, Calibration(per_step_s=0.25, note="test")))
    data = json.loads(result.to_json())
    assert data["step_time_s"] == result.step_time_s and data["calibration"]["per_step_s"] == 0.25
    again = Estimate.from_dict(data)
    assert again == result
    assert list(again.timeline) == list(result.timeline)
    assert again.timeline[0] == TimelineOp("d0", 0, 0, "forward", 0.0, 8.0, 0, "")
    assert [op.micro_batch for op in result.timeline if op.kind == "update"] == [NO_MICRO_BATCH]
    summary = result.to_dict(include_timeline=False)
    assert "timeline" not in summary and summary["peak_memory_bytes"] == result.peak_memory_bytes
    assert Estimate.from_dict(summary).timeline == []


def test_calibration_save_load_and_errors(tmp_path: Path) -> None:
    fitted = Calibration(per_message_s=1e-4, per_step_s=0.02, slowdown_exponent=1.1, note="local, 3 runs")
    assert Calibration.load(fitted.save(tmp_path / "calibration.json")) == fitted
    assert Calibration.from_dict({}) == DEFAULT_CALIBRATION
    assert DEFAULT_CALIBRATION.compute_scale == 1.0 and DEFAULT_CALIBRATION.per_message_s == 0.0
    with pytest.raises(CalibrationError, match=r"unknown field.*per_mesage_s"):
        Calibration.from_dict({"per_mesage_s": 1.0})
    with pytest.raises(CalibrationError, match="per_step_s must be >= 0"):
        Calibration.from_dict({"per_step_s": -1})
    with pytest.raises(CalibrationError, match="compute_scale must be > 0"):
        Calibration(compute_scale=0.0)
    with pytest.raises(CalibrationError, match="must be a number"):
        Calibration.from_dict({"per_step_s": "fast"})
    with pytest.raises(CalibrationError, match="does not exist"):
        Calibration.load(tmp_path / "missing.json")


def test_plan_that_cannot_run_is_refused() -> None:
    lib = library(chain(2), [1.0, 1.0], [1.0, 1.0], [10, 10])
    cl = cluster([1.0, 1.0])
    with pytest.raises(PlanError, match="runs backward"):
        estimate(plan([1, 0], [["d0"], ["d1"]], 1, 1), CostContext(lib, cl))
    with pytest.raises(PlanError, match="unknown device 'd9'"):
        estimate(plan([0, 1], [["d0"], ["d9"]], 1, 1), CostContext(lib, cl))
    with pytest.raises(PlanError, match="places 3 layers"):
        estimate(plan([0, 1, 1], [["d0"], ["d1"]], 1, 1), CostContext(lib, cl))


def test_gantt_writes_a_png_for_an_estimate_and_for_a_bare_timeline(tmp_path: Path) -> None:
    result = pipeline_3x4("1f1b")
    for source, name in ((result, "estimate.png"), (list(result.timeline), "timeline.png")):
        out = gantt(source, tmp_path / name, title="1f1b, 3 stages")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert out.stat().st_size > 5000
    with pytest.raises(ValueError, match="empty"):
        gantt([], tmp_path / "empty.png")


# --------------------------------------------------------------------------------------------------------------
# Ranks that share a host's cores (``costs`` "Shared cores"); durations settle to SHARING_TOLERANCE, hence rel=2e-3.


def shared_host_case(threads: Sequence[int]) -> tuple[LayerLibrary, Cluster]:
    """Two layers: forward 1 s and backward 2 s per sample in all, on real (not emulated) devices of these
    threads, each costed from its own kind's library (the same times on every kind)."""
    base = library(chain(2), [1.0, 1.0], [2.0, 2.0], [10, 10], batch_size=2)
    kinds = [dataclasses.replace(base, threads=t) for t in sorted(set(threads))]
    devices = [{"name": f"d{i}", "threads": t, "memory": 10**9} for i, t in enumerate(threads)]
    cl = parse_cluster(
        {"name": "shared", "emulated": False, "devices": devices, "links": {"bandwidth": 100.0, "latency": 0.0}}
    )
    return kinds[0].with_kinds(kinds[1:]), cl


def sharing(cores: int, factors: dict[str, float]) -> Calibration:
    return Calibration(
        host_cores=cores, kinds={kind: KindCalibration(shared_cores_factor=f) for kind, f in factors.items()}
    )


def test_ranks_computing_together_on_too_few_cores_slow_each_other() -> None:
    lib, cl = shared_host_case([1, 1])
    bsp = single_stage_plan(lib, ["d0", "d1"], micro_batches=1)
    # Alone: each replica does 1 sample, forward 1 s and backward 2 s -> step 3.
    assert_close(estimate(bsp, CostContext(lib, cl)).step_time_s, 3.0)
    # One core for both: every rank computes all the time (excess 1), each at 1/2 its pace -> 2 s + 4 s.
    assert estimate(bsp, CostContext(lib, cl, sharing(1, {"cpu-t1": 2.0}))).step_time_s == pytest.approx(6.0, rel=2e-3)
    # Two cores: the threads fit, nothing is shared; 0 cores: no sharing was measured.
    for cores in (2, 0):
        assert_close(estimate(bsp, CostContext(lib, cl, sharing(cores, {"cpu-t1": 2.0}))).step_time_s, 3.0)


def test_a_starved_rank_computes_when_the_other_waits() -> None:
    lib, cl = shared_host_case([1, 2])
    calibration = sharing(2, {"cpu-t1": 1.0, "cpu-t2": 1e6})
    bsp = single_stage_plan(lib, ["d0", "d1"], micro_batches=1)
    # d0 (1 thread) is not slowed; d1 (2 threads) all but stops while d0 computes: d0 [0, 3], then d1 does its
    # 3 s alone, [3, 6].
    assert estimate(bsp, CostContext(lib, cl, calibration)).step_time_s == pytest.approx(6.0, rel=2e-3)
    # A two-stage pipeline of one micro-batch: the stages take turns, so neither is slowed.
    pipeline = plan([0, 1], [["d0"], ["d1"]], batch_size=2, micro_batches=1)
    assert_close(
        estimate(pipeline, CostContext(lib, cl, calibration)).step_time_s,
        estimate(pipeline, CostContext(lib, cl)).step_time_s,
    )


def test_a_rank_alone_is_not_slowed_by_sharing() -> None:
    lib, cl = shared_host_case([1, 2])
    alone = single_stage_plan(lib, ["d1"], micro_batches=2)
    assert_close(
        estimate(alone, CostContext(lib, cl, sharing(2, {"cpu-t2": 5.0}))).step_time_s,
        estimate(alone, CostContext(lib, cl)).step_time_s,
    )


def test_sharing_needs_the_shared_host_in_the_plan() -> None:
    lib, cl = shared_host_case([1, 1])
    cl = cl.model_copy(update={"devices": (*cl.devices, cl.devices[0].model_copy(update={"name": "far", "host": "b"}))})
    alone = single_stage_plan(lib, ["far"], micro_batches=1)
    # The whole batch on "far", alone on its host: 2 s forward, 4 s backward; d0 and d1 share a core, idle.
    assert_close(estimate(alone, CostContext(lib, cl, sharing(1, {"cpu-t1": 2.0}))).step_time_s, 6.0)


def test_the_compute_fit_recovers_its_terms_and_keeps_the_profile_where_noise_would_set_the_scale() -> None:
    """``fit_compute`` over the calibration's three single-device steps: exact steps give back their scale and
    fixed costs; steps a few milliseconds long whose noise makes the smaller batch the slower (a small text
    classifier's, measured) give a scale past ``PLAUSIBLE_COMPUTE_SCALES``, so the scale is the profile's (1) and
    only the fixed costs are fitted."""
    lib = library(chain(2), [0.004, 0.004], [0.008, 0.008], [10, 20], batch_size=16)  # 24 ms per batch of 16
    per_sample = lib.layer_time_sum_s / 16

    def step(b: int, m: int, scale: float = 1.2, per_op: float = 0.002, per_step: float = 0.001) -> StepPoint:
        return StepPoint(b, m, scale * per_sample * b + 2 * m * per_op + per_step)

    fit = fit_compute(lib, [step(16, 1), step(16, 8), step(4, 1)])
    assert (fit.compute_scale, fit.per_operation_s, fit.per_step_s) == pytest.approx((1.2, 0.002, 0.001))
    noisy = [StepPoint(16, 1, 0.0030), StepPoint(16, 8, 0.0184), StepPoint(4, 1, 0.0033)]
    fit = fit_compute(lib, noisy)
    assert fit.compute_scale == 1.0
    assert fit.per_operation_s >= 0 and fit.per_step_s >= 0
