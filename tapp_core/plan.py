"""Plans: which layers form which pipeline stage, and which device(s) run each stage.

A stage may run on several devices: these are data-parallel replicas of the stage. Each micro-batch is cut
into equal, contiguous sample ranges, one per replica (``replica_slices``), and the replicas average their
gradients with an allreduce before the update. BSP is the plan with one stage on every device; single-device
training is one stage on one device.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tapp_core.cluster import Cluster
from tapp_core.errors import TappError
from tapp_core.library import LayerLibrary

Schedule = Literal["gpipe", "1f1b", "async"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "async")

# Bytes of training state per parameter byte: weights, gradients and SGD momentum.
STATE_PER_PARAM_BYTE = 3


class PlanError(TappError):
    """A plan that cannot run: the message names the layer, stage or device at fault."""


@dataclass(frozen=True)
class Plan:
    model: str
    batch_size: int
    micro_batches: int
    schedule: Schedule
    stage_of_layer: tuple[int, ...]
    """``stage_of_layer[i]`` is the stage of layer ``i`` of the layer library."""
    stage_devices: tuple[tuple[str, ...], ...]
    """``stage_devices[s]`` are the devices running stage ``s`` (more than one: data-parallel replicas)."""
    planner: str = ""
    notes: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

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

    def canonical(self) -> dict[str, object]:
        """The content that decides what runs; the id is its hash. Planner name and notes are not part of it."""
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "stage_of_layer": list(self.stage_of_layer),
            "stage_devices": [list(d) for d in self.stage_devices],
        }

    @property
    def id(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

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
            plan = cls(
                model=str(data["model"]),
                batch_size=int(data["batch_size"]),  # type: ignore[arg-type]
                micro_batches=int(data["micro_batches"]),  # type: ignore[arg-type]
                schedule=str(data["schedule"]),  # type: ignore[arg-type]
                stage_of_layer=tuple(int(s) for s in data["stage_of_layer"]),  # type: ignore[union-attr]
                stage_devices=tuple(tuple(str(d) for d in devs) for devs in data["stage_devices"]),  # type: ignore[union-attr]
                planner=str(data.get("planner", "")),
                notes=dict(data.get("notes") or {}),  # type: ignore[call-overload]
            )
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
        if not p.is_file():
            raise PlanError(f"plan file {p} does not exist")
        return cls.from_json(p.read_text(), str(p))


def replica_slices(n_samples: int, n_replicas: int) -> list[tuple[int, int]]:
    """The contiguous sample range ``[start, stop)`` each replica of a stage takes from a micro-batch."""
    share = n_samples // n_replicas
    return [(r * share, (r + 1) * share) for r in range(n_replicas)]


def stage_param_bytes(plan: Plan, library: LayerLibrary) -> list[int]:
    totals = [0] * plan.n_stages
    for layer in library.layers:
        totals[plan.stage_of_layer[layer.index]] += layer.param_bytes
    return totals


def in_flight_micro_batches(plan: Plan, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak, by schedule."""
    if plan.schedule == "gpipe":
        return plan.micro_batches
    return min(plan.micro_batches, plan.n_stages - stage) if plan.schedule == "1f1b" else plan.n_stages - stage


def stage_memory_bytes(plan: Plan, library: LayerLibrary, stage: int) -> int:
    """Peak memory of one replica of ``stage``: training state plus stashed activations of in-flight micro-batches.

    The async schedule also keeps one weight version per in-flight micro-batch (weight stashing).
    """
    n_replicas = len(plan.stage_devices[stage])
    samples = plan.micro_batch_size // n_replicas
    params = sum(library.layers[i].param_bytes for i in plan.stage_layers(stage))
    activations = sum(library.layers[i].activation_bytes for i in plan.stage_layers(stage)) * samples
    in_flight = in_flight_micro_batches(plan, stage)
    weight_versions = in_flight if plan.schedule == "async" else 0
    return STATE_PER_PARAM_BYTE * params + weight_versions * params + in_flight * activations


def validate(plan: Plan, library: LayerLibrary, cluster: Cluster) -> None:
    """Raise ``PlanError`` naming the first problem that would stop ``plan`` running on ``cluster``."""
    if plan.model != library.model:
        raise PlanError(f"plan is for model {plan.model!r} but the layer library is for {library.model!r}")
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {plan.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if plan.batch_size <= 0 or plan.micro_batches <= 0:
        raise PlanError(f"batch size ({plan.batch_size}) and micro-batches ({plan.micro_batches}) must be positive")
    if plan.batch_size % plan.micro_batches:
        raise PlanError(f"batch size {plan.batch_size} is not divisible by {plan.micro_batches} micro-batches")
    n_layers = len(library.layers)
    if len(plan.stage_of_layer) < n_layers:
        first = library.layers[len(plan.stage_of_layer)]
        raise PlanError(f"layer {first.index} ({first.name}) is missing from the plan: it has no stage")
    if len(plan.stage_of_layer) > n_layers:
        raise PlanError(f"plan places {len(plan.stage_of_layer)} layers but the model has {n_layers}")
    if plan.n_stages == 0:
        raise PlanError("plan has no stages")
    for i, stage in enumerate(plan.stage_of_layer):
        if not 0 <= stage < plan.n_stages:
            raise PlanError(
                f"layer {i} ({library.layers[i].name}) is on stage {stage}, but stages are 0..{plan.n_stages - 1}"
            )
    for stage in range(plan.n_stages):
        if not plan.stage_devices[stage]:
            raise PlanError(f"stage {stage} has no device")
        if stage not in plan.stage_of_layer:
            raise PlanError(f"stage {stage} has no layer")
    for u, v in library.edges():
        if plan.stage_of_layer[u] > plan.stage_of_layer[v]:
            raise PlanError(
                f"edge {library.layers[u].name} -> {library.layers[v].name} runs backward: "
                f"stage {plan.stage_of_layer[u]} feeds stage {plan.stage_of_layer[v]}"
            )
    known = set(cluster.device_names)
    seen: dict[str, int] = {}
    for stage, devices in enumerate(plan.stage_devices):
        for device in devices:
            if device not in known:
                raise PlanError(
                    f"stage {stage} uses unknown device {device!r}; cluster {cluster.name!r} has {', '.join(sorted(known))}"
                )
            if device in seen:
                raise PlanError(f"device {device!r} is used by two stages ({seen[device]} and {stage})")
            seen[device] = stage
        if plan.micro_batch_size % len(devices):
            raise PlanError(
                f"stage {stage} has {len(devices)} replicas, which do not divide the micro-batch of {plan.micro_batch_size} samples"
            )
    for stage, devices in enumerate(plan.stage_devices):
        need = stage_memory_bytes(plan, library, stage)
        for name in devices:
            have = cluster.device(name).memory
            if need > have:
                raise PlanError(
                    f"device {name!r} memory exceeded: stage {stage} needs {need / 2**30:.2f} GiB, "
                    f"the device has {have / 2**30:.2f} GiB"
                )


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
