"""Log-probs and entropies of chosen tokens straight from hidden states, a chunk at a time.

The trainer needs, for each response token, ``log softmax(h W^T / temperature)[target]`` and
the entropy of that distribution. Computing it the plain way materialises a float32
vocabulary-wide row of logits for every token of the batch, keeps it alive for the backward
pass, and pays the lm head on prompt and padding positions whose results are thrown away.
Here the head is applied only to the positions that are scored, ``chunk_size`` tokens at a
time, and each chunk's logits are recomputed in the backward pass instead of being kept
(activation checkpointing), so at most one chunk of logits exists at once.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_SIZE = 1024
"""Tokens per chunk: large enough for an efficient matmul, small enough that one chunk's
logits (chunk x vocabulary floats) stay a few hundred MB at most."""


def chunked_token_logprobs(
    hidden_N_D: torch.Tensor,
    head_weight_V_D: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    head_bias_V: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_N`` of ``targets_N`` and ``entropy_N`` of each token's distribution, under
    ``softmax((hidden @ head_weight^T + head_bias) / temperature)``, both float32.

    Equal (up to float rounding) to :func:`palaestra.algo.losses.token_logprobs` and
    :func:`~palaestra.algo.losses.token_entropy` on the full logits, gradients included.
    """
    logprobs, entropies = [], []
    for start in range(0, hidden_N_D.shape[0], chunk_size):
        hidden_C_D = hidden_N_D[start : start + chunk_size]
        targets_C = targets_N[start : start + chunk_size]
        if torch.is_grad_enabled() and (hidden_C_D.requires_grad or head_weight_V_D.requires_grad):
            logprobs_C, entropy_C = checkpoint(
                _chunk,
                hidden_C_D,
                head_weight_V_D,
                head_bias_V,
                targets_C,
                temperature,
                use_reentrant=False,
            )
        else:
            logprobs_C, entropy_C = _chunk(
                hidden_C_D, head_weight_V_D, head_bias_V, targets_C, temperature
            )
        logprobs.append(logprobs_C)
        entropies.append(entropy_C)
    if not logprobs:
        empty = hidden_N_D.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprobs), torch.cat(entropies)


def _chunk(
    hidden_C_D: torch.Tensor,
    weight_V_D: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_C: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The matmul runs in whatever precision autocast asks for; the softmax in float32.
    logits_C_V = torch.nn.functional.linear(hidden_C_D, weight_V_D, bias_V).float() / temperature
    log_z_C = torch.logsumexp(logits_C_V, dim=-1)
    picked_C = logits_C_V.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1)
    probs_C_V = torch.softmax(logits_C_V, dim=-1)
    entropy_C = log_z_C - (probs_C_V * logits_C_V).sum(dim=-1)
    return picked_C - log_z_C, entropy_C
