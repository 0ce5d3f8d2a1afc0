"""A workload, defined once: the model with its example inputs, its targets, its loss, its optimiser and its data.

A ``Workload`` is plain data (names and numbers): it is built once, where a command or a task starts, and passed
unchanged to the profiler, the planners, the pool and every MPI rank, which rebuilds the model from its spec
(``tapp_core.model.zoo.build_model``). CIFAR-10 classification with SGD is the default workload.

A ``RunSpec`` is what a measurement or a training run needs besides the plan: the workload, the seed, and how long
to train on which data. It is the one spelling of the training options (the command line, ``launch.train``,
``WorkerPool.train`` and the rank's ``TrainJob`` all carry one).

The runtime feeds one tensor per sample (``Workload.feed``). A model of one input takes it as it is; a model of
several takes them packed into one float32 row per sample, which ``PackedInputs`` unpacks in the traced graph's
first layers (integer inputs survive the round trip below 2**24).

A user's model file gives its workload next to its model: a module-level ``workload`` (a dict, or a callable
returning one) with any of the keys ``inputs``, ``target``, ``targets``, ``loss``, ``optimizer`` and ``data``
(``workload_of``). Without one, the model takes one CIFAR-shaped image and returns class logits.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from tapp_core.model.checkpoint_options import CheckpointOptions
from tapp_core.model.data import TEXT_DATASETS, ByteText, InMemoryImages, check_dataset, open_dataset, open_text
from tapp_core.model.graph import ModelError, drop_dead_nodes, trace_model
from tapp_core.model.zoo.registry import (
    INPUT_SHAPE,
    MODEL_NAMES,
    build_model,
    model_file_attribute,
    registered_workload,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
"""The dtypes an input or a target may have, by name."""

LOSSES = ("cross_entropy", "mse")
"""``cross_entropy``: logits over the output's last dimension against integer targets of the output's other
dimensions (one class per sample, or one per position of a sequence); ``mse``: the output against float targets
of its shape."""

TARGETS = ("drawn", "next_token")
"""How synthetic targets are made: ``drawn`` from the target spec alone, or ``next_token``: the first input is
a counting sequence of token ids (a random start, then +1 modulo its vocabulary) and the target at each position
is the token after it, a rule a causal model can learn."""

OptionValue: TypeAlias = float | int | bool | str | tuple[float, ...]
SYNTHETIC = "synthetic"
SYNTHETIC_TRAIN_SAMPLES, SYNTHETIC_TEST_SAMPLES = 2048, 512


class WorkloadError(ModelError):
    """A workload that cannot be run as given; the message says what to give instead."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor per sample: its shape (without the sample dimension) and dtype; ``high`` bounds integer values,
    drawn in [0, high) (class labels, token ids)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    high: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise WorkloadError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if any(not isinstance(n, int) or n < 1 for n in self.shape):
            raise WorkloadError(f"a shape is positive integers, got {self.shape!r}")
        if self.integer and (self.high is None or self.high < 1):
            raise WorkloadError(f"an integer tensor ({self.dtype}) needs 'high', its values' bound, got {self.high!r}")

    @property
    def integer(self) -> bool:
        return not DTYPES[self.dtype].is_floating_point

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def numel(self) -> int:
        return math.prod(self.shape)

    def draw(self, samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``samples`` random values: normal floats, or integers in [0, high)."""
        if self.integer:
            assert self.high is not None
            return torch.randint(0, self.high, (samples, *self.shape), generator=generator, dtype=self.torch_dtype)
        return torch.randn(samples, *self.shape, generator=generator).to(self.torch_dtype)

    def describe(self) -> str:
        bound = f" < {self.high}" if self.high is not None else ""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]{bound}"


IMAGE = TensorSpec(tuple(INPUT_SHAPE))
"""One CIFAR-10 image: the default workload's input."""


@dataclass(frozen=True)
class OptimizerConfig:
    """Any ``torch.optim`` class by ``name``: ``lr``, ``momentum`` and ``weight_decay`` are given to it when its
    constructor takes them, ``options`` (name, value) are its other keyword arguments. The default is SGD with
    momentum."""

    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    stale_compensation: bool = True
    """Asynchronous schedules: a stage with delay d updates with ``stage_lr`` (lr / (d + 1)) and, where the
    optimiser keeps a velocity to predict along (``runtime.optim.predicted_weights``), runs each forward on its
    weights predicted d updates ahead. False: plain weight stashing, every stage at ``lr``. Synchronous schedules
    (d = 0 on every stage) are never affected."""
    name: str = "SGD"
    options: tuple[tuple[str, OptionValue], ...] = ()

    def __post_init__(self) -> None:
        optimizer_class(self.name)
        taken = set(inspect.signature(optimizer_class(self.name)).parameters)
        unknown = [key for key, _ in self.options if key not in taken]
        if unknown:
            raise WorkloadError(f"torch.optim.{self.name} takes no option {', '.join(map(repr, unknown))}")

    def kwargs(self, lr: float | None = None) -> dict[str, Any]:
        """The optimiser's keyword arguments (``lr`` overriding the rate)."""
        taken = inspect.signature(optimizer_class(self.name)).parameters
        named = {"lr": self.lr if lr is None else lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        return {**{k: v for k, v in named.items() if k in taken}, **dict(self.options)}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def state_per_param(self) -> int:
        """Tensors of optimiser state the optimiser keeps per parameter, each the parameter's size: SGD with
        momentum 1, without 0, Adam and AdamW 2 (their two moments), with ``amsgrad`` 3. Found by one step over a
        parameter of 8 numbers, so any ``torch.optim`` class is counted as it runs."""
        return _state_per_param(self.name, tuple(self.kwargs().items()))

    def describe(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.kwargs().items())})"

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> OptimizerConfig:
        """From a dict: ``name``, ``lr``, ``momentum``, ``weight_decay``, ``stale_compensation``, and the
        optimiser's other keyword arguments."""
        own = {f.name for f in dataclasses.fields(cls)} - {"options"}
        options = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in given.items() if k not in own)
        return cls(**{k: v for k, v in given.items() if k in own}, options=options)


@functools.lru_cache(maxsize=32)
def _state_per_param(name: str, kwargs: tuple[tuple[str, Any], ...]) -> int:
    param = torch.nn.Parameter(torch.zeros(8))
    param.grad = torch.ones(8)
    optimizer = optimizer_class(name)([param], **dict(kwargs))
    optimizer.step()
    state = optimizer.state.get(param, {})
    return sum(1 for value in state.values() if isinstance(value, torch.Tensor) and value.numel() == param.numel())


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    found = getattr(torch.optim, name, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise WorkloadError(f"optimizer {name!r} is not a torch.optim class (SGD, Adam, AdamW, ...)")
    return found


@dataclass(frozen=True)
class Workload:
    """The model (a registry name, ``module:callable`` or ``file.py:callable``) and what training it means."""

    model: str
    inputs: tuple[TensorSpec, ...] = (IMAGE,)
    target: TensorSpec = TensorSpec((), "int64", high=10)
    targets: str = "drawn"
    loss: str = "cross_entropy"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: str = "cifar10"
    """The dataset it trains on (``tapp_core.model.data.DATASET_NAMES``); a workload whose inputs are not one
    CIFAR-shaped image trains on ``synthetic`` samples of its own specs."""
    num_classes: int = 10
    """The classes a registered model is built with."""
    output: str | int | None = None
    """Which output it trains on where the model returns several: a key of the dict (or ``ModelOutput``) it
    returns (``"logits"``), or a position in its tuple (``0``); None: the model returns one tensor."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise WorkloadError("a workload needs at least one input")
        if self.output is not None and (isinstance(self.output, bool) or not isinstance(self.output, str | int)):
            raise WorkloadError(f"output {self.output!r} is neither a key (a string) nor a position (an integer)")
        if self.loss not in LOSSES:
            raise WorkloadError(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.targets not in TARGETS:
            raise WorkloadError(f"targets {self.targets!r} is not one of {', '.join(TARGETS)}")
        if self.targets == "next_token" and not self.inputs[0].integer:
            raise WorkloadError("next_token targets need integer token ids as the first input")

    @property
    def network(self) -> Workload:
        """Only what its model is built and traced from (the model, its inputs, classes and output), the rest at
        the defaults: what a traced model is cached by, so that training on other data or with another optimiser
        reuses it rather than holding a second copy of the model."""
        return Workload(model=self.model, inputs=self.inputs, num_classes=self.num_classes, output=self.output)

    @property
    def images(self) -> bool:
        """Whether it takes one CIFAR-shaped image, as the image datasets give."""
        return self.inputs == (IMAGE,)

    @property
    def language_model(self) -> bool:
        """Whether it predicts the next token at every position: its quality is a perplexity (the exponential of
        the mean cross-entropy per token, ``perplexity``), not an accuracy."""
        return self.targets == "next_token" and self.loss == "cross_entropy"

    @property
    def quality(self) -> str:
        """What its trained model's quality is reported as: ``perplexity`` or ``accuracy``."""
        return "perplexity" if self.language_model else "accuracy"

    @property
    def feed(self) -> TensorSpec:
        """The one tensor per sample the runtime feeds: the input itself, or several packed in a float32 row."""
        if len(self.inputs) == 1:
            return self.inputs[0]
        return TensorSpec((sum(spec.numel() for spec in self.inputs),))

    def describe(self) -> str:
        inputs = ", ".join(spec.describe() for spec in self.inputs)
        target = "next token" if self.targets == "next_token" else self.target.describe()
        return (
            f"{self.model}: inputs {inputs} -> {self.loss} on {target}, {self.optimizer.describe()}, data {self.data}"
        )

    def batch(self, samples: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random (feed, targets) of ``samples`` samples. The default workload draws exactly as the runtime's
        synthetic batches always have: normal images, then uniform labels."""
        inputs = [spec.draw(samples, generator) for spec in self.inputs]
        if self.targets == "next_token":
            tokens = self.inputs[0]
            assert tokens.high is not None
            start = torch.randint(0, tokens.high, (samples, 1), generator=generator)
            counting = (start + torch.arange(tokens.shape[-1])) % tokens.high
            inputs[0] = counting.expand(samples, *tokens.shape).to(tokens.torch_dtype)
            return self.pack(inputs), ((inputs[0].to(torch.int64) + 1) % tokens.high)
        return self.pack(inputs), self.target.draw(samples, generator)

    def pack(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(inputs) == 1:
            return inputs[0]
        return torch.cat([x.reshape(x.shape[0], -1).to(torch.float32) for x in inputs], dim=1)

    def example(self, samples: int = 2) -> torch.Tensor:
        """A feed of ``samples`` samples (seeded, so every caller sees the same)."""
        return self.batch(samples, torch.Generator().manual_seed(0))[0]

    def loss_of(self, output: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
        """This slice's share of the mini-batch loss: summed over its samples (and positions), divided by the
        mini-batch's ``batch_size`` samples (times positions). Summing the shares of every micro-batch and replica
        gives the mini-batch's mean, so accumulated gradients equal one big batch's. Targets of -1 are ignored."""
        positions = math.prod(targets.shape[1:])
        if self.loss == "mse":
            return F.mse_loss(output, targets.to(output.dtype), reduction="sum") / (batch_size * positions)
        logits = output.reshape(-1, output.shape[-1])
        total = F.cross_entropy(logits, targets.reshape(-1), reduction="sum", ignore_index=-1)
        return total / (batch_size * positions)


def example_input(input_shape: Sequence[int] | TensorSpec, samples: int) -> torch.Tensor:
    """An example model input of ``samples`` samples: random normal floats of ``input_shape``, or drawn from a
    spec (integer token ids, say)."""
    if isinstance(input_shape, TensorSpec):
        return input_shape.draw(samples)
    return torch.randn(samples, *input_shape)


class PackedInputs(nn.Module):
    """``model`` taking its several inputs from one packed float32 row per sample (``Workload.pack``)."""

    def __init__(self, model: nn.Module, inputs: Sequence[TensorSpec]) -> None:
        super().__init__()
        self.model = model
        self.specs = tuple(inputs)

    def forward(self, packed: torch.Tensor) -> Any:
        unpacked, start = [], 0
        for spec in self.specs:  # slices, not torch.split: a traced split cannot be iterated
            unpacked.append(packed[:, start : start + spec.numel()].reshape(-1, *spec.shape).to(spec.torch_dtype))
            start += spec.numel()
        return self.model(*unpacked)


def build_workload_model(workload: Workload, seed: int | None = 0) -> nn.Module:
    """The workload's model, taking ``Workload.feed`` and returning the one tensor it trains on."""
    model = build_model(workload.model, num_classes=workload.num_classes, seed=seed)
    if workload.output is not None:
        select_output(model, workload.output, len(workload.inputs))
    return model if len(workload.inputs) == 1 else PackedInputs(model, workload.inputs)


def select_output(model: nn.Module, output: str | int, inputs: int = 1) -> None:
    """Make ``model`` (of ``inputs`` inputs) return only its output ``output`` (``Workload.output``). Its class
    becomes a subclass whose ``forward`` selects, so its parameters keep their names (a wrapper would prefix
    them, and the trained weights would no longer load into the model) and torch.fx and torch.export trace the
    selection with it; the outputs left unused are then dropped from the graph (``graph.drop_dead_nodes``)."""
    base = type(model)

    def forward_of_one(self: nn.Module, x: Any) -> Any:  # torch.fx names the graph's inputs by these parameters
        return selected_output(base.forward(self, x), output, base.__name__)

    def forward_of_several(self: nn.Module, *given: Any) -> Any:  # reached inside PackedInputs, never a root
        return selected_output(base.forward(self, *given), output, base.__name__)

    forward = forward_of_one if inputs == 1 else forward_of_several
    namespace = {"forward": forward, "__module__": base.__module__, "__qualname__": base.__qualname__}
    model.__class__ = type(base.__name__, (base,), namespace)


def selected_output(value: Any, output: str | int, model: str) -> Any:
    """Output ``output`` of the ``value`` a model returned: a key of a dict or a field of a named tuple (the
    ``logits`` of a ``ModelOutput`` or of torchvision's ``InceptionOutputs``), a position in a tuple or list. A
    model that returns one tensor returns it (torchvision's Inception returns its auxiliary logits only when
    training)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(output, str) and output in getattr(value, "_fields", ()):
        return getattr(value, output)
    if isinstance(output, str) and isinstance(value, Mapping):
        if output not in value:
            raise WorkloadError(f"model {model!r} returns no output {output!r}; it returns {sorted(value)}")
        return value[output]
    if isinstance(output, int) and isinstance(value, tuple | list):
        if not -len(value) <= output < len(value):
            raise WorkloadError(f"model {model!r} returns {len(value)} outputs, so it has no output {output}")
        return value[output]
    if isinstance(value, torch.fx.Proxy):  # a tuple torch.fx cannot see into (a traced call's result)
        return operator.getitem(value, output)
    raise WorkloadError(f"output {output!r} names {_kind(output)}, and model {model!r} returns {returned(value)}")


NAME_THE_OUTPUT = (
    "name the one it trains on as 'output' in its workload (a key such as 'logits', or a position such as 0; "
    "README: Your own workload)"
)


def _kind(output: str | int) -> str:
    return "a key of a dict" if isinstance(output, str) else "a position in a tuple"


def returned(value: Any) -> str:
    """What a model returned, in words: a dict's keys, a tuple's length, a tensor's shape."""
    if isinstance(value, Mapping):
        return f"a dict of {sorted(value)}"
    if hasattr(value, "_fields"):
        return f"a named tuple of {list(value._fields)}"
    if isinstance(value, tuple | list):
        return f"a {'list' if isinstance(value, list) else 'tuple'} of {len(value)} values"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def build_traced_workload(workload: Workload, seed: int | None = 0) -> torch.fx.GraphModule:
    """The workload's model traced (``trace_model``: by torch.fx, else exported on the workload's example feed);
    where it trains on one of several outputs, without what feeds only the others."""
    traced = trace_model(build_workload_model(workload, seed), name=workload.model, example=workload.example())
    if workload.output is not None:
        drop_dead_nodes(traced)
    return traced


def as_workload(model: str | Workload) -> Workload:
    """A workload as it is; a model spec as its workload (``workload_of``: what its file declares, or the
    default), for the places that only the spec reaches (a plan's ``model``)."""
    return model if isinstance(model, Workload) else workload_of(model)


def workload_of(spec: str, **overrides: Any) -> Workload:
    """The workload of model ``spec``: a registered model's is the one it declares (the GPT's, next-byte prediction
    on text), else the default (CIFAR-10, SGD); a model file's is what its module-level ``workload`` (a dict, or a
    callable returning one) gives over the default. ``overrides`` (fields of ``Workload``, None for unset) win over
    both. Raises ``WorkloadError`` saying what to give."""
    fields = {**_given_fields(spec), **{k: v for k, v in overrides.items() if v is not None}}
    return Workload(model=spec, **fields)


def declared_workload(spec: str) -> tuple[Workload, OptimizerConfig | None]:
    """The workload of model ``spec`` (``workload_of``) and the optimiser it declares (the GPT's AdamW, a model
    file's ``optimizer``; None where it declares none and takes the default), from one read of its declaration."""
    fields = _given_fields(spec)
    declared = fields.get("optimizer")
    return Workload(model=spec, **fields), declared if isinstance(declared, OptimizerConfig) else None


def _given_fields(spec: str) -> dict[str, Any]:
    """The workload fields model ``spec`` declares: a registered model's, else its file's (none for the rest)."""
    registered = registered_workload(spec)
    if registered is not None:
        return _fields_of(spec, registered)
    return {} if spec.strip() in MODEL_NAMES else _declared(spec)


def _declared(spec: str) -> dict[str, Any]:
    """The fields a model file declares (read afresh, as ``build_model`` reads the model)."""
    declared = model_file_attribute(spec, "workload")
    if declared is None:
        return {}
    value = declared() if callable(declared) else declared
    if isinstance(value, Workload):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(Workload) if f.name != "model"}
    if not isinstance(value, Mapping):
        raise WorkloadError(
            f"model {spec!r}: its 'workload' must be a dict (or return one), not {type(value).__name__}"
        )
    return _fields_of(spec, value)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "inputs": lambda given: tuple(_tensor_spec(x) for x in given),
    "target": lambda given: _tensor_spec(given),
    "optimizer": lambda given: OptimizerConfig.of(given),
}


def _fields_of(spec: str, given: Mapping[str, Any]) -> dict[str, Any]:
    allowed = {f.name for f in dataclasses.fields(Workload)} - {"model"}
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise WorkloadError(f"model {spec!r}: its workload has unknown key(s) {unknown}; known: {sorted(allowed)}")
    try:
        return {key: _PARSERS.get(key, lambda value: value)(value) for key, value in given.items()}
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"model {spec!r}: its workload cannot be read: {exc}") from exc


def _tensor_spec(given: Any) -> TensorSpec:
    if isinstance(given, TensorSpec):
        return given
    if isinstance(given, Mapping):
        return TensorSpec(tuple(given["shape"]), str(given.get("dtype", "float32")), given.get("high"))
    return TensorSpec(tuple(given))


def check_inputs(workload: Workload) -> None:
    """``WorkloadError`` in one line, saying what to give, when the model's forward takes another number of inputs
    than the workload gives (it builds the model; it runs nothing)."""
    model = build_model(workload.model, num_classes=workload.num_classes)
    required, accepted = _positional_inputs(model)
    if not required <= len(workload.inputs) <= accepted:
        takes = f"{required} to {int(accepted)}" if required < accepted < math.inf else str(required)
        raise WorkloadError(
            f"model {workload.model!r} takes {takes} inputs and its workload gives {len(workload.inputs)} "
            f"({', '.join(s.describe() for s in workload.inputs)}): {_GIVE_INPUTS}"
        )


def check_workload(workload: Workload) -> None:
    """``check_inputs``, then the model run once on two example samples and its loss on the output:
    ``WorkloadError`` in one line saying what to give when they do not fit."""
    check_inputs(workload)
    model = build_workload_model(workload)
    feed, targets = workload.batch(2, torch.Generator().manual_seed(0))
    model.eval()
    try:
        with torch.no_grad():
            workload.loss_of(model(feed), targets, 2)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WorkloadError(
            f"model {workload.model!r} fails on a batch of 2 inputs "
            f"{' and '.join(s.describe() for s in workload.inputs)} with a {workload.loss} loss "
            f"({type(exc).__name__}: {reason}): {_GIVE_INPUTS}"
        ) from None


_GIVE_INPUTS = "give its inputs, targets and loss in a module-level 'workload' in its file (README: Your own workload)"


def _positional_inputs(model: nn.Module) -> tuple[int, float]:
    """How many positional arguments the model's forward requires, and how many it accepts (those with defaults
    too, as a zoo's ``forward(input_ids=None, ...)``; unbounded with ``*args``)."""
    parameters = inspect.signature(model.forward).parameters.values()
    positional = [
        p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = sum(1 for p in positional if p.default is inspect.Parameter.empty)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return required, math.inf
    return required, len(positional)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What a measurement or a training run needs besides the plan, built once where the command or the task
    starts and passed unchanged through launch, pool and rank."""

    workload: Workload
    seed: int = 0
    """Seeds the model's initial weights and the order of the batches."""
    epochs: int = 1
    steps_per_epoch: int | None = None
    """Cut each epoch to this many steps (None: the whole training set)."""
    data_dir: str | None = None
    augment: bool = False
    test_samples: int | None = None
    """Evaluate on the test set's first this many samples (None: all of them)."""
    checkpoints: CheckpointOptions | None = None
    """Where a training writes checkpoints, how often, and the checkpoint it resumes from (``runtime.checkpoint``)."""

    def with_options(self, **options: Any) -> RunSpec:
        """This spec with fields replaced by name; ``model``, ``dataset`` and ``optimizer`` replace the workload's
        model, data and optimiser (None: unchanged)."""
        given = {k: v for k, v in options.items() if v is not None or k in ("steps_per_epoch", "test_samples")}
        workload_fields = {"model": "model", "dataset": "data", "optimizer": "optimizer"}
        changes = {workload_fields[k]: given.pop(k) for k in list(given) if k in workload_fields and given[k]}
        given = {k: v for k, v in given.items() if k not in workload_fields}
        if "data_dir" in given:
            given["data_dir"] = str(given["data_dir"])
        return dataclasses.replace(self, workload=dataclasses.replace(self.workload, **changes), **given)

    @classmethod
    def of(cls, model: str | Workload, **options: Any) -> RunSpec:
        """The spec of ``model`` (a spec's default workload, or a workload) with ``options`` as ``with_options``."""
        return cls(workload=as_workload(model)).with_options(**options)


class SyntheticSamples:
    """``samples`` random samples of a workload (``Workload.batch``), a pure function of ``seed``: the training and
    test sets of a workload whose inputs no image dataset gives."""

    synthetic = True

    def __init__(self, workload: Workload, samples: int, seed: int) -> None:
        self.feed, self.targets = workload.batch(samples, torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return int(self.feed.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.feed[index], self.targets[index]

    def get_batch(
        self, indices: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.feed[indices], self.targets[indices]

    def head(self, samples: int | None) -> SyntheticSamples:
        """The first ``samples`` samples (all of them if None)."""
        if samples is None:
            return self
        kept = SyntheticSamples.__new__(SyntheticSamples)
        kept.feed, kept.targets = self.feed[:samples], self.targets[:samples]
        return kept


def synthetic_samples(workload: Workload, train: bool) -> SyntheticSamples:
    """A workload's synthetic training set (2048 samples) or test set (512), for a workload that takes no images."""
    if workload.data != SYNTHETIC:
        raise WorkloadError(
            f"model {workload.model!r} takes {', '.join(s.describe() for s in workload.inputs)}, which dataset "
            f"{workload.data!r} does not give: train it on 'synthetic' data (--dataset synthetic)"
        )
    return SyntheticSamples(workload, SYNTHETIC_TRAIN_SAMPLES if train else SYNTHETIC_TEST_SAMPLES, 0 if train else 1)


def perplexity(mean_loss: float) -> float:
    """A language model's perplexity: the exponential of its mean cross-entropy per token (in nats)."""
    return math.exp(mean_loss) if math.isfinite(mean_loss) else float("nan")


def open_workload_data(
    workload: Workload, data_dir: str | None, train: bool, augment: bool = False
) -> InMemoryImages | ByteText | SyntheticSamples:
    """The training (``train``) or test set of a workload: its image dataset, its text as byte tokens, or synthetic
    samples of its own inputs. Raises ``DataError`` or ``WorkloadError`` in one line when they do not fit."""
    if workload.images:
        return open_dataset(workload.data, data_dir, train=train, augment=augment)
    if workload.data in TEXT_DATASETS:
        tokens = workload.inputs[0]
        if len(workload.inputs) != 1 or not workload.language_model or (tokens.high or 0) < 256:
            raise WorkloadError(
                f"model {workload.model!r}: text ({workload.data}) is one input of byte token ids (high 256 or more) "
                f"with next_token targets and a cross_entropy loss, not {workload.describe()}"
            )
        return open_text(workload.data, data_dir, train=train, context=tokens.shape[-1])
    return synthetic_samples(workload, train)


def check_workload_data(workload: Workload, data_dir: str | None) -> None:
    """Read a workload's training and test data once and let them go: what a command runs before any worker starts,
    so that missing, corrupt or unfit data fails at once, in one line (``DataError`` naming the file, or
    ``WorkloadError``)."""
    if workload.images:
        check_dataset(workload.data, data_dir)
        return
    for train in (True, False):
        open_workload_data(workload, data_dir, train)
