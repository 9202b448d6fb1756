"""Weights cast once per version (algo.casts): the same copy while a weight is unchanged, a new
one once it changes, and the learner's bfloat16 gradients unchanged by it, bit for bit."""

from __future__ import annotations

import torch

import palaestra.algo.casts as casts
from palaestra.algo.casts import cast_weight, casting_once, weights_cast_once
from palaestra.train.batch import build_train_batch
from palaestra.train.scoring import score_tokens
from tests.support.tiny_models import build_tiny_model, build_tokenizer, samples_of


def test_a_weight_is_cast_once_until_it_changes():
    weight = torch.nn.Parameter(torch.tensor([[1.001, 2.0], [3.0, -4.0]]))
    with weights_cast_once():
        assert casting_once()
        first = cast_weight(weight, torch.bfloat16)
        assert first.dtype == torch.bfloat16 and not first.requires_grad
        assert torch.equal(first, weight.detach().to(torch.bfloat16))
        assert cast_weight(weight, torch.bfloat16) is first  # reused, not cast again
        with torch.no_grad():
            weight.add_(1.0)  # as an optimiser step does: in place, the version moves
        second = cast_weight(weight, torch.bfloat16)
        assert second is not first
        assert second.tolist() == [[2.0, 3.0], [4.0, -3.0]]
        # A weight in the compute dtype already is itself.
        assert cast_weight(weight, torch.float32) is weight
    assert not casting_once()
    # Outside a block every call casts.
    assert cast_weight(weight, torch.bfloat16) is not cast_weight(weight, torch.bfloat16)


def test_an_inner_block_leaves_the_outer_blocks_copies():
    weight = torch.nn.Parameter(torch.ones(3, 3))
    with weights_cast_once():
        outer = cast_weight(weight, torch.bfloat16)
        with weights_cast_once():
            assert cast_weight(weight, torch.bfloat16) is outer
        assert casting_once()
        assert cast_weight(weight, torch.bfloat16) is outer
    assert casts._casts is None  # the copies are gone with the outermost block


def test_two_bfloat16_micro_batches_give_the_same_gradients_with_one_copy_per_weight():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=3)
    samples = samples_of(
        tokenizer,
        ["Write about rain", "Write about rain", "Sea"],
        ["Drops on a tin roof", "Grey sky", "Waves"],
    )
    batch = build_train_batch(samples, torch.tensor([1.0, -0.5, -0.5]), tokenizer.pad_token_id)
    seen: dict[str, int] = {}

    def grads(once: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with weights_cast_once() if once else torch.enable_grad():
            for _ in range(2):  # two micro-batches reading every weight before one step
                logprobs_B_T, _ = score_tokens(model, batch, 0.8, torch.bfloat16)
                (logprobs_B_T * batch.mask_B_T).sum().backward()
            if once:
                seen["copies"] = len(casts._casts)
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    every_use, once = grads(once=False), grads(once=True)
    for name, grad in every_use.items():
        assert torch.equal(once[name], grad), name  # the same casts, so the same bits
    # One copy per matrix the passes cast: per layer the 4 attention projections and the 3 MLP
    # ones, and the tied lm head; however many times each was read.
    assert seen["copies"] == 7 * model.config.num_hidden_layers + 1
