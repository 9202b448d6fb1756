# The getting-started tutorial's code as printed ("Getting started with RL", Modal's Training
# Gym), its code blocks in order, blank lines as rendered, nothing changed. It runs on Modal,
# not here: examples/haiku.py is this code for a laptop, and tests/unit/test_tutorial_example.py
# fails on any difference between the two that examples/haiku.py's docstring does not list.

import nltk
from nltk.corpus import cmudict


import re


from modal_training_gym import (
    Endpoint,
    HuggingFaceDataset,
    Qwen3_5_4B,
    Qwen3_5_4B_Recipe,
    TrainConfig,
)


model = Qwen3_5_4B()


base_deployment = Endpoint.launch(
    model, unauthenticated=True, recreate_if_existing=True
)
base_deployment.wait_until_ready(timeout=15 * 60)
print(f"base model deployed to {base_deployment.url}")


_cmudict_cache = {}


def _get_cmudict() -> dict:
    if not _cmudict_cache:
        nltk.download("cmudict", quiet=True)
        _cmudict_cache.update(cmudict.dict())
    return _cmudict_cache


def _count_syllables(text: str) -> int:
    cmu = _get_cmudict()
    total = 0
    for word in re.findall(r"[a-zA-Z]+", text):
        phones = cmu.get(word.lower())
        if phones:
            total += sum(p[-1].isdigit() for p in phones[0])
        else:
            count = len(re.findall(r"[aeiouy]+", word.lower()))
            if word.lower().endswith("e") and count > 1:
                count -= 1
            total += max(count, 1)
    return total


def score_haiku(response: str) -> float:
    lines = [line.strip() for line in response.strip().split("\n") if line.strip()]
    if len(lines) != 3:
        return -10
    total_diff = sum(
        abs(_count_syllables(line) - target)
        for line, target in zip(lines, [5, 7, 5])
    )
    return -float(total_diff)


class HaikuDataset(HuggingFaceDataset):
    hf_repo = "statworx/haiku"
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


train_dataset = HaikuDataset(hf_split="train[:10]")


eval_dataset = HaikuDataset(hf_split="train[10:15]")


def run_eval(deployment, max_concurrency: int = 2) -> float:
    from concurrent.futures import ThreadPoolExecutor


    deployment.wait_until_ready(timeout=15 * 60)


    def _score_one(example):
        topic = str(example[eval_dataset.input_column])
        prompt = eval_dataset.prompt_template.format(input=topic)
        msg = deployment.chat(
            [{"role": "user", "content": prompt}],
            chat_template_kwargs={"enable_thinking": False},
        )
        return score_haiku(msg.get("content") or msg.get("reasoning_content") or "")


    with ThreadPoolExecutor(max_workers=max_concurrency) as executor:
        scores = list(executor.map(_score_one, eval_dataset.load()))
    return sum(scores) / len(scores) if scores else float("nan")


print("running base model evaluation...")
base_mean = run_eval(base_deployment)
print(f"average score: {base_mean:.1f}")


async def haiku_rm(args, sample, **kwargs) -> float:
    response = model.parse_response(sample.response)
    return score_haiku(response.content)


config = TrainConfig(
    model=model,
    dataset=train_dataset,
    recipe=Qwen3_5_4B_Recipe(
        eval_interval=None,
        rollout_num_gpus=8,
        num_rollout=10,
        n_samples_per_prompt=8,
        save_interval=5,
        apply_chat_template_kwargs='{"enable_thinking": false}',
        custom_rm_function=haiku_rm,
        image_overlay=lambda image: image.run_commands(
            "uv pip install --system aiohttp 'nltk>=3.8.0'",
            "python -c \"import nltk; nltk.download('cmudict', quiet=True)\"",
        ),
    ),
)


run = config.launch()
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
print(f"average score: {trained_mean:.1f}")


new_config = TrainConfig(
    model=model,
    dataset=train_dataset,
    checkpoint=checkpoint,
    recipe=Qwen3_5_4B_Recipe(
        eval_interval=None,
        custom_rm_function=haiku_rm,
        rollout_num_gpus=8,
        num_rollout=20,
        n_samples_per_prompt=8,
        apply_chat_template_kwargs='{"enable_thinking": false}',
        image_overlay=lambda image: image.run_commands(
            "uv pip install --system aiohttp 'nltk>=3.8.0'",
            "python -c \"import nltk; nltk.download('cmudict', quiet=True)\"",
        ),
    ),
)


new_run = new_config.launch()
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
print(f"average score: {new_mean:.1f}")
