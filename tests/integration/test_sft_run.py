"""A supervised fine-tuning run of the tiny model that learns its dataset."""

from __future__ import annotations

import json

from palaestra import LocalDataset, ModelConfig, Recipe, TrainConfig


def test_sft_run_lowers_the_loss_on_its_dataset(home, tiny_model_dir, prompts_file):
    config = TrainConfig(
        model=ModelConfig.from_pretrained(tiny_model_dir, name="tiny"),
        dataset=LocalDataset(
            path=str(prompts_file),
            input_column="topic",
            output_column="answer",
            prompt_template="Say {input}",
        ),
        recipe=Recipe(loss_type="sft_loss", num_rollout=8, rollout_batch_size=6, lr=1e-2),
    )
    result = config.train()
    metrics = result.metrics()
    assert [m["step"] for m in metrics] == list(range(1, 9))
    # Every step is the same six rows (one epoch each), so the losses compare directly.
    # The answers are the upper-cased topics plus the end-of-turn tokens: "RAIN<|im_end|>\n".
    assert metrics[-1]["loss"] < 0.7 * metrics[0]["loss"]
    assert metrics[0]["response_tokens"] == sum(
        len(t) + 2 for t in ["rain", "snow", "sun", "wind", "moon", "sea"]
    )
    assert "reward_mean" not in metrics[0]
    assert result.samples() == []
    (checkpoint,) = result.checkpoints()
    assert json.loads((checkpoint.path / "palaestra.json").read_text())["step"] == 8
