"""Build a model from a spec: a registered name, ``some.module:callable`` or ``path/to/file.py:callable``.

Every MPI rank builds its own copy of the model from the same spec and seed, so construction seeds torch
first: same spec + same seed = same initial weights everywhere.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

import torch
import torch.fx
from torch import nn

from tapp_core.model.graph import ModelError, trace_model
from tapp_core.model.zoo.alexnet import alexnet
from tapp_core.model.zoo.gpt import GPT_WORKLOAD, gpt
from tapp_core.model.zoo.inception import inception_v3
from tapp_core.model.zoo.small import mlp, tiny_branchy, tiny_cnn
from tapp_core.model.zoo.vgg import vgg16
from tapp_core.model.zoo.vit import tiny_vit, vit

INPUT_SHAPE: tuple[int, int, int] = (3, 32, 32)
"""Shape of one input sample (CIFAR-10): channels, height, width."""

_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "alexnet": alexnet,
    "vgg16": vgg16,
    "inception_v3": inception_v3,
    "vit": vit,
    "mlp": mlp,
    "tiny_cnn": tiny_cnn,
    "tiny_branchy": tiny_branchy,
    "tiny_vit": tiny_vit,
    "gpt": lambda _classes: gpt(),  # a language model's classes are its vocabulary, the byte values
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)

_WORKLOADS: dict[str, Mapping[str, object]] = {"gpt": GPT_WORKLOAD}
"""The workloads of the registered models that are not CIFAR-10 classifiers, declared as a model file declares its
own (``tapp_core.model.workload.workload_of``)."""


def build_model(spec: str, num_classes: int = 10, seed: int | None = 0) -> nn.Module:
    """The model named by ``spec``, its weights initialised after ``torch.manual_seed(seed)``.

    ``spec`` is one of ``MODEL_NAMES`` (built with ``num_classes`` outputs), or ``module:callable`` /
    ``file.py:callable`` where the callable takes no arguments and returns an ``nn.Module`` (``num_classes`` is
    then the callable's business).
    """
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ModelError(f"num_classes must be a positive integer, got {num_classes!r}")
    factory = _factory_for(spec, num_classes)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = factory()
    except ModelError:
        raise
    except (Exception, SystemExit) as exc:  # user code that calls sys.exit() is an error too, not an exit
        raise ModelError(f"building model {spec!r} failed: {_described(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"model spec {spec!r}: the callable returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_traced_model(spec: str, num_classes: int = 10, seed: int | None = 0) -> torch.fx.GraphModule:
    """``build_model`` then ``torch.fx`` tracing; an untraceable model raises ``ModelError`` saying why."""
    return trace_model(build_model(spec, num_classes=num_classes, seed=seed), name=spec)


def registered_workload(spec: str) -> Mapping[str, object] | None:
    """The workload a registered model declares (None: the default, CIFAR-10 classification)."""
    return _WORKLOADS.get(spec.strip()) if isinstance(spec, str) else None


def model_file_attribute(spec: str, name: str) -> object | None:
    """The module-level ``name`` of the file or module that ``spec`` builds from (None for a registered model, or
    when it has none): where a user's model file gives its workload."""
    if not isinstance(spec, str) or spec.strip() in _BUILDERS or ":" not in spec:
        return None
    source = spec.strip().rpartition(":")[0]
    module = _load_file(source) if _looks_like_path(source) else _import_module(source)
    return getattr(module, name, None)


def _factory_for(spec: str, num_classes: int) -> Callable[[], object]:
    if not isinstance(spec, str) or not spec.strip():
        raise ModelError(f"model spec must be a non-empty string, got {spec!r}; known models: {', '.join(MODEL_NAMES)}")
    spec = spec.strip()
    if spec in _BUILDERS:
        builder = _BUILDERS[spec]
        return lambda: builder(num_classes)
    if ":" not in spec:
        raise ModelError(
            f"unknown model {spec!r}; known models: {', '.join(MODEL_NAMES)} "
            "(or give your own as 'some.module:callable' or 'path/to/file.py:callable')"
        )
    source, _, attribute = spec.rpartition(":")
    if not source or not attribute:
        raise ModelError(f"model spec {spec!r} must be 'module:callable' or 'file.py:callable', with both parts given")
    module = _load_file(source) if _looks_like_path(source) else _import_module(source)
    if not hasattr(module, attribute):
        raise ModelError(f"model spec {spec!r}: {source!r} has no attribute {attribute!r}")
    factory: Callable[[], object] = getattr(module, attribute)
    if not callable(factory):
        raise ModelError(
            f"model spec {spec!r}: {attribute!r} in {source!r} is a {type(factory).__name__}, not callable"
        )
    if inspect.isbuiltin(factory):  # sys:exit, os:abort: no model factory is a C function, and calling one may end us
        raise ModelError(f"model spec {spec!r}: {attribute!r} is a built-in function, not a model factory")
    return factory


def _described(exc: BaseException) -> str:
    """An exception in one line: its type and message (``SystemExit`` by its exit status)."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def _looks_like_path(source: str) -> bool:
    return source.endswith(".py") or "/" in source or os.sep in source


def _load_file(source: str) -> ModuleType:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise ModelError(f"model file {source!r} does not exist ({path})")
    # A name unique to the file, registered in sys.modules so that dataclasses, pickling and relative
    # look-ups inside the user's file behave as in a normal import.
    module_name = "tapp_user_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise ModelError(f"model file {source!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[module_name]
        raise ModelError(f"importing model file {source!r} failed: {_described(exc)}") from exc
    return module


def _import_module(source: str) -> ModuleType:
    # Like `python -m`, let modules in the current directory be found even when started from an entry point.
    cwd = os.getcwd()
    added_cwd = cwd not in sys.path and "" not in sys.path
    if added_cwd:
        sys.path.append(cwd)
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as exc:
        raise ModelError(f"cannot import module {source!r} for the model: {exc}") from exc
    except (Exception, SystemExit) as exc:
        raise ModelError(f"importing module {source!r} for the model failed: {_described(exc)}") from exc
    finally:
        if added_cwd:
            sys.path.remove(cwd)
