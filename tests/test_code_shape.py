"""The code stays readable: no function of the project's packages is longer than one screen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tapp_core", "tasks", "flows", "reports")
MOST_LINES = 80


def long_functions(root: Path = ROOT, most: int = MOST_LINES) -> list[str]:
    """``path:line name (lines)`` of every function in ``PACKAGES`` longer than ``most`` lines."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > most:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_a_screen() -> None:
    assert long_functions() == []


def test_a_long_function_is_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MOST_LINES))
    (tmp_path / "tapp_core").mkdir()
    (tmp_path / "tapp_core" / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == [f"tapp_core/m.py:5 long ({MOST_LINES + 1} lines)"]
