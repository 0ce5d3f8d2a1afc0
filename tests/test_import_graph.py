"""The import graph keeps the architecture: every import runs down the floors, no module imports itself back, and a
planner imports another planner's module only where the registry declares it (``Method.builds_on``).

Every import statement counts, at the top of a module or inside a function, under ``TYPE_CHECKING`` or not: a
function-local import is still an arrow, only a hidden one. The floors are ``docs/architecture.md``'s.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

from tapp_core.planners.base import Method, registered_methods

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tapp_core", "tasks", "flows", "reports")

FLOORS: tuple[tuple[str, ...], ...] = (
    ("tapp_core",),
    ("tapp_core.platform",),
    ("tapp_core.model",),
    ("tapp_core.profile",),
    ("tapp_core.plan",),
    ("tapp_core.measure",),
    ("tapp_core.cost",),
    ("tapp_core.planners", "tapp_core.runtime"),
    ("reports",),
    ("tasks",),
    ("flows",),
)
"""Bottom first; the first floor is ``tapp_core``'s own modules (errors, units, paths), not its packages. A module may import its own package's modules and any floor below its own, never one above. Two
packages on one floor may not import each other: the planners plan without MPI, the runtime runs without planners."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """Every project module ``module`` imports, with its line: ``from X import y`` names module ``X.y`` when it is
    one, else ``X``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno
                elif target in known:
                    yield target, node.lineno


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    modules = project_modules(root)
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in imports_of(module, path, known):
            if target != module:
                edges.setdefault(target, line)
    return graph


def floor_of(module: str) -> tuple[int, str]:
    """The floor of ``module`` and the package that places it there (the longest prefix named in ``FLOORS``)."""
    best: tuple[int, str] = (-1, "")
    for level, packages in enumerate(FLOORS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > len(best[1]):
                best = (level, package)
    if best[0] < 0 or (best[1] == "tapp_core" and module.count(".") > 1):
        raise AssertionError(f"{module} is on no floor: add its package to FLOORS and docs/architecture.md")
    return best


def upward_imports(graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        level, package = floor_of(module)
        for target, line in sorted(edges.items()):
            target_level, target_package = floor_of(target)
            if target_package == package:
                continue
            if target_level > level or (target_level == level and target_package != package):
                found.append(f"{modules[module].relative_to(ROOT)}:{line} {module} imports {target}")
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _without_package_inits(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """A package's ``__init__`` re-exporting its modules, which import siblings through the package, is no cycle
    of design: edges from a submodule to its own package's ``__init__`` are left out."""
    return {
        module: {t: line for t, line in edges.items() if not module.startswith(t + ".")}
        for module, edges in graph.items()
    }


def test_every_import_runs_down_the_floors() -> None:
    assert upward_imports(import_graph(), project_modules()) == []


def test_no_module_imports_itself_back() -> None:
    assert cycles(_without_package_inits(import_graph())) == []


def test_tapp_core_never_imports_prefect_or_mlflow() -> None:
    found = []
    for module, path in project_modules().items():
        if not module.startswith("tapp_core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [f"{module}: {n}" for n in names if n.split(".")[0] in ("prefect", "mlflow")]
    assert found == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_an_upward_import_and_a_cycle_are_found(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "tapp_core/__init__.py": "",
            "tapp_core/plan/__init__.py": "",
            "tapp_core/plan/a.py": "def f():\n    from tapp_core.planners import b\n",
            "tapp_core/planners/__init__.py": "",
            "tapp_core/planners/b.py": "from tapp_core.planners.c import x\n",
            "tapp_core/planners/c.py": "from tapp_core.planners import b\nx = 1\n",
            "tapp_core/runtime/__init__.py": "",
            "tapp_core/runtime/d.py": "import tapp_core.planners.c\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["tapp_core.plan.a"] == {"tapp_core.planners.b": 2}
    assert cycles(graph) == [["tapp_core.planners.b", "tapp_core.planners.c"]]
    levels = {m: floor_of(m)[0] for m in graph}
    assert levels["tapp_core.plan.a"] < levels["tapp_core.planners.b"] == levels["tapp_core.runtime.d"]


# --- the registry's declared edges between planners ----------------------------------------------------------------

PLANNERS = "tapp_core.planners"


def planner_homes(methods: Iterable[Method]) -> dict[str, set[str]]:
    """Each planner's home, the module or sub-package of ``tapp_core.planners`` its class lives in (TAPP's is the
    whole ``planners.tapp``), with the names of the methods it holds (``single`` holds three)."""
    homes: dict[str, set[str]] = {}
    for method in methods:
        module = f"{PLANNERS}.{method.target.split(':')[0]}"
        homes.setdefault(".".join(module.split(".")[:3]), set()).add(method.name)
    return homes


def _home_of(module: str, homes: dict[str, set[str]]) -> str | None:
    return next((home for home in homes if module == home or module.startswith(home + ".")), None)


def planner_edges(graph: dict[str, dict[str, int]], methods: Iterable[Method]) -> tuple[list[str], list[str]]:
    """(imports of one planner's module by another planner's that its ``builds_on`` does not declare, declarations
    with no such import behind them)."""
    methods = tuple(methods)
    homes = planner_homes(methods)
    declared = {method.name: set(method.builds_on) for method in methods}
    used: set[tuple[str, str]] = set()
    undeclared = []
    for module, edges in sorted(graph.items()):
        home = _home_of(module, homes)
        if home is None:
            continue
        for target, line in sorted(edges.items()):
            peer = _home_of(target, homes)
            if peer is None or peer == home:
                continue
            pairs = {(name, other) for name in homes[home] for other in homes[peer] if other in declared[name]}
            if not pairs:
                names, others = "/".join(sorted(homes[home])), "/".join(sorted(homes[peer]))
                undeclared.append(f"{module}:{line} imports {target}: {names} does not declare it builds on {others}")
            used |= pairs
    unbacked = [
        f"{name} declares it builds on {other}, but none of its modules imports {other}'s"
        for name, others in sorted(declared.items())
        for other in sorted(others)
        if (name, other) not in used
    ]
    return undeclared, unbacked


def test_a_planner_imports_another_s_module_exactly_where_the_registry_declares_it() -> None:
    assert planner_edges(import_graph(), registered_methods()) == ([], [])


def test_an_undeclared_import_between_planners_and_a_declaration_without_one_are_found(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "tapp_core/__init__.py": "",
            "tapp_core/planners/__init__.py": "",
            "tapp_core/planners/space.py": "",
            "tapp_core/planners/a.py": "from tapp_core.planners import space\n",
            "tapp_core/planners/b.py": "def f():\n    from tapp_core.planners.a import A\n",
            "tapp_core/planners/c.py": "import tapp_core.planners.a\n",
            "tapp_core/planners/deep/__init__.py": "",
            "tapp_core/planners/deep/planner.py": "",
            "tapp_core/planners/deep/warm.py": "from tapp_core.planners.b import B\n",
        },
    )
    methods = (
        Method("a", "a:A", "A", ""),
        Method("b", "b:B", "B", "", builds_on=("a",)),
        Method("c", "c:C", "C", "", builds_on=("b",)),
        Method("deep", "deep.planner:Deep", "Deep", "", builds_on=("b",)),
    )
    undeclared, unbacked = planner_edges(import_graph(tmp_path), methods)
    assert undeclared == [
        "tapp_core.planners.c:1 imports tapp_core.planners.a: c does not declare it builds on a"
    ]  # a helper (space) is no planner; deep's warm module imports b for deep, as declared
    assert unbacked == ["c declares it builds on b, but none of its modules imports b's"]
