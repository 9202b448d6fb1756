"""Renders the field tables of docs/recipes.md from ``palaestra.recipes``: one table per concern
of ``Recipe`` (its fields, types, defaults and field docstrings), then what each preset changes.

The tables sit between ``<!-- recipe-fields:start -->`` and ``<!-- recipe-fields:end -->``, so
the page reads the same on GitHub as on the site. Run it after changing a field:

    python docs/gen_recipes.py            # rewrite docs/recipes.md in place
    python docs/gen_recipes.py --check    # exit 1 if the page is stale

The concerns come from ``Recipe``'s class docstring (``- Concern: ``field``, ...``); a field it
does not name lands under "Other", so no field is ever left out of the page.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import typing
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

PAGE = Path(__file__).with_name("recipes.md")
START = "<!-- recipe-fields:start -->"
END = "<!-- recipe-fields:end -->"
CONSTRAINTS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def concerns(recipe_class: type) -> list[tuple[str, list[str]]]:
    """``[(concern, [field, ...]), ...]`` in the order the class docstring lists them."""
    doc = inspect.cleandoc(recipe_class.__doc__ or "")
    found: list[tuple[str, list[str]]] = []
    # A bullet runs on over indented lines until the next bullet or the end of the docstring.
    for match in re.finditer(r"^- ([^:\n]+):(.*?)(?=^- |\Z)", doc, flags=re.M | re.S):
        found.append((match.group(1).strip(), re.findall(r"``(\w+)``", match.group(2))))
    return found


def type_name(field: FieldInfo) -> str:
    """The field's type as a reader writes it: ``int`` ≥ 1, one of ``"grpo"``, ``"rloo"``;
    ``str`` or ``None``. No ``|`` inside a code span: a table cell cannot escape it there."""
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        text = "one of " + ", ".join(f'`"{choice}"`' for choice in typing.get_args(annotation))
    else:
        raw = annotation.__name__ if isinstance(annotation, type) else str(annotation)
        raw = re.sub(r"\b(typing|collections\.abc)\.", "", raw)
        text = " or ".join(f"`{part.strip()}`" for part in raw.split("|"))
    for constraint in field.metadata:
        for attribute, sign in CONSTRAINTS.items():
            bound = getattr(constraint, attribute, None)
            if bound is not None:
                text += f" {sign} {bound}"
    return text


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return f"`{field.default_factory()!r}`"
    if field.default is PydanticUndefined:
        return "required"
    if isinstance(field.default, str):  # as the Literal choices are written: "grpo"
        return f'`"{field.default}"`'
    return f"`{field.default!r}`"


def description(field: FieldInfo) -> str:
    """The field docstring on one table line: RST literals as Markdown, list items kept apart."""
    text = inspect.cleandoc(field.description or "")
    text = text.replace("``", "`").replace("|", "\\|")
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        items = re.split(r"^- ", block, flags=re.M)
        head = " ".join(items[0].split())
        tail = ["• " + " ".join(item.split()) for item in items[1:]]
        paragraphs.append("<br>".join(([head] if head else []) + tail))
    return "<br>".join(paragraphs)


def field_tables(recipe_class: type) -> list[str]:
    fields = recipe_class.model_fields
    groups = concerns(recipe_class)
    named = {name for _, names in groups for name in names}
    missing = [name for name in fields if name not in named]
    if missing:
        groups.append(("Other", missing))
    lines = []
    for concern, names in groups:
        lines += [f"### {concern}", "", "| Field | Type | Default | What it does |"]
        lines.append("| --- | --- | --- | --- |")
        for name in names:
            if name not in fields:
                raise ValueError(f"Recipe's docstring names {name!r}, which is not a field")
            field = fields[name]
            lines.append(
                f"| `{name}` | {type_name(field)} | {default_text(field)} | {description(field)} |"
            )
        lines.append("")
    return lines


def preset_table(base: type, presets: list[type]) -> list[str]:
    """One row per field some preset sets differently from ``base``, one column per preset."""
    changed = [
        name
        for name, field in base.model_fields.items()
        if any(p.model_fields[name].default != field.default for p in presets)
    ]
    header = " | ".join(f"`{p.__name__}`" for p in presets)
    lines = [f"| Field | `{base.__name__}` | {header} |"]
    lines.append("| --- | --- |" + " --- |" * len(presets))
    for name in changed:
        cells = [default_text(p.model_fields[name]) for p in presets]
        lines.append(
            f"| `{name}` | {default_text(base.model_fields[name])} | {' | '.join(cells)} |"
        )
    return lines + [""]


def render() -> str:
    """The generated block, markers included."""
    from palaestra import recipes

    presets = [recipes.SmolLM2_135M_Recipe, recipes.Qwen3_4B_Recipe, recipes.Qwen3_5_4B_Recipe]
    lines = [START, "", "<!-- generated by docs/gen_recipes.py; edit the docstrings -->", ""]
    lines += ["## Every field", ""] + field_tables(recipes.Recipe)
    lines += ["## What the presets change", ""] + preset_table(recipes.Recipe, presets)
    return "\n".join(lines + [END])


def updated(page: str) -> str:
    """``page`` with its generated block replaced by a fresh one."""
    if START not in page or END not in page:
        raise ValueError(f"{PAGE} has no {START} ... {END} block to fill")
    before, rest = page.split(START, 1)
    after = rest.split(END, 1)[1]
    return before + render() + after


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args()
    current = PAGE.read_text()
    fresh = updated(current)
    if args.check:
        if fresh != current:
            print(f"{PAGE} is stale: run python docs/gen_recipes.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
