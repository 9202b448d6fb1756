"""Choosing the next token of each row of a batch, each row under its own sampling settings.

Rows in one decode step may come from different requests: each has its own temperature,
top-p and random generator, so a seeded row draws the same tokens whatever shares its batch.
"""

from __future__ import annotations

import math

import torch


def row_seed(seed: int, sample_index: int) -> int:
    """The generator seed of sample ``sample_index`` of a request seeded with ``seed``.

    The samples of one request must differ, and each must depend only on the request's own
    seed, never on the other rows sharing the batch.
    """
    return (seed * 1_000_003 + sample_index * 7_919) % (2**63)


def sample_next_tokens(
    logits_B_V: torch.Tensor,
    temperatures_B: list[float],
    top_ps_B: list[float],
    generators_B: list[torch.Generator],
) -> tuple[list[int], list[float]]:
    """One token per row, and the row's log-prob of it.

    Temperature 0 is greedy (argmax) and its log-prob is the log-softmax of the raw logits.
    Otherwise the token is drawn from ``softmax(logits / temperature)``, cut to the smallest set
    of tokens whose mass reaches ``top_p``, and the log-prob is the one under the temperature
    alone (before the top-p cut), which is what the trainer recomputes: it scores tokens under
    the sampling temperature and does not model top-p, as TRL does not.

    Sampling inverts each row's cumulative distribution at one uniform draw from the row's own
    generator: one batched cumsum and search instead of a ``multinomial`` call per row.
    """
    device = logits_B_V.device
    # One float32 working copy, scaled in place; the rest reads it or works on one more
    # vocabulary-wide tensor (each a fresh 6 MB at 32 rows of a 49k vocabulary, whose pages
    # cost more than the arithmetic).
    z_B_V = logits_B_V.to(torch.float32, copy=True)
    # Greedy rows are scaled by 1: their log-prob is the raw logits' log-softmax. (A division
    # by 1 changes no bit: where every row is at 1, none is made.)
    scales_B = [t if t > 0 else 1.0 for t in temperatures_B]
    if any(scale != 1.0 for scale in scales_B):
        z_B_V.div_(torch.tensor(scales_B, device=device).unsqueeze(-1))
    log_z_B = torch.logsumexp(z_B_V, dim=-1)
    probs_B_V = torch.sub(z_B_V, log_z_B.unsqueeze(-1)).exp_()
    if any(p < 1.0 for p in top_ps_B):
        # Rows at top_p 1 keep every token, rounding in the running mass notwithstanding.
        thresholds_B = [p if p < 1.0 else math.inf for p in top_ps_B]
        top_p_B_1 = torch.tensor(thresholds_B, device=device).unsqueeze(-1)
        probs_B_V = nucleus(probs_B_V, top_p_B_1)
    uniforms_B = torch.stack([torch.rand((), generator=g, device=device) for g in generators_B])
    tokens_B = search_cdf(probs_B_V.cumsum_(dim=-1), uniforms_B)  # probs_B_V is ours
    if any(t <= 0 for t in temperatures_B):  # a pass over the vocabulary, only where needed
        greedy_B = torch.tensor([t <= 0 for t in temperatures_B], device=device)
        tokens_B = torch.where(greedy_B, z_B_V.argmax(dim=-1), tokens_B)
    picked_B = z_B_V.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1) - log_z_B
    return tokens_B.tolist(), picked_B.tolist()


def inverse_cdf(probs_B_V: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative mass exceeds ``uniform * total mass``.

    Rows need not be normalised (a nucleus cut leaves them short of 1). A token of zero mass
    adds nothing to the running sum, so it can never be the first to exceed the target.
    """
    return search_cdf(probs_B_V.cumsum(dim=-1), uniforms_B)


def search_cdf(cdf_B_V: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """``inverse_cdf`` over rows already summed up (``probs_B_V.cumsum(-1)``)."""
    total_B = cdf_B_V[:, -1]
    # Rounding could lift ``uniform * total`` to the total itself, past every token; keep the
    # target just below it, so the search always lands on a token with mass.
    targets_B = torch.minimum(
        uniforms_B * total_B, torch.nextafter(total_B, torch.zeros_like(total_B))
    )
    return torch.searchsorted(cdf_B_V, targets_B.unsqueeze(-1), right=True).squeeze(-1)


def nucleus(probs_V: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """``probs_V`` with everything outside the top-``top_p`` nucleus set to zero.

    A token is kept when the mass of the tokens more likely than it is still below ``top_p``,
    so the most likely token always survives. Works on a batch of rows too, with ``top_p`` a
    number or a column of one threshold per row.
    """
    sorted_V, order_V = torch.sort(probs_V, descending=True)
    mass_before_V = torch.cumsum(sorted_V, dim=-1) - sorted_V
    sorted_V = torch.where(mass_before_V < top_p, sorted_V, torch.zeros_like(sorted_V))
    return torch.zeros_like(probs_V).scatter(-1, order_V, sorted_V)
