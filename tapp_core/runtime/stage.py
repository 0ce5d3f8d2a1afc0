"""Stages: one rank's share of the model, cut from the traced graph with torch.fx ``split_module``.

The cut follows the plan's ``stage_of_layer`` over ``tapp_core.model.graph.layer_nodes``, the numbering the layer
library and every planner use. Between stages travel *cut values*: the tensors one stage produces and a later
stage consumes. There may be several per cut, and a value may skip stages (stage 0 -> stage 2): it is then sent
straight from its producer to each consumer. The model input is a cut value too, produced by nobody: every stage
that reads it takes it from the data, which is identical on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import operator
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch import nn
from torch.fx.passes.split_module import split_module

from tapp_core.errors import TappError
from tapp_core.model.crossing import CUT_SAMPLES, CutFacts, Layout, cut_facts, is_plain, pack, unpack
from tapp_core.model.flops import tensors_in
from tapp_core.model.graph import (
    MODEL_INPUT,
    LayerBytes,
    LayerSpec,
    SharedParameter,
    layer_edges,
    layer_index,
    layer_nodes,
    layer_parameters,
    op_axes,
    op_type,
    shared_parameters,
)
from tapp_core.model.workload import (
    NAME_THE_OUTPUT,
    TensorSpec,
    Workload,
    as_workload,
    build_traced_workload,
    example_input,
)
from tapp_core.model.zoo import INPUT_SHAPE
from tapp_core.plan.plan import PlanError, check_edges, check_layers, check_stages_used
from tapp_core.plan.rule import ModelFacts

LAYER_META = "tapp_layer"
"""The key of a traced node's ``meta`` holding its layer index (``graph.layer_index``), kept by every stage's copy."""


class StageError(TappError):
    """A plan that cannot be cut into stages of this model; the message names the layer or value at fault."""


@dataclass(frozen=True)
class CutValue:
    """A tensor that crosses a stage boundary (or the model input). Its first dimension is the sample."""

    index: int
    name: str
    layer: int
    """The library index of the layer that computes it (``MODEL_INPUT`` for the model's input): how programs
    (``tapp_core.plan.program``) name it."""
    producer: int
    consumers: tuple[int, ...]
    sample_shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    """Whether a gradient flows back to the producer (false for the input and for values no parameter shaped)."""

    def shape(self, samples: int) -> tuple[int, ...]:
        return (samples, *self.sample_shape)

    def nbytes(self, samples: int) -> int:
        return samples * int(torch.Size(self.sample_shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PipelineGraph:
    """Who produces and who consumes every cut value, for all stages of one plan."""

    n_stages: int
    values: tuple[CutValue, ...]
    stage_inputs: tuple[tuple[int, ...], ...]
    """Per stage, the values its submodule takes, in call order."""
    stage_outputs: tuple[tuple[int, ...], ...]
    """Per stage, the values its submodule returns, in return order."""
    output: int
    """The value holding the model's output (logits), produced by the last stage."""


def check_stage_assignment(graph_module: torch.fx.GraphModule, stage_of_layer: Sequence[int], n_stages: int) -> None:
    """Raise ``StageError`` unless every layer has a stage, every stage a layer, and no edge runs backward: what
    cutting the stages needs (the whole rule of what the runtime runs is ``tapp_core.plan.rule.check_runs``)."""
    nodes = layer_nodes(graph_module)
    index = layer_index(graph_module)
    edges = [(index[node], index[user]) for node in nodes for user in node.users if user in index]

    def name(i: int) -> str:
        return nodes[i].name

    try:
        check_layers(stage_of_layer, n_stages, len(nodes), name, "the traced model")
        check_stages_used(stage_of_layer, n_stages)
        check_edges(stage_of_layer, edges, name)
    except PlanError as exc:
        raise StageError(str(exc)) from None


def split_stages(
    graph_module: torch.fx.GraphModule,
    stage_of_layer: Sequence[int],
    n_stages: int,
    input_shape: Sequence[int] | TensorSpec = INPUT_SHAPE,
) -> tuple[torch.fx.GraphModule, PipelineGraph]:
    """Cut ``graph_module`` into ``submod_0..submod_{n-1}`` and describe the values crossing the cuts.

    Shapes, dtypes and whether a gradient flows are found by running the split model on two samples (eval mode,
    so no running statistics change).
    """
    check_stage_assignment(graph_module, stage_of_layer, n_stages)
    facts = _cut_facts(graph_module, input_shape)
    index = layer_index(graph_module)
    for node, i in index.items():  # copied into the stages with each node: how a stage's value names its layer
        node.meta[LAYER_META] = i
    # Each stage's nodes keep the traced model's names, which sharding finds layers by: split_module otherwise
    # names a stage's nodes afresh (relu_1 becomes relu, another layer's name).
    split = split_module(
        graph_module, graph_module, lambda node: stage_of_layer[index[node]], keep_original_node_name=True
    )
    _move_attributes_into_stages(split)

    placeholders = [n for n in split.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise StageError(f"the model takes {len(placeholders)} inputs; the runtime feeds exactly one (the images)")
    samples = _trace_values(split, example_input(input_shape, 2))
    if _pack_cut_values(split, samples, facts):
        samples = _trace_values(split, example_input(input_shape, 2))
    if _rebuild_shape_values(split, placeholders[0], samples, input_shape):
        samples = _trace_values(split, example_input(input_shape, 2))
    _copy_inputs_changed_in_place(split)
    flow = _ValueFlow.of(split, placeholders[0], n_stages)
    graph = PipelineGraph(
        n_stages=n_stages,
        values=tuple(
            _cut_value(v, node, _layer_of(split, node), flow.producers[v], flow.consumers(v), samples[node])
            for v, node in enumerate(flow.nodes)
        ),
        stage_inputs=tuple(flow.stage_inputs[s] for s in range(n_stages)),
        stage_outputs=tuple(tuple(flow.stage_outputs[s]) for s in range(n_stages)),
        output=flow.output,
    )
    return split, graph


def _move_attributes_into_stages(split: torch.fx.GraphModule) -> None:
    """Give each tensor the model reads itself (a ``get_attr`` node: a class token, a position embedding) to the
    stages that read it.

    ``split_module`` leaves such a tensor on the top-level module and passes it to every stage that reads it as an
    argument, where it would be a cut value without a producer, and a parameter no stage trains. Instead each such
    stage registers the tensor under its own name (a parameter as a parameter, anything else as a buffer) and
    reads it with its own ``get_attr``: a parameter thus belongs to each stage that uses it, which updates its own
    copy (``owned_copy``) like any parameter of its layers; used on several stages, it is tied, its gradient
    summed among them every step (``tapp_core.plan.ties``). A buffer or constant read on several stages is copied
    to each.
    """
    moved: set[str] = set()
    for node in list(split.graph.nodes):
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = attrgetter(target)(split)
        if not isinstance(value, torch.Tensor):
            continue
        for user in list(node.users):
            if user.op != "call_module":
                raise StageError(f"the model's {target!r} is used outside every stage (by {user.name})")
            stage_module = _stage_module(split, user)
            local = _free_attribute_name(stage_module, target.replace(".", "_"))
            if isinstance(value, nn.Parameter):
                stage_module.register_parameter(local, value)
            else:
                stage_module.register_buffer(local, value)
            placeholders = [n for n in stage_module.graph.nodes if n.op == "placeholder"]
            for position, arg in enumerate(user.args):
                if arg is node:
                    with stage_module.graph.inserting_after(placeholders[-1]):
                        read = stage_module.graph.get_attr(local)
                    placeholders[position].replace_all_uses_with(read)
                    stage_module.graph.erase_node(placeholders[position])
            user.args = tuple(arg for arg in user.args if arg is not node)
            stage_module.recompile()
        split.graph.erase_node(node)
        moved.add(target)
    for target in moved:  # a tensor read in several places has several get_attr nodes
        path, _, attribute = target.rpartition(".")
        delattr(split.get_submodule(path) if path else split, attribute)
    split.recompile()


def _stage_module(split: torch.fx.GraphModule, call: torch.fx.Node) -> torch.fx.GraphModule:
    """The submodule of the stage that top-level node ``call`` (``submod_s(...)``) runs."""
    module = split.get_submodule(str(call.target))
    if not isinstance(module, torch.fx.GraphModule):
        raise StageError(f"{call.target} is a {type(module).__name__}, not a split's GraphModule")
    return module


def _free_attribute_name(module: nn.Module, name: str) -> str:
    free, n = name, 0
    while hasattr(module, free):
        n += 1
        free = f"{name}_{n}"
    return free


_CUT_FACTS: weakref.WeakKeyDictionary[torch.fx.GraphModule, dict[object, CutFacts]] = weakref.WeakKeyDictionary()
"""``crossing.cut_facts`` of each traced model a rank or a planner holds, by input: found once, not once a plan."""


def _cut_facts(graph_module: torch.fx.GraphModule, input_shape: Sequence[int] | TensorSpec) -> CutFacts:
    key = input_shape if isinstance(input_shape, TensorSpec) else tuple(input_shape)
    found = _CUT_FACTS.setdefault(graph_module, {})
    if key not in found:
        found[key] = cut_facts(graph_module, example_input(input_shape, CUT_SAMPLES))
    return found[key]


def _pack_cut_values(split: torch.fx.GraphModule, values: Mapping[torch.fx.Node, Any], facts: CutFacts) -> bool:
    """Let every value cross a cut as one tensor with its samples first; returns whether one was not.

    The producing stage returns such a value packed (``crossing.pack``: a tuple's tensors side by side, samples
    moved first, several rows per sample grouped), and each consuming stage unpacks it (``crossing.unpack``) before
    its layers read it: the stages compute what the model does, and the cut carries what the transfers split. A
    value that cannot be packed raises ``StageError`` with the reason the rule (``ModelFacts.refusals``) gives.
    """
    changed = False
    for node in list(split.graph.nodes):
        consumers = [user for user in node.users if user.op == "call_module"]
        if node.op == "placeholder" or not consumers or _is_shape_value(values.get(node)):
            continue
        layer = _layer_of(split, node)
        if layer in facts.refusals:
            raise StageError(f"the output of layer {node.name!r} cannot cross a cut: {facts.refusals[layer]}")
        layout = facts.layouts[layer]
        if is_plain(layout):
            continue
        _return_packed(split, node, layout)
        for user in consumers:
            _take_packed(_stage_module(split, user), list(user.args).index(node), layout)
        changed = True
    split.recompile()
    return changed


def _return_packed(split: torch.fx.GraphModule, node: torch.fx.Node, layout: Layout) -> None:
    """The stage that returns top-level value ``node`` returns it packed."""
    returned = _returned_node(split, node)
    stage_module = returned.graph.owning_module
    assert isinstance(stage_module, torch.fx.GraphModule)
    (output,) = [n for n in stage_module.graph.nodes if n.op == "output"]
    with stage_module.graph.inserting_before(output):
        packed = stage_module.graph.call_function(pack, (returned, layout))
    packed.meta = dict(returned.meta)
    output.args = (_replaced(output.args[0], returned, packed),)
    stage_module.recompile()


def _replaced(returned: Any, old: torch.fx.Node, new: torch.fx.Node) -> Any:
    if isinstance(returned, tuple | list):
        return type(returned)(new if item is old else item for item in returned)
    return new if returned is old else returned


def _take_packed(stage_module: torch.fx.GraphModule, position: int, layout: Layout) -> None:
    """The stage's ``position``-th input arrives packed: unpack it for the layers that read it."""
    graph = stage_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    taken = placeholders[position]
    with graph.inserting_after(placeholders[-1]):
        value = graph.call_function(unpack, (taken, layout))
    taken.replace_all_uses_with(value, delete_user_cb=lambda user: user is not value)
    stage_module.recompile()


_IN_PLACE_FUNCTIONS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.ipow,
    operator.imod,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.imatmul,
}
_VIEWS = {
    "view",
    "reshape",
    "transpose",
    "permute",
    "flatten",
    "unsqueeze",
    "squeeze",
    "expand",
    "narrow",
    "movedim",
    "select",
    "t",
    "getitem",
    "unflatten",
    "view_as",
    "expand_as",
    "chunk",
    "split",
    "unbind",
    "unpack",
}


def _copy_inputs_changed_in_place(split: torch.fx.GraphModule) -> None:
    """A stage that changes a value it takes in place (``F.relu(x, inplace=True)``, ``x *= s``) works on a copy.

    The engine gives a stage each value it takes as a leaf tensor that records its gradient, and autograd refuses
    an in-place change of such a leaf or of a view of it; in the whole model the same value is an intermediate
    result, which may be changed. The copy costs one tensor's memory and no change in what the stage computes.
    """
    for call in split.graph.nodes:
        if call.op != "call_module" or not str(call.target).startswith("submod_"):
            continue
        stage_module = _stage_module(split, call)
        changed = False
        for taken in [n for n in stage_module.graph.nodes if n.op == "placeholder"]:
            if _changed_in_place(stage_module, taken):
                with stage_module.graph.inserting_after(taken):
                    copy_ = stage_module.graph.call_method("clone", (taken,))
                taken.replace_all_uses_with(copy_, delete_user_cb=lambda user, c=copy_: user is not c)
                changed = True
        if changed:
            stage_module.recompile()


def _changed_in_place(module: torch.fx.GraphModule, value: torch.fx.Node) -> bool:
    """Whether an operation changes ``value``, or a view of it, in place."""
    for user in value.users:
        first = user.args[0] if user.args else None
        if first is value and _in_place(module, user):
            return True
        if _operation_name(user) in _VIEWS and first is value and _changed_in_place(module, user):
            return True
    return False


def _in_place(module: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.kwargs.get("inplace") is True or node.target in _IN_PLACE_FUNCTIONS:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_module":
        return getattr(module.get_submodule(str(node.target)), "inplace", False) is True
    return False


def _operation_name(node: torch.fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


_SAMPLE_COUNTS = (2, 3, 5)
"""Sample counts the split model is run at to tell how a shape value crossing a cut depends on the samples."""


def _rebuild_shape_values(
    split: torch.fx.GraphModule,
    model_input: torch.fx.Node,
    values: Mapping[torch.fx.Node, Any],
    input_shape: Sequence[int] | TensorSpec,
) -> bool:
    """Let no shape value cross a cut: rebuild it in each stage that takes it. Returns whether any did.

    A model written the usual way reads shapes from its input (``batch, tokens, dim = x.shape``) and uses them
    layers later (``q.view(batch, tokens, heads, head_dim)``), so a cut can fall between the two. Such a value is
    not a tensor of samples that could be sent: it is a number, or a tuple of numbers, each either constant or
    affine in the micro-batch's samples. The consuming stage computes it from the samples of a tensor it takes
    (the model input if it takes none), the producing stage stops returning it, and the cut carries nothing for
    it, as the layer library (no bytes) says. A value that is neither raises ``StageError`` naming it.
    """
    crossing = [
        arg
        for node in split.graph.nodes
        if node.op == "call_module"
        for arg in node.args
        if isinstance(arg, torch.fx.Node) and _is_shape_value(values.get(arg))
    ]
    if not crossing:
        return False
    runs = [values, *(_trace_values(split, example_input(input_shape, n)) for n in _SAMPLE_COUNTS[1:])]
    for node in dict.fromkeys(crossing):
        template = _shape_template([run[node] for run in runs], _returned_node(split, node).name)
        for user in list(node.users):
            _rebuild_in_stage(split, user, node, template, model_input, values)
        _stop_returning(split, node)
    split.recompile()
    return True


def _is_shape_value(value: object) -> bool:
    """A number or a (nested) tuple or list of numbers, what reading a tensor's shape gives, or what else a model
    reads of a tensor to make another like it: its device (``x.device``) or dtype."""
    if isinstance(value, tuple | list):
        return all(_is_shape_value(item) for item in value)
    return isinstance(value, int | float | torch.device | torch.dtype)


def _shape_template(runs: Sequence[Any], name: str) -> tuple[Any, ...]:
    """How a shape value depends on the samples, from its values at ``_SAMPLE_COUNTS`` samples: ``("const", v)``,
    ``("samples", a, b)`` for ``a * samples + b``, ``("device",)`` for a device (the consuming stage's own, which
    may not be the producing stage's), or ``(kind, items)`` for a torch.Size, tuple or list."""
    first = runs[0]
    if isinstance(first, torch.device):
        return ("device",)
    if isinstance(first, tuple | list):
        kind = "size" if isinstance(first, torch.Size) else type(first).__name__
        if all(type(run) is type(first) and len(run) == len(first) for run in runs):
            return (kind, tuple(_shape_template([run[i] for run in runs], name) for i in range(len(first))))
    elif all(run == first for run in runs):
        return ("const", first)
    elif all(isinstance(run, int) for run in runs):
        (s0, s1, _), (v0, v1, _) = _SAMPLE_COUNTS, runs
        per_sample, constant = (v1 - v0) // (s1 - s0), v0 - (v1 - v0) // (s1 - s0) * s0
        if all(per_sample * s + constant == v for s, v in zip(_SAMPLE_COUNTS, runs, strict=True)):
            return ("samples", per_sample, constant)
    raise StageError(
        f"value {name!r} crossing a stage cut is a shape that is not a function of the micro-batch size "
        f"({', '.join(f'{v} at {s} samples' for s, v in zip(_SAMPLE_COUNTS, runs, strict=True))}); move the cut"
    )


def shape_value(anchor: torch.Tensor, template: tuple[Any, ...]) -> Any:
    """The shape value ``template`` (``_shape_template``) stands for, for ``anchor``'s number of samples."""
    kind = template[0]
    if kind == "const":
        return template[1]
    if kind == "device":
        return anchor.device
    if kind == "samples":
        return template[1] * anchor.shape[0] + template[2]
    items = [shape_value(anchor, item) for item in template[1]]
    return torch.Size(items) if kind == "size" else tuple(items) if kind == "tuple" else items


def _rebuild_in_stage(
    split: torch.fx.GraphModule,
    user: torch.fx.Node,
    node: torch.fx.Node,
    template: tuple[Any, ...],
    model_input: torch.fx.Node,
    values: Mapping[torch.fx.Node, Any],
) -> None:
    """In the stage that ``user`` calls, compute the value of ``node`` instead of taking it as an argument."""
    stage_module = _stage_module(split, user)
    graph = stage_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    taken = {_graph_node(arg, user): placeholder for arg, placeholder in zip(user.args, placeholders, strict=True)}
    anchor = next((placeholder for arg, placeholder in taken.items() if _has_samples(values.get(arg))), None)
    if anchor is None:  # a stage that takes no tensor reads the model's input, which every rank has
        with graph.inserting_after(placeholders[-1]):
            anchor = graph.placeholder(_free_attribute_name(stage_module, model_input.name))
        user.args = (*user.args, model_input)
    with graph.inserting_after([n for n in graph.nodes if n.op == "placeholder"][-1]):
        rebuilt = graph.call_function(shape_value, (anchor, template))
    taken[node].replace_all_uses_with(rebuilt)
    graph.erase_node(taken[node])
    user.args = tuple(arg for arg in user.args if arg is not node)
    stage_module.recompile()


def _has_samples(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _returned_by(node: torch.fx.Node) -> tuple[torch.fx.Node, int | None]:
    """Top-level value ``node``'s stage call, and its position in what the stage returns (None: its only value)."""
    if node.op == "call_module":
        return node, None
    call, position = node.args  # getitem(submod_s, position)
    if not isinstance(position, int):
        raise StageError(f"{node.name} picks {position!r} from what a stage returns, not a position")
    return _graph_node(call, node), position


def _returned_node(split: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node:
    """The node, inside the stage that returns it, of the split's top-level value ``node``: a stage's submodule
    returns its values under their names in the traced model (not the split's ``submod_s`` or ``getitem``)."""
    call, position = _returned_by(node)
    (output,) = [n for n in _stage_module(split, call).graph.nodes if n.op == "output"]
    returned = output.args[0]
    if position is not None:
        assert isinstance(returned, tuple | list)
        returned = returned[position]
    if not isinstance(returned, torch.fx.Node):
        raise StageError(f"stage {call.target} returns a constant ({returned!r}) as {node.name}")
    return returned


def _stop_returning(split: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Drop ``node``, a value no stage takes any more, from what its producing stage returns."""
    if node.users:
        raise StageError(f"value {node.name!r} is a shape the model returns; the model must return its logits")
    call, position = _returned_by(node)
    stage_module = _stage_module(split, call)
    (output,) = [n for n in stage_module.graph.nodes if n.op == "output"]
    if position is None:
        output.args = ((),)
    else:
        returned = output.args[0]
        assert isinstance(returned, tuple)
        output.args = ((*returned[:position], *returned[position + 1 :]),)
        split.graph.erase_node(node)
        for later in list(call.users):
            if isinstance(later.args[1], int) and later.args[1] > position:
                later.args = (call, later.args[1] - 1)
    stage_module.recompile()


@dataclass
class _ValueFlow:
    """The values of a split model's top graph, numbered in graph order (the model input is value 0): the node and
    the producing stage of each, what each stage takes and returns, and which value is the model's output."""

    nodes: list[torch.fx.Node] = field(default_factory=list)
    producers: list[int] = field(default_factory=list)
    stage_inputs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    stage_outputs: dict[int, list[int]] = field(default_factory=dict)
    output: int = -1
    value_of_node: dict[torch.fx.Node, int] = field(default_factory=dict)

    @classmethod
    def of(cls, split: torch.fx.GraphModule, model_input: torch.fx.Node, n_stages: int) -> _ValueFlow:
        flow = cls()
        flow._add(model_input, MODEL_INPUT)
        for node in split.graph.nodes:
            if node.op == "call_module":
                flow._stage_call(node)
            elif node.op == "call_function":
                flow._stage_output(node)
            elif node.op == "output":
                (result,) = node.args
                if not isinstance(result, torch.fx.Node) or result not in flow.value_of_node:
                    raise StageError(f"the model must return one tensor: {NAME_THE_OUTPUT}")
                flow.output = flow.value_of_node[result]
        flow._check(n_stages)
        return flow

    def consumers(self, value: int) -> tuple[int, ...]:
        """The stages that take ``value``, in stage order."""
        return tuple(stage for stage, inputs in sorted(self.stage_inputs.items()) for v in inputs if v == value)

    def _add(self, node: torch.fx.Node, producer: int) -> None:
        self.value_of_node[node] = len(self.nodes)
        self.nodes.append(node)
        self.producers.append(producer)

    def _stage_call(self, node: torch.fx.Node) -> None:
        """A stage's submodule call: its inputs, and its output unless the ``getitem`` nodes after it pick several."""
        stage = int(str(node.target).removeprefix("submod_"))
        self.stage_inputs[stage] = tuple(self.value_of_node[_graph_node(arg, node)] for arg in node.args)
        self.stage_outputs[stage] = []
        if all(user.op == "call_function" and getattr(user.target, "__name__", "") == "getitem" for user in node.users):
            return
        self._add(node, stage)
        self.stage_outputs[stage].append(self.value_of_node[node])

    def _stage_output(self, node: torch.fx.Node) -> None:
        """``getitem(submod_s, position)``: one of the several values stage s returns."""
        source, position = node.args
        stage = int(str(_graph_node(source, node).target).removeprefix("submod_"))
        self._add(node, stage)
        if position != len(self.stage_outputs[stage]):
            raise StageError(f"stage {stage} returns its values out of order at {node.name}")
        self.stage_outputs[stage].append(self.value_of_node[node])

    def _check(self, n_stages: int) -> None:
        if sorted(self.stage_inputs) != list(range(n_stages)):
            raise StageError(f"split gave stages {sorted(self.stage_inputs)}, expected 0..{n_stages - 1}")
        if self.producers[self.output] != n_stages - 1:
            raise StageError(
                f"the model's output is computed on stage {self.producers[self.output]}, not on the last stage "
                f"{n_stages - 1}: layers after it on later stages do not lead to the output"
            )


def _layer_of(split: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    """The layer of the traced model whose output the split's top-level value ``node`` is."""
    return MODEL_INPUT if node.op == "placeholder" else int(_returned_node(split, node).meta[LAYER_META])


def _graph_node(arg: torch.fx.node.Argument, user: torch.fx.Node) -> torch.fx.Node:
    if not isinstance(arg, torch.fx.Node):
        raise StageError(f"{user.name} takes a constant ({arg!r}) where the split model passes values between stages")
    return arg


def _cut_value(
    index: int, node: torch.fx.Node, layer: int, producer: int, consumers: tuple[int, ...], sample: Any
) -> CutValue:
    """Describe value ``index`` from what it held when the split model ran on two samples."""
    name = node.name
    if not isinstance(sample, torch.Tensor):
        raise StageError(
            f"value {name!r} crossing a stage cut is a {type(sample).__name__}, not a tensor; move the cut"
        )
    if sample.dim() == 0 or sample.shape[0] != 2:
        raise StageError(
            f"value {name!r} crossing a stage cut has shape {tuple(sample.shape)}: its first dimension is not the "
            "sample, so it cannot be split into micro-batches; move the cut"
        )
    return CutValue(
        index=index,
        name=name,
        layer=layer,
        producer=producer,
        consumers=consumers,
        sample_shape=tuple(sample.shape[1:]),
        dtype=sample.dtype,
        requires_grad=producer != MODEL_INPUT and sample.requires_grad,
    )


def _trace_values(split: torch.fx.GraphModule, sample: torch.Tensor) -> dict[torch.fx.Node, Any]:
    values: dict[torch.fx.Node, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            values[n] = result
            return result

    was_training = split.training
    split.eval()
    try:
        Recorder(split).run(sample)
    except Exception as exc:
        raise StageError(f"running the model on a sample failed: {type(exc).__name__}: {exc}") from exc
    finally:
        split.train(was_training)
    return values


def owned_copy(shared: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """A copy of ``shared`` on ``device`` that shares no tensor with it: parameters, buffers and tensor constants
    are copied straight to ``device``; the graph (never changed after the split) is shared.

    A split's submodules share their layers with the traced model they were cut from; a stage trains and moves
    this copy, so the cached model stays on the CPU at its initial weights, whatever a plan did to its stage.
    """
    copies: dict[int, Any] = {}
    for tensor in itertools.chain(shared.parameters(), shared.buffers()):
        moved = tensor.detach().to(device, copy=True)
        copies[id(tensor)] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
    owned = torch.fx.GraphModule(shared, shared.graph, class_name=type(shared).__name__)
    # Taking the graph made the copy its owner, a reference from the cached split that would keep the copy (its
    # parameters, gradients and optimiser state's parameters) alive after the stage is gone, until the next copy.
    shared.graph.owning_module = shared
    for name, child in list(owned.named_children()):
        setattr(owned, name, copy.deepcopy(child, copies))
    for name, param in list(owned._parameters.items()):
        if param is not None:
            owned._parameters[name] = copies[id(param)]
    for name, buffer in list(owned._buffers.items()):
        if buffer is not None:
            owned._buffers[name] = copies[id(buffer)]
    copied = {id(tensor) for tensor in copies.values()}
    for node in owned.graph.nodes:
        if node.op != "get_attr":
            continue
        path, _, attr = str(node.target).rpartition(".")
        holder = owned.get_submodule(path) if path else owned
        constant = getattr(holder, attr)
        if isinstance(constant, torch.Tensor) and id(constant) not in copies and id(constant) not in copied:
            setattr(holder, attr, constant.detach().to(device, copy=True))
    return owned


class Stage:
    """One stage's submodule and its cut values, on one device.

    The stage owns its parameters (``owned_copy``): training or moving it never touches the model it was cut
    from. ``named_parameters`` uses the original model's parameter names, so stages of different plans and the
    single-device model can be compared name by name.
    """

    def __init__(
        self, index: int, module: nn.Module, graph: PipelineGraph, device: torch.device, whole_model: nn.Module
    ) -> None:
        """``module`` is the split's submodule of stage ``index`` (sharing its layers with ``whole_model``)."""
        if not isinstance(module, torch.fx.GraphModule):
            raise StageError(f"stage {index} is a {type(module).__name__}, not a split's GraphModule")
        model_names = {id(t): name for name, t in whole_model.state_dict(keep_vars=True).items()}
        # The submodule's state names -> the model's (the copy keeps the submodule's names).
        self._names = {
            local: model_names[id(t)] for local, t in module.state_dict(keep_vars=True).items() if id(t) in model_names
        }
        self.module: nn.Module = owned_copy(module, device)
        self.index = index
        self.graph = graph
        self.device = device
        self.inputs = [graph.values[v] for v in graph.stage_inputs[index]]
        self.outputs = [graph.values[v] for v in graph.stage_outputs[index]]

    @property
    def is_last(self) -> bool:
        return self.index == self.graph.n_stages - 1

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {self._names[name]: p for name, p in self.module.named_parameters()}

    def parameter_names(self) -> dict[str, str]:
        """The stage module's parameter names -> the model's."""
        return {name: self._names[name] for name, _ in self.module.named_parameters()}

    def state_names(self) -> dict[str, str]:
        """The stage module's parameter and buffer names -> the model's."""
        return dict(self._names)

    def named_state(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the original model's names."""
        return {
            self._names[name]: t for name, t in self.module.state_dict(keep_vars=True).items() if name in self._names
        }

    def forward(
        self,
        inputs: Sequence[torch.Tensor],
        params: Mapping[str, torch.Tensor] | None = None,
        recompute: bool = False,
    ) -> list[torch.Tensor]:
        """Run the submodule; ``params`` (submodule names) replaces its parameters, as weight stashing needs. With
        ``recompute`` (and autograd on), autograd keeps only the inputs and runs the submodule again in the
        backward (``torch.utils.checkpoint``, with the random state of the first run; the buffers it changes, a
        batch norm's running statistics, change once)."""
        if recompute and torch.is_grad_enabled():
            result = torch.utils.checkpoint.checkpoint(
                self._run,
                *inputs,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _buffers_kept(self.module)),
                params=params,
            )
        else:
            result = self._run(*inputs, params=params)
        return list(result) if isinstance(result, tuple) else [result]

    def _run(self, *inputs: torch.Tensor, params: Mapping[str, torch.Tensor] | None = None) -> Any:
        if params is None:
            return self.module(*inputs)
        return torch.func.functional_call(self.module, dict(params), tuple(inputs))


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """Whatever ``module``'s buffers hold on entry, they hold again on exit: a recomputed forward's running
    statistics are not counted twice."""
    kept = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


@dataclass(frozen=True)
class ModelGraph:
    """What programs need of a traced model (``tapp_core.plan.program``): its layer edges that carry tensors, each layer's
    parameter bytes, the layer that owns each parameter (by the model's names), and each layer's ``LayerSpec`` (what
    the layout pass of ``tapp_core.plan.placement`` reads); the same facts a layer library holds
    (``LayerLibrary.tensor_edges``, ``Layer.param_bytes``, ``LayerLibrary.specs``)."""

    edges: tuple[tuple[int, int], ...]
    """The edges whose value is a tensor, found by running the model once: a shape read on one stage and used on
    a later one crosses no cut (``_rebuild_shape_values``)."""
    param_bytes: tuple[int, ...]
    trained_bytes: tuple[int, ...]
    """Of ``param_bytes``, the parameters' that train (``Layer.trained_bytes``): what the gradient buckets sum."""
    layer_of_param: Mapping[str, int]
    specs: tuple[LayerSpec, ...] = ()
    input_shape: tuple[int, ...] = tuple(INPUT_SHAPE)
    """The model input's shape per sample."""
    shared: tuple[SharedParameter, ...] = ()
    """The parameters several layers use (``graph.shared_parameters``): tied where a plan parts their users."""
    layer_edges: tuple[tuple[int, int], ...] = ()
    """Every edge between layers, a tensor's or not (what no plan may run backward)."""
    refusals: tuple[tuple[int, str], ...] = ()
    """The layers whose output cannot cross a cut, each with the reason (``crossing.cut_facts``)."""

    def facts(self) -> ModelFacts:
        """What the runtime's rule (``tapp_core.plan.rule.check_runs``) reads of the traced model."""
        return ModelFacts.of_layers(self.specs, self.layer_edges, self.shared, dict(self.refusals))

    @classmethod
    def of(
        cls, graph_module: torch.fx.GraphModule, input_shape: Sequence[int] | TensorSpec = INPUT_SHAPE
    ) -> ModelGraph:
        owners = layer_parameters(graph_module)
        layer_bytes = LayerBytes.of(owners)
        param_bytes = layer_bytes.total
        outputs = _trace_values(graph_module, example_input(input_shape, 2))
        nodes = layer_nodes(graph_module)
        facts = _cut_facts(graph_module, input_shape)
        return cls(
            edges=tuple(
                (u, v) for u, v in layer_edges(graph_module) if next(tensors_in(outputs[nodes[u]]), None) is not None
            ),
            param_bytes=param_bytes,
            trained_bytes=layer_bytes.trained,
            layer_of_param={name: layer for layer, own in enumerate(owners) for name in own},
            specs=layer_specs(graph_module, param_bytes, input_shape, facts.sample_free),
            input_shape=input_shape.shape if isinstance(input_shape, TensorSpec) else tuple(input_shape),
            shared=shared_parameters(graph_module),
            layer_edges=tuple(layer_edges(graph_module)),
            refusals=tuple(sorted(facts.refusals.items())),
        )


def layer_specs(
    graph_module: torch.fx.GraphModule,
    param_bytes: Sequence[int],
    input_shape: Sequence[int] | TensorSpec = INPUT_SHAPE,
    sample_free: frozenset[int] = frozenset(),
) -> tuple[LayerSpec, ...]:
    """Every layer's ``LayerSpec``, as the profiler records the layer (``tapp_core.profile.profiler``): its operation
    (``graph.op_type``), the layers it reads (the model's input when none), its first output tensor's shape per
    sample (found by running the model on two samples, in eval mode), whether it holds parameters, and whether it
    is one of the ``sample_free`` layers (``crossing.CutFacts.sample_free``)."""
    index = layer_index(graph_module)
    shapes: dict[torch.fx.Node, tuple[int, ...]] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            if n in index:
                first = next(tensors_in(result), None)
                shapes[n] = tuple(first.shape[1:]) if first is not None else ()
            return result

    was_training = graph_module.training
    graph_module.eval()
    try:
        with torch.no_grad():
            Recorder(graph_module).run(example_input(input_shape, 2))
    finally:
        graph_module.train(was_training)
    return tuple(
        LayerSpec(
            index=i,
            name=node.name,
            op=op_type(graph_module, node),
            inputs=tuple(sorted({index[arg] for arg in node.all_input_nodes if arg in index})) or (MODEL_INPUT,),
            shape=shapes.get(node, ()),
            has_params=param_bytes[i] > 0,
            axes=op_axes(node, len(shapes.get(node, ())) + 1),
            sample_free=i in sample_free,
        )
        for node, i in index.items()
    )


class StageFactory:
    """Builds stages from (workload, seed, plan), caching traced models and splits across plans on one rank; a
    model spec stands for its default workload (``as_workload``).

    The cached models are never trained or moved (every stage trains its own copy), so every stage starts from
    the model's initial weights for its seed, whichever plans ran before it, on whichever device.
    """

    def __init__(self) -> None:
        self._models: dict[tuple[Workload, int], torch.fx.GraphModule] = {}
        self._splits: dict[tuple[Workload, int, tuple[int, ...], int], tuple[torch.fx.GraphModule, PipelineGraph]] = {}
        self._graphs: dict[tuple[Workload, int], tuple[torch.fx.GraphModule, ModelGraph]] = {}

    MAX_MODELS = 4
    MAX_SPLITS = 64

    def traced(self, model: str | Workload, seed: int) -> torch.fx.GraphModule:
        """The traced model of ``model`` at ``seed``'s initial weights, on the CPU (read only: do not train it)."""
        key = (as_workload(model).network, seed)
        if key not in self._models:
            if len(self._models) >= self.MAX_MODELS:
                oldest = next(iter(self._models))
                del self._models[oldest]
                self._splits = {k: v for k, v in self._splits.items() if k[:2] != oldest}
            self._models[key] = build_traced_workload(key[0], seed=seed)
        return self._models[key]

    def graph(self, model: str | Workload, seed: int) -> ModelGraph:
        """The traced model's ``ModelGraph`` (cached with it)."""
        key = (as_workload(model).network, seed)
        if key not in self._graphs or self._graphs[key][0] is not self.traced(model, seed):
            traced = self.traced(model, seed)
            self._graphs[key] = (traced, ModelGraph.of(traced, key[0].feed))
        return self._graphs[key][1]

    def split(
        self, model: str | Workload, seed: int, stage_of_layer: Sequence[int], n_stages: int
    ) -> tuple[torch.fx.GraphModule, PipelineGraph]:
        workload = as_workload(model).network
        key = (workload, seed, tuple(stage_of_layer), n_stages)
        if key not in self._splits:
            if len(self._splits) >= self.MAX_SPLITS:
                del self._splits[next(iter(self._splits))]
            self._splits[key] = split_stages(self.traced(workload, seed), stage_of_layer, n_stages, workload.feed)
        return self._splits[key]

    def stage(
        self,
        model: str | Workload,
        seed: int,
        stage_of_layer: Sequence[int],
        n_stages: int,
        stage: int,
        device: torch.device,
    ) -> Stage:
        """Stage ``stage`` of the plan, on ``device``, at the initial weights, in training mode."""
        split, graph = self.split(model, seed, stage_of_layer, n_stages)
        built = Stage(stage, split.get_submodule(f"submod_{stage}"), graph, device, self.traced(model, seed))
        built.module.train()
        return built
