"""The fast paths against plain references: chunked log-probs, the learner's scoring and loss,
the inverse-CDF sampler, and the bfloat16 sampling copy."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from palaestra.algo.logprobs import chunked_token_logprobs
from palaestra.algo.losses import LossScale, aggregate, ppo_clip_loss, token_entropy, token_logprobs
from palaestra.engine import SamplingParams
from palaestra.engine.sampling import inverse_cdf, sample_next_tokens
from palaestra.engine.torch_engine import TorchEngine
from palaestra.models.loading import compute_dtype
from palaestra.recipes import Recipe
from palaestra.train.batch import build_train_batch
from palaestra.train.learner import Learner
from palaestra.train.scoring import score_tokens
from tests.support.tiny_models import build_tiny_model, build_tokenizer, samples_of

# Float32 throughout unless a test says otherwise: the fast and plain paths differ only in the
# order of summation, so they agree to float32 rounding: a few ulps of values near 4.5 (the
# entropy of a near-uniform 99-token distribution, where one ulp is 4.8e-7).
FLOAT32_TOLERANCE = 2e-6


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# The logits kept from the forward (these 7 x 11 fit any budget) and made again in the backward
# (a budget of 0 bytes) give the same values and gradients.
KEEP = {"kept": 256 << 20, "recomputed": 0}


# Without an entropy term the entropy's gradient is None, not zeros, and its part is skipped.
@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("entropy_weight", [0.3, None])
def test_chunked_logprobs_equal_the_full_logits_values_and_gradients(
    monkeypatch, entropy_weight, keep
):
    import palaestra.algo.logprobs as head

    # Slices of 3 tokens and 4 vocabulary entries: 7 tokens = 3 + 3 + 1 and 11 entries =
    # 4 + 4 + 3, so targets land in every slice and the running sums cross slices.
    monkeypatch.setattr(head, "TOKEN_CHUNK", 3)
    monkeypatch.setattr(head, "VOCAB_CHUNK", 4)
    monkeypatch.setattr(head, "KEEP_BYTES", KEEP[keep])
    torch.manual_seed(0)
    hidden_N_D = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    weight_V_D = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    bias_V = torch.randn(11, dtype=torch.float64, requires_grad=True)
    targets_N = torch.tensor([0, 3, 10, 4, 4, 9, 1])
    upstream_N = torch.randn(7, dtype=torch.float64)

    def grads(logprobs_N, entropy_N):
        total = (logprobs_N * upstream_N).sum()
        if entropy_weight is not None:
            total = total + entropy_weight * entropy_N.sum()
        return torch.autograd.grad(total, (hidden_N_D, weight_V_D, bias_V))

    logits_N_V = (hidden_N_D @ weight_V_D.T + bias_V) / 0.7
    # The reference: token_logprobs/token_entropy work in float32; compare in float64 by hand.
    ref_logprobs_N = torch.log_softmax(logits_N_V, -1).gather(-1, targets_N[:, None]).squeeze(-1)
    ref_entropy_N = -(torch.softmax(logits_N_V, -1) * torch.log_softmax(logits_N_V, -1)).sum(-1)
    ref_grads = grads(ref_logprobs_N, ref_entropy_N)
    fast_logprobs_N, fast_entropy_N = chunked_token_logprobs(
        hidden_N_D, weight_V_D, targets_N, 0.7, bias_V
    )
    # _chunk upcasts logits to float32, so compare at float32 precision.
    assert torch.allclose(fast_logprobs_N.double(), ref_logprobs_N, atol=1e-5)
    assert torch.allclose(fast_entropy_N.double(), ref_entropy_N, atol=1e-5)
    fast_grads = grads(fast_logprobs_N.double(), fast_entropy_N.double())
    for fast, ref in zip(fast_grads, ref_grads, strict=True):
        assert torch.allclose(fast, ref, atol=1e-5)


@pytest.mark.parametrize("keep", KEEP)
def test_the_heads_gradient_added_in_place_equals_autograds_and_adds_to_what_is_there(
    monkeypatch, keep
):
    import palaestra.algo.logprobs as head

    monkeypatch.setattr(head, "TOKEN_CHUNK", 3)
    monkeypatch.setattr(head, "VOCAB_CHUNK", 4)
    monkeypatch.setattr(head, "KEEP_BYTES", KEEP[keep])
    torch.manual_seed(0)
    hidden_N_D = torch.randn(7, 5, requires_grad=True)
    weight_V_D = torch.randn(11, 5, requires_grad=True)
    targets_N = torch.tensor([0, 3, 10, 4, 4, 9, 1])
    upstream_N = torch.randn(7)

    def backward(in_place: bool) -> None:
        logprobs_N, entropy_N = chunked_token_logprobs(
            hidden_N_D, weight_V_D, targets_N, 0.7, weight_grad_in_place=in_place
        )
        ((logprobs_N * upstream_N).sum() + 0.3 * entropy_N.sum()).backward()

    backward(in_place=False)
    expected_weight, expected_hidden = weight_V_D.grad.clone(), hidden_N_D.grad.clone()
    weight_V_D.grad = hidden_N_D.grad = None
    backward(in_place=True)  # makes .grad
    torch.testing.assert_close(weight_V_D.grad, expected_weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden_N_D.grad, expected_hidden, rtol=0, atol=1e-6)
    backward(in_place=True)  # adds to it, as autograd accumulates
    torch.testing.assert_close(weight_V_D.grad, 2 * expected_weight, rtol=0, atol=1e-6)


def test_logits_within_the_budget_are_made_once_and_a_second_backward_makes_them_again(
    monkeypatch,
):
    import palaestra.algo.logprobs as head

    monkeypatch.setattr(head, "TOKEN_CHUNK", 3)
    monkeypatch.setattr(head, "VOCAB_CHUNK", 4)
    made = []
    logits = head._logits
    monkeypatch.setattr(head, "_logits", lambda *args: made.append(1) or logits(*args))
    torch.manual_seed(0)
    hidden_N_D = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    weight_V_D = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    targets_N = torch.tensor([0, 3, 10, 4, 4, 9, 1])

    def forward_and_backward(budget: int, retain: bool = False) -> tuple[int, torch.Tensor]:
        monkeypatch.setattr(head, "KEEP_BYTES", budget)
        hidden_N_D.grad = weight_V_D.grad = None
        made.clear()
        logprobs_N, entropy_N = chunked_token_logprobs(hidden_N_D, weight_V_D, targets_N, 0.7)
        total = logprobs_N.sum() + 0.3 * entropy_N.sum()
        total.backward(retain_graph=retain)
        return len(made), total

    # 3 token chunks x 3 vocabulary slices = 9 slices of logits per pass over them. 7 x 11
    # float32 logits are 308 bytes: a budget of 308 keeps them, 307 does not.
    assert forward_and_backward(308)[0] == 9
    kept_grad = weight_V_D.grad.clone()
    assert forward_and_backward(307)[0] == 9 + 9
    # Equal to float32 rounding: the logits are float32, kept as z - m and added back to m.
    torch.testing.assert_close(weight_V_D.grad, kept_grad, rtol=0, atol=1e-6)
    # A second backward through the same graph finds the kept slices spent and makes them again.
    _, total = forward_and_backward(308, retain=True)
    made.clear()
    total.backward()
    assert len(made) == 9
    torch.testing.assert_close(weight_V_D.grad, 2 * kept_grad, rtol=0, atol=1e-6)
    # Without gradients nothing is kept, and nothing runs a second time.
    with torch.no_grad():
        made.clear()
        chunked_token_logprobs(hidden_N_D, weight_V_D, targets_N, 0.7)
    assert len(made) == 9


def test_chunked_logprobs_of_no_tokens_are_empty_with_zero_gradients():
    weight_V_D = torch.ones(6, 4, requires_grad=True)
    logprobs_N, entropy_N = chunked_token_logprobs(
        torch.zeros(0, 4), weight_V_D, torch.zeros(0, dtype=torch.long)
    )
    assert logprobs_N.shape == entropy_N.shape == (0,)
    (logprobs_N.sum() + entropy_N.sum()).backward()
    assert torch.equal(weight_V_D.grad, torch.zeros(6, 4))


@pytest.fixture(scope="module")
def batch(tokenizer):
    # Prompts and responses of different lengths, so rows are right-padded differently.
    samples = samples_of(
        tokenizer,
        ["Write about rain", "Sea", "A haiku on snow please"],
        ["Drops on a tin roof", "Waves", "White hush"],
    )
    return build_train_batch(samples, torch.tensor([1.0, -0.5, -0.5]), tokenizer.pad_token_id)


def plain_scores(model, batch, temperature):
    """The straightforward path: full logits with the attention mask, every position."""
    logits_B_T_V = model(
        input_ids=batch.input_ids_B_T, attention_mask=batch.attention_mask_B_T
    ).logits
    logits_B_T_V = logits_B_T_V[:, :-1].float() / temperature
    logprobs_B_T = token_logprobs(logits_B_T_V, batch.input_ids_B_T[:, 1:])
    entropy_B_T = token_entropy(logits_B_T_V)
    return logprobs_B_T, entropy_B_T


def test_score_tokens_equals_full_logits_at_every_scored_position(tokenizer, batch):
    model = build_tiny_model(tokenizer, seed=4)
    with torch.no_grad():
        fast_logprobs_B_T, fast_entropy_B_T = score_tokens(model, batch, 0.8, torch.float32)
        ref_logprobs_B_T, ref_entropy_B_T = plain_scores(model, batch, 0.8)
    mask_B_T = batch.mask_B_T[:, :-1]
    assert int(mask_B_T.sum()) == 19 + 5 + 10  # response characters, one log-prob each
    diff = (fast_logprobs_B_T[:, :-1] - ref_logprobs_B_T).abs() * mask_B_T
    assert float(diff.max()) < FLOAT32_TOLERANCE
    diff = (fast_entropy_B_T[:, :-1] - ref_entropy_B_T).abs() * mask_B_T
    assert float(diff.max()) < FLOAT32_TOLERANCE
    # Outside the mask nothing is computed: exactly zero.
    assert float((fast_logprobs_B_T * (1 - batch.mask_B_T)).abs().sum()) == 0.0


def test_the_learners_loss_and_gradients_equal_the_plain_reference(tokenizer, batch):
    recipe = Recipe(precision="float32", rollout_temperature=0.8, lr=1e-3)
    fast_model = build_tiny_model(tokenizer, seed=5)
    plain_model = build_tiny_model(tokenizer, seed=5)
    learner = Learner(fast_model, recipe)
    num_tokens = float(batch.mask_B_T.sum())
    scale = LossScale(num_tokens, 3, 1, recipe.rollout_max_response_len)
    assert num_tokens == 34

    # Fast: the learner's own scoring and loss.
    logprobs_B_T, entropy_B_T = score_tokens(fast_model, batch, 0.8, torch.float32)
    fast_loss = learner._loss(batch, logprobs_B_T, entropy_B_T, scale, defaultdict(float))
    fast_loss.backward()

    # Plain: full logits, shifted, the clipped surrogate against detached log-probs, dapo sum.
    ref_logprobs_B_T, _ = plain_scores(plain_model, batch, 0.8)
    per_token_B_T, _ = ppo_clip_loss(
        ref_logprobs_B_T, ref_logprobs_B_T.detach(), batch.advantages_B, 0.2, 0.2
    )
    plain_loss = aggregate(per_token_B_T, batch.mask_B_T[:, :-1], "dapo", scale)
    plain_loss.backward()

    # With ratio 1 the surrogate is -A per token: (19 * -1 + 5 * 0.5 + 10 * 0.5) / 34.
    assert float(plain_loss.detach()) == pytest.approx(-11.5 / 34, abs=1e-6)
    assert float(fast_loss.detach()) == pytest.approx(float(plain_loss.detach()), abs=1e-6)
    for (name, fast), plain in zip(
        fast_model.named_parameters(), plain_model.parameters(), strict=True
    ):
        assert torch.allclose(fast.grad, plain.grad, atol=FLOAT32_TOLERANCE), name


@pytest.fixture(scope="module")
def grouped_batch(tokenizer):
    # Two prompts with three samples each (one group of three answers of different lengths
    # per prompt), and a prompt of its own, in the order a step lays them out.
    prompts = ["Write about rain"] * 3 + ["Sea"] * 3 + ["A haiku on snow please"]
    responses = ["Drops", "Drops on a tin roof", "Grey", "Waves", "Salt and foam", "W", "Hush"]
    samples = samples_of(tokenizer, prompts, responses)
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.9, -1.2, 0.0])
    return build_train_batch(samples, advantages, tokenizer.pad_token_id)


@pytest.mark.parametrize("attention, passes", [("sdpa", 4), ("eager", 7)])
def test_samples_of_one_prompt_share_its_pass_with_equal_results(
    tokenizer, grouped_batch, attention, passes
):
    from palaestra.train.batch import prefix_groups

    # Contexts: the prompt less its last character (that one scores the first answer token).
    groups = prefix_groups(grouped_batch.input_ids_B_T, grouped_batch.mask_B_T > 0)
    assert groups == [([0, 1, 2], 15), ([3, 4, 5], 2), ([6], 21)]

    fast_model = build_tiny_model(tokenizer, seed=9, attn_implementation=attention)
    plain_model = build_tiny_model(tokenizer, seed=9, attn_implementation=attention)
    mask_B_T = grouped_batch.mask_B_T[:, :-1]
    upstream_B_T = torch.randn(mask_B_T.shape, generator=torch.Generator().manual_seed(0))

    # The lone prompt's row runs alone; with SDPA both groups' prompts run in one pass and
    # their answers after them (a boolean mask keeps each row to its own prompt), with other
    # attention each group runs its own. Answers run as two passes where one would pad too
    # much (length_buckets): positions after the prompts 6, 20, 5 and 6, 14, 2. Together, 6 x 20
    # = 120 padded, split 20, 14 | 6, 6, 5, 2: 2 x 20 + 4 x 6 = 64, so SDPA takes 1 + 1 + 2
    # passes. Apart, 6, 20, 5: 60, split 20 | 6, 5: 32; 6, 14, 2: 42, split 14 | 6, 2: 26; so
    # the others take 1 + 3 + 3.
    calls = []
    fast_model.get_decoder().register_forward_hook(lambda *args: calls.append(1))
    fast_logprobs_B_T, fast_entropy_B_T = score_tokens(
        fast_model, grouped_batch, 0.9, torch.float32
    )
    assert len(calls) == passes
    plain_logprobs_B_T, plain_entropy_B_T = plain_scores(plain_model, grouped_batch, 0.9)
    diff = (fast_logprobs_B_T[:, :-1] - plain_logprobs_B_T).abs() * mask_B_T
    assert float(diff.detach().max()) < FLOAT32_TOLERANCE
    diff = (fast_entropy_B_T[:, :-1] - plain_entropy_B_T).abs() * mask_B_T
    assert float(diff.detach().max()) < FLOAT32_TOLERANCE

    # Gradients through the shared prompt pass equal those of a pass per sample.
    (
        (fast_logprobs_B_T[:, :-1] + fast_entropy_B_T[:, :-1]) * mask_B_T * upstream_B_T
    ).sum().backward()
    ((plain_logprobs_B_T + plain_entropy_B_T) * mask_B_T * upstream_B_T).sum().backward()
    for (name, fast), plain in zip(
        fast_model.named_parameters(), plain_model.parameters(), strict=True
    ):
        assert torch.allclose(fast.grad, plain.grad, atol=FLOAT32_TOLERANCE), name


def test_answers_split_into_two_passes_only_where_padding_wastes_a_tenth():
    from palaestra.train.scoring import length_buckets

    # Equal lengths, or nearly: one pass, rows in their own order.
    assert length_buckets([20, 20, 20, 20]) == [[0, 1, 2, 3]]
    # 48, 47, 46, 45: padded 4 x 48 = 192; the best split (48 | 47, 46, 45: 48 + 3 x 47 =
    # 189) saves under a tenth.
    assert length_buckets([45, 48, 46, 47]) == [[0, 1, 2, 3]]
    # 48, 48, 30, 10: padded 192; 48 | ...: 48 + 3 x 48; 48, 48 | 30, 10: 96 + 2 x 30 = 156;
    # 48, 48, 30 | 10: 144 + 10 = 154, the least (a fifth saved): the longest three, then 10.
    assert length_buckets([10, 48, 30, 48]) == [[1, 3, 2], [0]]
    # A lone row has nothing to split.
    assert length_buckets([7]) == [[0]]


def test_micro_batches_keep_a_prompts_samples_together(grouped_batch):
    from palaestra.train.batch import micro_batch_rows

    # Lengths: prompt 16 + answers 5, 19, 4; prompt 3 + 5, 13, 1; prompt 22 + 4.
    # Groups longest first (35, 26, 16), each longest first.
    rows = [r.tolist() for r in micro_batch_rows(grouped_batch, 4)]
    assert rows == [[1, 0, 2, 6], [4, 3, 5]]


def test_nothing_scored_gives_zeros_that_still_backpropagate(tokenizer, batch):
    model = build_tiny_model(tokenizer, seed=10)
    masked_out = dataclasses.replace(batch, mask_B_T=torch.zeros_like(batch.mask_B_T))
    logprobs_B_T, entropy_B_T = score_tokens(model, masked_out, 1.0, torch.float32)
    assert float(logprobs_B_T.detach().abs().sum()) == 0.0
    logprobs_B_T.sum().backward()  # a step of all-truncated answers must not crash


def test_bfloat16_autocast_stays_close_to_float32(tokenizer, batch):
    model = build_tiny_model(tokenizer, seed=6)
    with torch.no_grad():
        fp32_B_T, _ = score_tokens(model, batch, 1.0, torch.float32)
        bf16_B_T, _ = score_tokens(model, batch, 1.0, torch.bfloat16)
    mask_B_T = batch.mask_B_T
    mean_diff = float(((bf16_B_T - fp32_B_T).abs() * mask_B_T).sum() / mask_B_T.sum())
    # bfloat16 keeps 8 bits of mantissa (relative error 2^-9 per rounding); a 2-layer model's
    # log-probs near log(1/90) = -4.5 move by hundredths of a nat, not tenths.
    assert 0 < mean_diff < 0.05
    assert bf16_B_T.dtype == torch.float32


def test_precision_resolves_by_name_and_auto_by_the_hardware():
    assert compute_dtype("float32", "cpu") == torch.float32
    assert compute_dtype("bfloat16", "cpu") == torch.bfloat16
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert compute_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


def test_inverse_cdf_picks_where_the_running_mass_passes_the_draw():
    # Masses 1/8, 0, 1/2, 3/8 (exact in binary): running sums 0.125, 0.125, 0.625, 1.0.
    probs_V = torch.tensor([0.125, 0.0, 0.5, 0.375])
    draws = torch.tensor([0.0, 0.1, 0.125, 0.6, 0.625, 0.99999994])
    picked = inverse_cdf(probs_V.expand(6, 4), draws).tolist()
    # 0.125 lands exactly on the first running sum: the next token with mass (2), never the
    # zero-mass token 1. The largest float32 below 1 stays on the last token.
    assert picked == [0, 0, 2, 2, 3, 3]
    # Unnormalised rows (a nucleus cut) scale the draw by their total: same picks at twice
    # the mass.
    assert inverse_cdf((2 * probs_V).expand(6, 4), draws).tolist() == picked


def test_sampled_frequencies_follow_the_tempered_distribution():
    logits_V = torch.tensor([2.0, 1.0, 0.0, -1.0])
    expected_V = torch.softmax(logits_V / 0.5, -1)  # 0.865, 0.117, 0.016, 0.002
    generators = [torch.Generator().manual_seed(i) for i in range(4000)]
    tokens, logprobs = sample_next_tokens(
        logits_V.expand(4000, 4), [0.5] * 4000, [1.0] * 4000, generators
    )
    counts_V = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    # Binomial std at p = 0.865 over 4000 draws is 0.0054; allow about 3 of them.
    assert torch.allclose(counts_V, expected_V, atol=0.016)
    assert logprobs[0] == pytest.approx(float(expected_V[tokens[0]].log()), abs=1e-6)


def test_a_batch_mixing_greedy_tempered_and_plain_rows_gives_each_its_own_draw():
    logits_B_V = torch.tensor([[0.5, 3.0, 1.0, -2.0]] * 3)
    temperatures = [0.0, 0.5, 1.0]
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens, logprobs = sample_next_tokens(logits_B_V, temperatures, [1.0] * 3, generators)
    assert tokens[0] == 1  # greedy: the argmax
    for row, temperature in enumerate(temperatures):
        scale = temperature or 1.0  # a greedy row's log-prob is the raw logits'
        expected = torch.log_softmax(logits_B_V[row] / scale, -1)[tokens[row]]
        assert logprobs[row] == pytest.approx(float(expected), abs=1e-6)
    # Without a greedy row, the same draws: no argmax or division decides anything there.
    again = [torch.Generator().manual_seed(i) for i in range(1, 3)]
    assert sample_next_tokens(logits_B_V[1:], temperatures[1:], [1.0] * 2, again)[0] == tokens[1:]


def test_bfloat16_copy_samples_close_to_float32_and_follows_sync(tokenizer):
    model = build_tiny_model(tokenizer, seed=7).eval()
    fp32 = TorchEngine(model, tokenizer)
    bf16 = TorchEngine(model, tokenizer, dtype=torch.bfloat16)
    assert bf16.model is not model
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    # Buffers (rotary frequencies) keep float32.
    assert all(b.dtype != torch.bfloat16 for b in bf16.model.buffers())
    prompt = tokenizer("Say rain", add_special_tokens=False).input_ids
    params = SamplingParams(12, temperature=0.0)
    greedy_fp32 = fp32.generate([prompt], 1, params)[0][0]
    greedy_bf16 = bf16.generate([prompt], 1, params)[0][0]
    # Scoring the bf16 tokens in float32 gives log-probs within a few hundredths of the copy's.
    with torch.no_grad():
        ids = torch.tensor([prompt + greedy_bf16.token_ids])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
        reference = logprobs.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(greedy_bf16.logprobs), reference, atol=0.05)
    assert len(greedy_fp32.token_ids) == 12 or greedy_fp32.finish_reason == "stop"

    # A training step changes the float32 weights; after sync the copy has them, rounded.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    bf16.update_weights(dict(model.named_parameters()), version=1)
    assert bf16.weight_version == 1
    for copied, trained in zip(bf16.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(copied, trained.to(torch.bfloat16))


def test_learner_trains_in_bfloat16_with_float32_weights(tokenizer, batch):
    model = build_tiny_model(tokenizer, seed=8)
    before = [p.detach().clone() for p in model.parameters()]
    learner = Learner(model, Recipe(precision="bfloat16", lr=1e-2))
    metrics = learner.update(dataclasses.replace(batch))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert metrics["response_tokens"] == 34
