"""Plans: which layers form which pipeline stage, and which device(s) run each stage; and the checks a plan must
pass to run.

A stage may run on several devices, a *group* (``tapp_core.placement``): each device takes its share of the stage's
work (``stage_shares``; equal shares unless the plan gives them, e.g. in proportion to the devices' speeds). As
data-parallel replicas, each device computes its share of every micro-batch's samples (``rows``) and the group
sums its gradients with an allreduce before the update. BSP is the plan with one stage on every device;
single-device training is one stage on one device.

A plan's schedule is a name in ``tapp_core.schedules.SCHEDULES`` (with a ``staleness`` bound for ``async``),
checked when the plan is made. The checks are parts that each caller combines as it needs (``validate`` runs them
all): ``check_shape``, ``check_layers``, ``check_stages_used``, ``check_edges``, ``check_devices``,
``check_groups`` and ``check_memory``. Each raises ``PlanError`` naming the layer, stage or device at fault.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tapp_core.cluster import Cluster
from tapp_core.errors import TappError
from tapp_core.library import LayerLibrary
from tapp_core.placement import (
    DATA,
    SAMPLES,
    LayerSpec,
    Layout,
    PlacementError,
    Split,
    StageLayouts,
    check_shares,
    check_signature,
    check_units,
    even_shares,
    split_ranges,
    stage_layouts,
)
from tapp_core.schedules import PipelineSchedule, UnknownScheduleError, schedule_for, schedule_spec

# Bytes of training state per parameter byte: weights, gradients and SGD momentum.
STATE_PER_PARAM_BYTE = 3

LayerName = Callable[[int], str]
"""The name of a layer, by index: how a check names the layer at fault."""


class PlanError(TappError):
    """A plan that cannot run: the message names the layer, stage or device at fault."""


@dataclass(frozen=True)
class Plan:
    model: str
    batch_size: int
    micro_batches: int
    schedule: str
    """A name in ``tapp_core.schedules.SCHEDULES``; an unknown one is a ``PlanError`` when the plan is made."""
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
    (``tapp_core.placement``: ``col``, ``row``), by layer; every other layer runs ``data``."""
    bucket_bytes: int | None = None
    """Gradient bucket size of stages on several devices (``tapp_core.program``); None: the default; 0: one bucket,
    reduced once the step's last backward is done (no overlap with the backward)."""

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
        if self.stage_shares and len(self.stage_shares) != len(self.stage_devices):
            raise PlanError(f"plan gives shares for {len(self.stage_shares)} stages but has {len(self.stage_devices)}")
        for stage, (shares, devices) in enumerate(zip(self.stage_shares, self.stage_devices, strict=False)):
            if len(shares) != len(devices):
                raise PlanError(f"stage {stage}: {len(shares)} shares for {len(devices)} devices")

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
        return dataclasses.replace(
            self, stage_of_layer=layers, stage_devices=groups, stage_shares=shares, signatures=signatures
        )

    @property
    def schedule_spec(self) -> str:
        """The schedule with its staleness bound, in one string (``async:1``; ``tapp_core.schedules.schedule_spec``)."""
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
        """The plan in one line: its stages (devices, shares where unequal, split layers by name with a library),
        micro-batches and schedule (with its staleness bound), e.g. ``cpu0 | cpu1+cpu2 (0.6/0.4; fc1 col, fc2 row),
        m=2, async (staleness 1)``."""
        stages = []
        for s, group in enumerate(self.stage_devices):
            text = "+".join(group)
            details = []
            if self.stage_shares and len(set(self.stage_shares[s])) > 1:
                details.append("/".join(f"{x:.2g}" for x in self.stage_shares[s]))
            split = [
                f"{library.layers[x].name if library else f'layer {x}'} {sig}"
                for x, sig in self.signatures
                if self.stage_of_layer[x] == s
            ]
            if split:
                details.append(", ".join(split))
            stages.append(f"{text} ({'; '.join(details)})" if details else text)
        schedule = self.schedule + (f" (staleness {self.staleness})" if self.staleness is not None else "")
        return f"{' | '.join(stages)}, m={self.micro_batches}, {schedule}"

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
        return content

    @property
    def id(self) -> str:
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
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.to_json() + "\n")
        return out

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
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan {source} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan {source} must be a JSON object")
        return cls.from_dict(data, source)

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


def device_memory_bytes(plan: Plan, stage: int, samples: int, param_bytes: float, activation_bytes: float) -> float:
    """Peak memory of a device of ``stage`` that computes ``samples`` rows of each micro-batch and holds
    ``param_bytes`` of parameters whose layers output ``activation_bytes`` per sample: training state, the weight
    versions the schedule stashes, and the activations of the micro-batches it has in flight. Integers give an
    exact integer."""
    schedule = plan.pipeline_schedule
    in_flight = schedule.in_flight(stage, plan.n_stages, plan.micro_batches)
    versions = schedule.weight_versions(stage, plan.n_stages, plan.micro_batches)
    return STATE_PER_PARAM_BYTE * param_bytes + versions * param_bytes + in_flight * activation_bytes * samples


def stage_memory_bytes(plan: Plan, library: LayerLibrary, stage: int) -> dict[str, int]:
    """Peak memory of each device of ``stage`` (``device_memory_bytes`` of its layers and its rows; on a stage
    whose layers run split signatures, each layer's weights and outputs as its layouts hold them)."""
    layers = [library.layers[i] for i in plan.stage_layers(stage)]
    devices = plan.stage_devices[stage]
    if not plan.runs_split(stage):
        params = sum(layer.param_bytes for layer in layers)
        activations = sum(layer.activation_bytes for layer in layers)
        return {
            device: int(device_memory_bytes(plan, stage, stop - start, params, activations))
            for device, (start, stop) in zip(devices, plan.rows(stage), strict=True)
        }
    layouts = plan.layouts(library, stage)
    shares = plan.shares(stage)
    out = {}
    for d, (device, (start, stop)) in enumerate(zip(devices, plan.rows(stage), strict=True)):
        rows = stop - start
        held_params, per_row = 0.0, 0.0
        for x in layers:
            held_params += x.param_bytes * (shares[d] if isinstance(layouts.weights.get(x.index), Split) else 1.0)
            per_row += x.activation_bytes * _rows_held(layouts.outputs[x.index], shares[d], rows, plan)
        out[device] = int(device_memory_bytes(plan, stage, rows, held_params, per_row))
    return out


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
            except PlacementError as exc:
                raise PlanError(str(exc)) from None


def check_memory(plan: Plan, library: LayerLibrary, cluster: Cluster) -> None:
    """Every device has the memory its stage needs (``stage_memory_bytes``)."""
    for stage in range(plan.n_stages):
        for name, need in stage_memory_bytes(plan, library, stage).items():
            have = cluster.device(name).memory
            if need > have:
                raise PlanError(
                    f"device {name!r} memory exceeded: stage {stage} needs {_size(need)}, the device has {_size(have)}"
                )


def _size(n_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1 (``1.50 GiB``, ``812.00 KiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def library_layer_name(library: LayerLibrary) -> LayerName:
    """How the checks name a layer of ``library``."""
    return lambda i: library.layers[i].name


def validate(plan: Plan, library: LayerLibrary, cluster: Cluster) -> None:
    """Raise ``PlanError`` naming the first problem that would stop ``plan`` running on ``cluster``: every check."""
    if plan.model != library.model:
        raise PlanError(f"plan is for model {plan.model!r} but the layer library is for {library.model!r}")
    check_shape(plan)
    layer_name = library_layer_name(library)
    check_layers(plan.stage_of_layer, plan.n_stages, len(library.layers), layer_name, "the layer library")
    check_stages_used(plan.stage_of_layer, plan.n_stages)
    check_edges(plan.stage_of_layer, library.edges(), layer_name)
    check_devices(plan, cluster)
    check_groups(plan)
    check_signatures(plan, library)
    check_memory(plan, library, cluster)


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
