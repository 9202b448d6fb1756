"""bench/tutorial.py: the smoke run's edits to the real tutorial script, the summary it reads,
and the memory of a process tree."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench import bench_scripts

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tutorial(monkeypatch):
    with bench_scripts(monkeypatch, "tutorial") as (module,):
        yield module


def test_the_smoke_edits_find_their_text_in_the_real_script(tutorial):
    text = (REPO / "examples" / "haiku.py").read_text()
    smoke = tutorial.smoke_script(text)
    ast.parse(smoke)  # still Python
    assert smoke.count("num_rollout=1,") == 2
    assert "num_rollout=10," not in smoke and "num_rollout=20," not in smoke
    assert smoke.count("rollout_max_response_len=8") == 2
    assert 'hf_split="train[10:11]"' in smoke
    # Nothing but lines holding the listed texts changed.
    before, after = text.splitlines(), smoke.splitlines()
    assert len(before) == len(after)
    changed = [old for old, new in zip(before, after, strict=True) if old != new]
    assert len(changed) == 6
    assert all(any(edit[0] in line for edit in tutorial.SMOKE_EDITS) for line in changed)


def test_a_smoke_edit_that_no_longer_matches_names_its_text(tutorial):
    text = (
        (REPO / "examples" / "haiku.py").read_text().replace("num_rollout=20,", "num_rollout=30,")
    )
    with pytest.raises(ValueError, match=r"'num_rollout=20,' appears 0 times, the smoke run"):
        tutorial.smoke_script(text)


OUTPUT = """\
running new checkpoint evaluation...
average score: -5.6

average score, base model:     -11.40   1 of 5 three lines
average score, after 10 steps: -9.00   3 of 5 three lines
average score, after 30 steps: -5.60   5 of 5 three lines
wall time: 5.1 min
"""


def test_the_summary_lines_become_figures_and_the_headline_their_mean(tutorial):
    summary = tutorial.parse_summary(OUTPUT)
    assert summary["base model"] == {"score": -11.4, "three_lines": 1, "replies": 5}
    assert summary["after 30 steps"] == {"score": -5.6, "three_lines": 5, "replies": 5}
    run = {"seconds": 300.0, "peak_pss_mib": 3900, "steps s": 240.0, "outside the steps s": 60.0}
    run |= {f"{s} {k}": v for s in summary for k, v in summary[s].items()}
    other = run | {"seconds": 240.0, "after 30 steps three_lines": 3, "peak_pss_mib": 4100}
    other |= {"steps s": 204.0, "outside the steps s": 36.0}
    assert tutorial.headline([run, other]) == {
        "minutes": 4.5,
        "points learned": 5.8,
        "three-line share": 0.8,
        "steps min": 3.7,
        "outside the steps min": 0.8,
        "peak MiB": 4100,
        "runs": 2,
    }


def test_the_steps_of_every_training_run_split_the_wall_time(tutorial, tmp_path):
    def row(step, rollout, update, save):
        # step_s holds its parts and a reward of 0.1 s
        parts = {"rollout_s": rollout, "train_s": update, "weight_sync_s": 0.5, "save_s": save}
        return {"step": step, **parts, "step_s": rollout + update + 0.5 + save + 0.1}

    first, second = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    first.mkdir(parents=True)
    second.mkdir()
    lines = [row(1, 3.0, 7.0, 0.0), row(2, 3.0, 6.0, 4.0)]
    (first / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (second / "metrics.jsonl").write_text(json.dumps(row(3, 2.0, 6.0, 3.0)) + "\n\n")
    (tmp_path / "runs" / "c").mkdir()  # a run that never stepped
    steps = tutorial.step_metrics(tmp_path / "runs")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert tutorial.time_split(steps, 60.0) == {
        "steps": 3,
        "steps s": 35.8,
        "rollout s": 8.0,
        "update s": 19.0,
        "weight sync s": 1.5,
        "saves s": 7.0,
        "outside the steps s": 24.2,
    }


def test_a_missing_summary_line_is_named(tutorial):
    cut = OUTPUT.replace("average score, after 10 steps", "average score after 10 steps")
    with pytest.raises(ValueError, match="no summary line for: after 10 steps"):
        tutorial.parse_summary(cut)


def test_the_memory_of_a_process_tree_counts_its_children_and_shared_pages_once(tutorial):
    if not Path(f"/proc/{os.getpid()}/task").is_dir():
        pytest.skip("no /proc here")
    alone = tutorial.tree_memory_bytes(os.getpid())
    # 200 MiB written, then a forked grandchild that shares those pages and writes none.
    hold = (
        "import os, time; b = bytearray(os.urandom(200 * 2**20))\n"
        "if os.fork() == 0: time.sleep(30)\n"
        "else: time.sleep(0.5); print('ready', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        together = tutorial.tree_memory_bytes(os.getpid())
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert 200 * 2**20 < together - alone < 300 * 2**20  # the shared 200 MiB counted once
    assert tutorial.tree_memory_bytes(child.pid) == 0  # gone: nothing to count
