"""SIGKILL tiny runs that sample ahead (``max_staleness`` 0 and 2) while sampling, in the
update and mid-save, resume each time, and check the rollout ledger of the last checkpoint:
every prompt position of the data order settled exactly once, the trained ones exactly the
groups samples.jsonl records as trained at their step, and each step logged once."""

from __future__ import annotations

import json

import pytest

from palaestra.rollout.sampler import prompt_order
from palaestra.train.ledger import ledger_problems
from tests.support.moments import (
    checkpoint_problems,
    evaluated_config,
    kill_at,
    kill_while_saving,
    log_problems,
)
from tests.support.tiny_models import save_tiny_model_dir
from tests.support.tiny_runs import TOPICS, write_topics

STEPS = 6
P, G = 2, 4  # tiny_config's prompts and samples per step


def trained_rows_by_step(entries: list, seed: int) -> dict[int, list[int]]:
    """The dataset rows the ledger says each step trained on."""
    rows: dict[int, list[int]] = {}
    for first, last, state, step in entries:
        if state == "trained":
            rows.setdefault(step, []).extend(prompt_order(len(TOPICS), seed, first, last - first))
    return {step: sorted(found) for step, found in rows.items()}


# Sampling ahead trains a 4-layer, 256-wide model, one sequence a micro-batch: its update
# lasts long enough to be caught in. On the 2-layer, 32-wide model, a run ended before kill_at
# found the main thread in it in 5 of 10 runs on a 2-core machine (3 of 17 with one sequence a
# micro-batch); on this one, in 1 of 20 with 6 steps and the update killed second. So that run
# kills the update first, with every step still ahead, and takes 10 steps.
WIDER = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "staleness, fields",
    [
        (0, {}),
        (
            2,
            {"off_policy_correction": "tis", "dynamic_sampling": True, "train_micro_batch_size": 1},
        ),
    ],
)
def test_kills_and_resumes_settle_every_prompt_once(
    home, tiny_model_dir, tmp_path, staleness, fields
):
    data = write_topics(tmp_path / "topics.jsonl")
    steps, moments = STEPS, ("sampling", "update", "saving")
    if staleness:
        tiny_model_dir = save_tiny_model_dir(tmp_path / "wider-model", **WIDER)
        steps, moments = 10, ("update", "sampling", "saving")
    config = evaluated_config(
        tiny_model_dir,
        data,
        0,
        num_rollout=steps,
        save_interval=1,
        max_staleness=staleness,
        **fields,
    )
    run = config.launch()
    for moment in moments:
        if moment == "saving":
            kill_while_saving(run)
        else:
            kill_at(run, moment, seed=staleness)
        assert checkpoint_problems(run) == []
        run = run.resume()
    run.result(timeout=300)
    assert run.status == "completed"
    assert log_problems(run, steps, P * G) == []

    last = run.checkpoints()[-1].path
    state = json.loads((last / "trainer_state.json").read_text())
    entries = state["ledger"]
    assert ledger_problems(entries, state["cursor"]) == []
    assert {e[2] for e in entries} <= {"trained", "dropped_dynamic"}  # none stale locally
    trained = trained_rows_by_step(entries, config.recipe.seed)
    logged: dict[int, list[int]] = {}
    for row in run.samples():
        if row["trained"] and row["group_index"] == 0:
            logged.setdefault(row["step"], []).append(row["index"])
    assert trained == {step: sorted(rows) for step, rows in logged.items()}
    if staleness:
        metrics = run.metrics()
        assert [m["stale_dropped_groups"] for m in metrics] == [0] * steps
        assert all(m["sample_staleness_mean"] <= staleness for m in metrics if m["updates"])
        assert all("importance_ratio_mean" in m for m in metrics if m["updates"])
