"""The test suite's own layout: every test module sits in a tier folder, no test module imports
another (what they share lives in tests/support), and no two share a file name (the tier
folders are not packages, so pytest imports each test module by its bare name)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "ray", "vllm", "gpu")


def modules_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("test_*.py") if "support" not in p.parts)


def imported_names(path: Path) -> list[str]:
    """Every module name ``path`` imports, at its top or inside functions, absolute or not."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            # ``from . import test_x`` or ``from faults import test_x`` names a module too.
            dot = "" if base.endswith(".") else "."
            names += [base] + [f"{base}{dot}{a.name}" for a in node.names if a.name[:5] == "test_"]
    return names


def imports_of_test_modules(root: Path) -> list[str]:
    """One line per import of a test module (or conftest) by a test or support module."""
    modules = {p.stem for p in modules_under(root)} | {"conftest"}
    found = []
    for path in modules_under(root) + sorted((root / "support").rglob("*.py")):
        for name in imported_names(path):
            parts = name.lstrip(".").split(".")
            if parts[0] == "tests" and len(parts) > 1 and parts[1] != "support":
                found.append(f"{path.relative_to(root)} imports {name}")
            elif any(part in modules for part in parts):
                found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_no_test_module_imports_another():
    found = imports_of_test_modules(TESTS)
    assert found == [], "move what they share to tests/support/: " + "; ".join(found)


def test_the_check_finds_an_import_of_a_test_module(tmp_path):
    # A tree with four offending imports, written by hand, and one allowed import of tests.support.
    (tmp_path / "unit").mkdir()
    (tmp_path / "support").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text("from tests.support.tiny_runs import wait_for\n")
    (tmp_path / "unit" / "test_b.py").write_text(
        "import test_a\n\ndef test_x():\n    from conftest import build_tokenizer\n"
    )
    (tmp_path / "support" / "helpers.py").write_text("from tests.unit.test_a import wait_for\n")
    (tmp_path / "unit" / "test_c.py").write_text("from . import test_a\n")
    assert imports_of_test_modules(tmp_path) == [
        "unit/test_b.py imports test_a",
        "unit/test_b.py imports conftest",
        "unit/test_c.py imports .test_a",
        "support/helpers.py imports tests.unit.test_a",
    ]


def test_every_test_module_is_in_a_tier_folder():
    outside = [
        str(p.relative_to(TESTS))
        for p in modules_under(TESTS)
        if p.relative_to(TESTS).parts[0] not in TIERS
    ]
    assert outside == [], f"put these under one of tests/{{{','.join(TIERS)}}}/: {outside}"


def test_no_two_test_modules_share_a_name():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in modules_under(TESTS):
        if not (path.parent / "__init__.py").exists():  # a package's modules have long names
            by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert shared == {}, f"pytest imports these by the same name: {shared}"
