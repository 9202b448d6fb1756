"""Scoring a batch under the policy: the log-prob and entropy of every token the loss counts.

This is the learner's forward pass, and nearly all of a step's arithmetic, so it avoids work
that changes no number:

- A group's samples share their prompt. Its tokens run through the model once per group, and
  the group's samples continue from that prompt's keys and values (gradients flow back through
  them into the one prompt pass), instead of once per sample: with 8 samples of a 40-token
  prompt and 40-token answers, that is 45% fewer tokens through the model.
- The groups of a micro-batch share their passes: one pass over all their prompts, one over
  all their answers, each answer masked to its own prompt. Every pass over a weight costs a
  share of its gradient (a product, and under bfloat16 a cast and an add into the float32
  ``.grad``) and a round of small-op overheads, and larger passes make larger, faster matmuls:
  with two groups of 8 a micro-batch, the update of ``bench/update_profile.py`` took 13% less
  time than with a pair of passes per group.
- The answers' pass packs a group's answers end to end, several to a row (``pack_answers``),
  each attending to its prompt and its own tokens under a boolean mask, rather than padding
  every answer to the longest: answers sampled at temperature 1 end anywhere, and padding
  costs every product in full. ``bench/update_profile.py``'s update (groups of 8 answers of
  21 to 49 positions) took 11.4-11.6 s against 12.7-13.0 s with the answers one to a row in
  two length buckets, and 6.2-6.6 s against 7.5 s with the tutorial's answers of at most 20
  tokens (medians of 3, the two versions run in turn, 2-core AVX2 EPYC). Attention other
  than SDPA's takes no boolean mask: there a group's answers run one to a row, right-padded,
  where causal attention needs no mask.
- The lm head runs only at scored positions, a chunk at a time (``algo.logprobs``).
- Matmuls run in bfloat16 under autocast when the recipe's precision resolves to it.
- SwiGLU MLPs and RMSNorms keep only what their backward cannot cheaply recompute
  (``models.lean_layers``): a third fewer saved activations, the same gradients. Their weight
  gradients and the attention projections' are added to ``.grad`` as the backward computes
  them, not held by autograd until each weight's last use (a prompt pass and an answers pass
  per group): ``loss.backward()`` is how these passes are differentiated.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from palaestra.algo.logprobs import chunked_token_logprobs
from palaestra.models.kv_cache import (
    cache_argument,
    has_plain_attention,
    select_rows,
)
from palaestra.models.lean_layers import LEAN_ATTENTION, lean_layers
from palaestra.models.loading import compute_dtype
from palaestra.recipes import Recipe
from palaestra.train.batch import TrainBatch, micro_batch_rows, prefix_groups, take_rows


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the passes: matmuls in ``dtype``, weights and their updates float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def score_tokens(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float,
    dtype: torch.dtype,
    share_prefixes: bool = True,
    lean: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_B_T`` and ``entropy_B_T`` of the scored tokens of ``batch`` under ``model``,
    aligned like ``batch.mask_B_T`` (position t holds token t + 1's); 0 where the mask is 0.

    Tokens are scored under the sampling ``temperature`` (as the sampler saw them; top-p
    truncation is not modelled, as in TRL).

    ``share_prefixes=False`` runs every row in one plain decoder pass (the same numbers): a
    sharded learner needs each rank to call every layer the same number of times, since each
    call gathers that layer's weights from all ranks. ``lean=False`` keeps the stock layers:
    activation checkpointing recomputes a block after this function has returned, outside
    ``lean_layers``, and the recomputed pass must save what the first one saved.
    """
    input_ids_B_T = batch.input_ids_B_T
    device = input_ids_B_T.device
    scored_B_T = batch.mask_B_T > 0
    scored_B_T[:, -1] = False  # the last position predicts no token of the batch
    lengths_B = batch.attention_mask_B_T.sum(dim=1).tolist()
    decoder = model.get_decoder()
    share = share_prefixes and has_plain_attention(model.config)
    alone, shared = [], []
    for rows, start in prefix_groups(input_ids_B_T, scored_B_T):
        if share and len(rows) > 1 and start > 0:
            shared.append((rows, start))
        else:
            alone += [b for b in rows if scored_B_T[b].any()]
    zeros_B_T = torch.zeros(scored_B_T.shape, dtype=torch.float32, device=device)
    if not alone and not shared:  # nothing to score (every response masked out)
        zeros_B_T.requires_grad_(torch.is_grad_enabled())
        return zeros_B_T, zeros_B_T.detach()

    hidden, rows_N, cols_N = [], [], []
    # The weights' gradients go to .grad in the backward itself: the learner calls backward().
    in_place = torch.is_grad_enabled()
    layers = lean_layers(model, grads_in_place=in_place) if lean else contextlib.nullcontext()
    with autocast(device, dtype), layers:
        # One embedding lookup for the micro-batch, so its backward (a dense, vocabulary-sized
        # gradient) runs once, however many passes read slices of it.
        embeds_B_T_D = model.get_input_embeddings()(input_ids_B_T)
        if alone:
            # Rows with a context of their own: one plain pass over them all.
            width = max(lengths_B[b] for b in alone)
            hidden_A_T_D = decoder(inputs_embeds=embeds_B_T_D[alone, :width]).last_hidden_state
            where_A_T = scored_B_T[alone, :width]
            hidden.append(hidden_A_T_D[where_A_T])
            a, t = where_A_T.nonzero(as_tuple=True)
            rows_N.append(torch.tensor(alone, device=device)[a])
            cols_N.append(t)
        # Every group's prompt in one pass, then every group's rows after their own prompt in
        # a second: two passes for the micro-batch, however many groups it holds. Attention
        # other than SDPA's takes no boolean mask; there each group runs its own two passes.
        merge = getattr(model.config, "_attn_implementation", None) in SDPA_LIKE
        for groups in [shared] if merge and shared else [[group] for group in shared]:
            found = _after_prefixes(decoder, embeds_B_T_D, scored_B_T, lengths_B, groups, merge)
            for parts, part in zip((hidden, rows_N, cols_N), found, strict=True):
                parts.append(part)
        rows_N, cols_N = torch.cat(rows_N), torch.cat(cols_N)
        head = model.get_output_embeddings()
        logprobs_N, entropy_N = chunked_token_logprobs(
            torch.cat(hidden),
            head.weight,
            input_ids_B_T[rows_N, cols_N + 1],
            temperature,
            head.bias,
            weight_grad_in_place=in_place,
        )
    return (
        zeros_B_T.index_put((rows_N, cols_N), logprobs_N),
        zeros_B_T.index_put((rows_N, cols_N), entropy_N),
    )


SDPA_LIKE = frozenset({"sdpa", LEAN_ATTENTION})
"""Attention implementations that read a boolean 4D mask as "may attend"."""


def _after_prefixes(decoder, embeds_B_T_D, scored_B_T, lengths_B, groups, pack):
    """The final hidden states of the scored positions of ``groups`` (each ``(rows, start)``:
    rows sharing their first ``start`` tokens), their prefixes run together in one pass and
    every row's own tokens after them in a second, a group's answers several to a row where
    ``pack`` (``pack_answers``); with their batch rows and columns."""
    device = scored_B_T.device
    cost = key_cost(decoder)
    layout = []  # (group, its answers in the row: (batch row, first column, length))
    for g, (group_rows, start) in enumerate(groups):
        lengths = [lengths_B[b] - start for b in group_rows]
        packed = pack_answers(lengths, start, cost) if pack else [[i] for i in range(len(lengths))]
        layout += [(g, [(group_rows[i], start, lengths[i]) for i in row]) for row in packed]
    rows = [
        (g, [embeds_B_T_D[b, first : first + length] for b, first, length in answers])
        for g, answers in layout
    ]
    prefixes = [embeds_B_T_D[group_rows[0], :start] for group_rows, start in groups]
    hidden_R_W_D = continue_from_prefixes(decoder, prefixes, rows)
    # Every answer position's place in the pass (row, column) and in the batch (row, column).
    r_N, w_N, b_N, t_N = [], [], [], []
    for r, (_, answers) in enumerate(layout):
        offset = 0
        for b, first, length in answers:
            r_N += [r] * length
            w_N += range(offset, offset + length)
            b_N += [b] * length
            t_N += range(first, first + length)
            offset += length
    r_N, w_N, b_N, t_N = (torch.tensor(v, device=device) for v in (r_N, w_N, b_N, t_N))
    where_N = scored_B_T[b_N, t_N]
    return hidden_R_W_D[r_N[where_N], w_N[where_N]], b_N[where_N], t_N[where_N]


def key_cost(decoder: torch.nn.Module) -> float:
    """How many keys a query attends over for about the cost of its token's products in a
    layer: the products take 2 FLOPs a weight, attention 4 a hidden width a key, taken at a
    third of the products' speed (packed answers' attention ran at about half on a 2-core AVX2
    EPYC: 66 GFLOP/s forward and backward, the products 110-130). SmolLM2-135M: about 1,000."""
    config = decoder.config
    weights = sum(m.weight.numel() for m in decoder.modules() if isinstance(m, torch.nn.Linear))
    return weights / config.num_hidden_layers / (6 * config.hidden_size)


def pack_answers(lengths_A: list[int], prefix_keys: int, key_cost: float) -> list[list[int]]:
    """A group's answers (their indices, by their lengths ``lengths_A``) laid out in rows for
    one pass: each row holds whole answers end to end, right-padded to the longest row.

    A position costs its token's products, plus attention over the ``prefix_keys`` keys of
    the prompt and the row's own positions (``key_cost`` keys cost a token's products). Of the
    layouts first fit (longest answers first) gives into rows of at most W positions, for W
    from the longest answer (one answer a row, right-padded) up to four times it, the
    cheapest. Answers sampled at temperature 1 end anywhere: in ``bench/update_profile.py``'s
    step, a group's 8 answers of 21 to 49 positions padded to its longest compute a fifth of
    its positions for nothing; packed, a few hundredths."""
    order = sorted(range(len(lengths_A)), key=lambda a: -lengths_A[a])
    longest = lengths_A[order[0]]
    best, best_cost = [], float("inf")
    for limit in range(longest, min(sum(lengths_A), 4 * longest) + 1, max(1, longest // 32)):
        layout, room = [], []
        for a in order:
            fits = next((r for r, free in enumerate(room) if lengths_A[a] <= free), None)
            if fits is None:
                layout.append([a])
                room.append(limit - lengths_A[a])
            else:
                layout[fits].append(a)
                room[fits] -= lengths_A[a]
        width = limit - min(room)  # the longest row
        cost = len(layout) * width * (1 + (prefix_keys + width) / key_cost)
        if cost < best_cost:
            best, best_cost = layout, cost
    return best


def _window(embeds_T_D: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """``width`` positions of ``embeds_T_D`` from ``start``, zero-padded past its end."""
    window_S_D = embeds_T_D[start : start + width]
    return F.pad(window_S_D, (0, 0, 0, width - window_S_D.shape[0]))


def continue_from_prefixes(
    decoder: torch.nn.Module,
    prefixes: list[torch.Tensor],
    rows: list[tuple[int, list[torch.Tensor]]],
) -> torch.Tensor:
    """Final hidden states ``[R, W, D]`` of ``rows``: each the index of one of ``prefixes``
    (each ``[T_p, D]``) and answers (input embeddings ``[S, D]``) that follow it, end to end,
    right-padded to the longest row.

    The prefixes run once, together, right-padded to the longest; every answer then attends
    to its prefix's real positions and causally to its own tokens, as if it stood alone after
    its prefix (a boolean mask, where a row holds several answers or the prefixes differ in
    length). Autograd sums the answers' gradients into the prefix they read.
    """
    starts_P = [prefix.shape[0] for prefix in prefixes]
    longest = max(starts_P)
    prefix_P_T_D = torch.stack([_window(prefix, 0, longest) for prefix in prefixes])
    out = decoder(inputs_embeds=prefix_P_T_D, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    device = prefix_P_T_D.device
    width = max(sum(answer.shape[0] for answer in answers) for _, answers in rows)
    embeds, answer_R_W, place_R_W = [], [], []
    for _, answers in rows:
        lengths = [answer.shape[0] for answer in answers]
        pad = width - sum(lengths)
        embeds.append(_window(torch.cat(answers), 0, width))
        # Padding is an answer of its own (-1): nothing real reads it.
        answer_R_W.append([a for a, n in enumerate(lengths) for _ in range(n)] + [-1] * pad)
        place_R_W.append([i for n in lengths for i in range(n)] + [0] * pad)
    answer_R_W, place_R_W = (torch.tensor(v, device=device) for v in (answer_R_W, place_R_W))
    prefix_R = torch.tensor([p for p, _ in rows], device=device)
    start_R = torch.tensor(starts_P, device=device)[prefix_R]
    masks = {}
    if len(set(starts_P)) > 1 or any(len(answers) > 1 for _, answers in rows):
        # A position sees its prefix's real positions (the rest is padding, where prefixes
        # differ in length), then its own answer's, causally.
        prefix_R_K = torch.arange(longest, device=device) < start_R[:, None]
        causal_W_W = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        own_R_W_W = (answer_R_W[..., None] == answer_R_W[:, None, :]) & causal_W_W
        masks["attention_mask"] = torch.cat(
            [prefix_R_K[:, None, :].expand(-1, width, -1), own_R_W_W], dim=-1
        )[:, None]
    select_rows(cache, prefix_R)
    return decoder(
        inputs_embeds=torch.stack(embeds),
        position_ids=start_R[:, None] + place_R_W,
        use_cache=True,
        **{cache_argument(decoder): cache},
        **masks,
    ).last_hidden_state


@torch.no_grad()
def score_logprobs(model: torch.nn.Module, batch: TrainBatch, recipe: Recipe) -> torch.Tensor:
    """``logprobs_B_T`` of ``batch``'s scored tokens under ``model`` as it is now, in the
    recipe's precision, aligned like the batch's mask (position t holds token t + 1's log-prob;
    0 where the mask is 0)."""
    was_training = model.training
    model.eval()  # no dropout: these are the fixed log-probs the updates compare against
    device = next(model.parameters()).device
    dtype = compute_dtype(recipe.precision, device)
    out_B_T = torch.zeros(batch.input_ids_B_T.shape, dtype=torch.float32)
    try:
        for rows in micro_batch_rows(batch, recipe.train_micro_batch_size):
            micro = take_rows(batch, rows).to(device)
            logprobs_B_T, _ = score_tokens(model, micro, recipe.rollout_temperature, dtype)
            out_B_T[rows, : logprobs_B_T.shape[1]] = logprobs_B_T.cpu()
    finally:
        model.train(was_training)
    return out_B_T
