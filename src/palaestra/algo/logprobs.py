"""Log-probs and entropies of chosen tokens straight from hidden states, without ever holding
a vocabulary-wide row of logits per token.

The trainer needs, for each response token, ``log softmax(h W^T / temperature)[target]`` and
the entropy of that distribution. The plain way materialises float32 logits for every token
of the batch, keeps them (and the softmax) for the backward pass, and autograd then walks
several vocabulary-wide elementwise ops back, each a trip through main memory. Here the head
runs only on the positions that are scored, and over the vocabulary a slice at a time, so each
slice of logits is made, used and dropped while it is still in cache: the forward keeps a
running maximum, normaliser and expected logit per token (as flash attention does over keys),
and the backward recomputes each slice and writes the gradient in closed form:

    z = (h W^T + b) / temperature,   p = softmax(z),   E = sum_v p_v z_v
    logprob = z_target - logsumexp(z)           d logprob / dz = onehot(target) - p
    entropy = logsumexp(z) - E                  d entropy / dz = -p * (z - E)

Each slice of the head's weight gets its gradient once, whole. Where a call's logits fit in
``KEEP_BYTES`` (a micro-batch of short answers: 320 tokens of a 49152-entry vocabulary hold
63 MB), the forward keeps each slice for the backward, which then runs the head's two gradient
matmuls and nothing more; above it, the backward recomputes each slice, one head matmul more.
"""

from __future__ import annotations

import torch

from palaestra.algo.casts import cast_weight, casting_once

TOKEN_CHUNK = 512
"""Tokens per outer chunk: bounds a slice of logits at TOKEN_CHUNK x VOCAB_CHUNK floats."""
VOCAB_CHUNK = 1024
"""Vocabulary entries per slice: small enough that a slice of logits and of the head's weight
stay in cache, large enough for an efficient matmul."""
KEEP_BYTES = 256 << 20
"""The most float32 logits a call keeps from its forward for its backward, rather than
recomputing them there: one head matmul of four saved for this much memory held in between."""


def chunked_token_logprobs(
    hidden_N_D: torch.Tensor,
    head_weight_V_D: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    head_bias_V: torch.Tensor | None = None,
    weight_grad_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_N`` of ``targets_N`` and ``entropy_N`` of each token's distribution, under
    ``softmax((hidden @ head_weight^T + head_bias) / temperature)``, both float32.

    Equal (up to float rounding) to :func:`palaestra.algo.losses.token_logprobs` and
    :func:`~palaestra.algo.losses.token_entropy` on the full logits, gradients included. The
    matmuls run in the autocast dtype when autocast is on, the softmax in float32.

    With ``weight_grad_in_place`` the backward adds the head weight's gradient to its
    ``.grad`` itself rather than handing it to autograd, which would hold it (vocabulary x
    hidden floats) until a tied input embedding's backward, the last of the pass.
    """
    device = hidden_N_D.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_N_D, head_weight_V_D, head_bias_V)
    )
    keep = backward and hidden_N_D.shape[0] * head_weight_V_D.shape[0] * 4 <= KEEP_BYTES
    with torch.autocast(device, enabled=False):
        return _HeadLogprobs.apply(
            hidden_N_D,
            head_weight_V_D,
            head_bias_V,
            targets_N,
            temperature,
            dtype,
            weight_grad_in_place,
            keep,
        )


def _slices(total: int, size: int):
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def _logits(hidden_C_D, weight_v_D, bias_v, temperature: float) -> torch.Tensor:
    """Float32 logits / temperature of tokens ``hidden_C_D`` over one vocabulary slice (its
    weight and bias already in the compute dtype): a fresh tensor, the caller's to overwrite."""
    z_C_v = torch.nn.functional.linear(hidden_C_D, weight_v_D, bias_v).float()
    return z_C_v if temperature == 1.0 else z_C_v.div_(temperature)


def _slice_params(weight_V_D, bias_V, vocab: slice, dtype):
    """One vocabulary slice of the head in the compute dtype. Outside ``weights_cast_once``
    the full weight stays float32, since casting it whole would cost a pass over it (and
    another for its gradient) per call, while a slice is cast in cache; inside, the slice is a
    view of the one cast copy of the weight."""
    if casting_once():
        weight_v_D = cast_weight(weight_V_D, dtype)[vocab]
    else:
        weight_v_D = weight_V_D[vocab].to(dtype)
    return weight_v_D, None if bias_V is None else bias_V[vocab].to(dtype)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_N_D, weight_V_D, bias_V, targets_N, temperature, dtype, in_place, keep):
        dtype = dtype or weight_V_D.dtype
        # With ``keep``, each slice's z - m (m: the running max when it was made) and m, by
        # token chunk and vocabulary slice: z = kept + m, for the backward.
        kept: list[list] | None = [] if keep else None
        N, V = hidden_N_D.shape[0], weight_V_D.shape[0]
        log_z_N = hidden_N_D.new_empty(N, dtype=torch.float32)
        picked_N = torch.empty_like(log_z_N)
        expected_N = torch.empty_like(log_z_N)
        for tokens in _slices(N, TOKEN_CHUNK):
            hidden_C_D, targets_C = hidden_N_D[tokens].to(dtype), targets_N[tokens]
            # Running max m, sum s of exp(z - m), and sum t of exp(z - m) * z, per token.
            m_C = torch.full_like(log_z_N[tokens], -torch.inf)
            s_C, t_C = torch.zeros_like(m_C), torch.zeros_like(m_C)
            if kept is not None:
                kept.append([])
            for vocab in _slices(V, VOCAB_CHUNK):
                weight_v_D, bias_v = _slice_params(weight_V_D, bias_V, vocab, dtype)
                z_C_v = _logits(hidden_C_D, weight_v_D, bias_v, temperature)
                inside_C = (targets_C >= vocab.start) & (targets_C < vocab.stop)
                offsets_C = (targets_C - vocab.start).clamp(0, z_C_v.shape[1] - 1)
                here_C = z_C_v.gather(-1, offsets_C[:, None]).squeeze(-1)
                picked_N[tokens] = torch.where(inside_C, here_C, picked_N[tokens])
                new_m_C = torch.maximum(m_C, z_C_v.amax(dim=-1))
                rescale_C = torch.exp(m_C - new_m_C)
                # sum_v e_v z_v = sum_v e_v (z_v - m) + m s: the exponent's argument serves
                # both sums, so the slice is walked by fewer vocabulary-wide passes.
                shifted_C_v = z_C_v.sub_(new_m_C[:, None])
                if kept is not None:
                    kept[-1].append((shifted_C_v, new_m_C))  # neither is written again
                e_C_v = shifted_C_v.exp()
                slice_s_C = e_C_v.sum(-1)
                slice_t_C = torch.linalg.vecdot(e_C_v, shifted_C_v) + new_m_C * slice_s_C
                s_C = s_C * rescale_C + slice_s_C
                t_C = t_C * rescale_C + slice_t_C
                m_C = new_m_C
            log_z_N[tokens] = m_C + s_C.log()
            expected_N[tokens] = t_C / s_C
        ctx.save_for_backward(hidden_N_D, weight_V_D, bias_V, targets_N, log_z_N, expected_N)
        # An output no loss reads (the entropy, without an entropy term) comes back as None,
        # not zeros, and its vocabulary-wide part of the gradient is skipped.
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.dtype, ctx.in_place, ctx.kept = temperature, dtype, in_place, kept
        return picked_N - log_z_N, log_z_N - expected_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_N_D, weight_V_D, bias_V, targets_N, log_z_N, expected_N = ctx.saved_tensors
        temperature, dtype = ctx.temperature, ctx.dtype
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        N, V = hidden_N_D.shape[0], weight_V_D.shape[0]
        if grad_logprobs_N is None:
            grad_logprobs_N = torch.zeros_like(log_z_N)
        grad_hidden_N_D = torch.zeros_like(hidden_N_D, dtype=torch.float32)
        # Every slice of the weight's gradient is written whole by the first token chunk.
        new = torch.empty_like if N else torch.zeros_like
        grad_weight_V_D, fresh = None, True
        if want_weight and ctx.in_place:
            fresh = weight_V_D.grad is None
            if fresh:
                weight_V_D.grad = new(weight_V_D)
            grad_weight_V_D = weight_V_D.grad
        elif want_weight:
            grad_weight_V_D = new(weight_V_D, dtype=torch.float32)
        grad_bias_V = new(bias_V, dtype=torch.float32) if want_bias else None
        # Per-token factors of the slice's gradient (see the loop), each over the temperature.
        scaled_g_logprob_N1 = (grad_logprobs_N / temperature)[:, None]
        minus_g_logprob_N1 = -scaled_g_logprob_N1  # minus_weight without an entropy term
        if grad_entropy_N is not None:
            entropy_a_N = -grad_entropy_N / temperature
            entropy_b_N = -(grad_logprobs_N - grad_entropy_N * expected_N) / temperature
        kept, ctx.kept = ctx.kept, None  # released as the slices are used
        for first, tokens in enumerate(_slices(N, TOKEN_CHUNK)):
            hidden_C_D, targets_C = hidden_N_D[tokens].to(dtype), targets_N[tokens]
            log_z_C = log_z_N[tokens, None]
            for index, vocab in enumerate(_slices(V, VOCAB_CHUNK)):
                weight_v_D, bias_v = _slice_params(weight_V_D, bias_V, vocab, dtype)
                # z = base + shift: the kept slice (left as it is) and its max, or the slice
                # made again (this loop's to overwrite) and 0.
                if kept is None:
                    base_C_v = _logits(hidden_C_D, weight_v_D, bias_v, temperature)
                    shift_C1 = None
                else:
                    base_C_v, shift_C = kept[first][index]
                    kept[first][index] = None
                    shift_C1 = shift_C[:, None]
                # dL/dz = g_logprob * onehot(target) - p * (g_logprob + g_entropy * (z - E)),
                # and dL/dlogits = dL/dz / temperature. Per-token factors a and b fold the
                # sign and the temperature in: minus_weight = z * a + b (a = 0 without an
                # entropy term), then p = exp(z - log Z) and p * minus_weight in place.
                if grad_entropy_N is None:
                    minus_weight_C_v = minus_g_logprob_N1[tokens]
                else:
                    a_C1, b_C1 = entropy_a_N[tokens, None], entropy_b_N[tokens, None]
                    if shift_C1 is not None:
                        b_C1 = b_C1 + a_C1 * shift_C1
                    minus_weight_C_v = torch.mul(base_C_v, a_C1)
                    minus_weight_C_v.add_(b_C1)  # addcmul: 2.5x slower
                if shift_C1 is None:
                    grad_C_v = base_C_v.sub_(log_z_C)
                else:
                    grad_C_v = torch.sub(base_C_v, log_z_C - shift_C1)
                grad_C_v = grad_C_v.exp_().mul_(minus_weight_C_v)
                inside_C = (targets_C >= vocab.start) & (targets_C < vocab.stop)
                offsets_C = (targets_C - vocab.start).clamp(0, grad_C_v.shape[1] - 1)
                grad_C_v.scatter_add_(
                    -1, offsets_C[:, None], scaled_g_logprob_N1[tokens] * inside_C[:, None]
                )
                grad_logits_C_v = grad_C_v.to(dtype)
                if want_hidden:
                    grad_hidden_N_D[tokens] += grad_logits_C_v @ weight_v_D
                if want_weight:
                    # In the compute dtype, then cast into the float32 gradient as it is
                    # written or added (one pass, not a cast and then a copy).
                    grad_v_D = grad_logits_C_v.T @ hidden_C_D
                    if first == 0 and fresh:
                        grad_weight_V_D[vocab].copy_(grad_v_D)
                    else:
                        grad_weight_V_D[vocab].add_(grad_v_D)
                if want_bias:
                    grad_b_v = grad_logits_C_v.float().sum(0)
                    if first == 0:
                        grad_bias_V[vocab] = grad_b_v
                    else:
                        grad_bias_V[vocab] += grad_b_v
        return (
            grad_hidden_N_D.to(hidden_N_D.dtype) if want_hidden else None,
            None
            if grad_weight_V_D is None or ctx.in_place
            else grad_weight_V_D.to(weight_V_D.dtype),
            None if grad_bias_V is None else grad_bias_V.to(bias_V.dtype),
            None,
            None,
            None,
            None,
            None,
        )
