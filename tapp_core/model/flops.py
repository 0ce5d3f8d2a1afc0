"""FLOP rules: the forward FLOPs of one executed torch.fx node, from its real inputs and output.

Counts are for the node's whole batch (the profiler divides by the batch size). A multiply-add is 2 FLOPs.
Conventions for the rest, per output element unless said otherwise: elementwise and activations 1; dropout 1
(the mask multiply, training mode only); softmax 3; normalisation layers 4 (statistics 2, normalise with the
affine folded in 2); local response normalisation 2 x size + 4; max/avg pooling one per window element;
adaptive pooling and reductions one per input element; data movement (cat, flatten, view, getitem...) 0. An
operation without a rule counts None, and the profiler lists it in the library (``ops_without_flop_rule``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn

from tapp_core.model.graph import op_type

_ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
)
_NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.LayerNorm,
)
_NORM_FLOPS_PER_ELEMENT = 4
_SOFTMAX_FLOPS_PER_ELEMENT = 3
_MOVEMENT_MODULES: tuple[type[nn.Module], ...] = (nn.Identity, nn.Flatten, nn.Unflatten)


def _names(*groups: str) -> frozenset[str]:
    return frozenset(name for group in groups for name in group.split())


_ELEMENTWISE_FUNCTIONS = _names(
    "add sub mul truediv div floordiv neg pow sqrt rsqrt exp log abs clamp clip maximum minimum where",
    "iadd isub imul itruediv add_ sub_ mul_ div_",
    "relu relu_ relu6 leaky_relu elu selu gelu silu mish sigmoid tanh hardtanh hardswish hardsigmoid softplus",
)
_MOVEMENT_FUNCTIONS = _names(
    "cat concat concatenate stack flatten view reshape permute transpose t contiguous getitem getattr squeeze",
    "unsqueeze chunk split expand expand_as repeat size dim get_attr narrow select clone to type float",
)
_REDUCTION_FUNCTIONS = _names(
    "mean sum amax amin max min",
    "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d",
    "adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d",
)
_POOL_FUNCTIONS = _names("max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d")
_NORM_FUNCTIONS = _names("batch_norm layer_norm group_norm instance_norm")


def tensors_in(value: object) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, looking inside lists, tuples and dict values."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _numel(value: object) -> int:
    return sum(int(t.numel()) for t in tensors_in(value))


def _spatial_dims(out: object) -> int:
    first = next(tensors_in(out), None)
    return first.dim() - 2 if first is not None else 1


def _window(kernel_size: object, spatial_dims: int) -> int:
    """Elements in one pooling window: an int kernel is repeated over the spatial dimensions."""
    if isinstance(kernel_size, int):
        return int(kernel_size ** max(spatial_dims, 1))
    if isinstance(kernel_size, list | tuple):
        return math.prod(int(k) for k in kernel_size)
    raise TypeError(f"kernel size {kernel_size!r} is neither an int nor a sequence of ints")


def _module_flops(module: nn.Module, args: tuple[Any, ...], out: object) -> float | None:
    out_elements = _numel(out)
    if isinstance(module, nn.modules.conv._ConvNd):
        kernel = math.prod(module.kernel_size)
        if module.transposed:
            macs = _numel(args[0]) * (module.out_channels // module.groups) * kernel
        else:
            macs = out_elements * (module.in_channels // module.groups) * kernel
        return 2.0 * macs + (out_elements if module.bias is not None else 0)
    if isinstance(module, nn.Linear):
        return 2.0 * module.in_features * out_elements + (out_elements if module.bias is not None else 0)
    if isinstance(module, _NORM_MODULES):
        return float(_NORM_FLOPS_PER_ELEMENT * out_elements)
    if isinstance(module, nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd):
        return float(out_elements * _window(module.kernel_size, _spatial_dims(out)))
    if isinstance(module, nn.modules.pooling._AdaptiveAvgPoolNd | nn.modules.pooling._AdaptiveMaxPoolNd):
        return float(_numel(args[0]))
    if isinstance(module, nn.LocalResponseNorm):
        # Sum of squares over `size` channels (2 per channel), then scale, shift, power and divide.
        return float((2 * module.size + 4) * out_elements)
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return float(out_elements if module.training else 0)
    if isinstance(module, nn.Softmax | nn.LogSoftmax | nn.Softmin):
        return float(_SOFTMAX_FLOPS_PER_ELEMENT * out_elements)
    if isinstance(module, _ELEMENTWISE_MODULES):
        return float(out_elements)
    if isinstance(module, _MOVEMENT_MODULES):
        return 0.0
    return None


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str, default: Any = None) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _bias_flops(args: tuple[Any, ...], kwargs: dict[str, Any], out_elements: int) -> int:
    return out_elements if _arg(args, kwargs, 2, "bias") is not None else 0


def _function_flops(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> float | None:
    out_elements = _numel(out)
    if name in ("conv1d", "conv2d", "conv3d"):
        weight: torch.Tensor = _arg(args, kwargs, 1, "weight")
        macs_per_output = math.prod(int(size) for size in weight.shape[1:])
        return 2.0 * out_elements * macs_per_output + _bias_flops(args, kwargs, out_elements)
    if name == "linear":
        weight = _arg(args, kwargs, 1, "weight")
        return 2.0 * int(weight.shape[1]) * out_elements + _bias_flops(args, kwargs, out_elements)
    if name in ("matmul", "mm", "bmm", "matmul_"):
        return 2.0 * out_elements * int(args[0].shape[-1])
    if name in _POOL_FUNCTIONS:
        return float(out_elements * _window(_arg(args, kwargs, 1, "kernel_size"), _spatial_dims(out)))
    if name in _NORM_FUNCTIONS:
        return float(_NORM_FLOPS_PER_ELEMENT * out_elements)
    if name in ("softmax", "log_softmax"):
        return float(_SOFTMAX_FLOPS_PER_ELEMENT * out_elements)
    if name == "dropout":
        return float(out_elements if _arg(args, kwargs, 2, "training", True) else 0)
    if name in _REDUCTION_FUNCTIONS:
        return float(_numel(args[0]) if args else out_elements)
    if name in _ELEMENTWISE_FUNCTIONS:
        return float(out_elements)
    if name in _MOVEMENT_FUNCTIONS:
        return 0.0
    return None


def node_flops(
    graph_module: torch.fx.GraphModule, node: torch.fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any], out: object
) -> float | None:
    """Forward FLOPs of one executed node for its whole batch; None for an operation without a FLOP rule."""
    if node.op == "call_module":
        return _module_flops(graph_module.get_submodule(str(node.target)), args, out)
    if node.op == "get_attr":
        return 0.0
    if node.op == "call_function" and node.target is operator.getitem:
        return 0.0
    return _function_flops(op_type(graph_module, node), args, kwargs, out)


__all__ = ["node_flops", "tensors_in"]
