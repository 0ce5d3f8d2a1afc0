"""Sharded stages: a stage whose layers run split signatures (``tapp_core.plan.placement``), as one device of its group
holds and runs it.

``shard_stage`` takes a stage cut for one device (``runtime.stage``) and

- keeps only this device's shard of every split weight: a ``col`` layer its range of the output features
  (channels), ``split_ranges(features, shares)``; a ``row`` layer its range of the input features (channels), the
  range its input arrives in, and the bias on the group's first device only; a BatchNorm2d reading a channel split
  its channels;
- puts a ``LayoutChange`` (``runtime.collectives``) into the stage's graph for every ``Change`` of the layout
  pass: before the layer that reads the value, or, for a stage output, before the stage returns it (as Split(0));
- reads the model's input in the layout its layers need: the whole micro-batch when one of them reads it other
  than by samples (the others then slice their part of it, locally).

Every device knows every device's range of a split tensor (``Held``): a col layer splits its features by the
shares, in whole units where the layout pass asks for them (``StageLayouts.units``: whole attention heads); a layer
that carries a split (``StageLayouts.carried``) scales its inputs' ranges by its sizes over theirs: an elementwise
layer keeps them, a flatten widens each range by the elements per channel (a Conv2d's channel split keeps its
channel boundaries through a flatten), a view into heads divides them by the features per head, a transpose moves
them to another dimension; a change into a split divides the dimension by the shares. A change that several layers
need is made once, before the first of them. Split(0) is the plan's rows of the micro-batch (``Plan.rows``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from tapp_core.model.graph import MODEL_INPUT, LayerSpec
from tapp_core.plan.placement import (
    BROADCAST,
    COLUMN,
    OUTPUT,
    ROW,
    SAMPLES,
    Layout,
    PlacementError,
    Split,
    StageLayouts,
    check_units,
    split_ranges,
    stage_layouts,
)
from tapp_core.runtime.collectives import Group, Held, LayoutChange, Ranges
from tapp_core.runtime.stage import Stage, StageError


@dataclass(frozen=True)
class Shard:
    """How one parameter or buffer of a sharded stage is split among the group: along ``dim``, every device its
    range; ``first_only``: the group's first device holds it whole, the others not at all (a row layer's bias)."""

    dim: int
    ranges: Ranges
    first_only: bool = False


@dataclass(frozen=True)
class ShardedStage:
    """What ``shard_stage`` did to a stage."""

    shards: Mapping[str, Shard]
    """By the stage module's state names."""
    whole_input: bool
    """Whether the stage reads the whole micro-batch of the model's input (else its rows)."""


class _Placing:
    """How the group holds each value of one stage (``Held``), and how each layer reads its inputs."""

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        layouts: StageLayouts,
        layers: Sequence[int],
        shares: Sequence[float],
        rows: Ranges,
        input_shape: Sequence[int],
    ) -> None:
        self.specs, self.layouts, self.shares, self.rows = specs, layouts, tuple(shares), rows
        self.input_shape = tuple(input_shape)
        self.held: dict[int, Held] = {}
        self.reads: dict[int, Held] = {}
        for layer in layers:
            self._place(specs[layer])

    def held_of(self, value: int) -> Held:
        """A value as the stage holds it: its layer's output here, else by samples (a cut value, the input)."""
        return self.held.get(value, Held(SAMPLES, self.rows))

    def shape_of(self, value: int) -> tuple[int, ...]:
        return self.input_shape if value == MODEL_INPUT else self.specs[value].shape

    def divided(self, layout: Layout, shape: Sequence[int], unit: int = 1) -> Held:
        """``layout`` of a tensor of per-sample ``shape``, a split dividing its dimension by the shares (in whole
        ``unit``s)."""
        if not isinstance(layout, Split):
            return Held(layout)
        if layout.dim == 0:
            return Held(layout, self.rows)
        return Held(layout, split_ranges(shape[layout.dim - 1], self.shares, unit))

    def _place(self, spec: LayerSpec) -> None:
        if spec.index in self.layouts.carried:
            self._carried(spec)
            return
        read = self.layouts.inputs[spec.index]
        unit = self.layouts.units.get(spec.index, 1)
        reads = self.divided(read, self.shape_of(spec.inputs[0]), unit)
        if isinstance(read, Split) and read.dim > 0:
            held = [self.held_of(v) for v in spec.inputs if v != MODEL_INPUT and self.held_of(v).layout == read]
            if held:
                reads = held[0]
            if any(h.ranges != reads.ranges for h in held):
                raise StageError(f"layer {spec.name} reads inputs split along dimension {read.dim} at different bounds")
        self.reads[spec.index] = reads
        output = self.layouts.outputs[spec.index]
        self.held[spec.index] = reads if output == read else self.divided(output, spec.shape, unit)

    def _carried(self, spec: LayerSpec) -> None:
        """A layer whose feature split is carried from its inputs as they are held (``StageLayouts.carried``): it
        reads them as they are, all at the same bounds, and holds its output's split dimension at those bounds
        scaled by the ratio of the sizes (a view into heads: whole heads; a flatten: widened by the elements per
        channel)."""
        sources, ratio = self.layouts.carried[spec.index]
        held = [self.held_of(v) for v in sources]
        if any(h.ranges != held[0].ranges for h in held):
            raise StageError(f"layer {spec.name} reads inputs split at different bounds")
        self.reads[spec.index] = held[0]
        scaled = [(lo * ratio, hi * ratio) for lo, hi in held[0].ranges]
        if any(lo.denominator != 1 or hi.denominator != 1 for lo, hi in scaled):
            raise StageError(f"layer {spec.name} cuts a split tensor's ranges {held[0].ranges} into parts (x {ratio})")
        layout = self.layouts.outputs[spec.index]
        self.held[spec.index] = Held(layout, tuple((int(lo), int(hi)) for lo, hi in scaled))


def shard_stage(
    stage: Stage,
    specs: Sequence[LayerSpec],
    layers: Sequence[int],
    signatures: Mapping[int, str],
    group: Group,
    rows: Ranges,
    input_shape: Sequence[int],
) -> ShardedStage:
    """Make ``stage`` (built whole for device ``group.index`` of its group) the device's part of the sharded stage
    of ``layers`` (the model's ``specs`` by index) running ``signatures``: its shards of split weights and a layout
    change at every ``Change`` of the layout pass. ``rows`` are every device's rows of a micro-batch;
    ``input_shape`` is the model input's per sample."""
    module = stage.module
    if not isinstance(module, torch.fx.GraphModule):
        raise StageError(f"stage {stage.index} is a {type(module).__name__}, not a split's GraphModule")
    missing = [specs[layer].name for layer in layers if specs[layer].name not in _layer_names(module)]
    if missing:
        raise StageError(f"stage {stage.index} lacks layer(s) {', '.join(missing)} of the model's graph")
    layouts = stage_layouts(specs, layers, dict(signatures), len(group.ranks))
    try:
        check_units(specs, layouts, group.shares)
    except PlacementError as exc:
        raise StageError(str(exc)) from None
    placing = _Placing(specs, layouts, layers, group.shares, rows, input_shape)
    shards: dict[str, Shard] = {}
    for layer, weights in layouts.weights.items():
        if isinstance(weights, Split):
            called = _call_target(module, specs[layer].name)
            owned = _shard_layer(module.get_submodule(called), specs[layer], signatures.get(layer), placing, group)
            shards.update({f"{called}.{name}": shard for name, shard in owned.items()})
    graph = copy.deepcopy(module.graph)
    nodes = _value_nodes(graph, stage, specs, layers)
    for number, change in enumerate(layouts.changes):
        source = placing.held_of(change.value)
        if change.layer == OUTPUT:
            target, users = Held(SAMPLES, rows), [next(n for n in graph.nodes if n.op == "output")]
        else:
            target, users = placing.reads[change.layer], [nodes[x] for x in (change.layer, *change.readers)]
        if (source.layout, target.layout) != (change.source, change.target) or any(
            placing.reads[x] != target for x in change.readers
        ):
            raise StageError(f"layout change {change} does not match the stage's layouts {source} -> {target}")
        _insert(
            module, graph, f"layout_change_{number}", LayoutChange(group, source, target), nodes[change.value], users
        )
    whole_input = _read_input(module, graph, nodes, layers, specs, placing, group)
    graph.lint()
    module.graph = graph
    return ShardedStage(shards, whole_input)


def _layer_names(module: torch.fx.GraphModule) -> set[str]:
    return {node.name for node in module.graph.nodes if node.op not in ("placeholder", "output")}


def _call_target(module: torch.fx.GraphModule, name: str) -> str:
    node = next(n for n in module.graph.nodes if n.name == name)
    if node.op != "call_module":
        raise StageError(f"layer {name} holds split weights but is a {node.op}, not a module call")
    return str(node.target)


def _value_nodes(
    graph: torch.fx.Graph, stage: Stage, specs: Sequence[LayerSpec], layers: Sequence[int]
) -> dict[int, torch.fx.Node]:
    """The graph's node of every value the stage reads or makes, by layer (``MODEL_INPUT``: the model's input)."""
    by_name = {node.name: node for node in graph.nodes}
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    nodes = {value.layer: node for value, node in zip(stage.inputs, placeholders, strict=True)}
    nodes.update({layer: by_name[specs[layer].name] for layer in layers})
    return nodes


def _insert(
    module: torch.fx.GraphModule,
    graph: torch.fx.Graph,
    name: str,
    change: LayoutChange,
    value: torch.fx.Node,
    users: Sequence[torch.fx.Node],
) -> None:
    """Call ``change`` on ``value`` right before the first of ``users``, which all read the changed value instead."""
    module.add_submodule(name, change)
    with graph.inserting_before(users[0]):
        changed = graph.call_module(name, (value,))
    for user in users:
        user.replace_input_with(value, changed)


def _read_input(
    module: torch.fx.GraphModule,
    graph: torch.fx.Graph,
    nodes: Mapping[int, torch.fx.Node],
    layers: Sequence[int],
    specs: Sequence[LayerSpec],
    placing: _Placing,
    group: Group,
) -> bool:
    """Whether the stage reads the model's input whole (Broadcast: some layer reads it other than by samples); the
    layers that read it otherwise then slice their part of it."""
    if MODEL_INPUT not in nodes:
        return False
    readers = [layer for layer in layers if nodes[MODEL_INPUT] in nodes[layer].all_input_nodes]
    if all(placing.reads[layer].layout == SAMPLES for layer in readers):
        return False
    for layer in readers:
        if placing.reads[layer].layout != BROADCAST:
            change = LayoutChange(group, Held(BROADCAST), placing.reads[layer])
            _insert(module, graph, f"input_slice_{layer}", change, nodes[MODEL_INPUT], [nodes[layer]])
    return True


def _shard_layer(
    layer: nn.Module, spec: LayerSpec, signature: str | None, placing: _Placing, group: Group
) -> dict[str, Shard]:
    """Keep this device's shard of ``layer``'s split weights; returns each shard by the layer's state names."""
    index = group.index
    if signature in (COLUMN, ROW):
        if not isinstance(layer, nn.Linear | nn.Conv2d) or (isinstance(layer, nn.Conv2d) and layer.groups != 1):
            raise StageError(f"layer {spec.name} ({type(layer).__name__}) cannot run signature {signature!r}")
        if signature == COLUMN:
            ranges = placing.held[spec.index].ranges
            _keep(layer, "weight", 0, ranges[index])
            shards = {"weight": Shard(0, ranges)}
            if layer.bias is not None:
                _keep(layer, "bias", 0, ranges[index])
                shards["bias"] = Shard(0, ranges)
            return shards
        ranges = placing.reads[spec.index].ranges
        _keep(layer, "weight", 1, ranges[index])
        shards = {"weight": Shard(1, ranges)}
        if layer.bias is not None:
            shards["bias"] = Shard(0, (), first_only=True)
            if index > 0:
                layer.bias = None
        return shards
    if isinstance(layer, nn.BatchNorm2d):
        ranges = placing.reads[spec.index].ranges
        names = [n for n in ("weight", "bias", "running_mean", "running_var") if getattr(layer, n) is not None]
        for name in names:
            _keep(layer, name, 0, ranges[index])
        return {name: Shard(0, ranges) for name in names}
    raise StageError(f"layer {spec.name} ({type(layer).__name__}) cannot hold its weights split by channels")


def _keep(layer: nn.Module, name: str, dim: int, part: tuple[int, int]) -> None:
    """Replace ``layer``'s parameter or buffer ``name`` by its range ``part`` along ``dim``."""
    tensor = getattr(layer, name)
    lo, hi = part
    kept = tensor.detach().narrow(dim, lo, hi - lo).clone()
    if isinstance(tensor, nn.Parameter):
        setattr(layer, name, nn.Parameter(kept, tensor.requires_grad))
    else:
        setattr(layer, name, kept)


def full_state(stage: Stage, sharded: ShardedStage, group: Group) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the stage, whole, under the model's names, on the group's first device (the
    others get an empty dict; all must call this): shards gathered in device order along their dimension, a row
    bias the first device's."""
    local = stage.module.state_dict(keep_vars=True)
    gathered: dict[str, torch.Tensor] = {}
    for name in sorted(sharded.shards):
        shard = sharded.shards[name]
        if not shard.first_only:
            split = Held(Split(shard.dim), shard.ranges)
            gathered[name] = group.change(local[name].detach(), split, Held(BROADCAST), emulated=False)
    if group.index > 0:
        return {}
    names = stage.state_names()
    return {names[name]: gathered.get(name, tensor) for name, tensor in local.items() if name in names}
