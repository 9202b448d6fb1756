"""Runs compared side by side and groups of runs (sweeps), through the store and the dashboard's
JSON: every number the same as the runs' metrics.jsonl (labels: unit/test_compare_labels.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from palaestra.dashboard.app import create_app
from palaestra.runs.compare import compare_runs
from palaestra.runs.directory import read_jsonl
from tests.support.sweep_group import GRID, LABELS, TRAINED, make_group


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("compare") / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(home))
        made = make_group(home, tiny_model_dir)
    return made | {"home": home, "client": TestClient(create_app(home))}


def metrics_file(home: Path, run_id: str) -> list[dict]:
    return read_jsonl(home / "runs" / run_id / "metrics.jsonl")


def test_compare_runs_gives_each_runs_metrics_file_and_label(sweep):
    home, (v1, v2, v3) = sweep["home"], sweep["run_ids"]
    runs = compare_runs([v1, v2, v3, v1], home)
    assert [r["run_id"] for r in runs] == [v1, v2, v3]  # a repeated id once
    assert [r["label"] for r in runs] == LABELS
    for run in runs:
        assert run["state"] == "completed"
        assert run["metrics"] == metrics_file(home, run["run_id"])
        assert [row["step"] for row in run["metrics"]] == [1, 2]
        assert all("eval_reward_mean" in row for row in run["metrics"])
    with pytest.raises(KeyError, match="no-such-run"):
        compare_runs([v1, "no-such-run"], home)


def test_group_api_lists_the_group_and_its_variants_rewards(sweep):
    client, home, run_ids = sweep["client"], sweep["home"], sweep["run_ids"]
    (summary,) = client.get("/api/groups").json()
    assert summary["group_id"] == sweep["group_id"] and summary["name"] == "lr-sweep"
    assert summary["state"] == "completed" and summary["states"] == {"completed": 3}
    assert summary["variants"] == 3 and summary["skipped"] == 1
    detail = client.get(f"/api/groups/{sweep['group_id']}").json()
    assert detail["state"] == "completed" and detail["grid"] == GRID
    assert [v["run_id"] for v in detail["variants"]] == run_ids
    best_of_all = None
    for variant, (lr, n) in zip(detail["variants"], TRAINED, strict=True):
        rewards = [row["reward_mean"] for row in metrics_file(home, variant["run_id"])]
        assert len(rewards) == 2 and rewards[0] > rewards[1]  # so last and best differ
        assert variant["overrides"] == {"recipe.lr": lr, "recipe.n_samples_per_prompt": n}
        assert variant["final_reward"] == rewards[-1]
        assert variant["best_reward"] == max(rewards)
        assert (variant["state"], variant["step"], variant["total_steps"]) == ("completed", 2, 2)
        if best_of_all is None or max(rewards) > best_of_all[1]:
            best_of_all = (variant["run_id"], max(rewards))
    assert (summary["best_run_id"], summary["best_reward"]) == best_of_all


def test_compare_api_takes_a_list_or_repeated_runs_and_labels_them(sweep):
    client, home, (v1, v2, v3) = sweep["client"], sweep["home"], sweep["run_ids"]
    listed = client.get("/api/compare", params={"runs": f"{v1},{v3}"})
    assert listed.status_code == 200 and listed.headers["cache-control"] == "no-store"
    # Of these two, only lr differs (n is 2 in both).
    assert [(r["run_id"], r["label"]) for r in listed.json()] == [
        (v1, "recipe.lr=0.01"),
        (v3, "recipe.lr=0.001"),
    ]
    repeated = client.get("/api/compare", params=[("run", v2), ("run", v1)]).json()
    assert [(r["run_id"], r["label"]) for r in repeated] == [
        (v2, "recipe.n_samples_per_prompt=4"),
        (v1, "recipe.n_samples_per_prompt=2"),
    ]
    assert all(r["metrics"] == metrics_file(home, r["run_id"]) for r in repeated)
    # A variant against a run outside the group: every trained-with field that differs.
    mixed = client.get("/api/compare", params={"runs": f"{sweep['outside']},{v2}"}).json()
    assert [r["label"] for r in mixed] == [
        "eval_dataset=null, recipe.lr=0.005, recipe.eval_interval=null, name=baseline",
        "eval_dataset={…}, recipe.lr=0.01, recipe.eval_interval=1, name=lr-sweep-v2",
    ]
    assert client.get("/api/compare").json() == []


def test_unknown_groups_and_runs_are_404_naming_them(sweep):
    client, (v1, *_) = sweep["client"], sweep["run_ids"]
    response = client.get("/api/groups/no-such-group")
    assert response.status_code == 404 and "no-such-group" in response.json()["detail"]
    assert client.get("/api/groups/..").status_code == 404
    response = client.get("/api/compare", params={"runs": f"{v1},no-such-run"})
    assert response.status_code == 404 and "no-such-run" in response.json()["detail"]
    assert client.get("/api/compare", params={"runs": "../groups"}).status_code == 404


def test_group_and_compare_pages_are_the_page_and_read_only(sweep):
    client = sweep["client"]
    for path in (f"/groups/{sweep['group_id']}", f"/compare?runs={sweep['run_ids'][0]}"):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/static/app.js">' in page.text
    assert client.post("/api/compare").status_code == 405
    assert client.post(f"/api/groups/{sweep['group_id']}").status_code == 405
    assert client.delete(f"/api/groups/{sweep['group_id']}").status_code == 405
