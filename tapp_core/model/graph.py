"""The one definition of a model's *layers*: the compute nodes of its torch.fx graph, in topological order.

The profiler numbers layers with ``layer_nodes`` and the runtime cuts stages with the same numbering, so a
plan's ``stage_of_layer[i]`` always means the same node. Tracing is at leaf-module granularity (torch.nn
modules are leaves; user containers are traced through) plus every function and method call.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch.fx
from torch import nn

from tapp_core.errors import TappError

LAYER_OPS = ("call_module", "call_function", "call_method")
"""The node kinds that are layers. A ``get_attr`` node is not one: it computes nothing, it only reads a tensor the
model holds itself (a ViT's class token, a position embedding), and that tensor belongs to the layers that use its
value (``parameter_users``), wherever a plan cuts."""


MODEL_INPUT = -1
"""The index that stands for the model's input where a layer index is expected (a layer's inputs, a value's
producer): the data source, read locally by every stage that needs it."""


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What the layout pass needs of one layer (a library layer or a traced graph's node, alike)."""

    index: int
    name: str
    op: str
    inputs: tuple[int, ...]
    """The layers it reads, by index (the model's input is ``MODEL_INPUT``)."""
    shape: tuple[int, ...]
    """Its output's shape per sample."""
    has_params: bool
    axes: tuple[int, ...] = ()
    """The dimensions of the whole tensor (samples first, counted from 0) the operation acts along, where the layout
    pass needs them: a transpose's two, a permute's order, a softmax's one (``graph.op_axes``); () if none or
    unknown."""
    sample_free: bool = False
    """Its output is a tensor that no sample's data reaches (a weight read alone, a position table looked up by
    ``torch.arange``: ``crossing.SAMPLE_FREE``): it has no samples, and every device of a stage holds it whole."""


class ModelError(TappError):
    """A model that cannot be built or traced; the message says which and why."""


def trace_model(model: nn.Module, name: str = "", example: torch.Tensor | None = None) -> torch.fx.GraphModule:
    """Symbolically trace ``model``; an untraceable model raises ``ModelError`` naming the reason.

    Where ``torch.fx`` cannot trace it (a model zoo's model, whose Python branches on its configuration and its
    arguments) and an ``example`` input is given, the model is exported instead (``torch.export``, which runs the
    Python and records what ran), with the batch dimension left free, and the exported module is traced: the graph
    then has torch's own operations as layers, and the parameters keep the model's names."""
    label = name or type(model).__name__
    try:
        graph_module = torch.fx.symbolic_trace(model)
    except Exception as exc:  # torch.fx raises TraceError, TypeError, RuntimeError... depending on the cause
        if example is None:
            raise _untraceable(label, exc) from exc
        graph_module = _traced_by_export(model, example, label, exc)
    if not layer_nodes(graph_module):
        raise ModelError(f"model {label!r} has no layers after tracing")
    return graph_module


def drop_dead_nodes(graph_module: torch.fx.GraphModule) -> None:
    """Remove the nodes whose value nothing uses and that change nothing: a weight the model holds but never reads
    (an exported model reads all it holds), a head whose output the model computes but does not return. An
    in-place method (``x.add_(y)``, its result unused) changes its input, and stays."""

    def changes_something(node: torch.fx.Node) -> bool:
        in_place = node.op == "call_method" and str(node.target).endswith("_")
        return in_place or node.target is operator.setitem or node.is_impure()

    if graph_module.graph.eliminate_dead_code(is_impure_node=changes_something):
        graph_module.delete_all_unused_submodules()
        graph_module.recompile()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _untraceable(label: str, exc: BaseException, exported: BaseException | None = None) -> ModelError:
    also = f"; nor by torch.export: {_first_line(exported)}" if exported is not None else ""
    return ModelError(
        f"model {label!r} cannot be traced by torch.fx, so it cannot be split into stages: {_first_line(exc)}{also}. "
        "Data-dependent control flow (if/for on tensor values) must be moved into a leaf module."
    )


def _traced_by_export(
    model: nn.Module, example: torch.Tensor, label: str, fx_error: BaseException
) -> torch.fx.GraphModule:
    """``model`` exported on ``example`` (any batch size allowed), then traced (``trace_model``'s doc)."""
    batch = torch.export.Dim("batch", min=1)
    try:
        exported = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
        graph_module = torch.fx.symbolic_trace(exported.module())
    except Exception as exc:  # export raises many kinds (UserError, GuardOnDataDependentSymNode, ...)
        raise _untraceable(label, fx_error, exc) from exc
    drop_dead_nodes(graph_module)  # an exported module reads every weight it holds, used or not
    return graph_module


def layer_nodes(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The model's layers: every graph node but inputs and the output, in topological (graph) order."""
    return [node for node in graph_module.graph.nodes if node.op in LAYER_OPS]


def layer_index(graph_module: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    return {node: i for i, node in enumerate(layer_nodes(graph_module))}


def parameter_users(graph_module: torch.fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Every parameter a layer uses, by its name in the model, with the layers that use it, in layer order.

    A leaf module's parameters are used by the layers that call it; a parameter the model reads itself (a
    ``get_attr`` node) by the layers that take its value. A parameter used by layers on several stages of a plan
    lives on each of them, its gradients summed among them (``shared_parameters``, ``tapp_core.plan.ties``).
    """
    # The last of a shared parameter's names, as in the state dict the runtime names parameters by.
    names = {id(param): name for name, param in graph_module.named_parameters(remove_duplicate=False)}
    users: dict[str, set[int]] = {}

    def use(params: list[torch.Tensor], layers: list[int]) -> None:
        for param in params:
            if id(param) in names:
                users.setdefault(names[id(param)], set()).update(layers)

    index = layer_index(graph_module)
    for node in graph_module.graph.nodes:
        if node.op == "call_module":
            use(list(graph_module.get_submodule(str(node.target)).parameters()), [index[node]])
        elif node.op == "get_attr":
            value = attrgetter(str(node.target))(graph_module)
            if isinstance(value, nn.Parameter):
                use([value], [index[user] for user in node.users if user in index])
    return {name: tuple(sorted(layers)) for name, layers in users.items() if layers}


@dataclass(frozen=True, slots=True)
class SharedParameter:
    """A parameter that several layers use (a language model's embedding read again by its output head): its name
    in the model, the layers that use it, in layer order (the first is charged its bytes: ``layer_parameters``),
    and its bytes."""

    name: str
    layers: tuple[int, ...]
    nbytes: int
    trained: bool = True
    """False for a frozen one (``requires_grad`` False): its copies never change, so no tie sums them."""


def shared_parameters(graph_module: torch.fx.GraphModule) -> tuple[SharedParameter, ...]:
    """Every parameter used by more than one layer (``parameter_users``), by name."""
    shared = []
    for name, layers in sorted(parameter_users(graph_module).items()):
        if len(layers) > 1:
            parameter = graph_module.get_parameter(name)
            shared.append(SharedParameter(name, layers, _nbytes(parameter), parameter.requires_grad))
    return tuple(shared)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


GROUPED_CONV2D = "GroupedConv2d"
"""The operation of an ``nn.Conv2d`` of several groups (a depthwise one): each output channel reads only its
group's input channels, so it cannot split its features as a plain Conv2d does (``placement.SIGNATURES``)."""


def op_type(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """A short operation name: the leaf module's class (Conv2d; ``GROUPED_CONV2D`` for a grouped one) or the
    function/method name (add, flatten)."""
    if node.op == "call_module":
        module = graph_module.get_submodule(str(node.target))
        if type(module) is nn.Conv2d and module.groups != 1:
            return GROUPED_CONV2D
        return type(module).__name__
    if node.op == "get_attr":
        return "get_attr"
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def op_axes(node: torch.fx.Node, ndim: int) -> tuple[int, ...]:
    """The dimensions (of a tensor of ``ndim`` dimensions, samples first) an operation acts along where the layout
    pass of ``tapp_core.plan.placement`` needs them (``LayerSpec.axes``): a transpose's two, a permute's order, a
    softmax's one, non-negative; () for any other operation or where they are not plain numbers."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    args: list[object] = list(node.args[1:])
    axes: list[object]
    if name == "transpose":
        axes = args[:2] or [node.kwargs.get("dim0"), node.kwargs.get("dim1")]
    elif name == "permute":
        axes = list(args[0]) if len(args) == 1 and isinstance(args[0], tuple | list) else args
    elif name in ("softmax", "log_softmax"):
        axes = args[:1] or [node.kwargs.get("dim")]
    else:
        return ()
    numbers = [a for a in axes if isinstance(a, int) and not isinstance(a, bool) and -ndim <= a < ndim]
    if ndim <= 0 or not numbers or len(numbers) != len(axes):
        return ()
    return tuple(a % ndim for a in numbers)


def layer_edges(graph_module: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """(producer, consumer) layer indices of every edge between layers: the library's ``edges()``."""
    index = layer_index(graph_module)
    return [(index[node], index[user]) for node in index for user in node.users if user in index]


def layer_parameters(graph_module: torch.fx.GraphModule) -> list[dict[str, nn.Parameter]]:
    """Per layer, the parameters it uses by their names in the model, each charged once, to the first layer that
    uses it (``parameter_users``: a leaf module's own, or one the model reads itself with ``get_attr``)."""
    result: list[dict[str, nn.Parameter]] = [{} for _ in layer_nodes(graph_module)]
    for name, layers in parameter_users(graph_module).items():
        result[layers[0]][name] = graph_module.get_parameter(name)
    return result


@dataclass(frozen=True)
class LayerBytes:
    """Per layer, the bytes of the parameters it uses (``layer_parameters``: each charged to its first user), all of
    them and those alone that do not train (``requires_grad`` False)."""

    total: tuple[int, ...]
    frozen: tuple[int, ...]

    @classmethod
    def of(cls, owners: Sequence[Mapping[str, nn.Parameter]]) -> LayerBytes:
        def size(params: Iterable[nn.Parameter]) -> int:
            return sum(p.numel() * p.element_size() for p in params)

        return cls(
            tuple(size(own.values()) for own in owners),
            tuple(size(p for p in own.values() if not p.requires_grad) for own in owners),
        )

    @property
    def trained(self) -> tuple[int, ...]:
        return tuple(total - frozen for total, frozen in zip(self.total, self.frozen, strict=True))


def layer_param_bytes(graph_module: torch.fx.GraphModule) -> LayerBytes:
    """Bytes of the parameters each layer uses (``LayerBytes``)."""
    return LayerBytes.of(layer_parameters(graph_module))
