"""How runs compared side by side are labelled: from configs written by hand, only the fields that
differ among them, a group's variants by its grid fields in grid order."""

from __future__ import annotations

import time

from palaestra.runs.compare import differing_fields, run_label


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
