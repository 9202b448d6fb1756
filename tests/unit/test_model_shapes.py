"""bench/model_shapes.py: the GPU check's Qwen3-4B and Qwen3.5-4B, built from the catalogue's
shapes with no download. Full size (on the meta device: nothing allocated) they have the real
models' parameter counts; scaled down they keep the config class and the layer kinds; and the
torch engine samples the scaled Qwen3.5 (linear-attention cache layers) as a full recompute
does, several rows a prompt."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from palaestra.models.shape import ModelShape
from tests.support.tiny_models import build_tokenizer

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def shapes():
    """bench/model_shapes.py, imported as gpu_check.py imports it."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("model_shapes")
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("model_shapes", None)


def built(shapes, name: str, scaled: bool, vocab: int = 1000):
    """The model ``name`` builds, on the meta device (no memory), and its config."""
    from transformers import AutoModelForCausalLM

    shape, model_type = shapes.model_shape_of(name, scaled, vocab)
    config = shapes.transformers_config(shape, model_type, None, 2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, config, shape


def attention_kinds(model) -> list[str]:
    """Each decoder layer's attention module class, in order."""
    kinds = []
    for layer in model.model.layers:
        linear = getattr(layer, "linear_attn", None)
        kinds.append(type(linear if linear is not None else layer.self_attn).__name__)
    return kinds


# Qwen3-4B by hand (config.json: hidden 2560, intermediate 9728, 36 layers, 32 heads, 8 kv
# heads, head_dim 128, vocab 151936, tied):
#   attention 2560*4096 (q) + 2*2560*1024 (k, v) + 4096*2560 (o) + 2*128 (q/k norms)
#             = 10,485,760 + 5,242,880 + 10,485,760 + 256 = 26,214,656
#   mlp 3*2560*9728 = 74,711,040; two norms 5,120 -> a layer 100,930,816; x36 = 3,633,509,376
#   embeddings 151936*2560 = 388,956,160; final norm 2,560 -> 4,022,468,096 (the model card: 4.0B)
# Qwen3.5-4B's text model (hidden 2560, intermediate 9216, 32 layers, 8 of them gated full
# attention with 16 heads of 256 over 4 kv heads, 24 Gated DeltaNet with 16 key and 32 value
# heads of 128, conv kernel 4, vocab 248320, tied):
#   full: 2560*8192 (q and gate) + 2*2560*1024 (k, v) + 4096*2560 (o) + 2*256 = 36,700,672
#   linear: qkv 2560*(2*2048+4096) = 20,971,520; z 2560*4096 = 10,485,760; a, b 2*2560*32 =
#           163,840; conv 8192*4 = 32,768; A_log, dt_bias 2*32 = 64; norm 128; out 4096*2560 =
#           10,485,760 -> 42,139,840
#   mlp 3*2560*9216 = 70,778,880 + two norms 5,120 = 70,784,000 a layer
#   8*36,700,672 + 24*42,139,840 + 32*70,784,000 = 293,605,376 + 1,011,356,160 + 2,265,088,000
#   + embeddings 248320*2560 = 635,699,200 + final norm 2,560 = 4,205,751,296 (the catalogue's
#   claim; the model card's "4B" counts the vision tower too, which is not built here)
@pytest.mark.parametrize(
    ("name", "count", "published"),
    [("qwen3-4b", 4_022_468_096, 4.02e9), ("qwen3.5-4b", 4_205_751_296, 4_205_751_296)],
)
def test_full_size_models_have_the_real_parameter_counts(shapes, name, count, published):
    model, config, shape = built(shapes, name, scaled=False)
    assert sum(p.numel() for p in model.parameters()) == count  # transformers' own count
    assert shape.params == count  # the plan's arithmetic
    assert ModelShape.from_config(config) == shape  # what the plan reads back from config.json
    assert abs(count - published) / published < 0.02


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3.5-4b"])
def test_scaled_models_keep_the_config_class_and_layer_kinds(shapes, name):
    full, full_config, full_shape = built(shapes, name, scaled=False)
    small, small_config, small_shape = built(shapes, name, scaled=True)
    assert type(small) is type(full) and type(small_config) is type(full_config)
    full_kinds, small_kinds = attention_kinds(full), attention_kinds(small)
    # Qwen3.5: every 4th layer full attention (8 of 32); scaled: one repeat of that pattern.
    # Qwen3: every layer plain attention (36); scaled: 2 of them.
    assert small_kinds == full_kinds[: len(small_kinds)]
    period = len(small_kinds) if name == "qwen3.5-4b" else 1
    assert full_kinds == small_kinds[:period] * (len(full_kinds) // period)
    expected = {
        "qwen3-4b": ["Qwen3Attention"] * 2,
        "qwen3.5-4b": ["Qwen3_5GatedDeltaNet"] * 3 + ["Qwen3_5Attention"],
    }
    assert small_kinds == expected[name]
    # Every width /32 (2560 -> 80), the query/key-value head ratio and q/k norms kept.
    assert small_shape.hidden * 32 == full_shape.hidden
    assert small_shape.heads * small_shape.head_dim * 32 == full_shape.heads * full_shape.head_dim
    assert small_shape.heads // small_shape.kv_heads == full_shape.heads // full_shape.kv_heads
    assert small_shape.qk_norm and small_shape.attention_output_gate == (name == "qwen3.5-4b")
    assert sum(p.numel() for p in small.parameters()) == small_shape.params


def greedy_by_recompute(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Greedy tokens, each from a full forward pass over everything so far (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token == eos:
                break
    return ids[len(prompt) :]


def test_the_torch_engine_samples_scaled_qwen3_5_rows_as_a_full_recompute(shapes):
    """Two prompts of different lengths (left-padded), three rows each: the prefilled
    linear-attention states are copied to every row, and rows that stop early are dropped."""
    from transformers import AutoModelForCausalLM

    from palaestra.engine import GenerationRequest, SamplingParams
    from palaestra.engine.torch_engine import TorchEngine

    tokenizer = build_tokenizer()
    shape, model_type = shapes.model_shape_of("qwen3.5-4b", True, len(tokenizer))
    config = shapes.transformers_config(shape, model_type, None, tokenizer.eos_token_id)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    engine = TorchEngine(model, tokenizer)
    assert not engine.continuous  # linear attention: the padded path
    prompts = [tokenizer("Say rain", add_special_tokens=False).input_ids, [5, 6]]
    requests = [
        GenerationRequest(ids, 3, SamplingParams(max_tokens, temperature=0.0))
        for ids, max_tokens in zip(prompts, (6, 3), strict=True)
    ]
    results = engine.generate_requests(requests)
    for ids, request, rows in zip(prompts, requests, results, strict=True):
        expected = greedy_by_recompute(
            model, ids, request.params.max_tokens, tokenizer.eos_token_id
        )
        assert [row.token_ids for row in rows] == [expected] * 3
