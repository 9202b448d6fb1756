"""What must load no torch: ``palaestra --help``, what ``palaestra eval`` (an HTTP client) needs,
a reward module, and a dataset definition. Each case runs in a fresh interpreter with Python's
import-time report on, so a failure names the chain of imports that pulled torch in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch",)


def imported_modules(argv: list[str]) -> list[tuple[int, str]]:
    """(depth, name) of every module ``argv`` imports, in ``-X importtime`` order: a module's
    own imports come before it, one level deeper."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    modules = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        field = line.split("|")[2]
        name = field.strip()
        if name != "imported package":  # the report's header
            modules.append((len(field) - len(field.lstrip()), name))
    return modules


def import_chain(modules: list[tuple[int, str]], target: str) -> list[str]:
    """The chain of imports from the top to ``target`` (empty when it was never imported)."""
    for i, (depth, name) in enumerate(modules):
        if name == target:
            chain = [name]
            for parent_depth, parent in modules[i + 1 :]:
                if parent_depth < depth:
                    chain.append(parent)
                    depth = parent_depth
            return chain[::-1]
    return []


def assert_not_loaded(argv: list[str], heavy: tuple[str, ...] = HEAVY) -> None:
    modules = imported_modules(argv)
    assert modules, "no import-time report: is PYTHONPROFILEIMPORTTIME honoured?"
    chains = {name: import_chain(modules, name) for name in heavy}
    loaded = {name: " -> ".join(chain) for name, chain in chains.items() if chain}
    assert not loaded, "loaded " + "; ".join(f"{n} via {c}" for n, c in loaded.items())


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_report_names_the_chain() -> None:
    # The mechanism itself: json is imported here, so its chain must be found and named.
    modules = imported_modules(python("import json"))
    assert import_chain(modules, "json.decoder")[:2] == ["json", "json.decoder"]
    assert import_chain(modules, "no.such.module") == []


def test_the_console_script_help() -> None:
    script = Path(sys.executable).parent / "palaestra"
    if not script.exists():
        pytest.skip("the palaestra console script is not installed beside this interpreter")
    assert_not_loaded([str(script), "--help"])


def test_cli_main_help() -> None:
    assert_not_loaded(
        python(
            "from palaestra.cli import main\n"
            "try:\n    main(['--help'])\n"
            "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
        )
    )


@pytest.mark.parametrize(
    "module",
    [
        "palaestra",
        "palaestra.cli",
        "palaestra.evals",
        "palaestra.data",
        "palaestra.rewards",
        "palaestra.rewards.haiku",
        "palaestra.types",
        "palaestra.serve",
        "palaestra.serve.endpoint",
    ],
)
def test_what_palaestra_eval_needs(module: str) -> None:
    assert_not_loaded(python(f"import {module}"))


def test_a_reward_module_and_its_use() -> None:
    assert_not_loaded(
        python(
            "from palaestra.types import Sample\n"
            "from palaestra.rewards import resolve_reward\n"
            "reward = resolve_reward('palaestra.rewards.haiku:haiku_reward')\n"
            "sample = Sample(prompt='p', response='<think>x</think>one line', label=None,"
            " metadata={}, index=0, group_index=0)\n"
            "import asyncio\n"
            "assert asyncio.run(reward(None, sample)) == -10.0\n"
        )
    )


DATASET_DEFINITION = """
from palaestra import HuggingFaceDataset, builtin_dataset


class HaikuDataset(HuggingFaceDataset):
    hf_repo = str(builtin_dataset("haiku"))
    input_column = "keywords"
    output_column = "text"
    prompt_template = "Write a haiku about {input}."


dataset = HaikuDataset(hf_split="train")
"""


def test_a_dataset_definition_loads_neither_torch_nor_datasets() -> None:
    # A whole split needs no slicing, so not even datasets (and pandas) is imported.
    code = DATASET_DEFINITION + (
        "dataset.check_columns()\n"
        "dataset.apply_chat_template = False\n"
        "assert dataset.prepare()[0].text.startswith('Write a haiku about')\n"
    )
    assert_not_loaded(python(code), HEAVY + ("datasets",))


def test_a_sliced_dataset_loads_no_torch() -> None:
    code = DATASET_DEFINITION + "assert len(HaikuDataset(hf_split='train[:10%]').load()) > 10\n"
    assert_not_loaded(python(code))
