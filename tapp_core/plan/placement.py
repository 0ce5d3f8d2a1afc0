"""Placement: how the devices of one stage hold each tensor, and what it costs to change how they hold it.

The devices of a stage form a *group*; each device takes a *share* of the group's work (``shares``, fractions
that sum to 1; equal unless a plan says otherwise, e.g. in proportion to each device's speed). A tensor is held
by the group in one of three layouts (OneFlow's SBP, as AutoDDL uses them):

``Split(dim)``
    each device holds a contiguous slice of the tensor along ``dim``, its share of it (``split_ranges``);
``Broadcast``
    every device holds the whole tensor;
``PartialSum``
    every device holds a tensor of the full shape, and the tensor is their sum.

Data-parallel replicas are one case: every layer's input and output ``Split(0)`` (each device its share of the
samples), its weights ``Broadcast``, and the weights' gradients ``PartialSum`` until the update allreduces them.

A layout change is a collective among the group (``conversion``): Split to Broadcast is an allgather, PartialSum
to Broadcast an allreduce, PartialSum to Split a reduce-scatter, Split along one dimension to Split along another
an all-to-all, and Broadcast to Split or to PartialSum is local (each device keeps its slice, or one device keeps
the tensor and the others zeros). ``traffic`` says what a collective moves: the bytes each device sends over its
link and the number of message rounds, on the bandwidth-optimal ring algorithms (AutoDDL's cost table). The time
this takes on a cluster's links is ``tapp_core.cost.formulas``' business.

Between stages, every tensor crosses as ``Split(0)`` on both sides: each device of the receiving stage gets its
share of the samples from the devices of the sending stage that hold them (``row_routes``).

It imports only the model graph's description of a layer (``LayerSpec``): the plan, the memory check, the cost
model, the runtime and the planners all ask it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Literal

from tapp_core.model.graph import MODEL_INPUT, LayerSpec


@dataclass(frozen=True, slots=True)
class Split:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Broadcast:
    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True, slots=True)
class PartialSum:
    def __str__(self) -> str:
        return "P"


Layout = Split | Broadcast | PartialSum
SAMPLES = Split(0)
"""Split along the samples: how data-parallel replicas hold activations, and how every tensor crosses a cut."""
BROADCAST = Broadcast()
PARTIAL_SUM = PartialSum()


class PlacementError(ValueError):
    """Shares or layouts that cannot describe a group; the message names the problem."""


# ---------------------------------------------------------------------------------------------------------------
# Shares: how a group divides its work

SHARE_DIGITS = 6
"""Shares are rounded to this many decimals, so that a plan's id does not depend on float noise."""


def even_shares(devices: int) -> tuple[float, ...]:
    return tuple(1.0 / devices for _ in range(devices))


def normalized_shares(weights: Sequence[float]) -> tuple[float, ...]:
    """``weights`` scaled to sum to 1 and rounded (``SHARE_DIGITS``); the last takes the rounding's rest."""
    if not weights or min(weights) <= 0 or not all(math.isfinite(w) for w in weights):
        raise PlacementError(f"shares must be positive numbers, got {list(weights)}")
    total = sum(weights)
    rounded = [round(w / total, SHARE_DIGITS) for w in weights[:-1]]
    return (*rounded, round(1.0 - sum(rounded), SHARE_DIGITS))


def check_shares(shares: Sequence[float], devices: int) -> None:
    """One positive share per device, summing to 1 (to the rounding of ``SHARE_DIGITS``)."""
    if len(shares) != devices:
        raise PlacementError(f"{len(shares)} shares for {devices} devices")
    if min(shares) <= 0 or not all(math.isfinite(s) for s in shares):
        raise PlacementError(f"shares must be positive, got {list(shares)}")
    if abs(sum(shares) - 1.0) > 10 ** (1 - SHARE_DIGITS) * devices:
        raise PlacementError(f"shares must sum to 1, got {list(shares)} (sum {sum(shares):.6g})")


def split_sizes(total: int, shares: Sequence[float]) -> tuple[int, ...]:
    """``total`` items divided by ``shares``: each device's exact share rounded down, and the items left over one each
    to the devices whose shares lost most to the rounding (ties: the first). Even shares of a divisible total give
    equal sizes."""
    exact = [total * s for s in shares]
    sizes = [math.floor(x + 1e-9) for x in exact]
    left = total - sum(sizes)
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: max(0, left)]:
        sizes[i] += 1
    return tuple(sizes)


def split_ranges(total: int, shares: Sequence[float], unit: int = 1) -> tuple[tuple[int, int], ...]:
    """Each device's contiguous range ``[start, stop)`` of ``total`` items (``split_sizes``), in device order; with a
    ``unit``, every range is a whole number of units (``total // unit`` units divided by the shares: e.g. whole
    attention heads of ``unit`` features each)."""
    ranges = []
    start = 0
    for size in split_sizes(total // unit, shares):
        ranges.append((start, start + size * unit))
        start += size * unit
    return tuple(ranges)


def count_shares(counts: Sequence[int]) -> list[float]:
    """Each device's share of items split as ``counts`` (all zero: zero shares), the inverse of ``split_sizes``."""
    total = max(1, sum(counts))
    return [count / total for count in counts]


@dataclass(frozen=True, slots=True)
class RowRoute:
    """Rows ``[lo, hi)`` of a micro-batch that device ``sender`` of one group holds and device ``receiver`` of
    another needs (indices are the devices' positions in their groups)."""

    sender: int
    receiver: int
    lo: int
    hi: int


def row_routes(rows: int, sender_shares: Sequence[float], receiver_shares: Sequence[float]) -> tuple[RowRoute, ...]:
    """How a tensor of ``rows`` samples held ``Split(0)`` by one group reaches another group that holds it
    ``Split(0)``: every overlap of a sender's rows with a receiver's, in sender then receiver order."""
    routes = []
    for p, (p_lo, p_hi) in enumerate(split_ranges(rows, sender_shares)):
        for q, (q_lo, q_hi) in enumerate(split_ranges(rows, receiver_shares)):
            lo, hi = max(p_lo, q_lo), min(p_hi, q_hi)
            if lo < hi:
                routes.append(RowRoute(p, q, lo, hi))
    return tuple(routes)


# ---------------------------------------------------------------------------------------------------------------
# Layout changes and what they move

Collective = Literal["none", "slice", "zero", "allgather", "allreduce", "reduce_scatter", "all_to_all"]
LOCAL_COLLECTIVES: frozenset[Collective] = frozenset({"none", "slice", "zero"})
"""Layout changes that each device makes on its own, with no traffic."""


def conversion(source: Layout, target: Layout) -> Collective:
    """The collective that turns a tensor held as ``source`` by a group into one held as ``target`` (same shares)."""
    if source == target:
        return "none"
    if isinstance(source, Broadcast):
        return "slice" if isinstance(target, Split) else "zero"
    if isinstance(source, PartialSum):
        return "allreduce" if isinstance(target, Broadcast) else "reduce_scatter"
    if isinstance(target, Broadcast):
        return "allgather"
    if isinstance(target, Split):
        return "all_to_all"
    return "zero"  # Split -> PartialSum: each device pads its slice with zeros


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one collective costs each device: the bytes it sends over its link, and the message rounds (each a
    latency) it waits through."""

    bytes_per_device: float
    rounds: int

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes_per_device + other.bytes_per_device, self.rounds + other.rounds)


NO_TRAFFIC = Traffic(0.0, 0)


def traffic(collective: Collective, tensor_bytes: float, shares: Sequence[float]) -> Traffic:
    """The traffic of ``collective`` on a tensor of ``tensor_bytes`` (its whole size) among a group with ``shares``,
    on ring algorithms, for the busiest device (unequal shares: the one whose slice is smallest receives most).

    allgather ``(1 - min share) T`` in ``k - 1`` rounds; reduce-scatter the same; allreduce (a reduce-scatter then an
    allgather) ``2 (k - 1) / k T`` in ``2 (k - 1)`` rounds; all-to-all ``max share (1 - min share) T`` (each device
    sends its slice's parts that others hold) in ``k - 1`` rounds. With equal shares these are AutoDDL's costs.
    """
    k = len(shares)
    if k == 1 or collective in LOCAL_COLLECTIVES:
        return NO_TRAFFIC
    low, high = min(shares), max(shares)
    if collective in ("allgather", "reduce_scatter"):
        return Traffic((1.0 - low) * tensor_bytes, k - 1)
    if collective == "allreduce":
        return Traffic(2.0 * (k - 1) / k * tensor_bytes, 2 * (k - 1))
    return Traffic(high * (1.0 - low) * tensor_bytes, k - 1)


# ---------------------------------------------------------------------------------------------------------------
# Signatures: how a layer runs on a group
#
# A layer of a stage on several devices runs with a *signature*: the layouts of its input, its weights and its
# output. Linear and Conv2d choose one (``SIGNATURES``):
#
# ``data``  input Split(0), weights Broadcast, output Split(0): data parallelism (the default of every layer);
# ``col``   input Broadcast, weights split along their output features (channels), output Split(feature):
#           Megatron's column-parallel layer;
# ``row``   input Split(feature), weights split along their input features (channels), output PartialSum, the
#           bias added by the group's first device only: Megatron's row-parallel layer.
#
# (The feature dimension is a Linear's last and a Conv2d's channels, dimension 1.) Every other layer follows its
# input: elementwise layers (activations, dropout) keep any layout; layers that act per channel (pooling,
# BatchNorm2d, flatten) keep Split(0), Split(1) or Broadcast; a PartialSum reaching a layer that is not linear in
# it is first reduce-scattered along the features; ``add`` takes its first input's layout; a feature split
# (Split(d), d > 0) is *carried* through the shape operations of attention (``_carried``): a view or reshape that
# splits the dimension into several (``(T, D)`` to ``(T, heads, head_dim)``: the split falls on the first, the
# heads, and every device must hold whole heads) or merges it with those after it, a transpose or permute that
# moves it, a batched matmul whose two inputs are split along the same batch dimension (the heads), a softmax along
# another dimension, a product with a number; any other layer (``cat``, LayerNorm, ...) reads Split(0), or
# Broadcast when all its inputs are. A stage's inputs arrive Split(0) (the model's input is read from the data in
# any layout, for free), and its outputs leave Split(0). A value that several layers read in the same other layout
# changes once.
#
# Megatron's attention is then q, k, v ``col`` and the projection ``row``: each device computes whole heads and
# exchanges nothing between q/k/v and the projection; its MLP is fc1 ``col`` and fc2 ``row``. A split carried
# through a view into heads must give every device a whole number of heads: the layout pass finds that *unit* (the
# features of one head) from the shapes, and ``split_ranges`` rounds each device's share to it
# (``StageLayouts.units``); ``check_units`` rejects a group that cannot give every device one, naming the layer.
#
# Gradients flow back in the *dual* layout (Split stays Split, Broadcast's gradient is a PartialSum and
# PartialSum's a Broadcast), and each layout change's backward is the change between the duals
# (``backward_conversion``), the adjoint of the forward's collective: an allgather's backward is a reduce-scatter,
# an allreduce's an allreduce. Weights held Broadcast have PartialSum gradients, summed across the group before the
# update (the gradient buckets of ``tapp_core.plan.program``); split weights are updated where they are.

DATA, COLUMN, ROW = "data", "col", "row"
SIGNATURES: dict[str, tuple[str, ...]] = {"Linear": (DATA, COLUMN, ROW), "Conv2d": (DATA, COLUMN, ROW)}
"""The signatures a layer of each operation type may choose; every other layer runs ``data`` (follows its input)."""
ELEMENTWISE = frozenset(
    {"ReLU", "relu", "GELU", "gelu", "SiLU", "silu", "Sigmoid", "sigmoid", "Tanh", "tanh", "Dropout", "dropout",
     "Identity", "ReLU6", "LeakyReLU"}
)  # fmt: skip
"""Layers that act on each element on its own: any layout passes through them."""
CHANNELWISE = frozenset({"MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "BatchNorm2d", "flatten"})
"""Layers that act on each sample and each channel (dimension 1) on their own: Split(0), Split(1) and Broadcast
pass through them."""
LINEAR_IN_INPUT = frozenset({"add", "Identity", "flatten", "Dropout", "dropout"})
"""Layers whose output is linear in their input (in training, dropout's mask is fixed per device): a PartialSum
passes through them."""
SUMMING = frozenset({"add"})
RESHAPES = frozenset({"view", "reshape"})
PERMUTES = frozenset({"transpose", "permute"})
BATCHED_MATMULS = frozenset({"matmul", "bmm"})
ROWWISE = frozenset({"softmax", "log_softmax", "Softmax", "LogSoftmax"})
"""Layers that act along one dimension (``LayerSpec.axes``) and on every other on its own."""
SHAPE_READS = frozenset({"getattr", "size", "dim"})
"""Layers that read a tensor's shape: they read it as it is held and output numbers, which no layout change moves
(a device reads its own part's shape, as the model's code does on one device)."""
SCALING = frozenset({"mul", "truediv", "div"})
"""Products with (or quotients by) a number: elementwise when they read one layer and hold no parameter."""
OUTPUT = -2
"""``Change.layer`` of the changes a stage makes to its outputs before they leave it (to Split(0))."""


def feature_dim(op: str, shape: Sequence[int]) -> int:
    """The dimension a layer's features are split along, of its (samples, ...) output: a Conv2d's channels (1),
    any other layer's last."""
    return 1 if op == "Conv2d" else len(shape)


def dual(layout: Layout) -> Layout:
    """The layout of a tensor's gradient, given the tensor's."""
    if isinstance(layout, Broadcast):
        return PARTIAL_SUM
    if isinstance(layout, PartialSum):
        return BROADCAST
    return layout


def backward_conversion(source: Layout, target: Layout) -> Collective:
    """The collective the backward pass runs for a forward change from ``source`` to ``target``: the change from the
    gradient's layout at ``target`` to its layout at ``source``."""
    return conversion(dual(target), dual(source))


@dataclass(frozen=True, slots=True)
class Change:
    """A layout change before ``layer`` reads ``value`` (a layer's output; ``layer`` is ``OUTPUT`` for a stage
    output leaving): forward ``source`` -> ``target``, of a tensor of ``elements`` elements per sample."""

    layer: int
    value: int
    source: Layout
    target: Layout
    elements: int
    readers: tuple[int, ...] = ()
    """Later layers that read the changed value too (the same change serves them all)."""

    @property
    def forward(self) -> Collective:
        return conversion(self.source, self.target)

    @property
    def backward(self) -> Collective:
        return backward_conversion(self.source, self.target)


@dataclass(frozen=True)
class StageLayouts:
    """How one stage's group runs its layers: each layer's input and output layout and how it holds its weights,
    and every layout change (in order: before the layer that needs it; the outputs' last)."""

    inputs: dict[int, Layout]
    """Per layer: the layout it reads its inputs in."""
    outputs: dict[int, Layout]
    weights: dict[int, Layout]
    """Per parameter-holding layer: Broadcast, or Split(d) along the weight's dimension d (0: output features)."""
    changes: tuple[Change, ...]
    carried: dict[int, tuple[tuple[int, ...], Fraction]] = field(default_factory=dict)
    """Per layer whose output is a feature split carried from inputs held that way (``_LayoutPass._carry``): those
    inputs, and the size of its split dimension over theirs (a view into heads ``heads / D``, a merge back
    ``D / heads``, a transpose 1). Each device's range of it is theirs, scaled by that."""
    units: dict[int, int] = field(default_factory=dict)
    """Per layer where a feature split starts (a ``col`` output, a change into a split), when its ranges must be
    multiples of more than one item: that unit (e.g. the features of one attention head)."""

    @property
    def coupled(self) -> bool:
        """Whether the group's devices exchange data within a forward or a backward (else they run apart)."""
        return any(c.forward not in LOCAL_COLLECTIVES or c.backward not in LOCAL_COLLECTIVES for c in self.changes)

    def reduced(self, layer: int) -> bool:
        """Whether ``layer``'s weight gradients are summed across the group before the update."""
        return isinstance(self.weights.get(layer), Broadcast)

    def split(self, layer: int) -> bool:
        """Whether ``layer``'s work is split by the devices' shares along its features (split weights, or a feature
        split input), rather than by samples or replicated."""
        weights, read = self.weights.get(layer), self.inputs[layer]
        return isinstance(weights, Split) or (isinstance(read, Split) and read.dim > 0)

    def replicated(self, layer: int) -> bool:
        """Whether every device of the group runs ``layer`` whole (a Broadcast or PartialSum input)."""
        return not self.split(layer) and not isinstance(self.inputs[layer], Split)


class SignatureError(PlacementError):
    """A signature a layer cannot run with; the message names the layer."""


def check_signature(spec: LayerSpec, signature: str, devices: int) -> None:
    """``SignatureError`` unless ``spec``'s layer may run ``signature`` on a group of ``devices`` devices: its
    operation has it, and every device gets a feature of what it splits."""
    allowed = SIGNATURES.get(spec.op, (DATA,))
    if signature not in allowed:
        raise SignatureError(
            f"layer {spec.name} ({spec.op}) cannot run signature {signature!r}; it may run {', '.join(allowed)}"
        )
    if signature != DATA and spec.shape and spec.shape[feature_dim(spec.op, spec.shape) - 1] < devices:
        raise SignatureError(f"layer {spec.name}: {devices} devices cannot split its {spec.shape} output's features")


REGROUPING = RESHAPES | {"flatten", "Flatten", "unflatten"}
"""Shape operations that may move elements between samples (``x.reshape(-1, c)`` makes rows of several a sample)."""


def check_rows_per_sample(layers: Sequence[LayerSpec], stage_layers: Sequence[int]) -> None:
    """``SignatureError`` naming the first layer of a stage run by split signatures that regroups the rows of its
    samples (its output holds other elements per sample than its input): the layouts split, gather and slice a
    tensor by samples, one row each, and a tensor of several rows a sample would be cut between them."""
    for index in stage_layers:
        spec = layers[index]
        if spec.op not in REGROUPING:
            continue
        tensors = [v for v in spec.inputs if v != MODEL_INPUT and layers[v].shape]
        if tensors and math.prod(layers[tensors[0]].shape) != math.prod(spec.shape):
            raise SignatureError(
                f"layer {spec.name} ({spec.op}) regroups rows between samples ({layers[tensors[0]].shape} per sample "
                f"in, {spec.shape} out): a stage run by split signatures keeps one row per sample"
            )


def stage_layouts(
    layers: Sequence[LayerSpec], stage_layers: Sequence[int], signatures: dict[int, str], devices: int
) -> StageLayouts:
    """The layout pass of one stage: ``layers`` is the whole model (by index), ``stage_layers`` the stage's (in
    topological order), ``signatures`` the chosen ones (others ``data``), on a group of ``devices`` devices."""
    layout_pass = _LayoutPass(layers, set(stage_layers), devices)
    for index in stage_layers:
        layout_pass.place(layers[index], signatures.get(index, DATA))
    layout_pass.leave(stage_layers, _consumers(layers))
    return StageLayouts(
        layout_pass.inputs,
        layout_pass.outputs,
        layout_pass.weights,
        tuple(layout_pass.changes),
        layout_pass.carried,
        layout_pass.units(stage_layers),
    )


def check_units(layers: Sequence[LayerSpec], layouts: StageLayouts, shares: Sequence[float]) -> None:
    """``SignatureError`` naming the layer unless every split that must fall on whole units (``StageLayouts.units``,
    e.g. attention heads) gives each device of the group at least one unit with ``shares``."""
    for layer, unit in sorted(layouts.units.items()):
        spec, split = layers[layer], layouts.outputs[layer]
        size = spec.shape[split.dim - 1] if isinstance(split, Split) and split.dim > 0 else 0
        if size % unit or min(split_sizes(size // unit, shares)) < 1:
            raise SignatureError(
                f"layer {spec.name}: its split of {size} features must fall on whole units of {unit} (a later layer "
                f"splits them into {size // unit} x {unit}, e.g. attention heads), too few for {len(shares)} devices "
                f"with shares {[round(x, 3) for x in shares]}"
            )


_CONSUMERS: dict[int, tuple[Sequence[LayerSpec], dict[int, list[int]]]] = {}


def _consumers(layers: Sequence[LayerSpec]) -> dict[int, list[int]]:
    """Per layer, the layers that read it (cached per model: the pass runs for every stage of every plan)."""
    cached = _CONSUMERS.get(id(layers))
    if cached is not None and cached[0] is layers:
        return cached[1]
    out: dict[int, list[int]] = {spec.index: [] for spec in layers}
    for spec in layers:
        for value in spec.inputs:
            if value != MODEL_INPUT:
                out[value].append(spec.index)
    if len(_CONSUMERS) > 8:
        _CONSUMERS.clear()
    _CONSUMERS[id(layers)] = (layers, out)
    return out


class _LayoutPass:
    def __init__(self, layers: Sequence[LayerSpec], members: set[int], devices: int) -> None:
        self.layers = layers
        self.members = members
        self.devices = devices
        self.inputs: dict[int, Layout] = {}
        self.outputs: dict[int, Layout] = {}
        self.weights: dict[int, Layout] = {}
        self.changes: list[Change] = []
        self.carried: dict[int, tuple[tuple[int, ...], Fraction]] = {}
        self.shapes: dict[int, bool] = {}

    def layout_of(self, value: int) -> Layout:
        """A value's layout where the stage reads it: its layer's output here, else Split(0) (a cut value)."""
        return self.outputs.get(value, SAMPLES)

    def shape_value(self, value: int) -> bool:
        """Whether ``value`` holds numbers read from a shape (``SHAPE_READS``, items of those, arithmetic on them)."""
        if value == MODEL_INPUT or self.layers[value].shape:
            return False
        if value not in self.shapes:
            spec = self.layers[value]
            self.shapes[value] = spec.op in SHAPE_READS or (
                spec.inputs != (MODEL_INPUT,) and all(self.shape_value(v) for v in spec.inputs)
            )
        return self.shapes[value]

    def place(self, spec: LayerSpec, signature: str) -> None:
        if signature == DATA and self.shape_value(spec.index):
            tensors = self._tensor_inputs(spec)
            if tensors:
                self.inputs[spec.index] = self.layout_of(tensors[0])
            else:  # the model's input's shape is its rows' here (as ``_sized_by`` takes it), or numbers alone
                self.inputs[spec.index] = SAMPLES if MODEL_INPUT in spec.inputs else BROADCAST
            self.outputs[spec.index] = BROADCAST  # every device holds its numbers; no change ever moves them
        elif signature != DATA:
            self._chosen(spec, signature)
        elif spec.sample_free:  # a weight read alone, a table looked up by arange: every device holds it whole
            self._read(spec, BROADCAST)
        elif self._carry(spec):
            pass
        elif spec.op in ELEMENTWISE or spec.op in CHANNELWISE or self._scaling(spec):
            self._pointwise(spec)
        elif spec.op in SUMMING:
            self._read(spec, self._summed(spec))
            self._passed(spec)
        elif not self._tensor_inputs(spec) or self._reads_shapes(spec):
            self._read(spec, self._sized_by(spec))
        else:
            layouts = {self.layout_of(v) for v in self._tensor_inputs(spec)}
            self._read(spec, BROADCAST if layouts == {BROADCAST} else SAMPLES)
        if spec.has_params and spec.index not in self.weights:
            self.weights[spec.index] = Split(0) if self.inputs[spec.index] == Split(1) else BROADCAST

    def _reads_shapes(self, spec: LayerSpec) -> bool:
        return any(self.shape_value(v) for v in spec.inputs if v != MODEL_INPUT)

    def _sized_by(self, spec: LayerSpec) -> Layout:
        """The layout of a layer that reads shapes (a class token expanded to ``x.shape[0]``, ``q.view(b, n, h,
        d)``): its samples are those of the tensors the shapes were read from. A device holding a tensor split by
        features, a partial sum, or a whole one, reads every sample's size, so the layer reads and makes whole
        tensors (BROADCAST); one holding its share of the samples, or the model's input, its share (SAMPLES)."""
        held = {self.layout_of(v) if v is not None else SAMPLES for v in self._shape_sources(spec)}
        return BROADCAST if held and SAMPLES not in held else SAMPLES

    def _shape_sources(self, spec: LayerSpec) -> set[int | None]:
        """The tensors whose shapes ``spec`` reads (through ``SHAPE_READS``, items of those and arithmetic on them);
        None for a shape read of the model's input."""
        sources: set[int | None] = set()
        todo, seen = [v for v in spec.inputs if v != MODEL_INPUT and self.shape_value(v)], set()
        while todo:
            value = todo.pop()
            if value in seen:
                continue
            seen.add(value)
            read = self.layers[value]
            if read.op in SHAPE_READS:
                tensors = self._tensor_inputs(read)
                sources.add(tensors[0] if tensors else None)
            else:
                todo += [v for v in read.inputs if v != MODEL_INPUT and self.shape_value(v)]
        return sources

    def _read(self, spec: LayerSpec, layout: Layout, output: Layout | None = None) -> None:
        """``spec`` reads every input as ``layout`` (a change where one is held otherwise; the model's input is
        read from the data as needed) and writes ``output`` (default: ``layout``)."""
        for value in spec.inputs:
            source = self.layout_of(value)
            if value != MODEL_INPUT and self.layers[value].sample_free:
                if layout not in (SAMPLES, BROADCAST):
                    raise SignatureError(
                        f"layer {spec.name} ({spec.op}) would read {self.layers[value].name}, a tensor with no "
                        f"samples (made from weights or shapes alone), split as {layout}; it is held whole"
                    )
                continue  # held whole by every device, and read so against rows as against whole tensors
            if value != MODEL_INPUT and source != layout and not self.shape_value(value):
                done = [i for i, c in enumerate(self.changes) if (c.value, c.target) == (value, layout)]
                if done:  # another layer reads it in this layout already: the same change serves both
                    change = self.changes[done[0]]
                    self.changes[done[0]] = replace(change, readers=(*change.readers, spec.index))
                    continue
                elements = math.prod(self.layers[value].shape)
                self.changes.append(Change(spec.index, value, source, layout, elements))
        self.inputs[spec.index] = layout
        self.outputs[spec.index] = layout if output is None else output

    def _chosen(self, spec: LayerSpec, signature: str) -> None:
        feature = Split(feature_dim(spec.op, spec.shape))
        if signature == COLUMN:
            self._read(spec, BROADCAST, output=feature)
            self.weights[spec.index] = Split(0)
        else:
            self._read(spec, feature, output=PARTIAL_SUM)
            self.weights[spec.index] = Split(1)

    def _summed(self, spec: LayerSpec) -> Layout:
        """The layout a sum reads its inputs in: its first input's, unless the sum adds a tensor of its own (a
        position embedding: an fx ``get_attr``), which every device holds whole. That adds only to whole rows
        (SAMPLES) or whole values (BROADCAST): a feature split would add a whole tensor to a share of the features,
        a partial sum would add it once per device."""
        layout = self._first_input(spec)
        if (spec.has_params or self._reads_sample_free(spec)) and layout not in (SAMPLES, BROADCAST):
            return BROADCAST
        return layout

    def _first_input(self, spec: LayerSpec) -> Layout:
        """The layout of the first input that has samples (a tensor of none is held whole whatever its readers)."""
        if not spec.inputs:
            return SAMPLES
        with_samples = [v for v in spec.inputs if v == MODEL_INPUT or not self.layers[v].sample_free]
        return self.layout_of(with_samples[0]) if with_samples else BROADCAST

    def _pointwise(self, spec: LayerSpec) -> None:
        layout = self._first_input(spec)
        if isinstance(layout, PartialSum) and spec.op not in LINEAR_IN_INPUT:
            features = spec.shape[0] if spec.shape else 0
            layout = Split(1) if features >= self.devices else BROADCAST
        if spec.op in CHANNELWISE and isinstance(layout, Split) and layout.dim > 1:
            layout = BROADCAST
        if self._reads_sample_free(spec) and layout not in (SAMPLES, BROADCAST):
            layout = BROADCAST  # a whole tensor of no samples (a layer scale, a mask) meets whole features only
        self._read(spec, layout)
        self._passed(spec)

    def _reads_sample_free(self, spec: LayerSpec) -> bool:
        return any(v != MODEL_INPUT and self.layers[v].sample_free for v in spec.inputs)

    def _scaling(self, spec: LayerSpec) -> bool:
        return spec.op in SCALING and not spec.has_params and len(self._tensor_inputs(spec)) == 1

    def _tensor_inputs(self, spec: LayerSpec) -> list[int]:
        """The layers ``spec`` reads that hold tensors (not shapes read from one)."""
        return [v for v in spec.inputs if v != MODEL_INPUT and not self.shape_value(v)]

    def _passed(self, spec: LayerSpec) -> None:
        """Note a feature split that ``spec`` keeps from its first input as that holds it (scaled, as a flatten
        widens the channels by the elements of each)."""
        split, first = self.outputs[spec.index], self._first_input(spec)
        if isinstance(split, Split) and split.dim > 0 and first == split and spec.inputs[0] != MODEL_INPUT:
            before, after = self.layers[spec.inputs[0]].shape[split.dim - 1], spec.shape[split.dim - 1]
            self.carried[spec.index] = ((spec.inputs[0],), Fraction(after, before))

    def _carry(self, spec: LayerSpec) -> bool:
        """Carry a feature split through a shape operation of attention (view, transpose, batched matmul, softmax)
        that keeps it, without a collective; False where the layer is not one or does not keep it."""
        tensors = self._tensor_inputs(spec)
        held = [self.layout_of(v) for v in tensors]
        if not held or not isinstance(held[0], Split) or held[0].dim == 0 or any(h != held[0] for h in held):
            return False
        dim, source = held[0].dim, self.layers[tensors[0]].shape
        moved: tuple[int, Fraction] | None = None
        if spec.op in RESHAPES and len(tensors) == 1 and self._shape_sources(spec) <= {tensors[0]}:
            # shapes read from another tensor (``x.reshape(b, n, 3, h, c // h)`` with ``c`` from the block's input)
            # are whole where this one holds a share of the features: the reshape reads it whole instead
            moved = _reshaped(source, spec.shape, dim)
        elif spec.op in PERMUTES and len(tensors) == 1:
            order = _permutation(spec.op, spec.axes, len(source) + 1)
            moved = (order.index(dim), Fraction(1)) if order and order[0] == 0 else None
        elif spec.op in BATCHED_MATMULS and len(tensors) == 2 and dim <= len(spec.shape) - 2:
            shapes = {self.layers[v].shape[:-2] for v in tensors} | {spec.shape[:-2]}
            moved = (dim, Fraction(1)) if len(shapes) == 1 else None
        elif spec.op in ROWWISE and len(tensors) == 1 and len(spec.axes) == 1 and spec.axes[0] != dim:
            moved = (dim, Fraction(1))
        if moved is None:
            return False
        self.inputs[spec.index] = held[0]
        self.outputs[spec.index] = Split(moved[0])
        self.carried[spec.index] = (tuple(tensors), moved[1])
        return True

    def units(self, stage_layers: Sequence[int]) -> dict[int, int]:
        """Per layer where a feature split starts, the unit its ranges must be multiples of for every layer it is
        carried to to hold whole items (``StageLayouts.units``): requirements pushed back from the carried layers
        (a range scaled by ``a / b`` is whole when the source's is a multiple of ``b``), equal for a matmul's two
        inputs, to a fixed point."""
        need: dict[int, int] = {}
        changed = True
        while changed:
            changed = False
            for layer in reversed(stage_layers):
                if layer not in self.carried:
                    continue
                sources, ratio = self.carried[layer]
                scaled = ratio.denominator * need.get(layer, 1)
                want = math.lcm(scaled // math.gcd(ratio.numerator, scaled), *(need.get(v, 1) for v in sources))
                for value in sources:
                    if need.get(value, 1) != want:
                        need[value], changed = want, True
        return {x: u for x, u in need.items() if u > 1 and x not in self.carried and x in self.members}

    def leave(self, stage_layers: Sequence[int], consumers: dict[int, list[int]]) -> None:
        """Outputs read by a later stage, and the model's output, leave as Split(0)."""
        for index in stage_layers:
            readers = consumers[index]
            leaves = not readers or any(c not in self.members for c in readers)
            if leaves and self.outputs[index] != SAMPLES and not self.shape_value(index):
                elements = math.prod(self.layers[index].shape)
                self.changes.append(Change(OUTPUT, index, self.outputs[index], SAMPLES, elements))


def _reshaped(source: Sequence[int], target: Sequence[int], dim: int) -> tuple[int, Fraction] | None:
    """Where a view or reshape from per-sample ``source`` to ``target`` puts a split of dimension ``dim`` (samples
    are 0), and the new dimension's size over the old: the same dimension, the first of those it is split into
    (``(T, D)`` to ``(T, H, D / H)``: H / D) or it merged with those after it (back: D / H); None where the split
    does not survive (merged with a dimension before it)."""
    prefix, size = math.prod(source[: dim - 1]), source[dim - 1]
    for new in range(1, len(target) + 1):
        if math.prod(target[: new - 1]) == prefix and target[new - 1] != 1:
            break
    else:
        return None
    out = target[new - 1]
    if math.prod(target[: new - 1]) != prefix:
        return None
    merged = out >= size and any(math.prod(source[dim - 1 : k]) == out for k in range(dim, len(source) + 1))
    split = out < size and any(math.prod(target[new - 1 : k]) == size for k in range(new, len(target) + 1))
    return (new, Fraction(out, size)) if merged or split else None


def _permutation(op: str, axes: Sequence[int], ndim: int) -> list[int]:
    """The order of a transpose's (two axes) or permute's (all) output dimensions, as input dimensions; [] if the
    axes are unknown."""
    if op == "transpose" and len(axes) == 2:
        order = list(range(ndim))
        order[axes[0]], order[axes[1]] = order[axes[1]], order[axes[0]]
        return order
    return list(axes) if op == "permute" and len(axes) == ndim else []
