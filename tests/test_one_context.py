"""No function in ``tapp_core`` takes the layer library and the cluster as separate parameters: the run's
``CostContext`` (``tapp_core.cost.context``) carries them, with the calibration. The exceptions below are the
functions that run before a context can exist, or on a floor below it; each says why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tapp_core"

EXCEPTIONS: dict[str, str] = {
    "profile/device_libraries.py:device_library": "on the profile floor, below the context; the context calls it "
    "once per device to build its terms",
    "cost/calibration.py:check_calibration": "checks the calibration that a context will hold, before it is built",
    "cost/calibration.py:cluster_calibration": "loads the calibration that a context will hold, before it is built",
    "cost/calibration.py:_checked": "checks the calibration that a context will hold, before it is built",
    "runtime/calibrator.py:calibration_on_first_use": "finds or measures the calibration a context will hold",
    "runtime/calibrator.py:calibrate": "measures the calibration that a context will hold",
    "runtime/calibrator.py:measure_kinds": "part of measuring the calibration, before any context exists",
}


def separate_library_and_cluster(root: Path = ROOT) -> list[str]:
    """``file:function`` of every function under ``root`` with both a ``library`` and a ``cluster`` parameter."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                names = {argument.arg for argument in arguments}
                if {"library", "cluster"} <= names:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.name}")
    return found


def test_no_function_takes_library_and_cluster_apart() -> None:
    assert [where for where in separate_library_and_cluster() if where not in EXCEPTIONS] == []


def test_every_exception_still_exists() -> None:
    assert sorted(set(EXCEPTIONS) - set(separate_library_and_cluster())) == []


def test_the_check_finds_one(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("def f(plan, library, *, cluster):\n    pass\n\ndef g(context):\n    pass\n")
    assert separate_library_and_cluster(tmp_path) == ["m.py:f"]
