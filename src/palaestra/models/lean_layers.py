"""Training passes that keep fewer activations: the SwiGLU MLP and RMSNorm of Llama-family
models, each as one autograd function that saves only what its backward cannot cheaply redo.

Autograd keeps every tensor an op needs for its backward. Through a stock SwiGLU MLP,
``down(silu(x Wg^T) * (x Wu^T))``, that is four intermediate-wide tensors per token: the gate
``g``, the up projection ``u``, ``silu(g)``, and their product (the down projection's input).
The last two are one elementwise op away from the first two, so ``swiglu`` keeps ``x``, ``g``
and ``u`` and recomputes ``silu(g) * u`` in the backward: half the MLP's saved activations
(the largest share of a step's activation memory) for a few elementwise passes, no matmul.
An RMSNorm, ``w * (x / rms(x))``, keeps its input and its normalised output; ``rms_norm``
keeps the input and one reciprocal rms per token. And where attention has fewer key/value heads
than query heads and a mask (a group's answers read their shared prompt's keys), transformers
repeats the keys and values for every query head, and the attention keeps the repeated copies;
on a CPU, ``gqa_attention`` reads the key/value heads as they are (the same bits), and attends
in float32 where a pass would attend in bfloat16 (the backward is the faster one there).

The gradients are the stock modules' (the backward formulas are written out below); under
autocast the matmuls run in its dtype as ``nn.Linear`` would. Each use of a weight casts it to
that dtype, forward and backward, unless ``weights_cast_once`` is open: then a weight is cast
once and the copy reused until the weight changes. A learner's update opens it around its
micro-batches, in which every weight is used four times or more (a prompt pass and an answers
pass, forward and backward), and the weights only change at the optimiser's step.

With ``grads_in_place`` (the learner's passes), the weight gradients of these MLPs and of the
attention's projections are added to the weights' ``.grad`` by the backward that computes them
(``addmm_``), and a trained input embedding's by ``index_add_`` over the rows it looked up,
instead of being handed to autograd. Autograd holds a weight's gradient back
until every use of the weight in the graph has sent its share, and a learner's micro-batch uses
each weight several times (a prompt pass and an answers pass): from the second
micro-batch on, a whole second set of weight gradients sat in autograd's buffers through most
of the backward (513 MiB for SmolLM2-135M in float32). ``loss.backward()`` then leaves the same
``.grad`` as before; ``torch.autograd.grad`` would not see these weights' gradients, which is
why it is the caller's choice.

``lean_layers(model)`` routes the matching modules' forward through these functions inside
its block, and an SDPA model's attention through ``gqa_attention``; modules of other shapes
(LoRA-wrapped projections, other activations, other norms) keep theirs.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from palaestra.algo.casts import cast_weight

MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
"""MLPs computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
ATTENTION_CLASSES = frozenset(
    {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}
)
"""Attention modules whose q/k/v/o projections are plain ``nn.Linear`` children."""
RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
"""Norms computing ``weight * (x / sqrt(mean(x^2) + variance_epsilon))`` in float32, cast back
to the input's dtype before the weight multiplies it."""


WIDE_SHARE_ROWS = 64
"""Under autocast, a weight's gradient share over at most this many tokens is computed in the
weight's float32 and added by the product itself (``addmm_``), rather than as a bfloat16
product added after a cast: the cast and the add are passes over the whole weight, which cost
more than the float32 product of so few rows. On the AMX Xeon a layer's four shares over 40
tokens took 1.1 ms so against 2.1 ms, and broke even at 78. (A group's prompt pass in the
tutorial's recipe has about 40.)"""


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _weight_grad(grad_out_N_O: torch.Tensor, in_N_I: torch.Tensor, like: torch.Tensor):
    """d loss / d W of ``out = in W^T`` over N flattened tokens, in ``like``'s dtype."""
    return (grad_out_N_O.T @ in_N_I).to(like.dtype)


def _add_weight_grad(weight: torch.Tensor, grad_out_N_O: torch.Tensor, in_N_I: torch.Tensor):
    """``weight.grad += grad_out^T in`` (d loss / d W of ``out = in W^T``), in place; the first
    share makes ``weight.grad``."""
    if weight.grad is None:
        weight.grad = _weight_grad(grad_out_N_O, in_N_I, weight)
    elif grad_out_N_O.dtype == weight.grad.dtype:
        weight.grad.addmm_(grad_out_N_O.T, in_N_I)
    elif grad_out_N_O.shape[0] <= WIDE_SHARE_ROWS:  # few tokens: the whole share in float32
        dtype = weight.grad.dtype
        weight.grad.addmm_(grad_out_N_O.T.to(dtype), in_N_I.to(dtype))
    else:  # autocast: the product in its dtype, the sum in the weight's
        weight.grad.add_(grad_out_N_O.T @ in_N_I)


def _weight_share(weight, grad_out_N_O, in_N_I, in_place: bool):
    """This use's gradient of ``weight`` for autograd, or None once added to ``.grad``."""
    if not in_place:
        return _weight_grad(grad_out_N_O, in_N_I, weight)
    _add_weight_grad(weight, grad_out_N_O, in_N_I)
    return None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, w_down, b_down, dtype, in_place):
        xc = x.to(dtype)
        g = F.linear(xc, cast_weight(w_gate, dtype), _cast(b_gate, dtype))
        u = F.linear(xc, cast_weight(w_up, dtype), _cast(b_up, dtype))
        out = F.linear(F.silu(g) * u, cast_weight(w_down, dtype), _cast(b_down, dtype))
        ctx.save_for_backward(xc, g, u, w_gate, b_gate, w_up, b_up, w_down, b_down)
        ctx.x_dtype, ctx.in_place = x.dtype, in_place
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xc, g, u, w_gate, b_gate, w_up, b_up, w_down, b_down = ctx.saved_tensors
        need = ctx.needs_input_grad
        dtype = g.dtype
        a = F.silu(g)
        dy = grad_out.to(dtype).reshape(-1, grad_out.shape[-1])
        grads: list[torch.Tensor | None] = [None] * 9
        if need[5]:
            grads[5] = _weight_share(w_down, dy, (a * u).reshape(dy.shape[0], -1), ctx.in_place)
        if need[6]:
            grads[6] = dy.sum(0).to(b_down.dtype)
        dp = dy @ cast_weight(w_down, dtype)  # d loss / d (silu(g) * u)
        du = dp * a.reshape(dp.shape)
        dg = torch.ops.aten.silu_backward(dp * u.reshape(dp.shape), g.reshape(dp.shape))
        x2 = xc.reshape(dy.shape[0], -1)
        if need[1]:
            grads[1] = _weight_share(w_gate, dg, x2, ctx.in_place)
        if need[2]:
            grads[2] = dg.sum(0).to(b_gate.dtype)
        if need[3]:
            grads[3] = _weight_share(w_up, du, x2, ctx.in_place)
        if need[4]:
            grads[4] = du.sum(0).to(b_up.dtype)
        if need[0]:
            dx = dg @ cast_weight(w_gate, dtype) + du @ cast_weight(w_up, dtype)
            grads[0] = dx.reshape(xc.shape).to(ctx.x_dtype)
        return tuple(grads)


def swiglu(
    x,
    gate: torch.nn.Linear,
    up: torch.nn.Linear,
    down: torch.nn.Linear,
    grads_in_place: bool = False,
):
    """``down(silu(gate(x)) * up(x))``, keeping ``x``, the gate and the up projection for the
    backward only; with ``grads_in_place``, the backward adds the weights' gradients to their
    ``.grad`` itself."""
    return _SwiGLU.apply(
        x,
        gate.weight,
        gate.bias,
        up.weight,
        up.bias,
        down.weight,
        down.bias,
        _compute_dtype(x),
        grads_in_place,
    )


_last_input_cast: tuple = (None, None, None, None)
"""(weak reference to an input, its version, dtype, weak reference to its cast): the last
cast ``_cast_input`` made."""


def _cast_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, the same copy for consecutive calls on the same input: an attention's
    query, key and value projections read one normed input, which under autocast was cast
    (and kept for the backward) three times."""
    global _last_input_cast
    if x.dtype == dtype:
        return x
    source, version, cast_dtype, cast = _last_input_cast
    if source is not None and source() is x and (version, cast_dtype) == (x._version, dtype):
        held = cast()
        if held is not None:
            return held
    xc = x.to(dtype)
    _last_input_cast = (weakref.ref(x), x._version, dtype, weakref.ref(xc))
    return xc


class _Linear(torch.autograd.Function):
    """``nn.Linear``'s product whose backward adds the weight's gradient to ``.grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xc = _cast_input(x, dtype)
        ctx.save_for_backward(xc, weight)
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return F.linear(xc, cast_weight(weight, dtype), _cast(bias, dtype))

    @staticmethod
    def backward(ctx, grad_out):
        xc, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy = grad_out.to(xc.dtype).reshape(-1, grad_out.shape[-1])
        if need[1]:
            _add_weight_grad(weight, dy, xc.reshape(dy.shape[0], -1))
        grad_bias = dy.sum(0).to(ctx.bias_dtype) if need[2] else None
        grad_x = None
        if need[0]:
            grad_x = (dy @ cast_weight(weight, dy.dtype)).reshape(xc.shape).to(ctx.x_dtype)
        return grad_x, None, grad_bias, None


def linear_grads_in_place(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)``, with the weight's gradient added to its ``.grad`` by the backward."""
    return _Linear.apply(x, layer.weight, layer.bias, _compute_dtype(x))


class _Embedding(torch.autograd.Function):
    """``nn.Embedding``'s lookup whose backward adds the looked-up rows' gradients to the
    weight's ``.grad`` (``index_add_``). Autograd's own backward makes a dense zero gradient of
    the whole table (vocabulary x hidden) for the few rows a micro-batch reads, then adds it
    into ``.grad``: two passes over 113 MB a micro-batch for SmolLM2-135M in float32."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows_N = ids.reshape(-1)
        grad_N_D = grad_out.reshape(rows_N.shape[0], -1)
        if ctx.padding_idx is not None:  # the padding row gets no gradient, as in F.embedding
            keep_N = rows_N != ctx.padding_idx
            rows_N, grad_N_D = rows_N[keep_N], grad_N_D[keep_N]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, rows_N, grad_N_D.to(weight.grad.dtype))
        return None, None, None


def _plain_embedding(module: torch.nn.Module) -> bool:
    """A trained ``nn.Embedding`` that only looks rows up (no max_norm, no sparse or
    frequency-scaled gradient)."""
    return (
        type(module) is torch.nn.Embedding
        and module.weight.requires_grad
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    )


def embedding_grads_in_place(ids: torch.Tensor, embedding: torch.nn.Embedding) -> torch.Tensor:
    """``embedding(ids)``, with the looked-up rows' gradients added to ``.grad`` by the
    backward."""
    return _Embedding.apply(ids, embedding.weight, embedding.padding_idx)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, rstd, weight = ctx.saved_tensors
        xhat = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            products = grad_out * xhat.to(x.dtype)
            grad_weight = products.reshape(-1, products.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # y = x * r, r = (mean(x^2) + eps)^-1/2:  dx = r * (dy - y * mean(dy * y))
            dxhat = (grad_out * weight).to(x.dtype).float()
            grad_x = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` (float32 inside), keeping ``x`` and one
    reciprocal rms per token for the backward."""
    return _RMSNorm.apply(x, weight, eps)


LEAN_ATTENTION = "palaestra_lean_sdpa"


def gqa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except on a CPU:

    - a masked pass reads ``key`` and ``value`` with their own (fewer) heads through SDPA's
      ``enable_gqa`` instead of repeated for every query head. transformers repeats them
      whenever there is a mask, since on CUDA a mask with ``enable_gqa`` falls back to the math
      kernel; on a CPU the result has the same bits, and autograd keeps the unrepeated tensors.
    - a pass that would attend in bfloat16 or float16 (its inputs' dtype, or autocast's)
      attends in float32 instead, outside autocast, and hands its output back in that dtype.
      PyTorch's CPU flash-attention backward is several times slower in bfloat16 than in
      float32 on a learner's shapes (a group's answers over their prompt: 6.8 against 1.8 ms on
      a 2-core AMX Xeon), while the casts cost little (the queries and keys arrive in float32
      from the rotary embedding). Passes without gradients (a learner's scoring) attend the
      same way, so that the log-probs they score are the ones the update computes again."""
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = _compute_dtype(query)  # under autocast, SDPA would run in autocast's dtype
    if dtype in (torch.bfloat16, torch.float16):
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):
            out, weights = _cpu_attention(
                module, query.float(), key.float(), value.float(), attention_mask, **kwargs
            )
        return out.to(dtype), weights
    return _cpu_attention(module, query, key, value, attention_mask, **kwargs)


def _cpu_attention(module, query, key, value, attention_mask, **kwargs):
    grouped = query.shape[1] != key.shape[1]
    plain = kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    if attention_mask is None or not grouped or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(LEAN_ATTENTION, gqa_attention)
AttentionMaskInterface.register(LEAN_ATTENTION, sdpa_mask)  # its masks are SDPA's


def plain_swiglu(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an MLP of MLP_CLASSES with SiLU and plain ``nn.Linear``
    projections (LoRA-wrapped or otherwise replaced ones are not plain)."""
    if type(module).__name__ not in MLP_CLASSES:
        return False
    projections = (module.gate_proj, module.up_proj, module.down_proj)
    if any(type(p) is not torch.nn.Linear for p in projections):
        return False
    act = module.act_fn
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _lean_mlp(module: torch.nn.Module, grads_in_place: bool):
    if not plain_swiglu(module):
        return None  # other MLPs keep the stock forward
    return lambda x: swiglu(x, module.gate_proj, module.up_proj, module.down_proj, grads_in_place)


def _projections(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """The trained plain ``nn.Linear`` projections of an attention module of ATTENTION_CLASSES
    (LoRA-wrapped ones are not plain, and keep their forward)."""
    if type(module).__name__ not in ATTENTION_CLASSES:
        return []
    return [
        child
        for child in module.children()
        if type(child) is torch.nn.Linear and child.weight.requires_grad
    ]


def _lean_norm(module: torch.nn.Module):
    if type(module).__name__ not in RMS_NORM_CLASSES:
        return None
    return lambda x: rms_norm(x, module.weight, module.variance_epsilon)


@contextlib.contextmanager
def lean_layers(model: torch.nn.Module, grads_in_place: bool = False):
    """Inside the block, ``model``'s SwiGLU MLPs and RMSNorms run as ``swiglu`` and
    ``rms_norm``, and SDPA attention as ``gqa_attention``; with ``grads_in_place``, the MLPs',
    the attention projections' and the trained embeddings' weight gradients go straight to
    ``.grad`` in the backward (for ``loss.backward()``; not for ``torch.autograd.grad``).
    After the block, every module has its own forward again. Yields how many modules it
    patched."""
    patched = []
    for module in model.modules():
        forward = _lean_mlp(module, grads_in_place) or _lean_norm(module)
        if forward is not None and "forward" not in vars(module):
            module.forward = forward
            patched.append(module)
        for layer in _projections(module) if grads_in_place else ():
            if "forward" not in vars(layer):
                layer.forward = functools.partial(linear_grads_in_place, layer=layer)
                patched.append(layer)
        if grads_in_place and _plain_embedding(module) and "forward" not in vars(module):
            module.forward = functools.partial(embedding_grads_in_place, embedding=module)
            patched.append(module)
    config = getattr(model, "config", None)  # a bare module (a lone MLP) has none to switch
    attention = getattr(config, "_attn_implementation", None)
    if attention == "sdpa":
        config._attn_implementation = LEAN_ATTENTION
    try:
        yield len(patched)
    finally:
        if attention == "sdpa":
            config._attn_implementation = attention
        for module in patched:
            del module.forward
