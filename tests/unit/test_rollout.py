"""The torch rollout engine against plain forward passes of the same tiny model."""

from __future__ import annotations

import pytest
import torch

from palaestra.engine import GenerationRequest, SamplingParams
from palaestra.engine.sampling import nucleus
from palaestra.engine.torch_engine import TorchEngine
from tests.support.tiny_models import build_tiny_model, build_tokenizer

# Float32 throughout; batched and unbatched passes differ only in summation order.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(tokenizer, seed=3).eval()


@pytest.fixture
def engine(model, tokenizer):
    return TorchEngine(model, tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def greedy_reference(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Argmax decoding by a full forward pass over the whole sequence at every step."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
            if tokens[-1] in eos:
                break
    return tokens


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float):
    """Log-probs of ``tokens`` after ``prompt`` from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / scale, dim=-1)
    return logprobs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_sampler_logprobs_match_a_plain_forward_pass(engine, model, tokenizer):
    # Prompts of different lengths, so the short one is left-padded in the shared prefill.
    prompts = [encode(tokenizer, "Say rain"), encode(tokenizer, "A much longer prompt here")]
    for temperature in (0.7, 1.0, 0.0):
        params = SamplingParams(12, temperature=temperature, seed=5)
        completions_P_G = engine.generate(prompts, 3, params)
        for prompt, completions_G in zip(prompts, completions_P_G, strict=True):
            for completion in completions_G:
                expected = reference_logprobs(model, prompt, completion.token_ids, temperature)
                got = torch.tensor(completion.logprobs)
                assert got.shape == expected.shape
                assert torch.allclose(got, expected, atol=LOGPROB_TOLERANCE), got - expected


def test_greedy_equals_argmax_of_a_plain_forward_loop(engine, model, tokenizer):
    prompts = [encode(tokenizer, t) for t in ("Say snow", "x", "Tell me about the moon")]
    completions_P_G = engine.generate(prompts, 2, SamplingParams(15, temperature=0.0))
    for prompt, completions_G in zip(prompts, completions_P_G, strict=True):
        expected = greedy_reference(model, prompt, 15, set(engine.eos_ids))
        assert [c.token_ids for c in completions_G] == [expected, expected]
        assert completions_G[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_seeded_request_draws_the_same_whatever_shares_its_batch(engine, tokenizer):
    seeded = GenerationRequest(encode(tokenizer, "Say wind"), 3, SamplingParams(10, seed=11))
    alone = engine.generate_requests([seeded])[0]
    others = [
        GenerationRequest(encode(tokenizer, "a long prompt to pad"), 2, SamplingParams(4)),
        GenerationRequest(encode(tokenizer, "b"), 1, SamplingParams(20, temperature=0.5)),
    ]
    crowded = engine.generate_requests([others[0], seeded, others[1]])[1]
    assert [c.token_ids for c in crowded] == [c.token_ids for c in alone]
    # The samples of one request differ from each other, and another seed draws others.
    assert len({tuple(c.token_ids) for c in alone}) == 3
    reseeded = engine.generate_requests(
        [GenerationRequest(seeded.token_ids, 3, SamplingParams(10, seed=12))]
    )
    assert [c.token_ids for c in reseeded[0]] != [c.token_ids for c in alone]


def test_unseeded_sampling_follows_torch_manual_seed(engine, tokenizer):
    prompts = [encode(tokenizer, "Say sun")]
    torch.manual_seed(0)
    first = engine.generate(prompts, 2, SamplingParams(8))
    torch.manual_seed(0)
    second = engine.generate(prompts, 2, SamplingParams(8))
    assert [c.token_ids for c in first[0]] == [c.token_ids for c in second[0]]


def test_per_request_max_tokens_and_temperature_in_one_batch(engine, model, tokenizer):
    prompt = encode(tokenizer, "Say sea")
    short = GenerationRequest(prompt, 2, SamplingParams(3, temperature=1.0, seed=1))
    greedy = GenerationRequest(prompt, 1, SamplingParams(14, temperature=0.0))
    sampled = GenerationRequest(prompt, 4, SamplingParams(14, temperature=1.0, seed=2))
    out_short, out_greedy, out_sampled = engine.generate_requests([short, greedy, sampled])
    assert [len(c.token_ids) for c in out_short] == [3, 3]
    assert {c.finish_reason for c in out_short} == {"length"}
    # The greedy row is untouched by sampled rows beside it, and by the short rows leaving.
    assert out_greedy[0].token_ids == greedy_reference(model, prompt, 14, set(engine.eos_ids))
    assert len({tuple(c.token_ids) for c in out_sampled}) > 1
    assert all(len(c.token_ids) == 14 for c in out_sampled)


def test_rows_leaving_the_batch_do_not_change_the_others(engine, tokenizer):
    long = GenerationRequest(encode(tokenizer, "Say rain"), 2, SamplingParams(20, seed=4))
    alone = engine.generate_requests([long])[0]
    # Short rows of several lengths finish (and leave) at different steps around it.
    shorts = [
        GenerationRequest(encode(tokenizer, "hi"), 1, SamplingParams(k, seed=k)) for k in (1, 3, 7)
    ]
    mixed = engine.generate_requests([shorts[0], long, shorts[1], shorts[2]])
    assert [c.token_ids for c in mixed[1]] == [c.token_ids for c in alone]
    assert [len(out[0].token_ids) for out in (mixed[0], mixed[2], mixed[3])] == [1, 3, 7]


def test_stop_strings_cut_the_text_before_the_first_one(engine, tokenizer):
    prompt = encode(tokenizer, "Say moon")
    (full,) = engine.generate([prompt], 1, SamplingParams(20, temperature=0.0))[0]
    text = full.text
    stop = text[5:7]  # a string the greedy text contains, first at or before position 5
    cut = text.find(stop)
    params = SamplingParams(20, temperature=0.0, stop=(stop,))
    (completion,) = engine.generate([prompt], 1, params)[0]
    assert completion.text == text[:cut]
    assert completion.finish_reason == "stop"
    # Generation ends at the token that completed the stop string; the tokens up to it are kept.
    assert completion.token_ids == full.token_ids[: cut + len(stop)]
    assert len(completion.logprobs) == len(completion.token_ids)


def test_end_of_sequence_ends_a_row_and_stays_in_its_tokens(model, tokenizer):
    prompt = encode(tokenizer, "Say snow")
    plain = TorchEngine(model, tokenizer)
    greedy = plain.generate([prompt], 1, SamplingParams(12, temperature=0.0))[0][0].token_ids
    # Declare the fourth greedy token an end-of-sequence token: the row must stop there.
    eos_token = greedy[3]
    first = greedy.index(eos_token)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [eos_token]
    try:
        engine = TorchEngine(model, tokenizer)
        (completion,) = engine.generate([prompt], 1, SamplingParams(12, temperature=0.0))[0]
    finally:
        model.generation_config.eos_token_id = saved
    assert completion.token_ids == greedy[: first + 1]
    assert completion.finish_reason == "stop"
    assert completion.text == tokenizer.decode(greedy[: first + 1], skip_special_tokens=True)


def test_a_tiny_top_p_samples_the_most_likely_token(engine, model, tokenizer):
    prompt = encode(tokenizer, "Say wind")
    sampled = engine.generate([prompt], 3, SamplingParams(10, top_p=1e-6, seed=0))[0]
    expected = greedy_reference(model, prompt, 10, set(engine.eos_ids))
    assert [c.token_ids for c in sampled] == [expected] * 3


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    # Sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95. Below 0.85: first three.
    kept = nucleus(probs, 0.85)
    assert torch.equal(kept, torch.tensor([0.0, 0.5, 0.15, 0.3]))


def test_requests_beyond_the_context_are_refused(engine, tokenizer):
    assert engine.max_context == 256  # the tiny model's max_position_embeddings
    prompt = encode(tokenizer, "x" * 250)
    with pytest.raises(ValueError, match="request 1: 250 prompt tokens \\+ max_tokens 7 exceed"):
        engine.generate_requests(
            [
                GenerationRequest(prompt, 1, SamplingParams(6)),
                GenerationRequest(prompt, 1, SamplingParams(7)),
            ]
        )
