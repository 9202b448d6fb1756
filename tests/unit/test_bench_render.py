"""bench/render.py: result files in, the docs' and the README's tables out.

Fake result files (written by bench/results.py's own atomic writer) on two CPU kinds: the
latest run of each kind fills the docs' table, the latest overall the README's row, every run
the history; smoke results are left out; a file without its markers is named in the error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.bench import bench_scripts

AVX2 = {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False}
AMX = {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True}


@pytest.fixture
def bench_modules(monkeypatch):
    """bench/render.py and bench/results.py, imported as the scripts import each other."""
    with bench_scripts(monkeypatch, "render", "results") as modules:
        yield modules


def fake(time: str, commit: str, cpu: str, flags: dict, step_s: float, smoke=False) -> dict:
    return {
        "format": 1,
        "bench": "grpo_step",
        "time_utc": time,
        "commit": commit * 6,
        "commit_short": commit,
        "dirty": False,
        "command": "python bench/grpo_step.py --steps 3",
        "smoke": smoke,
        "machine": {"cpu_model": cpu, "cpu_flags": flags, "cpu_kind": "ignored by render"},
        "matmul_gflops": {"float32": 199.4, "bfloat16": 423.0},
        "torch": "2.13.0",
        "headline": {"step s": step_s, "TRL / palaestra": 2.75},
        "figures": {},
    }


@pytest.fixture
def files(tmp_path, bench_modules):
    _, results = bench_modules
    folder = tmp_path / "results"
    for record in (
        fake("2026-12-01T10:00:00Z", "aaaaaaa", "EPYC old", AVX2, 20.0),
        fake("2026-12-03T10:00:00Z", "bbbbbbb", "EPYC new", AVX2, 18.5),
        fake("2026-12-02T10:00:00Z", "ccccccc", "Xeon", AMX, 14.21),
        fake("2026-12-04T10:00:00Z", "ddddddd", "Xeon", AMX, 1.0, smoke=True),
    ):
        results.write_record(record, folder)
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    docs.write_text(
        "# Benchmarks\n\n<!-- benchmarks:start -->\nold\n<!-- benchmarks:end -->\ntail\n"
    )
    readme.write_text("# palaestra\n\n<!-- results:start -->\n<!-- results:end -->\nend\n")
    return folder, docs, readme


def argv(folder: Path, docs: Path, readme: Path, *extra: str) -> list[str]:
    return ["--results", str(folder), "--docs", str(docs), "--readme", str(readme), *extra]


def rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]


def test_the_latest_run_of_each_cpu_kind_and_every_run(files, bench_modules):
    render, _ = bench_modules
    folder, docs, readme = files
    assert render.main(argv(folder, docs, readme)) == 0
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n<!-- benchmarks:start -->\n### grpo_step")
    assert text.endswith("<!-- benchmarks:end -->\ntail\n")
    command = "`python bench/grpo_step.py --steps 3`"
    peak = "f32 199, bf16 423"  # 199.4 -> 199 (3 significant figures), 423.0 -> 423
    flags = "avx2, avx512f, avx512_bf16, amx_bf16"
    assert rows(text) == [
        "| CPU kind | date | commit | CPU | flags | matmul peak GFLOP/s | step s "
        "| TRL / palaestra | command |",
        # The AVX2 run of Dec 3 wins over Dec 1's; the AMX kind has one (smoke left out).
        f"| AVX2-only | 2026-12-03 | bbbbbbb | EPYC new | avx2 | {peak} | 18.5 | 2.75 "
        f"| {command} |",
        f"| AMX | 2026-12-02 | ccccccc | Xeon | {flags} | {peak} | 14.2 | 2.75 | {command} |",
        "| time | commit | CPU kind | CPU | matmul peak GFLOP/s | figures |",
        f"| 2026-12-03 10:00:00 UTC | bbbbbbb | AVX2-only | EPYC new | {peak} "
        "| step s 18.5; TRL / palaestra 2.75 |",
        f"| 2026-12-02 10:00:00 UTC | ccccccc | AMX | Xeon | {peak} "
        "| step s 14.2; TRL / palaestra 2.75 |",
        f"| 2026-12-01 10:00:00 UTC | aaaaaaa | AVX2-only | EPYC old | {peak} "
        "| step s 20; TRL / palaestra 2.75 |",
    ]
    # The README: one row per benchmark, its newest run whatever the CPU kind.
    assert rows(readme.read_text()) == [
        "| benchmark | latest figures | date | commit | CPU | matmul peak GFLOP/s |",
        "| `grpo_step` | step s 18.5; TRL / palaestra 2.75 | 2026-12-03 | bbbbbbb "
        f"| EPYC new (AVX2-only: avx2) | {peak} |",
    ]
    assert readme.read_text().endswith("<!-- results:end -->\nend\n")


def test_check_says_whether_the_files_are_up_to_date(files, bench_modules):
    render, _ = bench_modules
    folder, docs, readme = files
    assert render.main(argv(folder, docs, readme, "--check")) == 1
    before = docs.read_text()
    assert "old" in before  # --check wrote nothing
    assert render.main(argv(folder, docs, readme)) == 0
    assert render.main(argv(folder, docs, readme, "--check")) == 0
    # A new run makes them stale again.
    _, results = bench_modules
    results.write_record(fake("2026-12-05T09:00:00Z", "eeeeeee", "Xeon", AMX, 12.0), folder)
    assert render.main(argv(folder, docs, readme, "--check")) == 1


def test_a_file_without_its_markers_is_named(files, bench_modules, capsys):
    render, _ = bench_modules
    folder, docs, readme = files
    readme.write_text("# palaestra\n\nno markers here\n")
    assert render.main(argv(folder, docs, readme)) == 2
    error = capsys.readouterr().err
    assert str(readme) in error and "<!-- results:start -->" in error
    assert "old" in docs.read_text()  # nothing written when one file cannot be rendered


def test_cpu_kinds_from_flags(bench_modules):
    _, results = bench_modules
    assert results.cpu_kind(AVX2) == "AVX2-only"
    assert results.cpu_kind(AMX) == "AMX"
    assert results.cpu_kind(AMX | {"amx_bf16": False}) == "AVX-512 BF16"
    assert results.cpu_kind({}) == "AVX2-only"  # a CPU with none of the flags


def test_a_record_is_written_atomically_where_asked_and_a_smoke_run_writes_nothing(
    tmp_path, bench_modules, monkeypatch
):
    import argparse
    import json
    import re

    _, results = bench_modules
    monkeypatch.setattr(sys, "argv", ["bench/fake.py", "--smoke", "--steps", "1"])
    figures, headline, peaks = {"step_s": [1.5, 2.5]}, {"step s": 2.0}, {"float32": 100.0}

    smoke = argparse.Namespace(smoke=True, results_dir=None)
    assert results.record("fake", smoke, figures, headline, peaks) is None
    assert not (results.RESULTS / "fake").exists()

    asked = argparse.Namespace(smoke=True, results_dir=tmp_path / "out")
    path = results.record("fake", asked, figures, headline, peaks)
    assert path.parent == tmp_path / "out" / "fake"
    assert re.fullmatch(r"\d{8}T\d{6}Z-([0-9a-f]{7}|unknown)\.json", path.name)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    written = json.loads(path.read_text())
    assert written["command"] == "python bench/fake.py --smoke --steps 1"
    assert written["smoke"] is True
    assert (written["figures"], written["headline"]) == (figures, headline)
    assert written["matmul_gflops"] == peaks
    assert path.name.endswith(f"-{written['commit_short']}.json")
    machine = written["machine"]
    assert list(machine["cpu_flags"]) == ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    assert machine["cpu_kind"] == results.cpu_kind(machine["cpu_flags"])
    assert machine["cores"] >= 1 and machine["torch_threads"] >= 1


def test_offpolicy_runs_fill_the_off_policy_page_beside_the_docs(files, bench_modules):
    render, results = bench_modules
    folder, docs, readme = files
    record = fake("2026-12-05T10:00:00Z", "eeeeeee", "Xeon", AMX, 6.0)
    run = {"test_score": -4.25, "three_lines_last5": 0.84, "steps_per_minute": 8.6}
    timing = {"median": {"step_s": 6.4, "train_s": 4.99}}
    record |= {
        "bench": "offpolicy",
        "figures": {
            "backend": "ray",
            "runs": [
                run | timing | {"seed": 42, "max_staleness": 1, "test_score": -10.0},
                run | timing | {"seed": 1, "max_staleness": 0},
            ],
        },
    }
    results.write_record(record, folder)
    assert render.main(argv(folder, docs, readme)) == 0  # no off-policy.md there: left alone
    assert not (docs.parent / "off-policy.md").exists()
    page = docs.parent / "off-policy.md"
    page.write_text("# Off\n<!-- offpolicy:start -->\n<!-- offpolicy:end -->\nend\n")
    assert render.main(argv(folder, docs, readme)) == 0
    assert rows(page.read_text())[1:] == [  # by backend, seed, staleness
        "| ray | 1 | 0 | -4.25 | 84% | 8.6 | 6.4 | 4.99 | 2026-12-05 eeeeeee | AMX |",
        "| ray | 42 | 1 | -10.00 | 84% | 8.6 | 6.4 | 4.99 | 2026-12-05 eeeeeee | AMX |",
    ]
    assert page.read_text().endswith("<!-- offpolicy:end -->\nend\n")
    assert render.main(argv(folder, docs, readme, "--check")) == 0


def test_each_speed_goal_against_the_latest_run_of_its_bench_per_cpu_kind(files, bench_modules):
    render, results = bench_modules
    folder, docs, readme = files
    step = fake("2026-12-05T10:00:00Z", "fffffff", "Xeon", AMX, 6.0)
    step["headline"] = {"palaestra step / floor": 1.4, "trl / palaestra": 2.84}
    # 1000 GFLOP at 200 GFLOP/s: a floor of 5 s, the rollout's 1 s of it (2 x 1e8 x 1000).
    ours = {"peak_rss_mib": 4286.0, "gflops_mean": 1000.0, "floor_s_mean": 5.0}
    ours |= {"step_s_mean": 7.0, "step_over_floor": 1.4, "rollout_s_mean": 3.0}
    ours |= {"train_s_mean": 4.0, "generated_tokens_mean": 1000}
    theirs = {"step_s_mean": 19.88, "step_over_floor": 3.98}
    step["figures"] = {
        "sides": {"palaestra": ours, "trl": theirs},
        "machine": {"model_shape": {"matmul_params": 100_000_000}},
    }
    results.write_record(step, folder)
    slow = fake("2026-12-05T13:00:00Z", "iiiiiii", "EPYC", AVX2, 0.0)
    slow["bench"] = "tutorial"
    slow["headline"] = {"minutes": 6.0, "points learned": 4.5, "three-line share": 0.9}
    split = {"steps": 30, "rollout s": 90.0, "update s": 180.0, "saves s": 12.0}
    split |= {"steps s": 300.0, "outside the steps s": 60.0}
    slow["figures"] = {"runs": [split | {"seconds": 360.0}]}
    results.write_record(slow, folder)
    native = fake("2026-12-05T11:00:00Z", "kkkkkkk", "Xeon", AMX, 0.0)
    native["bench"] = "generation"
    native["headline"] = {"engine-fp32 tokens/s": 120.0, "vllm-float32 tokens/s": 100.0}
    native["headline"] |= {"engine-bf16 tokens/s": 169.0, "vllm-bfloat16 tokens/s": 214.0}
    native["figures"] = {"results": [{"mode": "engine-bf16", "concurrency": 8}]}
    results.write_record(native, folder)
    decode = fake("2026-12-05T09:00:00Z", "jjjjjjj", "EPYC", AVX2, 0.0)
    decode["bench"] = "decode_pass"
    decode["headline"] = {"rows": 8, "pass ms": 67.8, "products ms": 48.3, "rest ms": 19.2}
    decode["headline"] |= {"products GB/s": 11.1, "memory GB/s": 38.6}
    results.write_record(decode, folder)
    tutorial = fake("2026-12-05T12:00:00Z", "hhhhhhh", "Xeon", AMX, 0.0)
    tutorial["bench"] = "tutorial"
    tutorial["headline"] = {"minutes": 4.5, "points learned": 3.2, "three-line share": 0.8}
    scores = {"base model score": -9.0, "after 30 steps score": -5.8}
    scores |= {"after 30 steps three_lines": 4, "after 30 steps replies": 5}
    tutorial["figures"] = {"runs": [scores]}
    results.write_record(tutorial, folder)
    generation = fake("2026-12-05T11:00:00Z", "ggggggg", "EPYC", AVX2, 0.0)
    generation["bench"] = "generation"
    generation["headline"] = {"engine-fp32 tokens/s": 141.8, "vllm-float32 tokens/s": 165.9}
    generation["figures"] = {"results": [{"mode": "engine-fp32", "concurrency": 8}]}
    results.write_record(generation, folder)
    docs.write_text(docs.read_text() + "\n## Goals\n<!-- goals:start -->\n<!-- goals:end -->\n")

    assert render.main(argv(folder, docs, readme)) == 0
    goals = docs.read_text().split("<!-- goals:start -->")[1].split("<!-- goals:end -->")[0]
    table = {tuple(row.split(" | ")[:2]): row for row in rows(goals)}
    run = "`grpo_step` 2026-12-05 fffffff"
    step_row = table[("| GRPO step / its floor", "AMX")]
    assert step_row.endswith(f"| at most 1.5 | 1.4 | yes | {run} |")
    assert table[("| GRPO step / its floor", "AVX2-only")].endswith("| not measured |  |  |")
    assert table[("| TRL float32 step / palaestra step", "AMX")].endswith(
        f"| at least 4 | 2.84 | no | {run} |"
    )
    assert table[("| torch engine / vLLM CPU, float32", "AVX2-only")].endswith(
        "| at least 1 | 0.85 | no | `generation` 2026-12-05 ggggggg |"
    )
    # The memory goal reads palaestra's side of the step's figures.
    assert table[("| GRPO step, palaestra's peak resident MiB", "AMX")].endswith(
        f"| at most 4,140 | 4,286 | no | {run} |"
    )
    tutorial_run = "`tutorial` 2026-12-05 hhhhhhh"
    assert table[("| tutorial (`make haiku`), minutes", "AMX")].endswith(
        f"| at most 5 | 4.5 | yes | {tutorial_run} |"
    )
    assert table[("| tutorial, points learned over the base", "AMX")].endswith(
        f"| at least 4 | 3.2 | no | {tutorial_run} |"
    )
    assert table[("| tutorial, three-line replies after 30 steps", "AMX")].endswith(
        f"| at least 0.8 | 0.8 | yes | {tutorial_run} |"
    )
    assert table[("| tutorial, points learned over the base", "AVX-512 BF16")].endswith(
        "| not measured |  |  |"
    )
    # Under the table, what is left of each goal not met, from the same runs.
    left = goals.split("What is left where a goal is not met, from the same runs:")[1]
    assert left.strip().splitlines() == [
        "- torch engine / vLLM CPU, float32, AVX2-only (0.85): a float32 decode pass of 8 "
        "rows (`decode_pass` 2026-12-05): products 48 ms (reading the weights at 11 GB/s "
        "where this machine reads memory at 39), the rest 19 ms.",
        "- torch engine / vLLM CPU, bfloat16, AMX (0.79): no `decode_pass --dtype bfloat16` "
        "run of 8 rows on this CPU kind splits the pass.",
        "- TRL float32 step / palaestra step, AMX (2.84): TRL 19.9 s, 3.98x its floor; "
        "palaestra 7.0 s, 1.40x its floor; at its floor palaestra would make it 3.98.",
        "- tutorial (`make haiku`), minutes, AVX2-only (6): 30 steps 5.00 min (rollouts 1.50, "
        "updates 3.00, saves 0.20); outside the steps 1.00 min (the endpoints' and training "
        "runs' starts, the evaluations).",
        "- tutorial, points learned over the base, AMX (3.2): run 1: -9.00 -> -5.80, 4 of 5 "
        "three lines.",
    ]
    # bfloat16 goals stand only where bfloat16 is native.
    assert ("| torch engine / vLLM CPU, bfloat16", "AVX2-only") not in table
    assert ("| TRL bfloat16 step / palaestra step", "AMX") in table
    # The benchmarks' own section is rendered too, and --check agrees afterwards.
    assert "fffffff" in docs.read_text().split("<!-- benchmarks:start -->")[1]
    assert render.main(argv(folder, docs, readme, "--check")) == 0
