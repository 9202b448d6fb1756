"""Algorithm knobs end to end on the tiny model: dynamic sampling and a KL reference."""

from __future__ import annotations

import pytest

from tests.support.tiny_runs import count_lowercase, make_config


def flat_for_rain_and_snow(args, sample, **kwargs) -> float:
    """The same reward for every sample of a rain or snow prompt: those groups carry no signal."""
    if sample.metadata["topic"] in ("rain", "snow"):
        return 1.0
    return count_lowercase(args, sample)


def test_dynamic_sampling_drops_flat_groups_and_refills(home, tiny_model_dir, prompts_file):
    result = make_config(
        tiny_model_dir,
        prompts_file,
        reward=flat_for_rain_and_snow,
        dynamic_sampling=True,
        over_sampling_batch_size=2,
    ).train()
    (metrics,) = result.metrics()
    samples = result.samples()
    # Rows come group after group (4 samples each); a group trains or is dropped as a whole.
    by_group = [samples[i : i + 4] for i in range(0, len(samples), 4)]
    trained = [g for g in by_group if g[0]["trained"]]
    dropped = [g for g in by_group if not g[0]["trained"]]
    assert all(len({r["trained"] for r in g}) == 1 for g in by_group)
    # Refilled to rollout_batch_size = 2 groups; every flat group was dropped, and only those.
    assert len(trained) == 2
    assert all(len({r["reward"] for r in g}) > 1 for g in trained)
    assert all(len({r["reward"] for r in g}) == 1 for g in dropped)
    assert all(g[0]["metadata"]["topic"] not in ("rain", "snow") for g in trained)
    assert metrics["dropped_groups"] == len(dropped)
    assert metrics["sampling_rounds"] == len(by_group) // 2
    assert metrics["response_tokens"] == sum(r["response_tokens"] for g in trained for r in g)


def test_without_over_sampling_the_step_trains_on_what_is_left(home, tiny_model_dir, prompts_file):
    result = make_config(
        tiny_model_dir,
        prompts_file,
        reward=flat_for_rain_and_snow,
        dynamic_sampling=True,
        num_rollout=3,
        rollout_batch_size=3,
    ).train()
    for metrics in result.metrics():
        step_rows = result.samples(metrics["step"])
        assert len(step_rows) == 3 * 4  # one round only
        flat = sum(r["metadata"]["topic"] in ("rain", "snow") for r in step_rows) // 4
        assert metrics["dropped_groups"] >= flat
        assert metrics["sampling_rounds"] == 1


def test_kl_to_a_frozen_copy_of_the_model(home, tiny_model_dir, prompts_file):
    result = make_config(
        tiny_model_dir, prompts_file, num_rollout=2, kl_loss_coef=0.1, kl_loss_type="k2"
    ).train()
    first, second = result.metrics()
    # Step 1: the policy is the reference, so KL is 0; after one update it is not.
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    assert second["kl"] > 1e-6
    assert "kl" not in make_config(tiny_model_dir, prompts_file).train().metrics()[0]
