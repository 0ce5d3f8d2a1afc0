"""Profiling a model into a layer library (TAPP section 3 step 1).

Static facts (FLOPs, parameter bytes, activation bytes, shapes, edges) come from one pass over the traced graph
at the library's batch size; the FLOP of each operation is ``tapp_core.model.flops``'s rule. Times are measured *in
place*, inside real training steps, so that the layer times add up to the whole-model time: each step runs the
graph node by node with an fx ``Interpreter`` and reads the clock around every node's forward; every autograd
node that a layer's forward created is given a pre-hook that reads the clock when the backward reaches it, and
the backward time between one autograd node starting and the next one starting is charged to the layer that
created the first. Engine work between nodes (routing and summing gradients where a tensor feeds several layers,
accumulating parameter gradients) thus lands on the layer that caused it, and nothing is executed twice or out of
context, so in-place operations, first-call allocation and per-call Python overhead cost what they cost in the
real step.

Plain (un-instrumented) whole-model steps alternate with the instrumented ones, so that load drift on a shared
machine touches both alike; the library reports the median of each.
"""

from __future__ import annotations

import itertools
import math
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, Protocol

import torch
import torch.fx

from tapp_core.errors import TappError
from tapp_core.model.crossing import CUT_SAMPLES, CutFacts, cut_facts
from tapp_core.model.flops import node_flops, tensors_in
from tapp_core.model.graph import ModelError, layer_index, layer_param_bytes, op_axes, op_type, shared_parameters
from tapp_core.model.workload import (
    NAME_THE_OUTPUT,
    TensorSpec,
    Workload,
    as_workload,
    build_traced_workload,
    example_input,
    returned,
)
from tapp_core.platform import gpu
from tapp_core.profile.library import PROFILE_VERSION, Layer, LayerLibrary
from tapp_core.profile.saved import SavedFacts, saved_facts

DEFAULT_INPUT_SHAPE = (3, 32, 32)
LOSS = -1
"""Owner of the loss's own forward and backward time: reported apart from the layers."""


class ProfileError(TappError):
    """A model or device that cannot be profiled; the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# Clocks: host time on CPU, CUDA events on the GPU timeline (kernels are asynchronous).


class Clock(Protocol):
    """Where the profiler reads time: ``mark()`` a point, ``seconds(start, end)`` between two marks; ``sync()``
    waits for the device's queued work before a step starts and after it ends."""

    def mark(self) -> Any: ...
    def seconds(self, start: Any, end: Any) -> float: ...
    def sync(self) -> None: ...


class CpuClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def sync(self) -> None:
        pass


class CudaClock:
    """CUDA events on the device's stream. Every step starts and ends synchronised (``sync``), so the GPU is idle
    when the first mark is queued; then a layer's events bracket what the GPU did for it, including the time it
    waited for the host to launch its kernels. At a small batch the GPU waits on the host, so the affine fit's
    fixed part of a layer is its real cost per call (launches included), not only its kernels' time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        return gpu.recorded_event(timing=True)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return gpu.elapsed_s(start, end)

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
        self.graph_module = graph_module
        self.batch_size = batch_size
        self.facts: dict[torch.fx.Node, _NodeFacts] = {}
        self.unknown_ops: set[str] = set()

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = getattr(self, n.op)(n.target, args, kwargs)
        if n.op in ("placeholder", "output"):
            return out
        flops = node_flops(self.graph_module, n, args, kwargs, out)
        if flops is None:
            self.unknown_ops.add(op_type(self.graph_module, n))
            flops = 0.0
        tensors = list(tensors_in(out))
        total_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.facts[n] = _NodeFacts(
            flops=flops / self.batch_size,
            activation_bytes=math.ceil(total_bytes / self.batch_size),
            # A node with several output tensors reports the first one's shape; its bytes count them all.
            output_shape=tuple(tensors[0].shape) if tensors else (),
        )
        return out


# ---------------------------------------------------------------------------------------------------------------
# Timed steps.


@dataclass
class _StepTimes:
    forward_s: list[float]
    backward_s: list[float]
    loss_s: float = 0.0


def _loss(output: torch.Tensor, labels: torch.Tensor, workload: Workload) -> torch.Tensor:
    """The workload's mean loss over the batch (cross-entropy over classes for an image classifier)."""
    return workload.loss_of(output, labels, labels.shape[0])


def _check_output(output: object, batch_size: int, name: str) -> int:
    """The number of classes; the model must return one (batch, classes) tensor of logits."""
    if not isinstance(output, torch.Tensor):
        raise ProfileError(f"model {name!r} returns {returned(output)}, not one tensor: {NAME_THE_OUTPUT}")
    if output.dim() != 2 or output.shape[0] != batch_size:
        raise ProfileError(
            f"model {name!r} must return one tensor of logits shaped (batch={batch_size}, classes) for the "
            f"cross-entropy loss of a training step; it returned {tuple(output.shape)}"
        )
    return int(output.shape[1])


def _input_batch(
    batch_size: int, input_shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Random (seeded) inputs; a batch too large for this host's memory is a ``ProfileError``, not a crash."""
    try:
        return torch.randn((batch_size, *input_shape), generator=generator).to(device)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        size = batch_size * math.prod(input_shape) * 4 / 2**30
        raise ProfileError(
            f"a batch of {batch_size} samples needs {size:.3g} GiB for its input alone, more than {device} can "
            f"allocate: {_first_line(exc)}"
        ) from None


def _batch(
    facts: _FactsInterpreter,
    name: str,
    batch_size: int,
    input_shape: tuple[int, ...],
    generator: torch.Generator,
    device: torch.device,
    workload: Workload | None,
) -> tuple[torch.Tensor, torch.Tensor, Workload]:
    """(inputs, labels, workload) of the profiled batch, the facts recorded on a first run. Without a workload:
    images of ``input_shape`` and labels of as many classes as the model's logits (the default workload's)."""
    if workload is not None:
        try:
            inputs, labels = (t.to(device) for t in workload.batch(batch_size, generator))
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            raise ProfileError(f"a batch of {batch_size} samples is more than {device} can allocate: {exc}") from None
        with torch.no_grad():
            _first_run(facts, inputs, name)
        return inputs, labels, workload
    inputs = _input_batch(batch_size, input_shape, generator, device)
    with torch.no_grad():
        classes = _check_output(_first_run(facts, inputs, name), batch_size, name)
    labels = torch.randint(0, classes, (batch_size,), generator=generator).to(device)
    target = TensorSpec((), "int64", high=classes)
    return inputs, labels, Workload(name, inputs=(TensorSpec(input_shape),), target=target)


def _first_run(facts: _FactsInterpreter, inputs: torch.Tensor, name: str) -> object:
    """The model's output on ``inputs``; a model that fails on them (made for another input shape, say) is a
    ``ModelError`` that says what it was given."""
    try:
        return facts.run(inputs)
    except Exception as exc:
        shape = "x".join(str(n) for n in inputs.shape[1:])
        raise ModelError(
            f"model {name!r} fails on a batch of {inputs.shape[0]} inputs shaped {shape} (give its inputs in its "
            f"file's workload, README's 'Your own workload'): {type(exc).__name__}: {_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _whole_step(
    graph_module: torch.fx.GraphModule, inputs: torch.Tensor, labels: torch.Tensor, clock: Clock, workload: Workload
) -> tuple[float, float]:
    """One plain training step (forward, loss, backward): (forward + loss seconds, backward seconds)."""
    graph_module.zero_grad(set_to_none=True)
    clock.sync()
    start = clock.mark()
    loss = _loss(graph_module(inputs), labels, workload)
    middle = clock.mark()
    torch.autograd.backward(loss)
    end = clock.mark()
    clock.sync()
    return clock.seconds(start, middle), clock.seconds(middle, end)


class _TimedInterpreter(torch.fx.Interpreter):
    """Runs the forward node by node, reading the clock around each layer and claiming its autograd nodes."""

    def __init__(self, graph_module: torch.fx.GraphModule, index: dict[torch.fx.Node, int], clock: Clock) -> None:
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
        stack: list[torch.autograd.graph.Node | None] = [t.grad_fn for t in tensors_in(value)]
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
    clock: Clock,
    workload: Workload,
) -> _StepTimes:
    graph_module.zero_grad(set_to_none=True)
    interpreter = _TimedInterpreter(graph_module, index, clock)
    clock.sync()
    output = interpreter.run(inputs)
    loss_start = clock.mark()
    loss = _loss(output, labels, workload)
    loss_end = clock.mark()
    interpreter.claim(loss, LOSS)

    backward_marks: list[tuple[int, Any]] = []

    def on_backward(owner: int, _grad_outputs: object) -> None:
        backward_marks.append((owner, clock.mark()))

    for fn, owner in interpreter.owner.items():
        fn.register_prehook(partial(on_backward, owner))
    backward_start = clock.mark()
    torch.autograd.backward(loss)
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
# A profile: the static pass, the timed steps at the batch size and at a small batch, and the library they make.


def small_batch_size(batch_size: int) -> int | None:
    """The second batch size the affine time model is fitted at (None: too small a batch to fit)."""
    small = batch_size // 8
    return small if small >= 2 else None


def fixed_part(time_s: float, small_time_s: float, batch_size: int, small: int) -> float:
    """The per-call part of a time measured at ``batch_size`` (``time_s``) and at ``small`` samples: the
    intercept of the line through both points, clipped to [0, time_s] against timing noise."""
    per_sample = (time_s - small_time_s) / (batch_size - small)
    return min(max(time_s - per_sample * batch_size, 0.0), time_s)


@dataclass(frozen=True)
class _Run:
    """One profile's set-up: the traced model on its device, its inputs and how many steps to time."""

    graph_module: torch.fx.GraphModule
    index: dict[torch.fx.Node, int]
    inputs: torch.Tensor
    labels: torch.Tensor
    clock: Clock
    warmup: int
    repeats: int
    workload: Workload

    def instrumented(self, samples: int) -> list[_StepTimes]:
        """Instrumented steps on the first ``samples`` samples, warm-up steps dropped."""
        inputs, labels = self.inputs[:samples], self.labels[:samples]
        steps = [
            _instrumented_step(self.graph_module, self.index, inputs, labels, self.clock, self.workload)
            for _ in range(self.warmup + self.repeats)
        ]
        return steps[self.warmup :]

    def interleaved(self) -> tuple[list[tuple[float, float]], list[_StepTimes]]:
        """Whole-model and instrumented steps on the whole batch, alternating which runs first so that neither
        always inherits the other's warm caches: ((forward, backward) per whole step, instrumented steps)."""
        whole_steps: list[tuple[float, float]] = []
        steps: list[_StepTimes] = []
        for step in range(self.warmup + self.repeats):
            whole_first = step % 2 == 0
            if whole_first:
                whole_steps.append(_whole_step(self.graph_module, self.inputs, self.labels, self.clock, self.workload))
            steps.append(
                _instrumented_step(self.graph_module, self.index, self.inputs, self.labels, self.clock, self.workload)
            )
            if not whole_first:
                whole_steps.append(_whole_step(self.graph_module, self.inputs, self.labels, self.clock, self.workload))
        return whole_steps[self.warmup :], steps[self.warmup :]


@dataclass
class _LayerTimes:
    """Per layer: median forward and backward seconds at the batch size, and the fitted per-call parts."""

    forward_s: list[float]
    backward_s: list[float]
    forward_fixed_s: list[float]
    backward_fixed_s: list[float]
    small_batch_size: int | None


def _medians(steps: Sequence[_StepTimes], n_layers: int) -> tuple[list[float], list[float]]:
    forward_s = [statistics.median(step.forward_s[i] for step in steps) for i in range(n_layers)]
    backward_s = [statistics.median(step.backward_s[i] for step in steps) for i in range(n_layers)]
    return forward_s, backward_s


def _layer_times(run: _Run, steps: Sequence[_StepTimes], batch_size: int) -> _LayerTimes:
    """Medians at the batch size; the per-call parts from the same layers timed again at a small batch."""
    n_layers = len(run.index)
    forward_s, backward_s = _medians(steps, n_layers)
    small = small_batch_size(batch_size)
    if small is None:
        return _LayerTimes(forward_s, backward_s, [0.0] * n_layers, [0.0] * n_layers, None)
    small_forward_s, small_backward_s = _medians(run.instrumented(small), n_layers)
    return _LayerTimes(
        forward_s,
        backward_s,
        [fixed_part(t, small_t, batch_size, small) for t, small_t in zip(forward_s, small_forward_s, strict=True)],
        [fixed_part(t, small_t, batch_size, small) for t, small_t in zip(backward_s, small_backward_s, strict=True)],
        small,
    )


def _layers(
    graph_module: torch.fx.GraphModule,
    index: dict[torch.fx.Node, int],
    facts: _FactsInterpreter,
    times: _LayerTimes,
    cuts: CutFacts,
    saved: SavedFacts,
) -> list[Layer]:
    layer_bytes = layer_param_bytes(graph_module)
    param_bytes, frozen_bytes = layer_bytes.total, layer_bytes.frozen
    layers = []
    for node, i in index.items():
        fact = facts.facts[node]
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
                forward_s=times.forward_s[i],
                backward_s=times.backward_s[i],
                forward_fixed_s=times.forward_fixed_s[i],
                backward_fixed_s=times.backward_fixed_s[i],
                axes=op_axes(node, len(fact.output_shape)),
                cut_refusal=cuts.refusals.get(i, ""),
                sample_free=i in cuts.sample_free,
                frozen_bytes=frozen_bytes[i],
                output_saved=saved.output_saved[i],
                saved_bytes=saved.saved_bytes[i],
            )
        )
    return layers


def _profile(
    graph_module: torch.fx.GraphModule,
    name: str,
    batch_size: int,
    device: torch.device,
    clock: Clock,
    repeats: int,
    warmup: int,
    seed: int,
    input_shape: tuple[int, ...],
    workload: Workload | None,
) -> LayerLibrary:
    """``profile_graph``'s work, once its arguments are checked and torch's threads are set."""
    wall_start = time.perf_counter()
    graph_module.to(device).train()
    generator = torch.Generator().manual_seed(seed)
    facts = _FactsInterpreter(graph_module, batch_size)
    inputs, labels, workload = _batch(facts, name, batch_size, input_shape, generator, device, workload)
    classes = int(labels.max()) + 1 if workload.target.high is None else workload.target.high
    if workload.targets == "next_token":
        classes = workload.inputs[0].high or classes
    input_shape = tuple(inputs.shape[1:])

    run = _Run(graph_module, layer_index(graph_module), inputs, labels, clock, warmup, repeats, workload)
    whole_steps, steps = run.interleaved()
    times = _layer_times(run, steps, batch_size)
    cuts = cut_facts(graph_module, example_input(workload.feed, CUT_SAMPLES).to(device))
    saved = saved_facts(graph_module, run.index, (inputs,), partial(_loss, labels=labels, workload=workload))
    layers = _layers(graph_module, run.index, facts, times, cuts, saved)
    whole_forward = [forward for forward, _ in whole_steps]
    whole_backward = [backward for _, backward in whole_steps]
    whole_steps_s = [f + b for f, b in zip(whole_forward, whole_backward, strict=True)]
    return LayerLibrary(
        model=name,
        batch_size=batch_size,
        device=device.type,
        threads=torch.get_num_threads(),
        layers=layers,
        input_bytes=math.prod(input_shape) * inputs.element_size(),
        whole_model_s=statistics.median(whole_steps_s),
        torch_version=torch.__version__,
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        gpu_model=torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        host=platform.node(),
        shared=shared_parameters(graph_module),
        extra={
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "input_shape": list(input_shape),
            "classes": classes,
            "workload": workload.describe(),
            "repeats": repeats,
            "warmup": warmup,
            "seed": seed,
            "whole_model_forward_s": statistics.median(whole_forward),
            "whole_model_backward_s": statistics.median(whole_backward),
            "whole_model_steps_s": whole_steps_s,
            # Per instrumented step, the layers' total: against whole_model_steps_s it separates the cost of the
            # instrumentation from the gap that medians taken per layer open on a noisy machine.
            "layer_steps_s": [sum(step.forward_s) + sum(step.backward_s) for step in steps],
            "loss_s": statistics.median(step.loss_s for step in steps),
            "flops_per_sample": sum(layer.flops for layer in layers),
            "ops_without_flop_rule": sorted(facts.unknown_ops),
            "profile_version": PROFILE_VERSION,
            "small_batch_size": times.small_batch_size,
            "timing": "in place: fx Interpreter per node (forward), autograd pre-hooks per node (backward)",
            "profiling_wall_s": time.perf_counter() - wall_start,
        },
    )


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
    clock: Clock | None = None,
    workload: Workload | None = None,
) -> LayerLibrary:
    """Profile a traced classifier into a layer library at ``batch_size`` on ``device``.

    The module is moved to ``device`` and left there in training mode with gradients set. Inputs are random
    (seeded) images of ``input_shape`` and random labels; the loss is cross-entropy. Times are medians over
    ``repeats`` steps after ``warmup`` steps; the layers are timed again at ``small_batch_size(batch_size)``
    samples to fit the part of each time that does not scale with the samples (``Layer.forward_fixed_s``).
    ``threads`` sets torch's intra-op threads for the duration of the call only. ``clock`` reads the time
    (default: the host's clock on a CPU, CUDA events on a GPU). A ``workload`` gives the inputs, targets and
    loss instead (``Workload.batch``, ``Workload.loss_of``; its ``feed`` is what ``graph_module`` takes).
    """
    if batch_size < 1:
        raise ProfileError(f"batch_size must be at least 1, got {batch_size}")
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if threads is not None and threads < 1:
        raise ProfileError(f"threads must be at least 1, got {threads}")
    torch_device = _resolve_device(device)
    if clock is None:
        clock = CudaClock(torch_device) if torch_device.type == "cuda" else CpuClock()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(
            graph_module, name, batch_size, torch_device, clock, repeats, warmup, seed, tuple(input_shape), workload
        )
    finally:
        torch.set_num_threads(previous_threads)


@dataclass(frozen=True)
class ProfileRequest:
    """What to profile and how: the model of ``model`` (a workload, or a registry name or ``module:callable`` for
    its default workload) at ``batch_size`` samples, on ``device`` with ``threads`` (torch's when None), each
    layer timed ``repeats`` times after ``warmup`` runs, from the weights and inputs of ``seed``. It is also what a
    cached library depends on (``ProfileKey``)."""

    model: str | Workload
    batch_size: int
    device: str = "cpu"
    threads: int | None = None
    repeats: int = 5
    warmup: int = 2
    seed: int = 0


def profile_model(request: ProfileRequest) -> LayerLibrary:
    """Build the request's model and profile it on its workload's inputs, targets and loss."""
    workload = as_workload(request.model)
    graph_module = build_traced_workload(workload, seed=request.seed)
    return profile_graph(
        graph_module,
        workload.model,
        request.batch_size,
        device=request.device,
        threads=request.threads,
        repeats=request.repeats,
        warmup=request.warmup,
        seed=request.seed,
        input_shape=workload.feed.shape,
        workload=None if workload.images else workload,
    )


__all__ = [
    "Clock",
    "CpuClock",
    "CudaClock",
    "ProfileError",
    "ProfileRequest",
    "fixed_part",
    "profile_graph",
    "profile_model",
    "small_batch_size",
]
