"""Programs: per device of a plan, the one list of actions it runs, communication included.

A device's program is its stage's compute order (``tapp_core.plan.schedules``) with the communication put around it:

- before each forward (backward), a ``recv_forward`` (``recv_backward``) from every device it takes a cut value
  (a cut value's gradient) from, naming the values and the micro-batch rows it takes;
- after each forward (backward), a ``send_forward`` (``send_backward``) to every device that takes one from it;
- before each update of a stage whose weights several devices hold, a ``reduce`` of every gradient bucket;
- then, on a stage holding a tied parameter (one whose users are on several stages, ``tapp_core.plan.ties``), a
  ``tie``: its gradient summed among every device of every stage that holds it.

The runtime's engine executes exactly ``DeviceProgram.actions()``, and the cost model simulates exactly the same
program (reading its parts directly, for speed: the compute order, the routes around each kind of compute, and the
buckets). ``check_programs`` proves, before anything runs, that the programs of all devices match up (every send
has its receive) and cannot deadlock.

Transfers are derived here, once, from the layer graph: a layer's output is a *cut value* for every later stage
holding one of its consumers (``crossings``); it goes straight from its producer to each such stage (a value that
skips a stage is not relayed), as ``Split(0)`` on both sides (``tapp_core.plan.placement.row_routes``). The model's input
is read from the data by every stage that needs it and crosses no link. Every cut value's gradient flows back the
same way (a value computed from the input alone, with no parameter before it, has a zero gradient, sent all the
same so that the programs do not depend on what requires a gradient).

Gradient buckets (``gradient_buckets``): the layers of a stage holding parameters, from the last to the first (the
order the backward pass finishes them in), grouped into buckets of at most ``BUCKET_BYTES`` (or the plan's
``bucket_bytes``) without splitting a layer. A bucket's reduction may start as soon as the step's last backward has
produced its gradients (the runtime starts it from a gradient hook, the cost model when that share of the backward
is done), and the update waits for all of them. A plan with ``bucket_bytes`` 0 reduces one bucket once the last
backward is done (``DeviceProgram.overlap`` false): no overlap.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tapp_core.model.graph import LayerSpec, SharedParameter
from tapp_core.plan.placement import row_routes, stage_layouts
from tapp_core.plan.plan import Plan, PlanError
from tapp_core.plan.schedules import Action, ActionKind, PipelineSchedule
from tapp_core.plan.ties import plan_ties, untied_param_bytes

BUCKET_BYTES = 25 * 2**20
"""Gradient bucket size (PyTorch DDP's default): small enough that reductions overlap the backward, large enough
that their latency does not add up."""

FORWARD, BACKWARD = "forward", "backward"
RECEIVE: dict[str, ActionKind] = {FORWARD: "recv_forward", BACKWARD: "recv_backward"}
SEND: dict[str, ActionKind] = {FORWARD: "send_forward", BACKWARD: "send_backward"}
SEND_KINDS = frozenset(SEND.values())
RECEIVE_KINDS = frozenset(RECEIVE.values())


class ScheduleError(PlanError):
    """Programs that do not match up or that deadlock; the message names the stage, the device and the action."""


@dataclass(frozen=True, slots=True)
class Crossing:
    """Layer ``layer``'s output, produced on stage ``source`` and consumed on the later stages ``targets``."""

    layer: int
    source: int
    targets: tuple[int, ...]


def crossings(stage_of_layer: Sequence[int], edges: Sequence[tuple[int, int]] | np.ndarray) -> tuple[Crossing, ...]:
    """Every cut value of a plan whose layers sit on ``stage_of_layer``, by producing layer."""
    stage = np.asarray(stage_of_layer, dtype=np.int64)
    pairs = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    sources, targets = pairs[:, 0], pairs[:, 1]
    crossing = stage[targets] > stage[sources]
    consumers: dict[int, set[int]] = defaultdict(set)
    for u, v in zip(sources[crossing].tolist(), targets[crossing].tolist(), strict=True):
        consumers[u].add(int(stage[v]))
    return tuple(Crossing(u, int(stage[u]), tuple(sorted(consumers[u]))) for u in sorted(consumers))


@dataclass(frozen=True, slots=True)
class Route:
    """What one device exchanges with one ``peer`` around one operation: the cut ``values`` (by producing layer)
    and the micro-batch ``rows`` ``[lo, hi)`` of them."""

    peer: int
    values: tuple[int, ...]
    rows: tuple[int, int]

    @property
    def samples(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    layers: tuple[int, ...]
    """From the last layer to the first: the order the backward pass finishes them in."""
    nbytes: int


def gradient_buckets(
    layers: Sequence[int], param_bytes: Sequence[int] | np.ndarray, limit: int = BUCKET_BYTES
) -> tuple[Bucket, ...]:
    """The parameter-holding ``layers`` of a stage (with ``param_bytes`` per library layer), last first, in buckets
    of at most ``limit`` bytes (a layer larger than that is a bucket of its own)."""
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    for layer in sorted(layers, reverse=True):
        nbytes = int(param_bytes[layer])
        if nbytes <= 0:
            continue
        if current and size + nbytes > limit:
            buckets.append(Bucket(len(buckets), tuple(current), size))
            current, size = [], 0
        current.append(layer)
        size += nbytes
    if current:
        buckets.append(Bucket(len(buckets), tuple(current), size))
    return tuple(buckets)


@dataclass(frozen=True, slots=True)
class TiedReduction:
    """The sum of tied parameter ``name``'s gradients (``nbytes``) among ``devices`` (positions in the plan's device
    order: every device of every stage holding it), tie ``index`` of the plan (``ties.plan_ties``)."""

    index: int
    name: str
    devices: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class DeviceProgram:
    """The program of the device at ``position`` in the plan's device order (stage by stage, replicas in order)."""

    position: int
    device: str
    stage: int
    replica: int
    rows: tuple[int, int]
    """The rows ``[lo, hi)`` of every micro-batch this device computes (its share of the stage's samples)."""
    order: tuple[Action, ...]
    """The stage's forwards, backwards and updates (``tapp_core.plan.schedules``)."""
    receives: dict[str, tuple[Route, ...]]
    """Per FORWARD / BACKWARD: what each such operation receives before it runs."""
    sends: dict[str, tuple[Route, ...]]
    """Per FORWARD / BACKWARD: what each such operation sends after it runs."""
    buckets: tuple[Bucket, ...] = ()
    """Gradient buckets reduced among the stage's devices before each update (none on a one-device stage)."""
    overlap: bool = True
    """Whether a bucket's reduction may start during the step's last backward (else after it)."""
    ties: tuple[TiedReduction, ...] = ()
    """The tied parameters this device holds a copy of, summed among their holders after the buckets."""

    @property
    def samples(self) -> int:
        return self.rows[1] - self.rows[0]

    def actions(self) -> Iterator[Action]:
        """The whole program, in order."""
        for action in self.order:
            kind = action.kind
            if kind == "update":
                yield from (Action("reduce", action.index, bucket=b.index) for b in self.buckets)
                yield from (Action("tie", action.index, bucket=t.index) for t in self.ties)
                yield action
                continue
            for route in self.receives[kind]:
                yield Action(RECEIVE[kind], action.index, route.peer, route.values, route.rows)
            yield action
            for route in self.sends[kind]:
                yield Action(SEND[kind], action.index, route.peer, route.values, route.rows)


def plan_programs(
    plan: Plan,
    edges: Sequence[tuple[int, int]] | np.ndarray,
    param_bytes: Sequence[int] | np.ndarray,
    steps: int,
    schedule: PipelineSchedule | None = None,
    specs: Sequence[LayerSpec] = (),
    shared: Sequence[SharedParameter] = (),
) -> tuple[DeviceProgram, ...]:
    """Every device's program for ``steps`` steps of ``plan`` on a model whose layer graph has ``edges`` (producer,
    consumer) and whose layers hold ``param_bytes``; under ``schedule`` instead of the plan's (evaluation runs
    ``ForwardOnly``). A plan whose layers run split signatures needs the layers' ``specs``: only the weights a
    stage's group holds whole are reduced (``placement.StageLayouts.reduced``). ``shared``: the parameters several
    layers use; those the plan ties are reduced by their ties, not in the stages' buckets."""
    positions = _positions(plan)
    receives, sends = _routes(plan, crossings(plan.stage_of_layer, edges), positions)
    ties = _tied_reductions(plan, shared, positions)
    if ties:
        param_bytes = untied_param_bytes(plan.stage_of_layer, param_bytes, shared)
    programs = []
    for stage, devices in enumerate(plan.stage_devices):
        order = _compute_order(schedule or plan.pipeline_schedule, stage, plan.n_stages, plan.micro_batches, steps)
        limit = BUCKET_BYTES if plan.bucket_bytes is None else plan.bucket_bytes or sum(int(b) for b in param_bytes)
        buckets = gradient_buckets(_reduced_layers(plan, stage, specs), param_bytes, limit) if len(devices) > 1 else ()
        overlap = plan.bucket_bytes != 0
        for replica, (device, rows) in enumerate(zip(devices, plan.rows(stage), strict=True)):
            position = positions[(stage, replica)]
            routes = (receives[position], sends[position])
            held = tuple(tie for tie, stages in ties if stage in stages)
            programs.append(
                DeviceProgram(position, device, stage, replica, rows, order, *routes, buckets, overlap, held)
            )
    return tuple(programs)


def tied_reductions(plan: Plan, shared: Sequence[SharedParameter]) -> tuple[TiedReduction, ...]:
    """Every tie of ``plan`` (``tapp_core.plan.ties``) as the reduction its holders' programs run."""
    return tuple(tie for tie, _ in _tied_reductions(plan, shared, _positions(plan)))


def _tied_reductions(
    plan: Plan, shared: Sequence[SharedParameter], positions: dict[tuple[int, int], int]
) -> list[tuple[TiedReduction, tuple[int, ...]]]:
    """Each tie of ``plan`` as a reduction among its holders' devices, with the holder stages."""
    out = []
    for tie in plan_ties(plan.stage_of_layer, shared):
        devices = tuple(
            positions[(stage, replica)] for stage in tie.stages for replica in range(len(plan.stage_devices[stage]))
        )
        out.append((TiedReduction(tie.index, tie.name, devices, tie.nbytes), tie.stages))
    return out


@functools.lru_cache(maxsize=1024)
def _compute_order(
    schedule: PipelineSchedule, stage: int, n_stages: int, micro_batches: int, steps: int
) -> tuple[Action, ...]:
    """A stage's forwards, backwards and updates (cached: a search builds the programs of thousands of plans of a few
    shapes)."""
    return schedule.compute_order(stage, n_stages, micro_batches, steps)


def _reduced_layers(plan: Plan, stage: int, specs: Sequence[LayerSpec]) -> list[int]:
    """The layers of ``stage`` whose weight gradients its group sums: all of them, unless some run split."""
    layers = plan.stage_layers(stage)
    if not plan.runs_split(stage):
        return layers
    if not specs:
        raise ValueError("a plan with split signatures needs the layers' specs to build its programs")
    layouts = stage_layouts(specs, layers, plan.signature_of(), len(plan.stage_devices[stage]))
    return [layer for layer in layers if layouts.reduced(layer)]


def _positions(plan: Plan) -> dict[tuple[int, int], int]:
    """(stage, replica) -> the device's position in the plan's device order."""
    out: dict[tuple[int, int], int] = {}
    for stage, devices in enumerate(plan.stage_devices):
        for replica in range(len(devices)):
            out[(stage, replica)] = len(out)
    return out


RouteTable = dict[int, dict[str, tuple[Route, ...]]]


def _routes(
    plan: Plan, cut: Sequence[Crossing], positions: dict[tuple[int, int], int]
) -> tuple[RouteTable, RouteTable]:
    """Per device position: its receives and its sends around each FORWARD and BACKWARD."""
    receives: dict[int, dict[str, list[Route]]] = {p: {FORWARD: [], BACKWARD: []} for p in positions.values()}
    sends: dict[int, dict[str, list[Route]]] = {p: {FORWARD: [], BACKWARD: []} for p in positions.values()}
    by_pair: dict[tuple[int, int], list[int]] = defaultdict(list)
    for value in cut:
        for target in value.targets:
            by_pair[(value.source, target)].append(value.layer)
    for (a, b), values in sorted(by_pair.items()):
        for route in row_routes(plan.micro_batch_size, plan.shares(a), plan.shares(b)):
            sender, receiver = positions[(a, route.sender)], positions[(b, route.receiver)]
            rows = (route.lo, route.hi)
            sends[sender][FORWARD].append(Route(receiver, tuple(values), rows))
            receives[receiver][FORWARD].append(Route(sender, tuple(values), rows))
            sends[receiver][BACKWARD].append(Route(sender, tuple(values), rows))
            receives[sender][BACKWARD].append(Route(receiver, tuple(values), rows))
    return _frozen(receives), _frozen(sends)


def _frozen(table: dict[int, dict[str, list[Route]]]) -> RouteTable:
    return {p: {kind: tuple(routes) for kind, routes in kinds.items()} for p, kinds in table.items()}


# ---------------------------------------------------------------------------------------------------------------
# The check


def check_programs(programs: Sequence[DeviceProgram]) -> None:
    """``ScheduleError`` unless every send has its receive (and every receive its send) and the programs run to their
    ends: sends never block, a receive waits for its send, a reduction waits for every device of its stage, and a
    tie for every device of every stage holding its parameter."""
    listed = [list(program.actions()) for program in programs]
    _check_pairs(programs, listed)
    _check_progress(programs, listed)


def _message_key(sender: int, receiver: int, action: Action) -> tuple[object, ...]:
    return (sender, receiver, action.kind.split("_")[1], action.index, action.values, action.rows)


def _where(program: DeviceProgram) -> str:
    return f"stage {program.stage} ({program.device})"


def _check_pairs(programs: Sequence[DeviceProgram], listed: Sequence[list[Action]]) -> None:
    sends: Counter[tuple[object, ...]] = Counter()
    receives: Counter[tuple[object, ...]] = Counter()
    for program, actions in zip(programs, listed, strict=True):
        for action in actions:
            if action.kind in SEND_KINDS:
                sends[_message_key(program.position, action.peer, action)] += 1
            elif action.kind in RECEIVE_KINDS:
                receives[_message_key(action.peer, program.position, action)] += 1
    for program, actions in zip(programs, listed, strict=True):
        for action in actions:
            if action.kind in SEND_KINDS and not receives[_message_key(program.position, action.peer, action)]:
                raise ScheduleError(f"{_where(program)}: {action} has no matching receive on device #{action.peer}")
            if action.kind in RECEIVE_KINDS and not sends[_message_key(action.peer, program.position, action)]:
                raise ScheduleError(f"{_where(program)}: {action} has no matching send on device #{action.peer}")
    if sends != receives:
        raise ScheduleError("the programs send and receive different numbers of the same message")


def _check_progress(programs: Sequence[DeviceProgram], listed: Sequence[list[Action]]) -> None:
    """Run the programs abstractly until none can go on; the first device left short names the cyclic wait."""
    position = [0] * len(programs)
    posted: Counter[tuple[object, ...]] = Counter()
    members = Counter(program.stage for program in programs)
    tie_members = {tie.index: len(tie.devices) for program in programs for tie in program.ties}
    at_reduction: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    at_tie: dict[tuple[int, int], set[int]] = defaultdict(set)
    progress = True
    while progress:
        progress = False
        for d, (program, actions) in enumerate(zip(programs, listed, strict=True)):
            while position[d] < len(actions):
                action = actions[position[d]]
                if action.kind in SEND_KINDS:
                    posted[_message_key(program.position, action.peer, action)] += 1
                elif action.kind in RECEIVE_KINDS:
                    key = _message_key(action.peer, program.position, action)
                    if not posted[key]:
                        break
                    posted[key] -= 1
                elif action.kind == "reduce":
                    group = at_reduction[(program.stage, action.index, action.bucket)]
                    group.add(d)
                    if len(group) < members[program.stage]:
                        break
                elif action.kind == "tie":
                    group = at_tie[(action.index, action.bucket)]
                    group.add(d)
                    if len(group) < tie_members[action.bucket]:
                        break
                position[d] += 1
                progress = True
    _report_stuck(programs, listed, position)


def _report_stuck(programs: Sequence[DeviceProgram], listed: Sequence[list[Action]], position: list[int]) -> None:
    stuck = [d for d, actions in enumerate(listed) if position[d] < len(actions)]
    if stuck:
        first = stuck[0]
        names = ", ".join(_where(programs[d]) for d in stuck)
        raise ScheduleError(
            f"the schedule deadlocks: {_where(programs[first])} waits forever at {listed[first][position[first]]} "
            f"(devices stuck: {names})"
        )
