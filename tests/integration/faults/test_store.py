"""Two trainings at the same moment on one store: two processes continue the same checkpoint at
once while this one lists the runs (the store and the dashboard). Each run gets its own id and
files, the checkpoint they share is only read, and no listing fails or shows half a record."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fastapi.testclient import TestClient

from palaestra.runs import records
from palaestra.runs.directory import STATES
from palaestra.runs.registry import list_run_ids, open_run
from tests.support.tiny_runs import tiny_config, wait_for, write_topics

REPO = Path(__file__).resolve().parents[3]

# Each process builds its config, says it is ready, waits for the go file, then trains.
CHILD = """
import sys, time
from pathlib import Path
from tests.support.tiny_runs import tiny_config
model, data, checkpoint, ready, go = sys.argv[1:]
config = tiny_config(Path(model), Path(data), num_rollout=2)
config = config.model_copy(update={"checkpoint": Path(checkpoint)})
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.002)
print("run:", config.train().training_run_id, flush=True)
"""


def digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_two_runs_continue_one_checkpoint_at_once_while_listed(home, tmp_path, tiny_model_dir):
    from palaestra.dashboard.app import create_app

    data = write_topics(tmp_path / "topics.jsonl")
    source = tiny_config(tiny_model_dir, data, num_rollout=1).train()
    checkpoint = source.checkpoints()[-1].path
    before, source_files = digest(checkpoint), digest(source.path)

    # One thread each: two trainings and this loop share a small machine without spinning.
    path = os.pathsep.join([str(REPO), *sys.path])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    go = tmp_path / "go"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tiny_model_dir), str(data), str(checkpoint),
             str(tmp_path / f"ready-{n}"), str(go)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for n in range(2)
    ]  # fmt: skip
    try:
        ready = [tmp_path / f"ready-{n}" for n in range(2)]
        # Until both are ready, or one has died (its output is shown below).
        wait_for(
            lambda: all(r.exists() for r in ready) or any(c.poll() is not None for c in children),
            120,
            "both trainings to be ready",
        )
        go.touch()
        client = TestClient(create_app())
        listings, failures = 0, []
        while any(child.poll() is None for child in children):
            try:
                summaries = records.list_runs()
                response = client.get("/api/runs")
                assert response.status_code == 200, response.text
                for summary in [*summaries, *response.json()]:
                    assert summary["state"] in STATES, summary
                    assert summary["model"] == "tiny", summary  # config.json read whole
                    assert summary["run_id"] in os.listdir(home / "runs")
                listings += 1
            except Exception as error:  # collected: every failing listing is reported
                failures.append(repr(error))
            time.sleep(0.05)
        outputs = [child.communicate(timeout=60)[0] for child in children]
    finally:
        for child in children:
            child.kill()
    assert [child.returncode for child in children] == [0, 0], outputs
    assert failures == [] and listings > 0

    run_ids = [output.split("run: ")[-1].split()[0] for output in outputs]
    assert len(set(run_ids)) == 2
    assert set(list_run_ids()) == {source.training_run_id, *run_ids}
    for run_id in run_ids:
        run = open_run(run_id)
        status = run.read_status()
        assert (status["state"], status["first_step"], status["step"]) == ("completed", 1, 3)
        config = run.config()
        assert (config["run_id"], config["checkpoint"]) == (run_id, str(checkpoint))
        assert [row["step"] for row in run.metrics()] == [2, 3]
        assert {row["step"] for row in run.samples()} == {2, 3}
        [(step, saved)] = run.checkpoint_paths()
        assert step == 3 and saved.parent.parent == run.path
        assert json.loads((saved / "trainer_state.json").read_text())["run_id"] == run_id
        assert json.loads((saved / "palaestra.json").read_text())["run_id"] == run_id
    assert digest(checkpoint) == before
    assert digest(source.path) == source_files
