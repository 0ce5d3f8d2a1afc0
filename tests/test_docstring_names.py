"""Docstrings name only what exists: every double-backquoted dotted name in a ``tapp_core`` docstring
(``tapp_core.cost.simulation.estimate``, ``schedules.schedule_spec``, ``Plan.stage_devices``, ``plan.micro_batches``)
resolves against the code. A name resolves from a module (by its full path, or by its last part where that is
one module's), from a top-level name of ``tapp_core`` (a class or function, then its attributes, fields and
``self.`` assignments), or from a parameter named after a type (``plan``: a ``Plan``). Spans that are not such a
name (files, expressions, other libraries' names) are left alone."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "tapp_core"
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
SPAN = re.compile(r"``([^`]+)``")
FILE_SUFFIXES = ("py", "json", "yaml", "yml", "csv", "pt", "png", "md", "txt", "toml", "safetensors", "gz")
TYPED_PARAMETERS = {
    "plan": "Plan",
    "library": "LayerLibrary",
    "cluster": "Cluster",
    "calibration": "Calibration",
    "context": "CostContext",
    "layer": "Layer",
    "device": "Device",
    "schedule": "PipelineSchedule",
    "estimate": "Estimate",
    "measurement": "Measurement",
}
"""Parameters the docstrings name as the instance of a type."""


def _modules() -> dict[str, ModuleType]:
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = importlib.import_module(name)
    return out


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for i, child in enumerate(body):
                first = i == 0 and isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                # attribute docstrings: a string right after an assignment
                after = i > 0 and isinstance(body[i - 1], ast.Assign | ast.AnnAssign)
                text = (
                    child.value.value if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) else None
                )
                if (first or after) and isinstance(text, str):
                    yield child.lineno, text


def _has_attribute(owner: object, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if not inspect.isclass(owner):
        return False
    for cls in owner.__mro__:
        if name in getattr(cls, "__annotations__", {}) or name in getattr(cls, "model_fields", {}):
            return True
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{name}\b\s*(:[^=\n]*)?=", source):
            return True
    return False


def _resolve(start: object, attributes: list[str]) -> bool:
    owner = start
    for name in attributes:
        if not _has_attribute(owner, name):
            return False
        found = getattr(owner, name, None)
        if found is None or isinstance(found, property):
            return len(attributes) == 1 or name == attributes[-1]
        owner = found
    return True


class _Names:
    def __init__(self) -> None:
        self.modules = _modules()
        self.short: dict[str, list[str]] = {}
        for name in self.modules:
            self.short.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        self.top: dict[str, object] = {}
        for module in self.modules.values():
            for key, value in vars(module).items():
                if getattr(value, "__module__", "").startswith("tapp_core") and not key.startswith("__"):
                    self.top.setdefault(key, value)

    def resolves(self, dotted: str) -> bool | None:
        """True where one reading of the name resolves, False where some apply and none does, None for a name
        this test leaves alone."""
        parts = dotted.split(".")
        if parts[-1] in FILE_SUFFIXES:
            return None
        if parts[0] == "tapp_core":
            cut = max((c for c in range(1, len(parts) + 1) if ".".join(parts[:c]) in self.modules), default=0)
            return cut > 0 and _resolve(self.modules[".".join(parts[:cut])], parts[cut:])
        starts: list[object] = [self.modules[name] for name in self.short.get(parts[0], [])]
        if parts[0] in self.top:
            starts.append(self.top[parts[0]])
        if parts[0] in TYPED_PARAMETERS:
            starts.append(self.top[TYPED_PARAMETERS[parts[0]]])
        if not starts:
            return None
        return any(_resolve(start, parts[1:]) for start in starts)


def unresolved_names() -> list[str]:
    names = _Names()
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for line, text in _docstrings(path):
            for span in SPAN.findall(text):
                candidate = span.removesuffix("()").split("(")[0]
                if DOTTED.match(candidate) and names.resolves(candidate) is False:
                    found.append(f"{path.relative_to(ROOT)}:{line}: ``{span}``")
    return found


@pytest.mark.filterwarnings("ignore")
def test_every_dotted_name_in_a_docstring_resolves() -> None:
    assert unresolved_names() == []


def test_a_name_that_does_not_exist_is_found() -> None:
    names = _Names()
    assert names.resolves("tapp_core.cost.simulation.estimate") is True
    assert names.resolves("plan.stage_devices") is True
    assert names.resolves("schedules.schedule_spec") is True
    assert names.resolves("plan.replica_slices") is False
    assert names.resolves("tapp_core.cost.simulation.async_warmup_iterations") is False
    assert names.resolves("deployments.clusters") is None
