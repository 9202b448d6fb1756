"""The fused generation pass computes what the model's own modules compute, for each
Llama-family shape it takes, and declines the others."""

from __future__ import annotations

import pytest
import torch
import transformers

from palaestra.engine import GenerationRequest, SamplingParams
from palaestra.engine.fused_pass import FusedPass, fits, fused_pass
from palaestra.engine.packed_linear import available
from palaestra.engine.slot_attention import Segment, SlotKV, SlotPlan
from palaestra.engine.torch_engine import TorchEngine, sampling_copy
from tests.support.tiny_models import build_tiny_model, build_tokenizer

pytestmark = pytest.mark.skipif(
    not available(torch.zeros(1)), reason="oneDNN's packed product is not available here"
)

SMALL = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def qwen2():
    # Qwen2 projects queries, keys and values with biases.
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**SMALL, use_sliding_window=False)
    )


def qwen3():
    # Qwen3 normalises each head's queries and keys before the rotary embedding.
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**SMALL, head_dim=8, use_sliding_window=False)
    )


def llama_with_biases():
    # Untied head; biases on the attention and the MLP; llama3-style rotary scaling.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = transformers.LlamaConfig(
        **SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=False, rope_parameters=rope
    )
    return transformers.LlamaForCausalLM(config)


def randomised(model):
    """Biases and norm weights away from their zero and one initial values, so a pass that
    skipped one would show."""
    torch.manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.eval()


@pytest.mark.parametrize("build", [qwen2, qwen3, llama_with_biases], ids=lambda b: b.__name__)
def test_the_fused_pass_gives_the_modules_logits(build):
    torch.manual_seed(0)
    model = randomised(build())
    fused = fused_pass(model)
    assert isinstance(fused, FusedPass)
    first, second = [3, 9, 4, 17, 5, 22, 8], [11, 2, 30, 6]
    kv = SlotKV(model.config, torch.float32, torch.device("cpu"))
    kv.reserve(3, 16)
    # Two prompts prefilled in one pass (the second shared with slot 2), then one decode pass
    # of all three rows at different lengths.
    prefill = fused.forward(
        SlotPlan(kv, [Segment(0, 0, first), Segment(1, 0, second, range(2, 3))], min_rows=1)
    )
    decode = fused.forward(
        SlotPlan(
            kv,
            [
                Segment(0, len(first), [12]),
                Segment(1, len(second), [13]),
                Segment(2, len(second), [14]),
            ],
            min_rows=1,
        )
    )
    with torch.no_grad():
        expected = [
            model(input_ids=torch.tensor([ids])).logits[0, -1]
            for ids in (first, second, first + [12], second + [13], second + [14])
        ]
    got = [prefill[0], prefill[1], decode[0], decode[1], decode[2]]
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, atol=1e-4), (g - e).abs().max()


def test_the_embedded_shape_runs_through_the_engine_s_fused_pass():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=2).eval()
    engine = TorchEngine(model, tokenizer)
    assert isinstance(engine.packed_weights(), FusedPass)
    ids = tokenizer("Say rain", add_special_tokens=False).input_ids
    params = SamplingParams(10, 0.0)  # greedy: the modules' own argmax, token by token
    [[completion]] = engine.generate_requests([GenerationRequest(ids, 1, params)])
    sequence = list(ids)
    with torch.no_grad():
        for _ in completion.token_ids:
            sequence.append(int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax()))
            if sequence[-1] in engine.eos_ids:
                break
    assert completion.token_ids == sequence[len(ids) :]


@pytest.mark.skipif(
    not available(torch.zeros(1, dtype=torch.bfloat16)),
    reason="bfloat16 packed products are not row-invariant here",
)
def test_a_bfloat16_copy_runs_fused_close_to_its_modules():
    tokenizer = build_tokenizer()
    model = sampling_copy(build_tiny_model(tokenizer, seed=4), torch.bfloat16)
    fused = fused_pass(model)
    assert fused is not None and fused.head.dtype == torch.bfloat16
    ids = [5, 7, 9, 11, 13, 2]
    kv = SlotKV(model.config, torch.bfloat16, torch.device("cpu"))
    kv.reserve(1, 8)
    got = fused.forward(SlotPlan(kv, [Segment(0, 0, ids)], min_rows=1))[0].float()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    assert torch.allclose(got, expected, atol=0.05, rtol=0.02), (got - expected).abs().max()


def test_other_shapes_go_through_their_modules():
    tokenizer = build_tokenizer()
    assert fits(build_tiny_model(tokenizer))
    assert not fits(build_tiny_model(tokenizer, hidden_act="gelu"))
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2)
    )
    assert not fits(gpt2) and fused_pass(gpt2) is None
    wrapped = build_tiny_model(tokenizer)
    layer = wrapped.model.layers[1].self_attn
    layer.q_proj = torch.nn.Sequential(layer.q_proj)  # a wrapped projection, as an adapter's
    assert not fits(wrapped)
