"""A causal LM's shape: the config numbers that decide its parameter count, its KV cache and its
FLOPs, read from a transformers config or hard-coded in the catalogue, so a plan needs no
download. No torch at import.

Two layer kinds are counted: plain grouped-query attention (Llama, SmolLM2, Qwen3) and the
Gated DeltaNet linear attention that Qwen3.5 interleaves with it (three linear layers to one
full-attention layer). Every layer has a SwiGLU MLP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GATED_KINDS = ("qwen3_5", "qwen3_next")
QK_NORM_KINDS = ("qwen3",)  # qwen3, qwen3_moe, qwen3_5, qwen3_5_text, qwen3_next


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer's config that decide its memory and FLOPs."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    attention_layers: int | None = None
    """Layers of full attention (the rest are linear attention); None: every layer."""
    attention_output_gate: bool = False
    """Qwen3.5's gated attention: the query projection is twice as wide (query and gate)."""
    qk_norm: bool = False
    """Qwen3's and Qwen3.5's RMSNorm of each query and key head (``head_dim`` weights each)."""
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config object or its ``config.json`` as a dict (a multimodal
        config's ``text_config`` is used when present)."""
        get = (
            config.get
            if isinstance(config, dict)
            else lambda key, default=None: getattr(config, key, default)
        )
        text = get("text_config")
        if text is not None:
            return cls.from_config(text)
        heads = get("num_attention_heads")
        kind = str(get("model_type") or "")
        layer_types = get("layer_types")
        attention = None
        if layer_types:
            attention = sum(1 for kind in layer_types if kind == "full_attention")
            if attention == len(layer_types):
                attention = None
        linear = {}
        if attention is not None:  # Gated DeltaNet layers beside the full-attention ones
            linear = dict(
                linear_key_heads=get("linear_num_key_heads"),
                linear_value_heads=get("linear_num_value_heads"),
                linear_key_dim=get("linear_key_head_dim"),
                linear_value_dim=get("linear_value_head_dim"),
                linear_conv_kernel=get("linear_conv_kernel_dim"),
            )
        return cls(
            hidden=get("hidden_size"),
            intermediate=get("intermediate_size"),
            layers=get("num_hidden_layers"),
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads,
            vocab=get("vocab_size"),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
            attention_layers=attention,
            # Qwen3.5's and Qwen3-Next's attention is always gated (transformers has no switch).
            attention_output_gate=bool(get("attn_output_gate", kind.startswith(GATED_KINDS))),
            qk_norm=kind.startswith(QK_NORM_KINDS),
            **linear,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelShape:
        """From the ``config.json`` of an HF-format model folder."""
        path = Path(folder) / "config.json"
        try:
            return cls.from_config(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: not a decoder config this plan knows ({error})") from error

    @property
    def full_attention_layers(self) -> int:
        return self.layers if self.attention_layers is None else self.attention_layers

    @property
    def linear_attention_layers(self) -> int:
        return self.layers - self.full_attention_layers

    @property
    def attention_params(self) -> int:
        """One full-attention layer's projections (q, k, v, o) and its q/k norms if gated."""
        h, d = self.hidden, self.head_dim
        query = h * self.heads * d * (2 if self.attention_output_gate else 1)
        norms = 2 * d if self.qk_norm else 0
        return query + 2 * h * self.kv_heads * d + self.heads * d * h + norms

    @property
    def linear_attention_params(self) -> int:
        """One Gated DeltaNet layer: q/k/v in one projection, the output gate z, the per-head
        a and b, the short convolution, decay and step biases, the value norm, the output."""
        h = self.hidden
        keys = self.linear_key_heads * self.linear_key_dim
        values = self.linear_value_heads * self.linear_value_dim
        qkv = h * (2 * keys + values)
        gates = h * values + 2 * h * self.linear_value_heads
        conv = (2 * keys + values) * self.linear_conv_kernel
        return qkv + gates + conv + 2 * self.linear_value_heads + self.linear_value_dim + values * h

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every parameter: embeddings, layers (with their two norms), final norm, head."""
        layers = (
            self.full_attention_layers * self.attention_params
            + self.linear_attention_layers * self.linear_attention_params
            + self.layers * (self.mlp_params + 2 * self.hidden)
        )
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + layers + self.hidden + head

    @property
    def matmul_params(self) -> int:
        """``N`` of the FLOP count: every weight a token is multiplied by (the head included,
        the embedding lookup not)."""
        return (
            self.params
            - self.embedding_params
            + self.embedding_params * (1 if self.tied_embeddings else 0)
        )

    @property
    def linear_projection_params(self) -> int:
        """Weights of the layers' linear projections (what LoRA's "all-linear" adapts)."""
        return self.params - self.embedding_params * (1 if self.tied_embeddings else 2)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values one token adds to the cache, over every full-attention layer."""
        return 2 * self.full_attention_layers * self.kv_heads * self.head_dim * dtype_bytes

    def state_bytes_per_sequence(self) -> int:
        """A sequence's fixed-size state in the linear-attention layers: the recurrent state
        (float32) and the convolution's last positions; 0 for plain models."""
        if not self.linear_attention_layers:
            return 0
        state = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim * 4
        keys = self.linear_key_heads * self.linear_key_dim
        conv = (2 * keys + self.linear_value_heads * self.linear_value_dim) * (
            self.linear_conv_kernel - 1
        )
        return self.linear_attention_layers * (state + conv * 2)

    def lora_params(self, rank: int) -> int:
        """Adapter parameters of rank ``rank`` on every linear projection of every layer:
        ``rank * (in + out)`` each."""
        h, d, r = self.hidden, self.head_dim, rank
        q_out = self.heads * d * (2 if self.attention_output_gate else 1)
        attention = r * ((h + q_out) + 2 * (h + self.kv_heads * d) + (self.heads * d + h))
        keys = self.linear_key_heads * self.linear_key_dim
        values = self.linear_value_heads * self.linear_value_dim
        linear = r * (
            (h + 2 * keys + values)
            + (h + values)
            + 2 * (h + self.linear_value_heads)
            + (values + h)
        )
        mlp = r * (2 * (h + self.intermediate) + (self.intermediate + h))
        return (
            self.full_attention_layers * attention
            + self.linear_attention_layers * linear
            + self.layers * mlp
        )
