"""The timing of a stage whose layers run split signatures (operator parallelism inside a stage): each device's
forward and backward of one micro-batch, and whether its group is coupled (exchanges data inside every forward and
backward). The simulation (``tapp_core.cost.simulation``) uses them in place of a replica's own compute."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from tapp_core.cost.calibration import Calibration
from tapp_core.cost.formulas import DeviceTerms, collective_s
from tapp_core.cost.layer_arrays import layer_arrays
from tapp_core.plan.placement import StageLayouts
from tapp_core.plan.plan import Plan
from tapp_core.plan.program import BACKWARD, FORWARD, DeviceProgram
from tapp_core.platform.cluster import Cluster, Link
from tapp_core.profile.library import LayerLibrary

EXCHANGE = {FORWARD: "forward exchange", BACKWARD: "backward exchange"}
"""``_SimulatedDevice.duration`` keys: the part of a coupled forward (backward) spent in its stage's collectives."""


def split_stage_durations(
    plan: Plan,
    programs: Sequence[DeviceProgram],
    terms: Mapping[str, DeviceTerms],
    cluster: Cluster,
    calibration: Calibration,
) -> dict[int, tuple[dict[str, float], bool]]:
    """Per device of a stage whose layers run split signatures: its forward and backward, and whether the stage is
    coupled. A layer's work on a device is its share of the layer as the layouts run it (``_layer_work``); a coupled
    group runs each segment between two layout changes at its slowest device's pace, then the change's collective
    (``formulas.collective_s``, the backward's from the dual layouts)."""
    out: dict[int, tuple[dict[str, float], bool]] = {}
    for stage in range(plan.n_stages):
        if not plan.runs_split(stage):
            continue
        members = [p for p in programs if p.stage == stage]
        library = terms[members[0].device].library
        layouts = plan.layouts(library, stage)
        group = plan.stage_devices[stage]
        links = [cluster.link(a, b) for i, a in enumerate(group) for b in group[i + 1 :]]
        work = {
            p.position: _layer_work(plan, layouts, stage, p, terms[p.device]) * terms[p.device].compute_factor
            for p in members
        }
        durations = {p.position: {FORWARD: 0.0, BACKWARD: 0.0} for p in members}
        for kind, column in ((FORWARD, 0), (BACKWARD, 1)):
            if layouts.coupled:
                busy, exchange = _coupled_time(plan, layouts, stage, work, column, library, links, calibration, kind)
                for p in members:
                    durations[p.position][kind] = busy + exchange + terms[p.device].figures.per_micro_batch_s
                    durations[p.position][EXCHANGE[kind]] = exchange
            else:
                for p in members:
                    seconds = float(work[p.position][:, column].sum())
                    durations[p.position][kind] = seconds + terms[p.device].figures.per_micro_batch_s
        for p in members:
            out[p.position] = (durations[p.position], layouts.coupled)
    return out


def _layer_work(
    plan: Plan, layouts: StageLayouts, stage: int, program: DeviceProgram, terms: DeviceTerms
) -> np.ndarray:
    """(stage layers, 2): each layer's forward and backward work on the device, in seconds of its library: the fixed
    part and the per-sample part times what the device runs of the layer (its rows of a Split(0) input; its share
    of the whole micro-batch where the layer is split along its features, fixed part included; all of it where
    the layer is replicated)."""
    arrays = layer_arrays(terms.library)
    layers = np.asarray(plan.stage_layers(stage))
    per_sample = 1.0 / terms.library.batch_size
    share = plan.shares(stage)[program.replica]
    micro = plan.micro_batch_size
    fixed_part = np.array([share if layouts.split(int(x)) else 1.0 for x in layers])
    samples = np.array(
        [share * micro if layouts.split(int(x)) else (micro if layouts.replicated(int(x)) else program.samples)
         for x in layers]
    )  # fmt: skip
    forward = (
        arrays.forward_fixed_s[layers] * fixed_part
        + (arrays.forward_s[layers] - arrays.forward_fixed_s[layers]) * per_sample * samples
    )
    backward = (
        arrays.backward_fixed_s[layers] * fixed_part
        + (arrays.backward_s[layers] - arrays.backward_fixed_s[layers]) * per_sample * samples
    )
    return np.stack([forward, backward], axis=1)


def _coupled_time(
    plan: Plan,
    layouts: StageLayouts,
    stage: int,
    work: Mapping[int, np.ndarray],
    column: int,
    library: LayerLibrary,
    links: Sequence[Link],
    calibration: Calibration,
    kind: str,
) -> tuple[float, float]:
    """A coupled group's forward (``column`` 0) or backward (1): (each segment of layers between layout changes at
    the pace of its slowest device (``work`` is per device, in its seconds), every change's collective on the
    micro-batch)."""
    layers = plan.stage_layers(stage)
    position = {layer: i for i, layer in enumerate(layers)}
    breaks = sorted({position[c.layer] for c in layouts.changes if c.layer in position} | {0, len(layers)})
    total = 0.0
    for start, stop in itertools.pairwise(breaks):
        total += max(float(w[start:stop, column].sum()) for w in work.values())
    shares = plan.shares(stage)
    activation = layer_arrays(library).activation_bytes
    exchange = 0.0
    for change in layouts.changes:
        collective = change.forward if kind == FORWARD else change.backward
        tensor_bytes = float(activation[change.value]) * plan.micro_batch_size
        exchange += collective_s(collective, tensor_bytes, shares, links, calibration)
    return total, exchange
