"""The docs stay true: their runnable code blocks run, the README's tutorial is the quickstart's,
the recipe tables are what the generator makes of ``Recipe`` today, and links resolve.

Conventions (docs/development.md): a ```python block on the line after ``<!-- run -->`` is run,
each in a fresh namespace from the repository root with an empty ``PALAESTRA_HOME``; the block
after ``<!-- tutorial -->`` is the tutorial, the same in README.md and docs/quickstart.md.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"```python\n(.*?)\n```", re.S)


def marked_blocks(path: Path, marker: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each python block right after a ``marker`` line in ``path``."""
    lines = path.read_text().splitlines()
    blocks = []
    for number, line in enumerate(lines, start=1):
        if line.strip() != marker:
            continue
        rest = "\n".join(lines[number:])
        match = FENCE.match(rest)
        if match is None:
            raise AssertionError(f"{path.name}:{number}: {marker} is not followed by ```python")
        blocks.append((number, match.group(1)))
    return blocks


def runnable_blocks() -> list[pytest.param]:
    return [
        pytest.param(code, id=f"{path.name}:{line}")
        for path in [README, *PAGES]
        for line, code in marked_blocks(path, "<!-- run -->")
    ]


@pytest.mark.parametrize("code", runnable_blocks())
def test_a_runnable_block_runs(code, home, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(code, "<docs block>", "exec"), {"__name__": "docs_block"})


def test_the_docs_have_runnable_blocks_on_the_pages_that_teach_the_api():
    pages = {param.id.split(":")[0] for param in runnable_blocks()}
    assert {"concepts.md", "recipes.md", "multi-turn.md", "cli.md"} <= pages


def tutorial() -> str:
    (readme_block,) = [code for _, code in marked_blocks(README, "<!-- tutorial -->")]
    return readme_block


def test_the_readme_tutorial_is_the_quickstarts():
    (quickstart_block,) = [
        code for _, code in marked_blocks(DOCS / "quickstart.md", "<!-- tutorial -->")
    ]
    assert tutorial() == quickstart_block


def test_the_tutorial_imports_resolve_and_names_only_real_fields():
    """The tutorial launches training, so it is not run here; what can go stale without running
    it is checked: its imports, the recipe, config and dataset fields it sets."""
    from palaestra import HuggingFaceDataset, Recipe, TrainConfig

    tree = ast.parse(tutorial())
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    assert imports, "the tutorial imports nothing"
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<tutorial>", "exec"), {})

    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    named = {
        "Recipe": (Recipe, [c for c in calls if ast.unparse(c.func).endswith("_Recipe")]),
        "TrainConfig": (TrainConfig, [c for c in calls if ast.unparse(c.func) == "TrainConfig"]),
    }
    for kind, (model, found) in named.items():
        assert found, f"the tutorial builds no {kind}"
        for call in found:
            unknown = {k.arg for k in call.keywords} - set(model.model_fields)
            assert not unknown, f"the tutorial sets {kind} fields that do not exist: {unknown}"
    (dataset,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    attributes = {
        t.id for node in dataset.body if isinstance(node, ast.Assign) for t in node.targets
    }
    assert attributes - set(HuggingFaceDataset.model_fields) == set()


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_recipes", DOCS / "gen_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recipe_page_is_what_the_generator_makes_of_recipe_today():
    generator = load_generator()
    page = (DOCS / "recipes.md").read_text()
    assert generator.updated(page) == page, "docs/recipes.md is stale: python docs/gen_recipes.py"


def test_every_recipe_field_has_a_row_with_its_default():
    from palaestra.recipes import Recipe

    rendered = load_generator().render()
    for name, field in Recipe.model_fields.items():
        value = field.default_factory() if field.default_factory else field.default
        default = f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"
        assert re.search(rf"^\| `{name}` \| [^\n]* \| {re.escape(default)} \|", rendered, re.M), (
            name
        )


def test_a_field_docstring_becomes_one_table_cell():
    from pydantic.fields import FieldInfo

    field = FieldInfo(
        annotation=int,
        description="Pick ``a`` or b:\n\n- ``a``: the first | one.\n- ``b``: the\n  second.",
    )
    # Literals become Markdown code, a pipe is escaped, list items are kept apart by <br> bullets.
    expected = "Pick `a` or b:<br>• `a`: the first \\| one.<br>• `b`: the second."
    assert load_generator().description(field) == expected


def slug(heading: str) -> str:
    """The anchor GitHub and MkDocs give a heading (for the headings these docs use)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target
        assert path.exists(), f"README links to {link}, which does not exist"
        if anchor:
            assert anchor in anchors(path), f"README links to {link}: no such heading"


def test_the_nav_lists_every_page():
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert sorted(nav) == sorted(page.name for page in PAGES)


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    assert text.count(start) == 1 and text.count(end) == 1
    outside = text.split(start)[0] + text.split(end)[1]
    # Dates and commits belong to the rendered results table and the changelog.
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", outside)
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", outside) if re.search(r"[a-f]", w)]
    assert not [w for w in hashes if re.search(r"\d", w)], hashes
    page = (DOCS / "benchmarks.md").read_text()
    assert page.count("<!-- benchmarks:start -->") == page.count("<!-- benchmarks:end -->") == 1
