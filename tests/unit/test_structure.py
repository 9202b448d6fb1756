"""The package's import rules, read from the source: every ``import`` of every module, those
inside functions included (only ``if TYPE_CHECKING:`` blocks are left out: they never run)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import palaestra

ROOT = Path(palaestra.__file__).parent
IO_MODULES = {"os", "io", "pathlib", "json", "shutil", "subprocess", "socket", "tempfile", "httpx"}


def unit_of(module: str) -> str:
    """The folder or top-level module a ``palaestra.*`` module belongs to: ``train``, ``types``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, at_import: bool = False) -> list[str]:
    """Absolute names of the modules ``path`` imports at run time; ``at_import``: only those
    its import runs (not those inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for stmt in node.body for child in ast.walk(stmt)}
        if at_import and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            skipped |= {id(child) for child in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # ``from palaestra.x import y`` may name a module y: count both.
            names.append(base)
            names += [
                f"{base}.{alias.name}" for alias in node.names if base.startswith("palaestra")
            ]
    return names


def import_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the modules of the first unit that import it."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    known = {module_name(p) for p in ROOT.rglob("*.py")}
    for path in ROOT.rglob("*.py"):
        source = module_name(path)
        for name in runtime_imports(path):
            if name.split(".")[0] != "palaestra" or name not in known:
                continue
            if unit_of(name) != unit_of(source):
                graph[unit_of(source)][unit_of(name)].add(source)
    return graph


def third_party_imports(unit: str, at_import: bool = False) -> dict[str, set[str]]:
    """Top-level names of outside modules imported by ``unit``'s modules -> importing modules."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        source = module_name(path)
        if unit_of(source) == unit:
            for name in runtime_imports(path, at_import):
                found[name.split(".")[0]].add(source)
    return found


def test_units_import_each_other_without_a_circle():
    graph = import_graph()
    cycles = []

    def visit(unit: str, trail: list[str]) -> None:
        for target in graph.get(unit, {}):
            if target in trail:
                cycles.append(trail[trail.index(target) :] + [target])
            elif len(trail) < 12:
                visit(target, trail + [target])

    for unit in list(graph):
        visit(unit, [unit])
    assert not cycles, "import circles: " + "; ".join(
        " -> ".join(cycle) for cycle in sorted({tuple(c) for c in cycles})
    )


@pytest.mark.parametrize(
    "unit, forbidden",
    [
        ("algo", {"runs", "models", "data", "rollout", "train", "serve", "checkpoints", "launch"}),
        ("rollout", {"train", "backends", "launch", "serve", "dashboard"}),
        ("train", {"serve", "dashboard", "launch", "backends", "cli"}),
        ("serve", {"train", "backends", "dashboard"}),
        ("runs", {"train", "launch", "serve", "dashboard", "backends", "rollout"}),
        ("types", {"*"}),
        ("trackers", {"train", "launch", "serve", "dashboard", "backends", "rollout", "models"}),
    ],
)
def test_a_unit_never_imports_what_its_rules_forbid(unit, forbidden):
    imported = import_graph().get(unit, {})
    broken = {
        target: sorted(sources)
        for target, sources in imported.items()
        if "*" in forbidden or target in forbidden
    }
    assert not broken, f"{unit}/ imports {broken}"


def test_the_dashboard_reads_through_the_run_store_only():
    imported = import_graph().get("dashboard", {})
    assert set(imported) <= {"runs", "home"}, dict(imported)


def test_nothing_imports_the_cli():
    importers = {
        unit: targets["cli"] for unit, targets in import_graph().items() if "cli" in targets
    }
    assert not importers, importers


def test_algo_does_no_io():
    imported = third_party_imports("algo")
    found = {name: sorted(s) for name, s in imported.items() if name in IO_MODULES}
    assert not found, f"algo/ imports I/O modules: {found}"


@pytest.mark.parametrize("unit", ["types", "rewards", "checkpoints", "runs", "recipes", "trackers"])
def test_light_units_load_no_torch_when_imported(unit):
    found = third_party_imports(unit, at_import=True)
    assert "torch" not in found, f"{unit} imports torch in {sorted(found['torch'])}"
