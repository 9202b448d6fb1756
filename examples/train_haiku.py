"""Teach the embedded SmolLM2-135M-Instruct to write 5-7-5 haikus with GRPO, then keep going.

The training half of the getting-started tutorial, on a laptop: no GPU, no network.

    python examples/train_haiku.py
"""

from palaestra import (
    HuggingFaceDataset,
    SmolLM2_135M,
    SmolLM2_135M_Recipe,
    TrainConfig,
    builtin_dataset,
)
from palaestra.rewards.haiku import score_haiku

model = SmolLM2_135M()


class HaikuDataset(HuggingFaceDataset):
    hf_repo = str(
        builtin_dataset("haiku")
    )  # "statworx/haiku" works too, where the hub is reachable
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


train_dataset = HaikuDataset(hf_split="train[:10]")


async def haiku_rm(args, sample, **kwargs) -> float:
    response = model.parse_response(sample.response)
    return score_haiku(response.content)


def mean_reward(metrics, steps):
    rows = [m["reward_mean"] for m in metrics[steps]]
    return sum(rows) / len(rows)


if __name__ == "__main__":
    config = TrainConfig(
        model=model,
        dataset=train_dataset,
        recipe=SmolLM2_135M_Recipe(
            eval_interval=None,
            num_rollout=10,
            n_samples_per_prompt=8,
            save_interval=5,
            apply_chat_template_kwargs='{"enable_thinking": false}',
            custom_rm_function=haiku_rm,
        ),
    )
    run = config.launch(show_output=True)
    print(f"run id: {run.training_run_id}")
    result = run.result()
    checkpoint = result.checkpoints()[-1]
    print(f"checkpoint: {checkpoint.path}")

    new_run = TrainConfig(
        model=model,
        dataset=train_dataset,
        checkpoint=checkpoint,
        recipe=SmolLM2_135M_Recipe(
            eval_interval=None,
            num_rollout=20,
            n_samples_per_prompt=8,
            apply_chat_template_kwargs='{"enable_thinking": false}',
            custom_rm_function=haiku_rm,
        ),
    ).launch(show_output=True)
    print(f"run id: {new_run.training_run_id}")
    new_result = new_run.result()
    print(f"checkpoint: {new_result.checkpoints()[-1].path}")

    metrics = result.metrics() + new_result.metrics()
    step_s = [m["step_s"] for m in metrics]
    print(f"steps: {len(metrics)}, mean step time {sum(step_s) / len(step_s):.1f} s")
    print(f"reward mean, first 3 steps: {mean_reward(metrics, slice(0, 3)):+.2f}")
    print(f"reward mean, last 3 steps:  {mean_reward(metrics, slice(-3, None)):+.2f}")
