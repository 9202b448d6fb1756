"""Choosing the next token of each row of a batch, each row under its own sampling settings.

Rows in one decode step may come from different requests: each has its own temperature,
top-p and random generator, so a seeded row draws the same tokens whatever shares its batch.
"""

from __future__ import annotations

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
    """
    logits_B_V = logits_B_V.float()
    # Greedy rows are scaled by 1: their log-prob is the raw logits' log-softmax.
    scale_B_1 = torch.tensor([t if t > 0 else 1.0 for t in temperatures_B]).unsqueeze(-1)
    logprobs_B_V = torch.log_softmax(logits_B_V / scale_B_1.to(logits_B_V.device), dim=-1)
    greedy_B = logits_B_V.argmax(dim=-1).tolist()
    tokens_B: list[int] = []
    for b, (temperature, top_p) in enumerate(zip(temperatures_B, top_ps_B, strict=True)):
        if temperature <= 0:
            tokens_B.append(greedy_B[b])
            continue
        probs_V = logprobs_B_V[b].exp()
        if top_p < 1.0:
            probs_V = nucleus(probs_V, top_p)
        tokens_B.append(int(torch.multinomial(probs_V, 1, generator=generators_B[b])))
    picked_B = logprobs_B_V.gather(-1, torch.tensor(tokens_B, device=logits_B_V.device)[:, None])
    return tokens_B, picked_B.squeeze(-1).tolist()


def nucleus(probs_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs_V`` with everything outside the top-``top_p`` nucleus set to zero.

    A token is kept when the mass of the tokens more likely than it is still below ``top_p``,
    so the most likely token always survives.
    """
    sorted_V, order_V = torch.sort(probs_V, descending=True)
    mass_before_V = torch.cumsum(sorted_V, dim=-1) - sorted_V
    sorted_V = torch.where(mass_before_V < top_p, sorted_V, torch.zeros_like(sorted_V))
    return torch.zeros_like(probs_V).scatter(-1, order_V, sorted_V)
