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
- Rows are right-padded, so with causal attention no real token sees padding and no attention
  mask is needed. Where padding every answer to the longest would waste a tenth of the
  answers' pass, its rows run as two passes over the same prompt pass, the longest and the
  rest (``length_buckets``): on ``bench/update_profile.py``'s answers of 24 to 48 tokens, the
  update took 5% less time (13.39 -> 12.68 s, 2-core AVX2 EPYC).
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
    plain_state,
    restore_plain_state,
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
            found = _after_prefixes(decoder, embeds_B_T_D, scored_B_T, lengths_B, groups)
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


def _after_prefixes(decoder, embeds_B_T_D, scored_B_T, lengths_B, groups):
    """The final hidden states of the scored positions of ``groups`` (each ``(rows, start)``:
    rows sharing their first ``start`` tokens), their prefixes run together in one pass and
    every row's own tokens after them (in one pass, or two where ``length_buckets`` says so);
    with their batch rows and columns."""
    device = scored_B_T.device
    rows = [b for group_rows, _ in groups for b in group_rows]
    starts_R = [start for group_rows, start in groups for _ in group_rows]
    group_of_R = [g for g, (group_rows, _) in enumerate(groups) for _ in group_rows]
    lengths_R = [lengths_B[b] - start for b, start in zip(rows, starts_R, strict=True)]
    buckets = length_buckets(lengths_R)
    passes = []
    for bucket in buckets:
        width = max(lengths_R[i] for i in bucket)
        suffixes_R_S_D = torch.stack(
            [_window(embeds_B_T_D[rows[i]], starts_R[i], width) for i in bucket]
        )
        passes.append(
            (suffixes_R_S_D, torch.tensor([group_of_R[i] for i in bucket], device=device))
        )
    prefixes = [embeds_B_T_D[group_rows[0], :start] for group_rows, start in groups]
    last = scored_B_T.shape[1] - 1  # a row of a later start reads past the batch
    found = []
    for bucket, hidden_R_S_D in zip(
        buckets, continue_from_prefixes(decoder, prefixes, passes), strict=True
    ):
        rows_R = torch.tensor([rows[i] for i in bucket], device=device)
        starts = torch.tensor([starts_R[i] for i in bucket], device=device)
        cols_R_S = starts[:, None] + torch.arange(hidden_R_S_D.shape[1], device=device)
        where_R_S = scored_B_T[rows_R[:, None], cols_R_S.clamp(max=last)] & (cols_R_S <= last)
        r, s = where_R_S.nonzero(as_tuple=True)
        found.append((hidden_R_S_D[where_R_S], rows_R[r], cols_R_S[r, s]))
    if len(found) == 1:
        return found[0]
    return tuple(torch.cat(parts) for parts in zip(*found, strict=True))


SPLIT_SAVING = 0.1
"""The share of an answers pass's positions that padding every row to the longest must waste
before its rows run as two passes (``length_buckets``)."""


def length_buckets(lengths_R: list[int]) -> list[list[int]]:
    """The rows of an answers pass (their indices, by their lengths ``lengths_R``): all in one
    pass, in their order, or, where right-padding them all to the longest would waste at least
    ``SPLIT_SAVING`` of its positions, in two passes (the longest rows, then the rest), split
    where the two pad least.

    A second pass costs a round of every layer's small ops and smaller products; padding costs
    every product in full. Answers sampled at temperature 1 end anywhere: in
    ``bench/grpo_step.py``'s step, 32 answers of at most 48 tokens average about 40, so a
    pass padded to 48 computes a sixth of its positions for nothing."""
    count = len(lengths_R)
    order = sorted(range(count), key=lambda i: -lengths_R[i])
    padded = count * lengths_R[order[0]]
    best, split = padded, 0
    for k in range(1, count):
        positions = k * lengths_R[order[0]] + (count - k) * lengths_R[order[k]]
        if positions < best:
            best, split = positions, k
    if not split or best > (1 - SPLIT_SAVING) * padded:
        return [list(range(count))]
    return [order[:split], order[split:]]


def _window(embeds_T_D: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """``width`` positions of ``embeds_T_D`` from ``start``, zero-padded past its end."""
    window_S_D = embeds_T_D[start : start + width]
    return F.pad(window_S_D, (0, 0, 0, width - window_S_D.shape[0]))


def continue_from_prefixes(
    decoder: torch.nn.Module,
    prefixes: list[torch.Tensor],
    passes: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[torch.Tensor]:
    """Final hidden states of each pass's rows: for each ``(suffixes_R_S_D, group_R)`` of
    ``passes``, row r of ``suffixes_R_S_D`` (input embeddings) read after
    ``prefixes[group_R[r]]`` (each ``[T_p, D]``).

    The prefixes run once, together, right-padded to the longest; their keys and values are
    then picked for every row of a pass, which attends to its own prefix's real positions (a
    boolean mask, when there is more than one prefix) as if it stood in front of the row.
    Autograd sums the rows' gradients into the prefix they read.
    """
    starts_P = [prefix.shape[0] for prefix in prefixes]
    longest = max(starts_P)
    prefix_P_T_D = torch.stack([_window(prefix, 0, longest) for prefix in prefixes])
    out = decoder(inputs_embeds=prefix_P_T_D, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    # A pass grows the cache by its own keys and values: the next starts from the prefixes'.
    kept = plain_state(cache) if len(passes) > 1 else []
    hidden = []
    for index, (suffixes_R_S_D, group_R) in enumerate(passes):
        if index:
            restore_plain_state(cache, kept)
        select_rows(cache, group_R)
        device = suffixes_R_S_D.device
        rows, width = suffixes_R_S_D.shape[:2]
        start_R = torch.tensor(starts_P, device=device)[group_R]
        positions_R_S = start_R[:, None] + torch.arange(width, device=device)
        masks = {}
        if len(prefixes) > 1:
            # Row r sees the first start_R[r] prefix positions (the rest is another prefix's
            # padding), then its own tokens causally.
            prefix_R_S_T = (torch.arange(longest, device=device) < start_R[:, None])[:, None, :]
            causal_S_S = torch.ones(width, width, dtype=torch.bool, device=device).tril()
            masks["attention_mask"] = torch.cat(
                [
                    prefix_R_S_T.expand(rows, width, longest),
                    causal_S_S.expand(rows, width, width),
                ],
                dim=-1,
            )[:, None]
        hidden.append(
            decoder(
                inputs_embeds=suffixes_R_S_D,
                position_ids=positions_R_S,
                use_cache=True,
                **{cache_argument(decoder): cache},
                **masks,
            ).last_hidden_state
        )
    return hidden


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
