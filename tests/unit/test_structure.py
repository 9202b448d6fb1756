"""The package's import rules, read from the source: every ``import`` of every module, those
inside functions included (only ``if TYPE_CHECKING:`` blocks are left out: they never run).

No circle among modules or among units (folders and top-level modules), except through the
lazy edges listed in ``LAZY_EDGES_ALLOWED``, each with its reason; what a module imports when
it is imported never closes a circle. Then the architecture's rules: which unit may not
import which, and which load no torch."""

from __future__ import annotations

import ast
import functools
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


# Edges (importer -> imported module) that close a circle, each run only inside a function and
# allowed for the reason given. Every entry must exist and be lazy, or the test says so.
LAZY_EDGES_ALLOWED = {
    ("palaestra.launch.worker", "palaestra.backends.local"): (
        "the run worker is the top of its process: it builds the run's backend, which asks "
        "launch.checks how to lay out Ray; nothing below the worker imports it"
    ),
    ("palaestra.launch.worker", "palaestra.backends.ray"): (
        "as backends.local: the worker builds the Ray backend, which uses launch.checks"
    ),
    ("palaestra.trackers", "palaestra.trackers.to_trackio"): (
        "a tracker's client opens on demand (its package is an optional extra), and subclasses "
        "the interface the package defines"
    ),
    ("palaestra.trackers", "palaestra.trackers.to_wandb"): "as to_trackio",
    ("palaestra.backends.ray", "palaestra.backends.ray_sharded"): (
        "a run whose learner is sharded starts its rank actors from build_ray; the rank actors "
        "are Ray actors of the same kind (ActorBase, the object-store weight sync)"
    ),
}


def allowed(source: str, target: str) -> bool:
    """Whether ``source`` -> ``target`` is an allowed lazy edge (or the package of one)."""
    return any(a == source and f"{b}.".startswith(f"{target}.") for a, b in LAZY_EDGES_ALLOWED)


def palaestra_imports(path: Path) -> dict[str, bool]:
    """The package's modules ``path`` imports -> whether one of those imports runs when ``path``
    is imported (False: only inside functions). Importing ``a.b.c`` runs the package ``a.b``
    too, so that counts; the top package (``palaestra``, lazy by design) does not."""
    known = known_modules()
    at_import = set(runtime_imports(path, at_import=True))
    found: dict[str, bool] = {}
    for name in runtime_imports(path):
        parts = name.split(".")
        for end in range(2, len(parts) + 1):
            target = ".".join(parts[:end])
            # A module's own packages are loaded before it, so importing them runs nothing.
            if target in known and not f"{module_name(path)}.".startswith(f"{target}."):
                found[target] = found.get(target, False) or name in at_import
    return found


@functools.cache
def known_modules() -> set[str]:
    return {module_name(p) for p in ROOT.rglob("*.py")}


@functools.cache
def module_graph() -> dict[str, dict[str, bool]]:
    """module -> imported module -> whether the import runs at import time."""
    return {module_name(path): palaestra_imports(path) for path in ROOT.rglob("*.py")}


def import_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the modules of the first unit that import it."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for source, targets in module_graph().items():
        for target in targets:
            if unit_of(target) != unit_of(source):
                graph[unit_of(source)][unit_of(target)].add(source)
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


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one node (each holds a circle),
    found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe(part: list[str], graph: dict[str, set[str]], lazy: set[tuple[str, str]]) -> str:
    edges = [
        f"{a} -> {b}{' (in a function)' if (a, b) in lazy else ''}"
        for a in part
        for b in sorted(graph.get(a, ()))
        if b in part
    ]
    return "{" + ", ".join(edges) + "}"


def test_modules_import_each_other_without_a_circle():
    """No circle among modules, counting imports inside functions too, but for the allowed
    lazy edges. A circle of imports at import time is never allowed."""
    modules = module_graph()
    lazy = {(a, b) for a, targets in modules.items() for b, now in targets.items() if not now}
    graph = {
        a: {b for b in targets if not (allowed(a, b) and not targets[b])}
        for a, targets in modules.items()
    }
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(describe(p, graph, lazy) for p in found)


def test_the_allowed_circles_are_lazy_edges_that_exist():
    modules = module_graph()
    stale = [edge for edge in LAZY_EDGES_ALLOWED if edge[1] not in modules.get(edge[0], {})]
    eager = [edge for edge in LAZY_EDGES_ALLOWED if modules.get(edge[0], {}).get(edge[1])]
    assert not stale, f"allowed edges no module has any more: {stale}"
    assert not eager, f"allowed edges imported at import time (never allowed): {eager}"


def test_units_import_each_other_without_a_circle():
    """No circle among units (folders and top-level modules) but through the allowed edges."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, targets in module_graph().items():
        for target, now in targets.items():
            if unit_of(target) != unit_of(source) and (now or not allowed(source, target)):
                graph[unit_of(source)].add(unit_of(target))
    found = circles(graph)
    assert not found, "unit circles: " + "; ".join(describe(p, graph, set()) for p in found)


@pytest.mark.parametrize(
    "unit, forbidden",
    [
        (
            "algo",
            {"runs", "models", "data", "rollout", "engine", "train", "serve", "checkpoints"}
            | {"launch", "backends"},
        ),
        ("engine", {"rollout", "train", "backends", "launch", "serve", "dashboard", "runs"}),
        ("rollout", {"train", "backends", "launch", "serve", "dashboard"}),
        ("train", {"serve", "dashboard", "launch", "backends", "cli"}),
        ("serve", {"train", "backends", "dashboard"}),
        ("runs", {"train", "launch", "serve", "dashboard", "backends", "rollout"}),
        ("types", {"*"}),
        ("calls", {"*"}),
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


@pytest.mark.parametrize(
    "unit", ["types", "calls", "rewards", "checkpoints", "runs", "recipes", "trackers"]
)
def test_light_units_load_no_torch_when_imported(unit):
    found = third_party_imports(unit, at_import=True)
    assert "torch" not in found, f"{unit} imports torch in {sorted(found['torch'])}"


def test_the_engine_interface_loads_no_torch_when_imported():
    """The sampler and the server name requests through ``palaestra.engine``; importing it must
    not load an engine (torch)."""
    path = ROOT / "engine" / "__init__.py"
    outside = {name.split(".")[0] for name in runtime_imports(path, at_import=True)}
    inside = [name for name, now in palaestra_imports(path).items() if now]
    assert "torch" not in outside
    assert inside == ["palaestra.types"], inside
