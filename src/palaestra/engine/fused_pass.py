"""A Llama-family model's generation pass written out over fused, packed weights.

Through transformers' modules a decode pass of SmolLM2-135M runs about 75 small ops per layer
(norms in six, rotary in fourteen, seven products, the residuals, the views between them), each
a Python call and a dispatch of a few microseconds, and seven weight products where four would
do. On a 2-core CPU, with 8 rows decoding, the products took about 70 ms of a 125 ms pass and
the ops around them most of the rest. ``FusedPass`` computes the same functions in fewer ops:

- per layer four products over weights packed once per weight version (``packed_linear``):
  the query, key and value projections as one, the output projection, the gate and up
  projections as one, the down projection; and the head, over each segment's last token only;
- the weights of the norms before the products folded into those products' weights
  (``(x * w) W^T = x (W diag w)^T``), so such a norm only scales each row to unit root mean
  square, in four kernels where ``F.rms_norm`` runs nine on a CPU with torch 2.13 (each small
  op costs more here than on a warm cache: the weights streaming through the products evict
  everything else); rotary
  embeddings over the queries and keys together, as ``x cos + roll(x) sin'`` with the sign of
  ``rotate_half`` folded into ``sin'``;
- attention over the slot cache as ``slot_attention.attend`` computes it for the modules.

A row's arithmetic still never depends on what shares its pass: every op is per token, or (the
products) packed for row-invariance, or (attention) per row. The results equal the modules' to
float rounding, not bit for bit; the engine's sampled log-probs are the sampler's, as always.

``fused_pass(model)`` returns ``None`` for models of another shape (other layer classes,
activations or norms, LoRA-wrapped projections, embeddings or logits scaled), which generate
through their modules.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from palaestra.engine import slot_attention
from palaestra.engine.packed_linear import available, pack, product, row_invariant
from palaestra.models.lean_layers import ATTENTION_CLASSES, RMS_NORM_CLASSES, plain_swiglu

CAUSAL_LM_CLASSES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
"""Models whose forward is embeddings, decoder layers, a final norm and a linear head, and
nothing else (no scaled embeddings, no logit soft-capping)."""


@dataclass
class _Norm:
    weight: torch.Tensor
    eps: float

    def __post_init__(self) -> None:
        self.floor = torch.tensor(self.eps, dtype=torch.float32, device=self.weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm as transformers' Llama norms compute it: in float32, then the weight in
        the input's dtype."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def unit(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` scaled to unit root mean square per row, in float32 (the norm without its
        weight, which the product after it holds), cast back to the input's dtype."""
        x32 = x.float()
        norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
        # mean(x^2) + eps = norm^2 / width + eps, in one op.
        scale = torch.addcmul(self.floor, norm, norm, value=1 / x.shape[-1]).rsqrt_()
        return x32 * scale if x.dtype == torch.float32 else (x32 * scale).to(x.dtype)


@dataclass
class _Layer:
    """One decoder layer's weights; its two norms' weights live in ``qkv`` and ``gate_up``."""

    attention_norm: _Norm
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    query_norm: _Norm | None
    key_norm: _Norm | None
    output: torch.Tensor
    output_bias: torch.Tensor | None
    mlp_norm: _Norm
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _norm(module: torch.nn.Module) -> _Norm | None:
    if type(module).__name__ not in RMS_NORM_CLASSES:
        return None
    return _Norm(module.weight.detach(), float(module.variance_epsilon))


def _fused(
    *layers: torch.nn.Linear, norm: _Norm | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights stacked (one product computes all their outputs), times ``norm``'s
    weight along their inputs where given, and packed (``packed_linear.pack``, in one pass
    over them where it can: the engine packs every weight version, one step's in a run); their
    biases likewise (zeros for a layer without one), or None where none has one."""
    weights = [layer.weight.detach() for layer in layers]
    scale = None if norm is None else norm.weight.to(weights[0].dtype)
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat(
            [
                layer.bias.detach()
                if layer.bias is not None
                else layer.weight.new_zeros(layer.out_features)
                for layer in layers
            ]
        )
    return pack(weights, scale), bias


def _layer(layer: torch.nn.Module) -> _Layer:
    """A decoder layer's weights, fused and packed."""
    attention, mlp = layer.self_attn, layer.mlp
    attention_norm = _norm(layer.input_layernorm)
    mlp_norm = _norm(layer.post_attention_layernorm)
    qkv, qkv_bias = _fused(
        attention.q_proj, attention.k_proj, attention.v_proj, norm=attention_norm
    )
    output, output_bias = _fused(attention.o_proj)
    gate_up, gate_up_bias = _fused(mlp.gate_proj, mlp.up_proj, norm=mlp_norm)
    down, down_bias = _fused(mlp.down_proj)
    return _Layer(
        attention_norm,
        qkv,
        qkv_bias,
        _norm(getattr(attention, "q_norm", None)),
        _norm(getattr(attention, "k_norm", None)),
        output,
        output_bias,
        mlp_norm,
        gate_up,
        gate_up_bias,
        down,
        down_bias,
    )


class FusedPass:
    """A generation pass of ``model`` (checked by ``fused_pass``) over copies of its weights,
    fused and packed: valid until the weights change."""

    def __init__(self, model: torch.nn.Module) -> None:
        base = model.model
        self.embedding = base.embed_tokens.weight.detach()
        self.rotary = base.rotary_emb
        self.final_norm = _norm(base.norm)
        first = base.layers[0].self_attn
        self.heads = first.q_proj.out_features // first.head_dim
        self.kv_heads = first.k_proj.out_features // first.head_dim
        self.head_dim = first.head_dim
        self.scaling = float(first.scaling)
        # oneDNN packs a weight on one core whatever the intra-op threads, and so does the
        # panel kernel's copy: the weights pack side by side, one per thread. The
        # engine packs every weight version (each step's, in a run); SmolLM2-135M on a 2-core
        # AVX2 EPYC, oneDNN's: 0.36 s one after another, 0.28 s side by side (medians of ten builds,
        # each into freshly faulted memory, which is most of what is left). The weights are
        # detached, so the threads' own autograd mode does not matter.
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            head = pool.submit(_fused, model.lm_head, norm=self.final_norm)
            self.layers = list(pool.map(_layer, base.layers))
            self.head, self.head_bias = head.result()

    @torch.inference_mode()
    def forward(self, plan: slot_attention.SlotPlan) -> torch.Tensor:
        """The logits after each segment's last token, ``[segments (padded as the plan
        says), vocab]``, as ``slot_attention.forward`` returns them."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(plan.input_ids[0], self.embedding)
        tokens = x.shape[0]
        cos, sin = self.rotary(x[None], plan.position_ids)
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, dim]: every head alike
        half = dim // 2
        # rotate_half(x) = cat(-x2, x1) = roll(x, half) with its first half negated.
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        for index, layer in enumerate(self.layers):
            qkv = product(layer.qkv, layer.qkv_bias, layer.attention_norm.unit(x))
            qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            if layer.query_norm is not None:
                qk = torch.cat((layer.query_norm(qk[:, :heads]), layer.key_norm(qk[:, heads:])), 1)
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            value = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
            attended = slot_attention.attend(
                plan, index, qk[:, :heads], qk[:, heads:], value, self.scaling
            )
            x = x + product(layer.output, layer.output_bias, attended.view(tokens, heads * dim))
            gate_up = product(layer.gate_up, layer.gate_up_bias, layer.mlp_norm.unit(x))
            width = gate_up.shape[-1] // 2
            gate = F.silu(gate_up[:, :width], inplace=True)
            x = x + product(layer.down, layer.down_bias, gate * gate_up[:, width:])
        return product(self.head, self.head_bias, self.final_norm.unit(x[plan.last_token]))


def fits(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Llama-family causal LM ``FusedPass`` computes exactly."""
    if type(model).__name__ not in CAUSAL_LM_CLASSES:
        return False
    base = getattr(model, "model", None)
    if base is None or type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return False
    if type(base.embed_tokens) is not torch.nn.Embedding or _norm(base.norm) is None:
        return False
    for layer in base.layers:
        attention = layer.self_attn
        if type(attention).__name__ not in ATTENTION_CLASSES or not plain_swiglu(layer.mlp):
            return False
        projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if any(type(p) is not torch.nn.Linear for p in [*projections, attention.o_proj]):
            return False
        if _norm(layer.input_layernorm) is None or _norm(layer.post_attention_layernorm) is None:
            return False
        # Qwen3 normalises queries and keys per head: both norms, or neither.
        head_norms = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
        if head_norms != [None, None] and any(_norm(n) is None for n in head_norms):
            return False
    return True


def fused_pass(model: torch.nn.Module) -> FusedPass | None:
    """A ``FusedPass`` of ``model``, or ``None`` where its shape does not fit or packed
    products are unavailable here or not row-invariant at its shapes (``packed_linear``)."""
    if not fits(model) or not available(model.lm_head.weight):
        return None
    fused = FusedPass(model)
    weights = [(layer.qkv, layer.output, layer.gate_up, layer.down) for layer in fused.layers]
    return fused if row_invariant([fused.head, *(w for ws in weights for w in ws)]) else None
