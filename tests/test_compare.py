"""Runs compared side by side and groups of runs (sweeps), through the store and the dashboard's
JSON: labels worked out by hand, and every number the same as the runs' metrics.jsonl."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from palaestra import TrainConfig
from palaestra.dashboard.app import create_app
from palaestra.runs.compare import compare_runs, differing_fields, run_label
from palaestra.runs.directory import read_jsonl
from palaestra.runs.groups import write_group
from tiny_runs import count_lowercase, gated_reward, tiny_config, write_topics

GRID = {"recipe.lr": [0.01, 0.001], "recipe.n_samples_per_prompt": [2, 4]}
AXES = list(GRID)
TRAINED = [(0.01, 2), (0.01, 4), (0.001, 2)]  # (0.001, 4) is recorded as skipped
GROUP_ID = "lr-sweep-20261204-101500-a1b2c3"
LABELS = [  # of the three variants side by side: both grid fields differ among them
    "recipe.lr=0.01, recipe.n_samples_per_prompt=2",
    "recipe.lr=0.01, recipe.n_samples_per_prompt=4",
    "recipe.lr=0.001, recipe.n_samples_per_prompt=2",
]


def fading_reward(args, sample, **kwargs) -> float:
    """``count_lowercase`` (0 to 8 here) less 10 a step: a run's mean reward falls every step,
    so its best (step 1) is never its last."""
    return count_lowercase(args, sample) - 10.0 * sample.step


def variant(model_dir: Path, data: Path, number: int, reward=fading_reward) -> TrainConfig:
    """Variant ``number`` (from 1) of the group: 2 steps, scored on an eval set each step."""
    lr, n = TRAINED[number - 1]
    base = tiny_config(model_dir, data, reward, num_rollout=2, lr=lr, n_samples_per_prompt=n)
    return base.model_copy(
        update={
            "recipe": base.recipe.model_copy(update={"eval_interval": 1}),
            "eval_dataset": base.dataset,
            "name": f"lr-sweep-v{number}",
            "group_id": GROUP_ID,
            "group_overrides": {"recipe.lr": lr, "recipe.n_samples_per_prompt": n},
            "group_axes": AXES,
        }
    )


def make_group(home: Path, model_dir: Path, live_last: bool = False) -> dict:
    """The group's three variants, its record, and a run outside it, in ``home`` (the caller
    sets PALAESTRA_HOME). With ``live_last`` the last variant is launched with
    ``gated_reward``, so it waits at step 2 while the others train here."""
    data = write_topics(home.parent / "topics.jsonl")
    live = variant(model_dir, data, 3, gated_reward).launch() if live_last else None
    run_ids = []
    for number in range(1, len(TRAINED) + 1 - bool(live)):
        run_ids.append(variant(model_dir, data, number).train().training_run_id)
        time.sleep(0.02)  # the runs list orders by creation time
    if live is not None:
        run_ids.append(live.training_run_id)
    skipped = {"recipe.lr": 0.001, "recipe.n_samples_per_prompt": 4}
    write_group(
        {
            "group_id": GROUP_ID,
            "name": "lr-sweep",
            "grid": GRID,
            "axes": AXES,
            "variants": [
                {"index": i, "run_id": run_id, "overrides": dict(zip(AXES, values, strict=True))}
                for i, (run_id, values) in enumerate(zip(run_ids, TRAINED, strict=True))
            ],
            "skipped": [{"overrides": skipped, "error": "variant 4 of 4: not today"}],
            "created_at": time.time(),
            "max_parallel": 1,
            "continue_on_error": True,
            "driver": None,
        },
        home,
    )
    outside = tiny_config(model_dir, data, fading_reward, num_rollout=2, lr=0.005).model_copy(
        update={"name": "baseline"}
    )
    return {
        "group_id": GROUP_ID,
        "run_ids": run_ids,
        "outside": outside.train().training_run_id,
        "live": live,
    }


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("compare") / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PALAESTRA_HOME", str(home))
        made = make_group(home, tiny_model_dir)
    return made | {"home": home, "client": TestClient(create_app(home))}


def metrics_file(home: Path, run_id: str) -> list[dict]:
    return read_jsonl(home / "runs" / run_id / "metrics.jsonl")


# Labels, from configs written by hand -----------------------------------------------------


def config(lr: float, n: int = 4, **top) -> dict:
    return {
        "run_id": f"r-{lr}-{n}",
        "created_at": time.time(),
        "model": {"name": "tiny", "source": "/m"},
        "dataset": {"path": "/d/topics.jsonl", "hf_repo": "/d/topics.jsonl", "hf_split": "train"},
        "eval_dataset": None,
        "recipe": {"lr": lr, "n_samples_per_prompt": n, "apply_chat_template_kwargs": {}},
        "name": None,
        "group_id": None,
        "group_overrides": None,
        "group_axes": None,
    } | top


def test_labels_name_only_the_fields_that_differ():
    a, b, c = config(0.01, 4), config(0.001, 4), config(0.01, 8)
    # lr differs (0.01, 0.001, 0.01), n differs (4, 4, 8); run_id and created_at always differ
    # and are not fields a run was trained with.
    fields = differing_fields([a, b, c])
    assert fields == ["recipe.lr", "recipe.n_samples_per_prompt"]
    assert run_label(a, fields, "x") == "recipe.lr=0.01, recipe.n_samples_per_prompt=4"
    assert run_label(b, fields, "x") == "recipe.lr=0.001, recipe.n_samples_per_prompt=4"
    # Two of them: only lr differs.
    assert differing_fields([a, b]) == ["recipe.lr"]
    # Nothing differs: each run is named by its id.
    assert differing_fields([a, config(0.01, 4)]) == []
    assert run_label(a, [], "run-a") == "run-a"
    assert differing_fields([a]) == []


def test_a_sub_config_set_in_one_run_differs_as_one_field():
    evals = {"path": "/d/eval.jsonl", "hf_repo": "/d/eval.jsonl", "hf_split": "train"}
    a, b = config(0.01), config(0.01, eval_dataset=evals)
    assert differing_fields([a, b]) == ["eval_dataset"]
    assert run_label(a, ["eval_dataset"], "a") == "eval_dataset=null"
    # The dataset's path and hf_repo move together: one field names the change, not two.
    other = config(0.01, dataset={**a["dataset"], "path": "/e/x.jsonl", "hf_repo": "/e/x.jsonl"})
    assert differing_fields([a, other]) == ["dataset.path"]
    # A field a run from before it existed lacks differs, and reads as unset.
    old = config(0.01)
    del old["recipe"]["n_samples_per_prompt"]
    assert differing_fields([a, old]) == ["recipe.n_samples_per_prompt"]
    assert (
        run_label(old, ["recipe.n_samples_per_prompt"], "o") == "recipe.n_samples_per_prompt=unset"
    )


def test_variants_of_one_group_are_named_by_its_grid_fields_in_grid_order():
    axes = ["recipe.n_samples_per_prompt", "recipe.lr"]
    tag = {"group_id": "g", "group_axes": axes}
    a = config(0.01, 2, name="g-v1", group_overrides={axes[0]: 2, axes[1]: 0.01}) | tag
    b = config(0.001, 2, name="g-v2", group_overrides={axes[0]: 2, axes[1]: 0.001}) | tag
    c = config(0.01, 4, name="g-v3", group_overrides={axes[0]: 4, axes[1]: 0.01}) | tag
    # The names differ too, but within a group only the grid tells variants apart; the grid's
    # order (n first) wins over the config's (lr first).
    assert differing_fields([a, b, c]) == axes
    assert run_label(b, axes, "b") == "recipe.n_samples_per_prompt=2, recipe.lr=0.001"
    assert differing_fields([a, b]) == ["recipe.lr"]  # n is 2 in both
    # Outside one group, the names are a difference like any other.
    assert differing_fields([a, config(0.001, 2)]) == ["recipe.lr", "name"]  # config order


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
