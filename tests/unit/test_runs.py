"""The run directory on its own: status inference, locked updates, log files, checkpoint listing."""

import json
import os

import pytest

from palaestra.checkpoints import TRAINER_STATE_FILE
from palaestra.runs.directory import RunDirectory, read_jsonl
from palaestra.runs.liveness import process_start_time


@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run-1"
    path.mkdir()
    return RunDirectory(path)


def test_running_with_a_live_pid_reads_as_running(run):
    run.update_status(state="running", pid=os.getpid(), pid_start=process_start_time(os.getpid()))
    assert run.read_status()["state"] == "running"


def test_a_reused_pid_does_not_keep_a_dead_run_alive(run):
    # Our own pid, but a start time that is not ours: the process that wrote it is gone.
    run.update_status(
        state="running", pid=os.getpid(), pid_start=process_start_time(os.getpid()) - 1
    )
    status = run.read_status()
    assert status["state"] == "failed"
    assert "exited without reporting" in status["error"]


def test_compare_and_set_refuses_the_wrong_state(run):
    run.update_status(state="completed")
    with pytest.raises(ValueError, match="is completed, not failed or stopped"):
        run.update_status(expect=("failed", "stopped"), state="pending")
    assert json.loads((run.path / "status.json").read_text())["state"] == "completed"


def test_a_line_cut_short_by_a_crash_is_skipped(run):
    (run.path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_jsonl(run.path / "metrics.jsonl") == [{"step": 1}, {"step": 2}]
    run.truncate_after_step("metrics.jsonl", 1)
    assert (run.path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_only_complete_checkpoints_are_listed(run):
    for name in ("step_000002", "step_000010", ".step_000011-x7", "step_000012", "notes"):
        (run.checkpoints_dir / name).mkdir(parents=True)
    for name in ("step_000002", "step_000010", ".step_000011-x7"):
        (run.checkpoints_dir / name / TRAINER_STATE_FILE).write_bytes(b"")
    # step_000012 has no trainer state (not ours, or emptied by hand): not a checkpoint.
    assert [step for step, _ in run.checkpoint_paths()] == [2, 10]


# The store's other records and readers --------------------------------------------------------


def test_save_eval_writes_a_new_id_first_and_lists_without_rows(tmp_path):
    from palaestra.runs.evals import list_evals, read_eval, save_eval

    eval_id, path = save_eval({"id": "ignored", "mean": 0.5, "rows": [{"score": 0.5}]}, tmp_path)
    assert path == tmp_path / "evals" / f"{eval_id}.json"
    assert eval_id.startswith("eval-") and len(eval_id.split("-")[-1]) == 6
    assert list(json.loads(path.read_text())) == ["id", "mean", "rows"]
    assert list_evals(tmp_path) == [{"id": eval_id, "mean": 0.5}]
    assert read_eval(eval_id, tmp_path)["rows"] == [{"score": 0.5}]
    with pytest.raises(KeyError, match="no eval '../evals'"):
        read_eval("../evals", tmp_path)


def test_endpoint_records_list_live_servers_with_safe_fields_only(tmp_path):
    from palaestra.runs.endpoints import endpoint_files, list_endpoints, read_records

    live = endpoint_files("live", tmp_path)
    live.write({"name": "live", "pid": os.getpid(), "pid_start": process_start_time(os.getpid())})
    live.update(url="http://127.0.0.1:1", api_key="never-shown")
    live.write_key("secret")
    assert oct(live.key.stat().st_mode)[-3:] == "600" and live.read_key() == "secret"
    dead = endpoint_files("dead", tmp_path)
    dead.write({"name": "dead", "pid": os.getpid(), "pid_start": 1})
    (shown,) = list_endpoints(tmp_path)
    assert shown["name"] == "live" and shown["url"] == "http://127.0.0.1:1" and shown["running"]
    assert "api_key" not in shown and "pid_start" not in shown
    assert [r["name"] for r in read_records(tmp_path, running_only=False)] == ["live", "dead"]
    live.remove()
    assert not live.record.exists() and not live.key.exists()


def test_last_lines_and_new_lines_share_one_offset(tmp_path):
    from palaestra.runs.logs import last_lines, new_lines

    log = tmp_path / "train.log"
    assert last_lines(log, 5) == ([], None)
    log.write_text("one\ntwo\nthree\nhalf")
    assert last_lines(log, 2) == (["three", "half"], len("one\ntwo\nthree\nhalf"))
    shown, offset = last_lines(log, 2, partial=False)
    assert shown == ["two", "three"] and offset == len("one\ntwo\nthree\n")
    assert new_lines(log, offset) == ([], offset)  # "half" waits for its newline
    with open(log, "a") as handle:
        handle.write(" done\nnext\n")
    assert new_lines(log, offset) == (["half done", "next"], log.stat().st_size)


def test_step_line_is_the_training_process_line_and_is_recognised():
    from palaestra.runs.progress import is_step_line, step_line

    metrics = {
        "step": 3,
        "reward_mean": 1.2,
        "reward_std": 0.3,
        "loss": 0.0123,
        "response_length_mean": 20.2,
        "dropped_groups": 1,
        "step_s": 4.21,
    }
    line = step_line(metrics, 10, "/runs/x/checkpoints/step_000003")
    assert line == (
        "step 3/10  reward +1.20 ± 0.30  loss +0.0123  len 20  dropped 1  4.2 s  saved step_000003"
    )
    assert step_line({"step": 1, "step_s": 1.0}, 2) == "step 1/2  loss +nan  tokens 0  1.0 s"
    dropped = {"step": 4, "reward_mean": -10.0, "reward_std": 0.0, "response_length_mean": 23.4}
    dropped |= {"dropped_groups": 4, "updates": 0, "step_s": 1.46}
    assert step_line(dropped, 10) == (
        "step 4/10  reward -10.00 ± 0.00  no update  len 23  dropped 4  1.5 s"
    )
    assert is_step_line(line) and not is_step_line("stepping 3/10 ")


def test_the_store_imports_nothing_that_controls_or_trains():
    """Every import in runs/, function-level ones included: only the store's own modules and
    light shared ones (no launch/, serve/, train/, dashboard/, cli, torch)."""
    import ast
    from pathlib import Path

    import palaestra.runs

    allowed = ("palaestra.runs", "palaestra.atomic", "palaestra.home", "palaestra.checkpoints")
    for path in Path(palaestra.runs.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in ("palaestra", "torch", "transformers"):
                    assert name.startswith(allowed), f"{path.name} imports {name}"
