"""Plans: which layers form which pipeline stage, and which device(s) run each stage; and the checks a plan must
pass to run.

A stage may run on several devices, a *group* (``tapp_core.plan.placement``): each device takes its share of the stage's
work (``stage_shares``; equal shares unless the plan gives them, e.g. in proportion to the devices' speeds). As
data-parallel replicas, each device computes its share of every micro-batch's samples (``rows``) and the group
sums its gradients with an allreduce before the update. BSP is the plan with one stage on every device;
single-device training is one stage on one device.

A plan's schedule is a name in ``tapp_core.plan.schedules.SCHEDULES`` (with a ``staleness`` bound for ``async``),
checked when the plan is made. The checks are parts that each caller combines as it needs (``validate`` runs them
all): ``check_shape``, ``check_layers``, ``check_stages_used``, ``check_edges``, ``check_devices``,
``check_groups`` and ``check_memory``. Each raises ``PlanError`` naming the layer, stage or device at fault.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np

from tapp_core.errors import TappError
from tapp_core.model.graph import LayerSpec
from tapp_core.plan.placement import (
    DATA,
    SAMPLES,
    Layout,
    PlacementError,
    Split,
    StageLayouts,
    check_rows_per_sample,
    check_shares,
    check_signature,
    check_units,
    even_shares,
    split_ranges,
    stage_layouts,
)
from tapp_core.plan.schedules import (
    PipelineSchedule,
    UnknownScheduleError,
    posted_receives,
    schedule_for,
    schedule_spec,
)
from tapp_core.plan.ties import tied_copy_bytes
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.library import Layer, LayerLibrary
from tapp_core.records import json_object, write_record

WEIGHT_AND_GRADIENT = 2
"""Bytes of training state per parameter byte besides the optimiser's: the weights and their gradients."""
SGD_MOMENTUM_STATE = 1
"""The optimiser state per parameter byte of the workload's default optimiser, SGD with momentum
(``OptimizerConfig.state_per_param``; AdamW's is 2): the memory model's when no optimiser is named."""
MEMORY_TERMS = (
    "training state",
    "stashed weights",
    "activations",
    "backward working memory",
    "gradient transient",
    "gradient buckets",
    "posted receives",
    "runtime",
    "model trace",
)
"""The terms of a device's peak memory (``device_memory_terms``):

- training state: weights, gradients and the optimiser's state, ``WEIGHT_AND_GRADIENT`` plus the optimiser's
  tensors per parameter (``OptimizerConfig.state_per_param``) times the parameters (a device of a stage that shards
  its optimiser state, ``Plan.shard_optimizer``: the optimiser's tensors of its share alone);
- stashed weights: the weight versions an asynchronous stage keeps for its forwards in flight (a version is
  dropped at the update after its last backward, before the next forward makes one);
- activations: the stage's inputs and what autograd keeps of each layer's forward (``KeptOutputs``) of each
  micro-batch in flight, views left out (``VIEW_OPS``; a recomputing stage: the inputs, and what the one whose
  backward runs keeps);
- backward working memory: the gradient a layer takes and the one it makes, twice the largest layer output of a
  micro-batch;
- gradient transient: a layer's new weight gradient before it is added to the gradient so far (a stage that runs
  several backwards a step; a stashing stage of one micro-batch a step takes each version's gradient as it is),
  the largest layer's;
- gradient buckets: on a stage of several devices, the flat buffer each bucket is reduced in and MPI's working
  memory for the allreduce, ``BUCKET_COPIES`` times the gradients reduced (a device of a stage that shards its
  optimiser state accumulates the gradients in the flat buffers themselves and receives its share of their sum:
  ``SHARD_COPIES`` times its share of them);
- posted receives: the buffers of the receives a device posts ahead of its forwards and backwards
  (``schedules.receive_lookahead``) whose messages have come and none has taken yet, at the stage's peak: the
  activations of as many micro-batches as the earlier stage has more in flight, the gradients of at most its own
  (a fresh buffer's pages are taken when its message is copied in);
- runtime: what a stage costs a rank whatever its layers (its traced program, the transport's buffers);
- model trace: how far the rank's run of the whole model at the plan's start (``model_trace_bytes``, with the
  runtime's own) goes beyond the other terms: a transient before the stage is built, so the device's peak is the
  larger of the two."""
BUCKET_COPIES = 1.5
"""Bytes a replicated stage holds per byte of gradient it reduces: the flat bucket (1) and MPICH's allreduce working
memory (measured about half, on 2 and 4 CPU ranks: ``bench/memory.py``)."""
SHARD_COPIES = 2.0
"""Bytes a device of a stage that shards its optimiser state holds per byte of its share of the reduced gradients:
the sum it receives (1) and MPICH's reduce-scatter working memory (measured 1: a reduce-scatter of 89 MiB took
2 x 44.5 MiB on each of 2 ranks, 2 x 22 on each of 4, and 2 x 67 and 2 x 22 with shares 0.75 and 0.25)."""
VIEW_OPS = frozenset(
    {"view", "reshape", "transpose", "permute", "flatten", "getitem", "expand", "unsqueeze", "squeeze", "getattr",
     "size", "dim", "chunk", "split", "narrow", "select", "movedim", "t", "unflatten", "view_as", "expand_as",
     "unbind"}
)  # fmt: skip
"""Layers whose output is a view of their input, sharing its memory: they hold no activation of their own (a
``reshape`` of a tensor that is not contiguous copies it; counted as a view all the same)."""
RUNTIME_BYTES = 7 * 2**20
"""What running a stage adds to a rank's memory whatever its layers (its traced program, the transport's buffers,
MPI's): with the C allocator giving freed memory back, the 23 stages of under 30 MiB that ``bench/memory.py``
measured held 2.6-10.0 MiB beyond their other terms in two runs (2026-11-30), medians 7.6 and 6.9, the same stage
up to 4 MiB apart from one run to the next: what the model cannot tell apart."""

TRACE_SAMPLES = 1
"""Samples of every layer's output that a rank's trace of the whole model, when it cuts the model for a plan
(``tapp_core.runtime.stage.split_stages``, on 2 samples), holds at its peak above the runtime's own, as measured
with the C allocator giving freed memory back (``tapp_core.runtime.allocator``): the ViT's head alone on a device,
12.7 MiB above the runtime against 12.5 counted (``bench/memory.py``, 2026-11-30). By glibc's default the peak
looks five samples' (57 MiB), the blocks the trace frees kept by the allocator."""

LayerName = Callable[[int], str]
"""The name of a layer, by index: how a check names the layer at fault."""


class PlanError(TappError):
    """A plan that cannot run: the message names the layer, stage or device at fault."""


class OutOfMemory(PlanError):
    """A plan a device lacks the memory for (``cost.checks.check_memory``): the message names the device, what its
    stage needs, by term, and what it has."""


@dataclass(frozen=True)
class Plan:
    model: str
    batch_size: int
    micro_batches: int
    schedule: str
    """A name in ``tapp_core.plan.schedules.SCHEDULES``; an unknown one is a ``PlanError`` when the plan is made."""
    stage_of_layer: tuple[int, ...]
    """``stage_of_layer[i]`` is the stage of layer ``i`` of the layer library."""
    stage_devices: tuple[tuple[str, ...], ...]
    """``stage_devices[s]`` are the devices running stage ``s`` (more than one: data-parallel replicas)."""
    planner: str = ""
    notes: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    staleness: int | None = None
    """``async`` only: the most updates a gradient may be applied after the weights it was computed on (None: as
    deep as the pipeline; 0: synchronous)."""
    stage_shares: tuple[tuple[float, ...], ...] = ()
    """Per stage, each device's share of its work; empty: equal shares on every stage."""
    signatures: tuple[tuple[int, str], ...] = ()
    """(layer, signature) of the layers of stages on several devices that run other than ``data``
    (``tapp_core.plan.placement``: ``col``, ``row``), by layer; every other layer runs ``data``."""
    bucket_bytes: int | None = None
    """Gradient bucket size of stages on several devices (``tapp_core.plan.program``); None: the default; 0: one bucket,
    reduced once the step's last backward is done (no overlap with the backward)."""
    recompute: tuple[int, ...] = ()
    """The stages that recompute their activations: each keeps only its inputs of a micro-batch in flight and runs
    its forward again in the backward (activation checkpointing). A stage whose layers run split signatures cannot."""
    shard_optimizer: tuple[int, ...] = ()
    """The stages of several devices that shard their optimiser state among their devices (ZeRO stage 1): each
    device holds and updates the state of its share of the gradient buckets (in proportion to its share of the
    stage), the gradients are reduce-scattered and the updated parameters all-gathered. Not on a stage whose layers
    run split signatures, nor on one that applies its gradients late (an asynchronous stage's weight prediction reads
    the whole optimiser state)."""

    def __post_init__(self) -> None:
        try:
            schedule_for(self.schedule, self.staleness)
        except UnknownScheduleError as exc:
            raise PlanError(str(exc)) from None
        if list(self.signatures) != sorted(dict(self.signatures).items()) or DATA in dict(self.signatures).values():
            object.__setattr__(
                self, "signatures", tuple(sorted((k, v) for k, v in dict(self.signatures).items() if v != DATA))
            )
        if self.bucket_bytes is not None and self.bucket_bytes < 0:
            raise PlanError(f"bucket_bytes must be 0 or more, got {self.bucket_bytes}")
        _check_recompute(self)
        if self.stage_shares and len(self.stage_shares) != len(self.stage_devices):
            raise PlanError(f"plan gives shares for {len(self.stage_shares)} stages but has {len(self.stage_devices)}")
        for stage, (shares, devices) in enumerate(zip(self.stage_shares, self.stage_devices, strict=False)):
            if len(shares) != len(devices):
                raise PlanError(f"stage {stage}: {len(shares)} shares for {len(devices)} devices")
        _check_shard_optimizer(self)

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        """The schedule object of ``schedule``: its order of operations, activations in flight and so on."""
        return schedule_for(self.schedule, self.staleness)

    def regrouped(
        self, stage_of_layer: tuple[int, ...] | None = None, stage_devices: tuple[tuple[str, ...], ...] | None = None
    ) -> Plan:
        """This plan with other stages or device groups: a stage keeps its shares while it keeps its group (a new
        group shares equally); the signatures stay on the layers still on a group of several devices."""
        layers = self.stage_of_layer if stage_of_layer is None else stage_of_layer
        groups = self.stage_devices if stage_devices is None else stage_devices
        shares: tuple[tuple[float, ...], ...] = ()
        if self.stage_shares:
            old = dict(zip(self.stage_devices, self.stage_shares, strict=True))
            shares = tuple(old.get(group, even_shares(len(group))) for group in groups)
        signatures = tuple((x, sig) for x, sig in self.signatures if len(groups[layers[x]]) > 1)
        recomputing = {self.stage_devices[s] for s in self.recompute}
        split = {layers[x] for x, _ in signatures}
        recompute = tuple(s for s, group in enumerate(groups) if group in recomputing and s not in split)
        sharding = {self.stage_devices[s] for s in self.shard_optimizer}
        regrouped = dataclasses.replace(
            self,
            stage_of_layer=layers,
            stage_devices=groups,
            stage_shares=shares,
            signatures=signatures,
            recompute=recompute,
            shard_optimizer=(),
        )
        kept = tuple(
            s for s, group in enumerate(groups) if group in sharding and optimizer_unshardable(regrouped, s) is None
        )
        return dataclasses.replace(regrouped, shard_optimizer=kept) if kept else regrouped

    def recomputes(self, stage: int) -> bool:
        """Whether ``stage`` runs its forward again in the backward rather than keep its activations."""
        return stage in self.recompute

    def shards_optimizer(self, stage: int) -> bool:
        """Whether ``stage``'s devices each hold and update only their share of its optimiser state."""
        return stage in self.shard_optimizer

    def optimizer_share(self, stage: int, rows: int) -> float:
        """The share of ``stage``'s optimiser state (and of its summed gradients) that a device computing ``rows``
        rows of each micro-batch holds and updates: its share of the rows where the stage shards it, else all."""
        return rows / self.micro_batch_size if self.shards_optimizer(stage) else 1.0

    @property
    def schedule_spec(self) -> str:
        """The schedule with its staleness bound, in one string (``async:1``; ``tapp_core.plan.schedules.schedule_spec``)."""
        return schedule_spec(self.schedule, self.staleness)

    def shares(self, stage: int) -> tuple[float, ...]:
        """Each device's share of ``stage``'s work, in the stage's device order."""
        return self.stage_shares[stage] if self.stage_shares else even_shares(len(self.stage_devices[stage]))

    def runs_split(self, stage: int) -> bool:
        """Whether a layer of ``stage`` runs a signature other than ``data``."""
        return any(self.stage_of_layer[layer] == stage for layer, _ in self.signatures)

    def signature_of(self) -> dict[int, str]:
        """Layer -> its signature, for the layers that run other than ``data``."""
        return dict(self.signatures)

    def layouts(self, library: LayerLibrary, stage: int) -> StageLayouts:
        """How ``stage``'s group runs its layers (``placement.stage_layouts``)."""
        return stage_layouts(
            library.specs(), self.stage_layers(stage), self.signature_of(), len(self.stage_devices[stage])
        )

    def rows(self, stage: int) -> tuple[tuple[int, int], ...]:
        """Each device's rows ``[start, stop)`` of every micro-batch of ``stage`` (``placement.split_ranges``)."""
        return split_ranges(self.micro_batch_size, self.shares(stage))

    @property
    def n_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for stage in self.stage_devices for d in stage)

    def stage_layers(self, stage: int) -> list[int]:
        return [i for i, s in enumerate(self.stage_of_layer) if s == stage]

    def describe(self, library: LayerLibrary | None = None) -> str:
        """The plan in one line: its stages (devices, layers where there are several stages, shares where unequal,
        split layers by name with a library), micro-batches and schedule (with its staleness bound), e.g.
        ``cpu0 (layers 0-1) | cpu1+cpu2 (layers 2-3; 0.6/0.4; fc1 col, fc2 row), m=2, async (staleness 1)``."""
        stages = []
        for s, group in enumerate(self.stage_devices):
            text = "+".join(group)
            details = [self._layers_of(s)] if self.n_stages > 1 else []
            if self.stage_shares and len(set(self.stage_shares[s])) > 1:
                details.append("/".join(f"{x:.2g}" for x in self.stage_shares[s]))
            split = [
                f"{library.layers[x].name if library else f'layer {x}'} {sig}"
                for x, sig in self.signatures
                if self.stage_of_layer[x] == s
            ]
            if split:
                details.append(", ".join(split))
            if self.recomputes(s):
                details.append("recompute")
            if self.shards_optimizer(s):
                details.append("sharded optimizer")
            stages.append(f"{text} ({'; '.join(details)})" if details else text)
        schedule = self.schedule + (f" (staleness {self.staleness})" if self.staleness is not None else "")
        return f"{' | '.join(stages)}, m={self.micro_batches}, {schedule}"

    def _layers_of(self, stage: int) -> str:
        """Stage ``stage``'s layers: their range where they follow each other, else how many."""
        layers = [x for x, owner in enumerate(self.stage_of_layer) if owner == stage]
        if layers and layers[-1] - layers[0] + 1 == len(layers):
            return f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
        return f"{len(layers)} layers"

    def canonical(self) -> dict[str, object]:
        """The content that decides what runs; the id is its hash. Planner name and notes are not part of it. The
        fields a plan of an earlier version could not have are written only when set, so its id is unchanged."""
        content: dict[str, object] = {
            "model": self.model,
            "batch_size": self.batch_size,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "stage_of_layer": list(self.stage_of_layer),
            "stage_devices": [list(d) for d in self.stage_devices],
        }
        if self.staleness is not None:
            content["staleness"] = self.staleness
        if self.stage_shares:
            content["stage_shares"] = [list(s) for s in self.stage_shares]
        if self.bucket_bytes is not None:
            content["bucket_bytes"] = self.bucket_bytes
        if self.signatures:
            content["signatures"] = {str(layer): name for layer, name in self.signatures}
        if self.recompute:
            content["recompute"] = list(self.recompute)
        if self.shard_optimizer:
            content["shard_optimizer"] = list(self.shard_optimizer)
        return content

    @functools.cached_property
    def id(self) -> str:
        """The content's digest, computed once per plan (the fields are frozen): a search asks it of every
        candidate many times."""
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def execution_id(self) -> str:
        """The id of what runs (``plan_execution_id``): equal for plans that differ only where nothing differs."""
        return plan_execution_id(self)

    def to_dict(self) -> dict[str, object]:
        return {"id": self.id, **self.canonical(), "planner": self.planner, "notes": self.notes}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> Path:
        return write_record(path, self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, object], source: str = "<plan>") -> Plan:
        required = ("model", "batch_size", "micro_batches", "schedule", "stage_of_layer", "stage_devices")
        missing = [k for k in required if k not in data]
        if missing:
            raise PlanError(f"plan {source} lacks field(s): {', '.join(missing)}")
        try:
            notes = data.get("notes") or {}
            if not isinstance(notes, dict):
                raise TypeError(f"notes must be a mapping, got {notes!r}")
            plan = cls(
                model=str(data["model"]),
                batch_size=_integer(data["batch_size"], "batch_size"),
                micro_batches=_integer(data["micro_batches"], "micro_batches"),
                schedule=str(data["schedule"]),
                stage_of_layer=tuple(_integer(s, "stage_of_layer") for s in _items(data["stage_of_layer"])),
                stage_devices=tuple(tuple(str(d) for d in _items(devs)) for devs in _items(data["stage_devices"])),
                planner=str(data.get("planner", "")),
                notes=dict(notes),
                staleness=None if data.get("staleness") is None else _integer(data["staleness"], "staleness"),
                bucket_bytes=None if data.get("bucket_bytes") is None else _integer(data["bucket_bytes"], "bytes"),
                signatures=_signatures(data.get("signatures") or {}),
                recompute=tuple(_integer(s, "recompute") for s in _items(data.get("recompute") or [])),
                shard_optimizer=tuple(
                    _integer(s, "shard_optimizer") for s in _items(data.get("shard_optimizer") or [])
                ),
                stage_shares=tuple(
                    tuple(_number(x, "stage_shares") for x in _items(shares))
                    for shares in _items(data.get("stage_shares") or [])
                ),
            )
        except PlanError as exc:
            raise PlanError(f"plan {source}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise PlanError(f"plan {source} has a field of the wrong type: {exc}") from None
        stated = data.get("id")
        if stated is not None and stated != plan.id:
            raise PlanError(f"plan {source} says its id is {stated} but its content hashes to {plan.id}")
        return plan

    @classmethod
    def from_json(cls, text: str, source: str = "<plan>") -> Plan:
        return cls.from_dict(json_object(text, "plan", source, PlanError), source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if p.is_dir():
            raise PlanError(f"plan file {p} is a folder, not a JSON file")
        if not p.is_file():
            raise PlanError(f"plan file {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise PlanError(f"plan file {p} is not a text file (JSON expected)") from None
        except OSError as exc:
            raise PlanError(f"plan file {p} cannot be read: {exc.strerror or exc}") from None
        return cls.from_json(text, str(p))


def _check_recompute(plan: Plan) -> None:
    """The recomputing stages in order, once each, every one a stage of the plan that runs no split signature."""
    stages = plan.recompute
    if list(stages) != sorted(set(stages)):
        object.__setattr__(plan, "recompute", tuple(sorted(set(stages))))
    for stage in plan.recompute:
        if not 0 <= stage < len(plan.stage_devices):
            raise PlanError(f"recompute names stage {stage}, but stages are 0..{len(plan.stage_devices) - 1}")
        if any(0 <= x < len(plan.stage_of_layer) and plan.stage_of_layer[x] == stage for x, _ in plan.signatures):
            raise PlanError(f"stage {stage} runs split signatures and cannot recompute its activations")


def _check_shard_optimizer(plan: Plan) -> None:
    """The stages that shard their optimiser state in order, once each, every one able to (``optimizer_unshardable``)."""
    stages = plan.shard_optimizer
    if list(stages) != sorted(set(stages)):
        object.__setattr__(plan, "shard_optimizer", tuple(sorted(set(stages))))
    for stage in plan.shard_optimizer:
        reason = optimizer_unshardable(plan, stage)
        if reason is not None:
            raise PlanError(f"shard_optimizer names stage {stage}, which {reason}")


def optimizer_unshardable(plan: Plan, stage: int) -> str | None:
    """Why ``stage`` of ``plan`` cannot shard its optimiser state among its devices (None: it can)."""
    if not 0 <= stage < len(plan.stage_devices):
        return f"is not a stage (stages are 0..{len(plan.stage_devices) - 1})"
    if len(plan.stage_devices[stage]) < 2:
        return "runs on one device"
    if any(0 <= x < len(plan.stage_of_layer) and plan.stage_of_layer[x] == stage for x, _ in plan.signatures):
        return "runs split signatures"
    schedule = plan.pipeline_schedule
    if schedule.delay(stage, plan.n_stages, plan.micro_batches) > 0 or schedule.stashes_weights(
        stage, plan.n_stages, plan.micro_batches
    ):
        return "applies its gradients late (an asynchronous stage predicts its weights from the whole optimiser state)"
    return None


def _integer(value: object, name: str) -> int:
    """``value`` as an integer: an int, a float with no fraction, or the text of an integer; nothing else (a
    fraction is not truncated, a boolean is not 1, and JSON's ``1e999`` reads as infinity)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise TypeError(f"{name} must be an integer, got {value!r}")


def _signatures(value: object) -> tuple[tuple[int, str], ...]:
    if not isinstance(value, dict):
        raise TypeError(f"signatures must map layers to signature names, got {value!r}")
    return tuple(sorted((_integer(layer, "signatures"), str(name)) for layer, name in value.items()))


def _number(value: object, name: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise TypeError(f"{name} must hold numbers, got {value!r}")


def _items(value: object) -> list[object]:
    if isinstance(value, list | tuple):
        return list(value)
    raise TypeError(f"expected a list, got {value!r}")


class DeviceFootprint(NamedTuple):
    """What a device of a stage holds, in the quantities ``device_memory_terms`` counts (per sample where said)."""

    param_bytes: float
    """Its parameters (its share of a split layer's)."""
    activation_bytes: float
    """Per sample, its layers' outputs that a micro-batch in flight holds."""
    kept_bytes: float = 0.0
    """Per sample, the inputs it keeps of each micro-batch in flight (``stage_input_bytes``)."""
    largest_param_bytes: float = 0.0
    """Its largest layer's parameters."""
    reduced_bytes: float = 0.0
    """The gradients its group sums across its devices."""
    largest_activation_bytes: float = 0.0
    """Per sample, its largest layer output."""
    received_bytes: tuple[float, float] = (0.0, 0.0)
    """Per sample, the activations and gradients it receives of a micro-batch (``StageCounts.received``)."""
    frozen_bytes: float = 0.0
    """Of ``param_bytes``, the frozen parameters' (``Layer.frozen_bytes``): weights without a gradient, an optimiser
    state or a stash."""


def device_memory_terms(
    plan: Plan,
    stage: int,
    samples: int,
    footprint: DeviceFootprint,
    optimizer_state: int = SGD_MOMENTUM_STATE,
    trace_bytes: float = 0.0,
) -> dict[str, float]:
    """The memory of a device of ``stage`` at its peak, by named term (``MEMORY_TERMS``), for a device that computes
    ``samples`` rows of each micro-batch and holds ``footprint``; ``optimizer_state`` is the optimiser's tensors per
    parameter, ``trace_bytes`` the model's ``model_trace_bytes``. A stage keeps its inputs and its layers' outputs
    of each micro-batch in flight; one that recomputes keeps only its inputs, and every activation of the one whose
    backward it runs. What is left out, and how the terms were checked against the machine: the README, "Memory"."""
    f = footprint
    schedule = plan.pipeline_schedule
    in_flight = schedule.in_flight(stage, plan.n_stages, plan.micro_batches)
    versions = schedule.weight_versions(stage, plan.n_stages, plan.micro_batches)
    if plan.recomputes(stage):
        activations = in_flight * f.kept_bytes * samples + f.activation_bytes * samples
    else:
        activations = in_flight * (f.activation_bytes + f.kept_bytes) * samples
    accumulates = plan.micro_batches > 1
    trained = f.param_bytes - f.frozen_bytes
    sharded = plan.shards_optimizer(stage)
    share = plan.optimizer_share(stage, samples)
    terms = {
        "training state": f.param_bytes + (WEIGHT_AND_GRADIENT - 1 + optimizer_state * share) * trained,
        "stashed weights": versions * trained,
        "activations": activations,
        "backward working memory": 2 * f.largest_activation_bytes * samples,
        "gradient transient": f.largest_param_bytes if accumulates else 0.0,
        "gradient buckets": (SHARD_COPIES * share if sharded else BUCKET_COPIES) * f.reduced_bytes
        if len(plan.stage_devices[stage]) > 1
        else 0.0,
        "posted receives": samples * _posted_receive_bytes(plan, stage, *f.received_bytes),
        "runtime": float(RUNTIME_BYTES),
    }
    terms["model trace"] = max(0.0, terms["runtime"] + trace_bytes - sum(terms.values()))
    return terms


def _posted_receive_bytes(plan: Plan, stage: int, forward: float, backward: float) -> float:
    """Per sample, the most that the receives a device of ``stage`` has posted ahead hold at its peak
    (``schedules.posted_receives``), beyond the micro-batches in flight: a receive's fresh buffer takes memory once
    its message is copied in. An earlier stage sends the activations of no more forwards than it has in flight,
    those this stage has taken among them, so at this stage's peak of micro-batches in flight, the difference has
    come and waits (a buffer taken is the stage's input, counted in its activations); a later stage sends the
    gradients of no more backwards than this stage has forwards in flight."""
    if not (forward or backward):
        return 0.0
    schedule, n_stages, micro_batches = plan.pipeline_schedule, plan.n_stages, plan.micro_batches
    counts = posted_receives(schedule, stage, n_stages, micro_batches, forward > 0, backward > 0)
    own = schedule.in_flight(stage, n_stages, micro_batches)
    sent = schedule.in_flight(stage - 1, n_stages, micro_batches) if stage > 0 else own
    return max(min(n_f, max(sent - own, 0)) * forward + min(n_b, own) * backward for n_f, n_b in counts)


def held_activation_bytes(layer: Layer) -> int:
    """Bytes per sample of ``layer``'s output that a micro-batch in flight holds: none for a view (``VIEW_OPS``)."""
    return 0 if layer.op in VIEW_OPS else layer.activation_bytes


class KeptOutputs:
    """Per layer, the bytes per sample that a micro-batch in flight keeps of its forward until its backward, under
    a plan's stages: its output (``held_activation_bytes``) where autograd saves it (``Layer.output_saved``; in a
    library that did not measure it, where the backward reads it: ``LayerLibrary.read_by_backward``) or it is sent
    to a layer of another stage (the runtime holds what it sends until that micro-batch's backward, saved or not:
    a frozen prefix's last output), and what else autograd saves of its forward (``Layer.saved_bytes``). The one
    definition the memory model and the planners' screen count."""

    def __init__(self, library: LayerLibrary) -> None:
        self.held = np.array([held_activation_bytes(layer) for layer in library.layers], dtype=np.float64)
        read = library.read_by_backward()
        self.output_saved = np.array(
            [read[x.index] if x.output_saved is None else x.output_saved for x in library.layers], dtype=bool
        )
        self.extra_saved = np.array([layer.saved_bytes for layer in library.layers], dtype=np.float64)
        self.edges = np.array(library.edges(), dtype=np.int64).reshape(-1, 2)
        self.trace_bytes = float(TRACE_SAMPLES * self.held.sum())
        """``model_trace_bytes``: every layer's held output of the trace's samples."""

    _last: ClassVar[tuple[weakref.ref[LayerLibrary], KeptOutputs] | None] = None

    @classmethod
    def of(cls, library: LayerLibrary) -> KeptOutputs:
        """The arrays of ``library``, made once for the same library object (a search screens thousands of plans)."""
        last = cls._last
        if last is not None and last[0]() is library:
            return last[1]
        kept = cls(library)
        cls._last = (weakref.ref(library), kept)
        return kept

    def outputs(self, stage_of_layer: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each layer's kept output bytes per sample under ``stage_of_layer`` (what else its forward keeps apart:
        ``extra_saved``)."""
        stages = np.asarray(stage_of_layer)
        kept = self.output_saved.copy()
        crossing = self.edges[stages[self.edges[:, 0]] != stages[self.edges[:, 1]], 0]
        kept[crossing] = True
        return np.where(kept, self.held, 0.0)

    def per_layer(self, stage_of_layer: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each layer's kept bytes per sample under ``stage_of_layer``: its output and the rest of its forward."""
        return self.outputs(stage_of_layer) + self.extra_saved


def model_trace_bytes(library: LayerLibrary) -> float:
    """What a rank holds at once, besides the runtime's own, while it cuts the whole model for a plan: every
    layer's output (views left out, ``held_activation_bytes``) of ``TRACE_SAMPLES`` samples. Freed before the
    stage is built (``tapp_core.runtime.rank``), it counts where the stage itself needs less.
    Counted once per library (``KeptOutputs.of``): the searches count thousands of plans' memory."""
    return KeptOutputs.of(library).trace_bytes


def stage_input_bytes(library: LayerLibrary, stage_of_layer: Sequence[int], stage: int) -> int:
    """Bytes per sample of what ``stage`` takes in: the cut values of earlier stages its layers read, and the
    model's input if a layer of it reads that. What a stage keeps of each micro-batch in flight besides its own
    layers' outputs (a recomputing stage: instead of them)."""
    return int(stages_input_bytes(library, stage_of_layer, max(max(stage_of_layer, default=0), stage) + 1)[stage])


def stages_input_bytes(library: LayerLibrary, stage_of_layer: Sequence[int], n_stages: int) -> np.ndarray:
    """``stage_input_bytes`` of every stage at once (``InputCounter``)."""
    return InputCounter.of(library).per_stage(stage_of_layer, n_stages)


class StageCounts(NamedTuple):
    """Per stage, bytes per sample: ``inputs``, what it takes in and keeps (``stage_input_bytes``); ``received``,
    what it receives for each micro-batch: the activations of earlier stages (its inputs but the model's), and the
    gradients of its outputs, one from each later stage reading them."""

    inputs: np.ndarray
    received: tuple[np.ndarray, np.ndarray]


class InputCounter:
    """``stage_input_bytes`` of every stage of any plan of one library, vectorised over its layers and edges (the
    arrays made once: a search counts thousands of plans)."""

    def __init__(self, library: LayerLibrary) -> None:
        self.outputs = np.array([layer.activation_bytes for layer in library.layers], dtype=np.float64)
        self.edges = np.array(library.edges(), dtype=np.int64).reshape(-1, 2)
        self.first = np.array([not layer.predecessors for layer in library.layers], dtype=bool)
        self.input_bytes = library.input_bytes

    _last: ClassVar[tuple[weakref.ref[LayerLibrary], InputCounter] | None] = None
    """The counter of the library counted last: the estimate of one plan counts each of its stages, and a search
    counts thousands of plans of the same library."""

    @classmethod
    def of(cls, library: LayerLibrary) -> InputCounter:
        """The counter of ``library``, made once for the same library object."""
        last = cls._last  # read once: another thread may count another library meanwhile
        if last is not None and last[0]() is library:
            return last[1]
        counter = cls(library)
        cls._last = (weakref.ref(library), counter)
        return counter

    def per_stage(self, stage_of_layer: Sequence[int], n_stages: int) -> np.ndarray:
        return self.counts(stage_of_layer, n_stages).inputs

    def counts(self, stage_of_layer: Sequence[int], n_stages: int) -> StageCounts:
        """Every stage's inputs and what it receives, from one pass over the values that cross a cut."""
        stage = np.asarray(stage_of_layer, dtype=np.int64)
        layer, reader = self._crossings(stage)
        outputs = self.outputs[layer]
        taken = np.bincount(reader, outputs, n_stages)
        reads_input = np.bincount(stage[self.first], minlength=n_stages)[:n_stages] > 0
        gradients = np.bincount(stage[layer], outputs, n_stages)
        return StageCounts(taken + self.input_bytes * reads_input, (taken, gradients))

    def _crossings(self, stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each (producing layer, reading stage) of a value that crosses a cut, once."""
        crossing = self.edges[stage[self.edges[:, 0]] != stage[self.edges[:, 1]]]
        # each pair once, as one integer: np.unique on rows is many times slower
        width = int(stage.max(initial=0)) + 1
        pairs = np.unique(crossing[:, 0] * width + stage[crossing[:, 1]])
        layer, reader = np.divmod(pairs, width)
        return layer, reader


def stage_memory_bytes(
    plan: Plan,
    library: LayerLibrary,
    stage: int,
    optimizer_state: int = SGD_MOMENTUM_STATE,
    shared: StageShares | None = None,
) -> dict[str, int]:
    """Peak memory of each device of ``stage`` (the sum of ``device_memory_terms`` of its layers and its rows; on
    a stage whose layers run split signatures, each layer's weights and outputs as its layouts hold them), with a
    copy of every tied parameter the stage holds (``tapp_core.plan.ties``); ``shared``: the plan's stage shares,
    if counted (they depend on its cuts alone)."""
    return _summed(stage_memory_terms(plan, library, stage, optimizer_state, shared))


def plan_memory_bytes(plan: Plan, library: LayerLibrary, optimizer_state: int = SGD_MOMENTUM_STATE) -> dict[str, int]:
    """``stage_memory_bytes`` of every stage, by device; what every stage shares is counted once for all (the
    stages' inputs and tied copies: an estimate counts thousands of plans)."""
    shared = StageShares.of(plan, library)
    return {
        device: need
        for stage in range(plan.n_stages)
        for device, need in _summed(stage_memory_terms(plan, library, stage, optimizer_state, shared)).items()
    }


def _summed(terms: Mapping[str, Mapping[str, float]]) -> dict[str, int]:
    return {device: int(sum(device_terms.values())) for device, device_terms in terms.items()}


@dataclass(frozen=True)
class StageShares:
    """Per stage: the bytes of the inputs it keeps (``stage_input_bytes``) and of its tied copies
    (``tied_copy_bytes``)."""

    inputs: np.ndarray
    copies: np.ndarray | None
    received: tuple[np.ndarray, np.ndarray]
    """``StageCounts.received``: per stage, the activations and the gradients it receives, per sample."""
    frozen_copies: np.ndarray | None = None
    """Of ``copies``, the frozen parameters': weights alone, with no gradient or optimiser state."""

    @classmethod
    def of(cls, plan: Plan, library: LayerLibrary) -> StageShares:
        copies = frozen = None
        if library.shared:
            copies = tied_copy_bytes(plan.stage_of_layer, plan.n_stages, library.shared)
            frozen = tied_copy_bytes(plan.stage_of_layer, plan.n_stages, library.shared, trained=False)
        n_stages = max(plan.n_stages, max(plan.stage_of_layer, default=-1) + 1)
        counts = InputCounter.of(library).counts(plan.stage_of_layer, n_stages)
        return cls(counts.inputs, copies, counts.received, frozen)

    def input_bytes(self, stage: int) -> int:
        return int(self.inputs[stage])

    def received_bytes(self, stage: int) -> tuple[float, float]:
        return float(self.received[0][stage]), float(self.received[1][stage])

    def copy_bytes(self, stage: int) -> float:
        return float(self.copies[stage]) if self.copies is not None else 0.0

    def frozen_copy_bytes(self, stage: int) -> float:
        return float(self.frozen_copies[stage]) if self.frozen_copies is not None else 0.0


def stage_memory_terms(
    plan: Plan,
    library: LayerLibrary,
    stage: int,
    optimizer_state: int = SGD_MOMENTUM_STATE,
    shared: StageShares | None = None,
) -> dict[str, dict[str, float]]:
    """``device_memory_terms`` of each device of ``stage`` (``shared``: the plan's stage shares, if counted)."""
    layers = [library.layers[i] for i in plan.stage_layers(stage)]
    kept_outputs = KeptOutputs.of(library)
    outputs, extras = kept_outputs.outputs(plan.stage_of_layer), kept_outputs.extra_saved
    kept = outputs + extras
    devices = plan.stage_devices[stage]
    shared = shared or StageShares.of(plan, library)
    copies = shared.copy_bytes(stage)
    largest = max((layer.param_bytes for layer in layers), default=0)
    widest = max((held_activation_bytes(layer) for layer in layers), default=0)  # forward or backward, at work
    trace = model_trace_bytes(library)
    if not plan.runs_split(stage):
        params = copies + sum(layer.param_bytes for layer in layers)
        frozen = shared.frozen_copy_bytes(stage) + sum(layer.frozen_bytes for layer in layers)
        footprint = DeviceFootprint(
            param_bytes=params,
            activation_bytes=float(sum(kept[layer.index] for layer in layers)),
            kept_bytes=shared.input_bytes(stage),
            largest_param_bytes=largest,
            reduced_bytes=params - frozen,
            largest_activation_bytes=widest,
            received_bytes=shared.received_bytes(stage),
            frozen_bytes=frozen,
        )
        return {
            device: device_memory_terms(plan, stage, stop - start, footprint, optimizer_state, trace)
            for device, (start, stop) in zip(devices, plan.rows(stage), strict=True)
        }
    layouts = plan.layouts(library, stage)
    shares = plan.shares(stage)
    reduced = sum(x.trained_bytes for x in layers if layouts.reduced(x.index))
    inputs = shared.input_bytes(stage)
    out = {}
    for d, (device, (start, stop)) in enumerate(zip(devices, plan.rows(stage), strict=True)):
        rows = stop - start
        part = [shares[d] if isinstance(layouts.weights.get(x.index), Split) else 1.0 for x in layers]
        held = [x.param_bytes * share for x, share in zip(layers, part, strict=True)]
        per_row = sum(_kept_rows(x, outputs[x.index], extras[x.index], layouts, shares[d], rows, plan) for x in layers)
        footprint = DeviceFootprint(
            param_bytes=copies + sum(held),
            activation_bytes=per_row,
            kept_bytes=inputs,
            largest_param_bytes=max(held, default=0.0),
            reduced_bytes=reduced,
            largest_activation_bytes=widest,
            received_bytes=shared.received_bytes(stage),
            frozen_bytes=shared.frozen_copy_bytes(stage)
            + sum(x.frozen_bytes * share for x, share in zip(layers, part, strict=True)),
        )
        out[device] = device_memory_terms(plan, stage, rows, footprint, optimizer_state, trace)
    return out


def _kept_rows(
    layer: Layer, output: float, extra: float, layouts: StageLayouts, share: float, rows: int, plan: Plan
) -> float:
    """What a device keeps of ``layer``'s forward per row it computes, on a stage run by split signatures: its kept
    ``output`` as the layout it is read in (a layer of the stage that reads it gathered keeps the gathered copy,
    which is the one autograd saves) or made in, the larger, and the rest autograd keeps of its forward (``extra``)
    as its output is held."""
    made = _rows_held(layouts.outputs[layer.index], share, rows, plan)
    read = [_rows_held(layouts.inputs[s], share, rows, plan) for s in layer.successors if s in layouts.inputs]
    return output * max([made, *read]) + extra * made


def _rows_held(output: Layout, share: float, rows: int, plan: Plan) -> float:
    """A device's part of a layer's output held as ``output``, per row of the micro-batch the device computes: its
    rows (Split(0)), its share of every row (a feature split), or every row (Broadcast, PartialSum)."""
    if output == SAMPLES:
        return 1.0
    held = plan.micro_batch_size * (share if isinstance(output, Split) else 1.0)
    return held / max(rows, 1)


# ---------------------------------------------------------------------------------------------------------------
# The checks


def check_shape(plan: Plan) -> None:
    """Batch size and micro-batches positive, the batch divisible into the micro-batches, at least one stage, and
    a device for every stage."""
    if plan.batch_size <= 0 or plan.micro_batches <= 0:
        raise PlanError(f"batch size ({plan.batch_size}) and micro-batches ({plan.micro_batches}) must be positive")
    if plan.batch_size % plan.micro_batches:
        raise PlanError(f"batch size {plan.batch_size} is not divisible by {plan.micro_batches} micro-batches")
    if plan.n_stages == 0:
        raise PlanError("plan has no stages")
    for stage, devices in enumerate(plan.stage_devices):
        if not devices:
            raise PlanError(f"stage {stage} has no device")


def check_layers(
    stage_of_layer: Sequence[int], n_stages: int, n_layers: int, layer_name: LayerName, graph: str = "the model"
) -> None:
    """A stage for each of the ``n_layers`` layers, each in ``0..n_stages - 1``. ``graph`` is what the message
    calls the layers' source ("the layer library", "the traced model")."""
    placed = len(stage_of_layer)
    if placed != n_layers:
        missing = f": layer {placed} ({layer_name(placed)}) is missing from the plan" if placed < n_layers else ""
        raise PlanError(f"plan places {placed} layers but {graph} has {n_layers}{missing}")
    if placed and (min(stage_of_layer) < 0 or max(stage_of_layer) >= n_stages):
        i = next(i for i, stage in enumerate(stage_of_layer) if not 0 <= stage < n_stages)
        raise PlanError(
            f"layer {i} ({layer_name(i)}) is on stage {stage_of_layer[i]}, but stages are 0..{n_stages - 1}"
        )


def check_stages_used(stage_of_layer: Sequence[int], n_stages: int) -> None:
    """At least one layer on every stage."""
    used = set(stage_of_layer)
    for stage in range(n_stages):
        if stage not in used:
            raise PlanError(f"stage {stage} has no layer")


def check_edges(
    stage_of_layer: Sequence[int] | np.ndarray, edges: Sequence[tuple[int, int]] | np.ndarray, layer_name: LayerName
) -> None:
    """No edge ``(u, v)`` (layer ``v`` consumes layer ``u``'s output) runs backward: ``v``'s stage is not before
    ``u``'s. Vectorised: ``edges`` may be an array of shape (edges, 2). Run ``check_layers`` first."""
    stage = np.asarray(stage_of_layer, dtype=np.int64)
    pairs = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    sources, targets = pairs[:, 0], pairs[:, 1]
    backward = np.flatnonzero(stage[targets] < stage[sources])
    if backward.size:
        u, v = int(sources[backward[0]]), int(targets[backward[0]])
        raise PlanError(
            f"edge {layer_name(u)} -> {layer_name(v)} runs backward: stage {stage[u]} feeds stage {stage[v]}"
        )


def check_devices(plan: Plan, cluster: Cluster) -> None:
    """Every device is one of ``cluster``'s and runs one stage only."""
    known = set(cluster.device_names)
    seen: dict[str, int] = {}
    for stage, devices in enumerate(plan.stage_devices):
        for device in devices:
            if device not in known:
                raise PlanError(
                    f"stage {stage} uses unknown device {device!r}; cluster {cluster.name!r} has {', '.join(sorted(known))}"
                )
            if device in seen:
                where = (
                    f"twice by stage {stage}"
                    if seen[device] == stage
                    else f"by two stages ({seen[device]} and {stage})"
                )
                raise PlanError(f"device {device!r} is used {where}")
            seen[device] = stage


def check_groups(plan: Plan) -> None:
    """Every stage's shares are valid for its devices and give every device at least one row of a micro-batch."""
    for stage, devices in enumerate(plan.stage_devices):
        try:
            check_shares(plan.shares(stage), len(devices))
        except PlacementError as exc:
            raise PlanError(f"stage {stage}: {exc}") from None
        for device, (start, stop) in zip(devices, plan.rows(stage), strict=True):
            if stop <= start:
                raise PlanError(
                    f"device {device!r} of stage {stage} gets no sample of the micro-batch of {plan.micro_batch_size}: "
                    f"{len(devices)} devices with shares {list(plan.shares(stage))}"
                )


def check_signatures(plan: Plan, library: LayerLibrary | Sequence[LayerSpec]) -> None:
    """Every signature names a layer of the library (or of the model's layer specs, e.g. a traced model's) that
    may run it on its stage's group (``placement``)."""
    specs = library.specs() if isinstance(library, LayerLibrary) else library
    for layer, signature in plan.signatures:
        if not 0 <= layer < len(specs):
            raise PlanError(f"signature {signature!r} is given for layer {layer}, but the model has {len(specs)}")
        devices = len(plan.stage_devices[plan.stage_of_layer[layer]])
        if devices == 1:
            raise PlanError(f"layer {specs[layer].name} has signature {signature!r} but its stage runs on one device")
        try:
            check_signature(specs[layer], signature, devices)
        except PlacementError as exc:
            raise PlanError(str(exc)) from None
    for stage in range(plan.n_stages):
        if plan.runs_split(stage):
            layouts = stage_layouts(
                specs, plan.stage_layers(stage), plan.signature_of(), len(plan.stage_devices[stage])
            )
            try:
                check_units(specs, layouts, plan.shares(stage))
                check_rows_per_sample(specs, plan.stage_layers(stage))
            except PlacementError as exc:
                raise PlanError(str(exc)) from None


def library_layer_name(library: LayerLibrary) -> LayerName:
    """How the checks name a layer of ``library``."""
    return lambda i: library.layers[i].name


def single_stage_plan(
    library: LayerLibrary,
    devices: Sequence[str],
    micro_batches: int = 1,
    planner: str = "",
    batch_size: int | None = None,
) -> Plan:
    """One stage holding every layer, on ``devices`` (one device: single-device training; all: BSP)."""
    return Plan(
        model=library.model,
        batch_size=batch_size or library.batch_size,
        micro_batches=micro_batches,
        schedule="gpipe",
        stage_of_layer=(0,) * len(library.layers),
        stage_devices=(tuple(devices),),
        planner=planner,
    )


# ---------------------------------------------------------------------------------------------------------------
# Plans that run the same


def execution_content(plan: Plan) -> dict[str, object]:
    """What decides how ``plan`` runs: its content (``Plan.canonical``), less what cannot matter for it.

    One stage and one micro-batch run one forward, one backward and one update per step, whatever the schedule:
    every schedule orders the same three operations the same way, and no weight is ever stale. Such a plan's
    schedule label (and staleness) is dropped: SingleCPU's ``gpipe`` plan and TAPP's ``1f1b`` plan of the same
    one device run the same."""
    content = dict(plan.canonical())
    if plan.n_stages == 1 and plan.micro_batches == 1:
        content.pop("schedule", None)
        content.pop("staleness", None)
    return content


def plan_execution_id(plan: Plan) -> str:
    """The hash of ``execution_content``: two plans with the same execution id run the same."""
    blob = json.dumps(execution_content(plan), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def same_execution(a: Plan, b: Plan) -> bool:
    """Whether ``a`` and ``b`` run the same (``execution_content``): raced once, shown as one."""
    return plan_execution_id(a) == plan_execution_id(b)
