"""Qwen3-4B's and Qwen3.5-4B's architectures with random weights and no download: transformers
configs written from the catalogue's shapes (``palaestra.models.catalogue``, the public
config.json numbers), at full size for a GPU and scaled down for the CPU smoke run, and saved as
HF folders beside a tokenizer that needs no download (the embedded model's converted one).

Qwen3-4B is ``Qwen3ForCausalLM`` (model type ``qwen3``): 36 layers of grouped-query attention
with per-head q/k norms. Qwen3.5-4B's text model is ``Qwen3_5ForCausalLM`` (``qwen3_5_text``):
32 layers, every 4th gated full attention and the rest Gated DeltaNet linear attention.

Scaled down, every width is divided by ``SCALE`` (hidden 2560 -> 80, each projection's width
likewise: head counts by the key/value head count, head dims by the rest) and the layers cut to
one repeat of the layer pattern, so the same config class builds the same layer kinds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from palaestra.models.catalogue import Qwen3_4B, Qwen3_5_4B
from palaestra.models.shape import ModelShape

SCALE = 32
MODELS = {"qwen3-4b": (Qwen3_4B, "qwen3"), "qwen3.5-4b": (Qwen3_5_4B, "qwen3_5_text")}
"""``--models`` name: (catalogue entry, transformers model type)."""
EXTRA_VOCAB = 128
"""Scaled-down vocab: the tokenizer's and this many ids past it, as the real models pad theirs
(Qwen3-4B: 151,936 ids for 151,669 tokens), so ids no token has are sampled in the smoke too."""


def scaled_shape(shape: ModelShape, vocab: int) -> ModelShape:
    """``shape`` with every width divided by ``SCALE``, one repeat of its layer pattern (2 plain
    layers; 3 linear + 1 full for Qwen3.5) and ``vocab`` ids."""
    heads = shape.kv_heads  # kv heads -> 1, the query/key-value head ratio kept
    dim = SCALE // heads
    linear = {}
    if shape.attention_layers is not None:
        linear = dict(
            linear_key_heads=shape.linear_key_heads // heads,
            linear_value_heads=shape.linear_value_heads // heads,
            linear_key_dim=shape.linear_key_dim // dim,
            linear_value_dim=shape.linear_value_dim // dim,
        )
    interval = layer_interval(shape)
    return dataclasses.replace(
        shape,
        hidden=shape.hidden // SCALE,
        intermediate=shape.intermediate // SCALE,
        layers=interval if shape.attention_layers is not None else 2,
        heads=shape.heads // heads,
        kv_heads=1,
        head_dim=shape.head_dim // dim,
        vocab=vocab,
        attention_layers=1 if shape.attention_layers is not None else None,
        **linear,
    )


def layer_interval(shape: ModelShape) -> int:
    """Layers per full-attention layer (1 for a model without linear attention)."""
    if shape.attention_layers is None:
        return 1
    return shape.layers // shape.attention_layers


def layer_types(shape: ModelShape) -> list[str]:
    """Qwen3.5's pattern: every ``interval``-th layer full attention, the others linear."""
    interval = layer_interval(shape)
    return [
        "full_attention" if i % interval == interval - 1 else "linear_attention"
        for i in range(shape.layers)
    ]


def transformers_config(shape: ModelShape, model_type: str, bos: int | None, eos: int | None):
    """The transformers config of a model of ``shape``: ``Qwen3Config`` or
    ``Qwen3_5TextConfig``."""
    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied_embeddings,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    if model_type == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **common,
        layer_types=layer_types(shape),
        linear_num_key_heads=shape.linear_key_heads,
        linear_num_value_heads=shape.linear_value_heads,
        linear_key_head_dim=shape.linear_key_dim,
        linear_value_head_dim=shape.linear_value_dim,
        linear_conv_kernel_dim=shape.linear_conv_kernel,
    )


def model_shape_of(name: str, scaled: bool, tokenizer_size: int) -> tuple[ModelShape, str]:
    """The shape ``--models`` ``name`` builds, and its transformers model type."""
    if name not in MODELS:
        raise SystemExit(f"--models: unknown model {name!r} ({', '.join(MODELS)})")
    entry, model_type = MODELS[name]
    shape = entry.shape
    if scaled:
        shape = scaled_shape(shape, tokenizer_size + EXTRA_VOCAB)
    return shape, model_type


def build_model_dir(
    name: str, tokenizer_dir: str, folder: Path, scaled: bool, device: str = "cpu"
) -> Path:
    """Save model ``name`` with random weights (seed 0) and ``tokenizer_dir``'s tokenizer as an
    HF folder. Full size it is built on ``device`` (a GPU: a 4B model is never allocated on
    the CPU) and saved in bfloat16 (half the disk; the learner loads it in float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape, model_type = model_shape_of(name, scaled, len(tokenizer))
    if not scaled and device == "cpu":
        raise SystemExit(f"{name}: the full-size model is built on a GPU only (--smoke scales it)")
    config = transformers_config(shape, model_type, tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not scaled:
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()  # the learner loads it afresh; keep the GPU for the run
    return folder
