"""The vLLM rollout engine on the embedded model, with vLLM's CPU build (``make test-vllm``).

One engine is shared by the module (a start takes minutes on a small CPU), opened on a
full-weight checkpoint folder as a run writes it, so every test also shows that vLLM loads
such a folder as it is. It samples in float32, so that its log-probs can be held to a float32
forward pass of the same weights.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

# Processed log-probs against transformers' float32 pass over the same tokens. vLLM's CPU
# kernels (its own attention, fused MLP) reorder the float32 sums, so values agree to about
# 1e-4 nats; these bounds leave an order of magnitude for other CPUs.
LOGPROB_MEAN_TOL = 2e-3
LOGPROB_MAX_TOL = 2e-2


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    from palaestra import SmolLM2_135M
    from palaestra.models.loading import load_tokenizer

    model = SmolLM2_135M()
    path = model.weights_path()
    return path, load_tokenizer(path, model.chat_template)


@pytest.fixture(scope="module")
def checkpoint(embedded, tmp_path_factory):
    """A checkpoint folder of the embedded model whose weights differ from the base's, and
    the float32 module holding them."""
    from palaestra.models.loading import load_causal_lm

    path, tokenizer = embedded
    model = load_causal_lm(path, torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.25)
    folder = tmp_path_factory.mktemp("run") / "step_000001"
    model.save_pretrained(folder)  # as Learner.save writes it
    tokenizer.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def engine(embedded, checkpoint):
    from palaestra.engine.vllm_engine import VLLMEngine

    _, tokenizer = embedded
    engine = VLLMEngine(str(checkpoint[0]), tokenizer, dtype="float32", max_model_len=512)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(embedded):
    _, tokenizer = embedded
    messages = [{"role": "user", "content": "Write a haiku about rain."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def float32_logprobs(model, prompt, completion, temperature):
    """Each completion token's log-prob under ``softmax(logits / temperature)``, and each
    position's logits (float32, transformers' own forward)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1), logits


def test_seeded_sampling_repeats_and_samples_differ(engine, prompt):
    from palaestra.engine import SamplingParams

    params = SamplingParams(24, temperature=1.0, seed=7)
    first = engine.generate([prompt], 3, params)[0]
    again = engine.generate([prompt], 3, params)[0]
    other = engine.generate([prompt], 3, SamplingParams(24, temperature=1.0, seed=8))[0]
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) == 3  # n samples of one request differ
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    for completion in first:
        assert len(completion.logprobs) == len(completion.token_ids) > 0
        assert completion.finish_reason in ("stop", "length")
        assert completion.text.strip()


def test_processed_logprobs_match_a_float32_pass(engine, prompt, checkpoint):
    """At top_p 1 the processed log-probs are the temperature's; under a nucleus they are
    renormalised over the kept tokens: log p(token) - log(mass of the nucleus)."""
    from palaestra.engine import SamplingParams
    from palaestra.engine.sampling import nucleus

    model = checkpoint[1]
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        params = SamplingParams(32, temperature=temperature, top_p=top_p, seed=3)
        completion = engine.generate([prompt], 1, params)[0][0]
        expected, logits = float32_logprobs(model, prompt, completion.token_ids, temperature)
        if top_p < 1.0:
            probs = torch.softmax(logits / temperature, dim=-1)
            kept_mass = nucleus(probs, top_p).sum(dim=-1)
            expected = expected - kept_mass.log()
        diff = (torch.tensor(completion.logprobs) - expected).abs()
        assert float(diff.mean()) < LOGPROB_MEAN_TOL, (temperature, top_p, diff)
        assert float(diff.max()) < LOGPROB_MAX_TOL, (temperature, top_p, diff)


def test_weight_sync_changes_what_vllm_samples(engine, prompt, embedded, checkpoint):
    """Greedy output equals the learner's own greedy output before and after an update; the
    first comparison is also the checkpoint folder's interop: vLLM opened it as it is."""
    from palaestra.engine import SamplingParams
    from palaestra.engine.torch_engine import TorchEngine
    from palaestra.models.loading import load_causal_lm

    path, tokenizer = embedded
    learner = load_causal_lm(str(checkpoint[0]), torch.float32)
    greedy = SamplingParams(16, temperature=0.0)

    def learner_greedy():
        return TorchEngine(learner, tokenizer).generate([prompt], 1, greedy)[0][0].token_ids

    before = engine.generate([prompt], 1, greedy)[0][0].token_ids
    assert before == learner_greedy()
    with torch.no_grad():  # an update the size of many GRPO steps at a high lr
        torch.manual_seed(0)
        for name, param in learner.named_parameters():
            # The embeddings too: the output head is tied to them, and vLLM's CPU build packs
            # a copy of that head for its matmul.
            if ".mlp." in name or "embed_tokens" in name:
                param.add_(torch.randn_like(param) * param.std() * 0.5)
    engine.update_weights(dict(learner.named_parameters()), version=1)
    after = engine.generate([prompt], 1, greedy)[0][0].token_ids
    assert engine.weight_version == 1
    assert after != before
    assert after == learner_greedy()
    # The checkpoint's weights again: vLLM samples what it sampled at first (no stale cache).
    original = load_causal_lm(str(checkpoint[0]), torch.float32)
    engine.update_weights(dict(original.named_parameters()), version=2)
    assert engine.generate([prompt], 1, greedy)[0][0].token_ids == before


def test_a_sync_is_attested_and_a_tensor_not_loaded_is_named(engine, checkpoint):
    """vLLM's digests of what it holds after a sync equal the learner's; a tensor that did not
    reach it fails the attestation, naming the tensor and the version."""
    from palaestra.engine.attest import WeightSyncError, attest_engine
    from palaestra.models.loading import load_causal_lm

    learner = load_causal_lm(str(checkpoint[0]), torch.float32)
    with torch.no_grad():
        learner.model.norm.weight.mul_(0.5)
        learner.model.embed_tokens.weight.add_(1e-3)
    weights = dict(learner.named_parameters())
    engine.update_weights(weights, version=3)
    # The CPU build holds q/k/v and gate/up fused and its other linear weights repacked, under
    # other shapes: the picks are among the rest (the embeddings and the norms), three of them.
    assert attest_engine(engine, weights, 3, "the vLLM engine") == 3
    unsent = weights | {"model.norm.weight": weights["model.norm.weight"] * 2}
    with pytest.raises(WeightSyncError, match=r"version 3: the vLLM engine .*model\.norm\.weight"):
        attest_engine(engine, unsent, 3, "the vLLM engine")
    original = load_causal_lm(str(checkpoint[0]), torch.float32)
    engine.update_weights(dict(original.named_parameters()), version=4)  # as later tests expect


def test_lora_weights_are_refused_with_the_way_out(engine):
    version = engine.weight_version
    with pytest.raises(ValueError, match="rollout_engine='torch'"):
        engine.update_weights({"base_model.model.lm_head.lora_A.default.weight": None}, 99)
    assert engine.weight_version == version


async def distinct_characters(args, sample, **kwargs) -> float:
    return len(set(sample.response)) / 10


def test_a_run_samples_with_vllm_and_keeps_its_weights_in_step(tmp_path, embedded, engine):
    """Two GRPO steps with rollout_engine="vllm" through TrainConfig.train(): the second
    step's samples come from the weights the first step made, and the sampler's log-probs stay
    within float32 rounding of the learner's own. The run's engine is this process's second of
    the model's architecture (``engine`` came first): on a CPU it takes its compiled graph from
    the compile cache instead of compiling it again (``CPU_BUILD_ENV``)."""
    from torch._dynamo.utils import counters

    from palaestra import LocalDataset, Recipe, SmolLM2_135M, TrainConfig

    data = tmp_path / "topics.jsonl"
    data.write_text("".join(f'{{"topic": "{t}"}}\n' for t in ("rain", "snow", "moon", "sea")))
    config = TrainConfig(
        model=SmolLM2_135M(),
        dataset=LocalDataset(path=str(data), input_column="topic", prompt_template="Say {input}"),
        recipe=Recipe(
            num_rollout=2,
            rollout_batch_size=2,
            n_samples_per_prompt=4,
            rollout_max_response_len=16,
            lr=1e-4,
            precision="float32",
            rollout_engine="vllm",
            save_interval=None,
            custom_rm_function=distinct_characters,
        ),
    )
    before = dict(counters["inductor"])
    result = config.train()
    missed, hit = (
        counters["inductor"][k] - before.get(k, 0)
        for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")
    )
    assert missed == 0 and hit >= 1, (missed, hit)
    metrics = result.metrics()
    assert [m["step"] for m in metrics] == [1, 2]
    for row in metrics:
        assert row["sampler_logprob_abs_diff"] < LOGPROB_MEAN_TOL, row
    versions = {(s["step"], s["weight_version"]) for s in result.samples()}
    assert versions == {(1, 0), (2, 1)}
    # vLLM holds a copy: each sync is attested (the embeddings and the norm at least).
    assert [m["attested_engines"] for m in metrics] == [1, 1]


def test_a_lora_policy_samples_as_a_lora_request(embedded, prompt):
    """The learner's adapters, loaded as a LoRA request over vLLM's base: greedy output
    equals the peft policy's own, for fresh adapters (a no-op) and after two updates."""
    from palaestra.engine import SamplingParams
    from palaestra.engine.torch_engine import TorchEngine
    from palaestra.engine.vllm_engine import VLLMEngine
    from palaestra.models.loading import load_causal_lm
    from palaestra.recipes import Recipe
    from palaestra.train.lora import apply_lora

    path, tokenizer = embedded
    policy = apply_lora(load_causal_lm(path, torch.float32), Recipe(lora_rank=8, lora_alpha=16))
    greedy = SamplingParams(16, temperature=0.0)

    def policy_greedy():
        return TorchEngine(policy, tokenizer).generate([prompt], 1, greedy)[0][0].token_ids

    engine = VLLMEngine(
        path, tokenizer, dtype="float32", max_model_len=512, lora_rank=8, lora_alpha=16
    )
    try:
        base = engine.generate([prompt], 1, greedy)[0][0].token_ids
        assert base == policy_greedy()  # fresh adapters: B is zero
        outputs = []
        for version in (1, 2):
            with torch.no_grad():
                torch.manual_seed(version)
                for name, param in policy.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0.0, 0.1)
            engine.update_weights(dict(policy.named_parameters()), version)
            outputs.append(engine.generate([prompt], 1, greedy)[0][0].token_ids)
            assert outputs[-1] == policy_greedy()
        assert base != outputs[0] != outputs[1]
        assert engine.llm.llm_engine.list_loras() == {3}  # version 2's adapters only
    finally:
        engine.close()
