"""Profiling a model into a layer library (TAPP section 3 step 1).

Static facts (FLOPs, parameter bytes, activation bytes, shapes, edges) come from one pass over the traced graph
at the library's batch size. Times are measured *in place*, inside real training steps, so that the layer times
add up to the whole-model time: each step runs the graph node by node with an fx ``Interpreter`` and reads the
clock around every node's forward; every autograd node that a layer's forward created is given a pre-hook that
reads the clock when the backward reaches it, and the backward time between one autograd node starting and the
next one starting is charged to the layer that created the first. Engine work between nodes (routing and
summing gradients where a tensor feeds several layers, accumulating parameter gradients) thus lands on the
layer that caused it, and nothing is executed twice or out of context, so in-place operations, first-call
allocation and per-call Python overhead cost what they cost in the real step.

Plain (un-instrumented) whole-model steps alternate with the instrumented ones, so that load drift on a shared
machine touches both alike; the library reports the median of each.
"""

from __future__ import annotations

import itertools
import math
import operator
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, Protocol

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from tapp_core.errors import TappError
from tapp_core.graph import layer_index, layer_nodes, op_type
from tapp_core.library import Layer, LayerLibrary

DEFAULT_INPUT_SHAPE = (3, 32, 32)
LOSS = -1
"""Owner of the loss's own forward and backward time: reported apart from the layers."""


class ProfileError(TappError):
    """A model or device that cannot be profiled; the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# Clocks: host time on CPU, CUDA events on the GPU timeline (kernels are asynchronous).


class _Clock(Protocol):
    def mark(self) -> Any: ...
    def seconds(self, start: Any, end: Any) -> float: ...
    def sync(self) -> None: ...


class _CpuClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def sync(self) -> None:
        pass


class _CudaClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


def _resolve_device(device: str) -> torch.device:
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ProfileError(f"unknown device {device!r}: use 'cpu' or 'cuda' ({exc})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(
            f"device {device!r} was asked for but CUDA is not available here "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); profile with device='cpu'"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ProfileError(f"device {device!r} is not supported: use 'cpu' or 'cuda'")
    return resolved


# ---------------------------------------------------------------------------------------------------------------
# FLOPs per node, for the whole batch (divided by the batch size by the caller). A multiply-add is 2 FLOPs.
# Conventions for the rest, per output element unless said otherwise: elementwise and activations 1; dropout 1
# (the mask multiply, training mode only); softmax 3; normalisation layers 4 (statistics 2, normalise with the
# affine folded in 2); max/avg pooling one per window element; adaptive pooling one per input element; data
# movement (cat, flatten, view, getitem...) 0.

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


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _numel(value: object) -> int:
    return sum(t.numel() for t in _tensors(value))


def _window(kernel_size: int | Sequence[int], spatial_dims: int) -> int:
    if isinstance(kernel_size, int):
        return kernel_size ** max(spatial_dims, 1)
    return math.prod(kernel_size)


def _module_flops(module: nn.Module, args: tuple[Any, ...], out: object) -> float | None:
    out_elements = _numel(out)
    first = next(_tensors(out), None)
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
        spatial = first.dim() - 2 if first is not None else 1
        return float(out_elements * _window(module.kernel_size, spatial))
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


def _function_flops(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> float | None:
    out_elements = _numel(out)
    first = next(_tensors(out), None)
    if name in ("conv1d", "conv2d", "conv3d"):
        weight = _arg(args, kwargs, 1, "weight")
        bias = _arg(args, kwargs, 2, "bias")
        return 2.0 * out_elements * math.prod(weight.shape[1:]) + (out_elements if bias is not None else 0)
    if name == "linear":
        weight = _arg(args, kwargs, 1, "weight")
        bias = _arg(args, kwargs, 2, "bias")
        return 2.0 * weight.shape[1] * out_elements + (out_elements if bias is not None else 0)
    if name in ("matmul", "mm", "bmm", "matmul_"):
        return 2.0 * out_elements * args[0].shape[-1]
    if name in ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d"):
        spatial = first.dim() - 2 if first is not None else 1
        return float(out_elements * _window(_arg(args, kwargs, 1, "kernel_size"), spatial))
    if name in ("batch_norm", "layer_norm", "group_norm", "instance_norm"):
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


# ---------------------------------------------------------------------------------------------------------------
# Static pass: shapes, FLOPs, activation bytes, parameter bytes and edges.


@dataclass
class _NodeFacts:
    flops: float
    activation_bytes: int
    output_shape: tuple[int, ...]


class _FactsInterpreter(torch.fx.Interpreter):
    """Executes the graph once and records what each layer node computed, from its real inputs and output."""

    def __init__(self, graph_module: torch.fx.GraphModule, batch_size: int) -> None:
        super().__init__(graph_module)
        self.batch_size = batch_size
        self.facts: dict[torch.fx.Node, _NodeFacts] = {}
        self.unknown_ops: set[str] = set()

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = getattr(self, n.op)(n.target, args, kwargs)
        if n.op in ("placeholder", "output"):
            return out
        flops = node_flops(self.module, n, args, kwargs, out)
        if flops is None:
            self.unknown_ops.add(op_type(self.module, n))
            flops = 0.0
        tensors = list(_tensors(out))
        total_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.facts[n] = _NodeFacts(
            flops=flops / self.batch_size,
            activation_bytes=math.ceil(total_bytes / self.batch_size),
            # A node with several output tensors reports the first one's shape; its bytes count them all.
            output_shape=tuple(tensors[0].shape) if tensors else (),
        )
        return out


def _param_bytes_per_layer(graph_module: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]) -> list[int]:
    """Bytes of the parameters each layer uses, every parameter charged once, to the first layer that uses it."""
    seen: set[int] = set()
    result = []
    for node in nodes:
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            params = list(graph_module.get_submodule(str(node.target)).parameters())
        elif node.op == "get_attr":
            value = operator.attrgetter(str(node.target))(graph_module)
            params = [value] if isinstance(value, nn.Parameter) else []
        total = 0
        for param in params:
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
        result.append(total)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Timed steps.


@dataclass
class _StepTimes:
    forward_s: list[float]
    backward_s: list[float]
    loss_s: float = 0.0


def _loss(output: object, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, labels)  # type: ignore[arg-type]


def _check_output(output: object, batch_size: int, name: str) -> int:
    """The number of classes; the model must return one (batch, classes) tensor of logits."""
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != batch_size:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ProfileError(
            f"model {name!r} must return one tensor of logits shaped (batch={batch_size}, classes) for the "
            f"cross-entropy loss of a training step; it returned {shape}"
        )
    return int(output.shape[1])


def _whole_step(
    graph_module: torch.fx.GraphModule, inputs: torch.Tensor, labels: torch.Tensor, clock: _Clock
) -> tuple[float, float]:
    """One plain training step (forward, loss, backward): (forward + loss seconds, backward seconds)."""
    graph_module.zero_grad(set_to_none=True)
    clock.sync()
    start = clock.mark()
    loss = _loss(graph_module(inputs), labels)
    middle = clock.mark()
    loss.backward()
    end = clock.mark()
    clock.sync()
    return clock.seconds(start, middle), clock.seconds(middle, end)


class _TimedInterpreter(torch.fx.Interpreter):
    """Runs the forward node by node, reading the clock around each layer and claiming its autograd nodes."""

    def __init__(self, graph_module: torch.fx.GraphModule, index: dict[torch.fx.Node, int], clock: _Clock) -> None:
        super().__init__(graph_module)
        self.index = index
        self.clock = clock
        self.forward_marks: list[tuple[int, Any, Any]] = []
        self.owner: dict[Any, int] = {}
        """Autograd node -> the layer whose forward created it (LOSS for the loss)."""

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        layer = self.index.get(n)
        if layer is None:
            return getattr(self, n.op)(n.target, args, kwargs)
        start = self.clock.mark()
        out = getattr(self, n.op)(n.target, args, kwargs)
        end = self.clock.mark()
        self.forward_marks.append((layer, start, end))
        self.claim(out, layer)
        return out

    def claim(self, value: object, owner: int) -> None:
        """Give ``owner`` every autograd node reachable from ``value`` that no earlier layer created."""
        stack = [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.owner:
                continue
            self.owner[fn] = owner
            stack.extend(next_fn for next_fn, _ in fn.next_functions)


def _instrumented_step(
    graph_module: torch.fx.GraphModule,
    index: dict[torch.fx.Node, int],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    clock: _Clock,
) -> _StepTimes:
    graph_module.zero_grad(set_to_none=True)
    interpreter = _TimedInterpreter(graph_module, index, clock)
    clock.sync()
    output = interpreter.run(inputs)
    loss_start = clock.mark()
    loss = _loss(output, labels)
    loss_end = clock.mark()
    interpreter.claim(loss, LOSS)

    backward_marks: list[tuple[int, Any]] = []

    def on_backward(owner: int, _grad_outputs: object) -> None:
        backward_marks.append((owner, clock.mark()))

    for fn, owner in interpreter.owner.items():
        fn.register_prehook(partial(on_backward, owner))
    backward_start = clock.mark()
    loss.backward()
    backward_end = clock.mark()
    clock.sync()

    n_layers = len(index)
    times = _StepTimes(forward_s=[0.0] * n_layers, backward_s=[0.0] * n_layers)
    for layer, start, end in interpreter.forward_marks:
        times.forward_s[layer] += clock.seconds(start, end)
    times.loss_s = clock.seconds(loss_start, loss_end)
    # Seeding the loss gradient, before the first hook, is the loss's backward.
    boundaries = [(LOSS, backward_start), *backward_marks, (LOSS, backward_end)]
    for (owner, start), (_, end) in itertools.pairwise(boundaries):
        seconds = clock.seconds(start, end)
        if owner == LOSS:
            times.loss_s += seconds
        else:
            times.backward_s[owner] += seconds
    return times


# ---------------------------------------------------------------------------------------------------------------
# Public API.


PROFILE_VERSION = 2
"""Bumped when a library's contents change meaning (2: fixed per-call parts fitted); caches key on it."""


def small_batch_size(batch_size: int) -> int | None:
    """The second batch size the affine time model is fitted at (None: too small a batch to fit)."""
    small = batch_size // 8
    return small if small >= 2 else None


def fixed_part(time_s: float, small_time_s: float, batch_size: int, small: int) -> float:
    """The per-call part of a time measured at ``batch_size`` (``time_s``) and at ``small`` samples: the
    intercept of the line through both points, clipped to [0, time_s] against timing noise."""
    per_sample = (time_s - small_time_s) / (batch_size - small)
    return min(max(time_s - per_sample * batch_size, 0.0), time_s)


def profile_graph(
    graph_module: torch.fx.GraphModule,
    name: str,
    batch_size: int,
    device: str = "cpu",
    threads: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    input_shape: Sequence[int] = DEFAULT_INPUT_SHAPE,
) -> LayerLibrary:
    """Profile a traced classifier into a layer library at ``batch_size`` on ``device``.

    The module is moved to ``device`` and left there in training mode with gradients set. Inputs are random
    (seeded) images of ``input_shape`` and random labels; the loss is cross-entropy. Times are medians over
    ``repeats`` steps after ``warmup`` steps; the layers are timed again at ``small_batch_size(batch_size)``
    samples to fit the part of each time that does not scale with the samples (``Layer.forward_fixed_s``).
    ``threads`` sets torch's intra-op threads for the duration of the call only.
    """
    if batch_size < 1:
        raise ProfileError(f"batch_size must be at least 1, got {batch_size}")
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if threads is not None and threads < 1:
        raise ProfileError(f"threads must be at least 1, got {threads}")
    torch_device = _resolve_device(device)
    clock: _Clock = _CudaClock(torch_device) if torch_device.type == "cuda" else _CpuClock()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(graph_module, name, batch_size, torch_device, clock, repeats, warmup, seed, tuple(input_shape))
    finally:
        torch.set_num_threads(previous_threads)


def _profile(
    graph_module: torch.fx.GraphModule,
    name: str,
    batch_size: int,
    device: torch.device,
    clock: _Clock,
    repeats: int,
    warmup: int,
    seed: int,
    input_shape: tuple[int, ...],
) -> LayerLibrary:
    wall_start = time.perf_counter()
    nodes = layer_nodes(graph_module)
    index = layer_index(graph_module)
    graph_module.to(device).train()
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((batch_size, *input_shape), generator=generator).to(device)

    facts_pass = _FactsInterpreter(graph_module, batch_size)
    with torch.no_grad():
        output = facts_pass.run(inputs)
    classes = _check_output(output, batch_size, name)
    labels = torch.randint(0, classes, (batch_size,), generator=generator).to(device)
    param_bytes = _param_bytes_per_layer(graph_module, nodes)

    whole_steps: list[tuple[float, float]] = []
    steps: list[_StepTimes] = []
    for step in range(warmup + repeats):
        # Alternate which kind runs first so neither always inherits the other's warm caches.
        whole_first = step % 2 == 0
        if whole_first:
            whole_steps.append(_whole_step(graph_module, inputs, labels, clock))
        steps.append(_instrumented_step(graph_module, index, inputs, labels, clock))
        if not whole_first:
            whole_steps.append(_whole_step(graph_module, inputs, labels, clock))
    whole_steps, steps = whole_steps[warmup:], steps[warmup:]
    whole_forward = [forward for forward, _ in whole_steps]
    whole_backward = [backward for _, backward in whole_steps]
    whole_s = statistics.median(f + b for f, b in zip(whole_forward, whole_backward, strict=True))
    forward_s = [statistics.median(step.forward_s[i] for step in steps) for i in range(len(nodes))]
    backward_s = [statistics.median(step.backward_s[i] for step in steps) for i in range(len(nodes))]

    small = small_batch_size(batch_size)
    forward_fixed_s = [0.0] * len(nodes)
    backward_fixed_s = [0.0] * len(nodes)
    if small is not None:
        small_steps = [
            _instrumented_step(graph_module, index, inputs[:small], labels[:small], clock)
            for _ in range(warmup + repeats)
        ][warmup:]
        for i in range(len(nodes)):
            forward_fixed_s[i] = fixed_part(
                forward_s[i], statistics.median(step.forward_s[i] for step in small_steps), batch_size, small
            )
            backward_fixed_s[i] = fixed_part(
                backward_s[i], statistics.median(step.backward_s[i] for step in small_steps), batch_size, small
            )

    layers = []
    for i, node in enumerate(nodes):
        fact = facts_pass.facts[node]
        layers.append(
            Layer(
                index=i,
                name=node.name,
                op=op_type(graph_module, node),
                successors=tuple(sorted({index[user] for user in node.users if user in index})),
                predecessors=tuple(sorted({index[arg] for arg in node.all_input_nodes if arg in index})),
                flops=fact.flops,
                param_bytes=param_bytes[i],
                activation_bytes=fact.activation_bytes,
                output_shape=fact.output_shape,
                forward_s=forward_s[i],
                backward_s=backward_s[i],
                forward_fixed_s=forward_fixed_s[i],
                backward_fixed_s=backward_fixed_s[i],
            )
        )
    element_size = inputs.element_size()
    return LayerLibrary(
        model=name,
        batch_size=batch_size,
        device=device.type,
        threads=torch.get_num_threads(),
        layers=layers,
        input_bytes=math.prod(input_shape) * element_size,
        whole_model_s=whole_s,
        torch_version=torch.__version__,
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        extra={
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "input_shape": list(input_shape),
            "classes": classes,
            "repeats": repeats,
            "warmup": warmup,
            "seed": seed,
            "whole_model_forward_s": statistics.median(whole_forward),
            "whole_model_backward_s": statistics.median(whole_backward),
            "whole_model_steps_s": [f + b for f, b in zip(whole_forward, whole_backward, strict=True)],
            # Per instrumented step, the layers' total: against whole_model_steps_s it separates the cost of the
            # instrumentation from the gap that medians taken per layer open on a noisy machine.
            "layer_steps_s": [sum(step.forward_s) + sum(step.backward_s) for step in steps],
            "loss_s": statistics.median(step.loss_s for step in steps),
            "flops_per_sample": sum(layer.flops for layer in layers),
            "ops_without_flop_rule": sorted(facts_pass.unknown_ops),
            "profile_version": PROFILE_VERSION,
            "small_batch_size": small,
            "timing": "in place: fx Interpreter per node (forward), autograd pre-hooks per node (backward)",
            "profiling_wall_s": time.perf_counter() - wall_start,
        },
    )


def profile_model(
    spec: str,
    batch_size: int,
    device: str = "cpu",
    threads: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> LayerLibrary:
    """Build the model named by ``spec`` (registry name or ``module:callable``) and profile it."""
    from tapp_core.models import INPUT_SHAPE, build_traced_model

    graph_module = build_traced_model(spec, seed=seed)
    return profile_graph(
        graph_module,
        spec,
        batch_size,
        device=device,
        threads=threads,
        repeats=repeats,
        warmup=warmup,
        seed=seed,
        input_shape=INPUT_SHAPE,
    )


__all__ = [
    "PROFILE_VERSION",
    "ProfileError",
    "fixed_part",
    "node_flops",
    "profile_graph",
    "profile_model",
    "small_batch_size",
]
