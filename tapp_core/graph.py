"""The one definition of a model's *layers*: the compute nodes of its torch.fx graph, in topological order.

The profiler numbers layers with ``layer_nodes`` and the runtime cuts stages with the same numbering, so a
plan's ``stage_of_layer[i]`` always means the same node. Tracing is at leaf-module granularity (torch.nn
modules are leaves; user containers are traced through) plus every function and method call.
"""

from __future__ import annotations

from operator import attrgetter

import torch.fx
from torch import nn

from tapp_core.errors import TappError

LAYER_OPS = ("call_module", "call_function", "call_method")
"""The node kinds that are layers. A ``get_attr`` node is not one: it computes nothing, it only reads a tensor the
model holds itself (a ViT's class token, a position embedding), and that tensor belongs to the layers that use its
value (``parameter_users``), wherever a plan cuts."""


class ModelError(TappError):
    """A model that cannot be built or traced; the message says which and why."""


def trace_model(model: nn.Module, name: str = "") -> torch.fx.GraphModule:
    """Symbolically trace ``model``; an untraceable model raises ``ModelError`` naming the reason."""
    label = name or type(model).__name__
    try:
        graph_module = torch.fx.symbolic_trace(model)
    except Exception as exc:  # torch.fx raises TraceError, TypeError, RuntimeError... depending on the cause
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"model {label!r} cannot be traced by torch.fx, so it cannot be split into stages: {reason}. "
            "Data-dependent control flow (if/for on tensor values) must be moved into a leaf module."
        ) from exc
    if not layer_nodes(graph_module):
        raise ModelError(f"model {label!r} has no layers after tracing")
    return graph_module


def layer_nodes(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The model's layers: every graph node but inputs and the output, in topological (graph) order."""
    return [node for node in graph_module.graph.nodes if node.op in LAYER_OPS]


def layer_index(graph_module: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    return {node: i for i, node in enumerate(layer_nodes(graph_module))}


def parameter_users(graph_module: torch.fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Every parameter a layer uses, by its name in the model, with the layers that use it, in layer order.

    A leaf module's parameters are used by the layers that call it; a parameter the model reads itself (a
    ``get_attr`` node) by the layers that take its value. A parameter used by several layers is one tensor: the
    stages of a plan must not split those layers (``tapp_core.runtime.stage.check_stage_assignment``).
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


def op_type(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """A short operation name: the leaf module's class (Conv2d) or the function/method name (add, flatten)."""
    if node.op == "call_module":
        return type(graph_module.get_submodule(str(node.target))).__name__
    if node.op == "get_attr":
        return "get_attr"
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def op_axes(node: torch.fx.Node, ndim: int) -> tuple[int, ...]:
    """The dimensions (of a tensor of ``ndim`` dimensions, samples first) an operation acts along where the layout
    pass of ``tapp_core.placement`` needs them (``LayerSpec.axes``): a transpose's two, a permute's order, a
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


def layer_param_bytes(graph_module: torch.fx.GraphModule) -> list[int]:
    """Bytes of the parameters each layer uses (``layer_parameters``)."""
    return [sum(p.numel() * p.element_size() for p in own.values()) for own in layer_parameters(graph_module)]
