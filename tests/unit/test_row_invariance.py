"""A row's arithmetic never depends on what shares its pass, in every precision the engine
samples in: packed products alone and among others, a prompt prefilled beside other prompts,
a seeded reply alone and in a crowd.

bfloat16 runs natively on CPUs with AVX-512 BF16 or AMX and is emulated (slowly) elsewhere, so
its legs use small models built in code. The shapes are SmolLM2-135M's widths where they
matter: on a Xeon with AMX, oneDNN's bfloat16 products of more than 32 rows and its float32
products of one row over 1,536 inputs give rows other bits than other counts do.
"""

from __future__ import annotations

import pytest
import torch

from palaestra.engine import GenerationRequest, SamplingParams
from palaestra.engine.fused_pass import fused_pass
from palaestra.engine.packed_linear import (
    ANY_COUNT,
    WINDOWS,
    available,
    pack,
    product,
    row_window,
)
from palaestra.engine.slot_attention import Segment, SlotKV, SlotPlan
from palaestra.engine.torch_engine import TorchEngine, sampling_copy
from tests.support.tiny_models import build_tiny_model, build_tokenizer

PRECISIONS = ["float32", "bfloat16"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(576, 1536), (3072, 576)], ids=["down", "gate_up"])
def test_a_packed_product_gives_a_row_the_same_bits_at_any_count_and_place(precision, shape):
    dtype = getattr(torch, precision)
    if not available(torch.zeros(1, dtype=dtype)):  # e.g. bfloat16 on an AVX2-only CPU
        pytest.skip(f"oneDNN packs no {precision} weights on this CPU; the engine pads instead")
    generator = torch.Generator().manual_seed(1)
    packed = pack(torch.randn(shape, generator=generator).to(dtype))
    window = row_window(packed)
    # A window holds for these shapes on every CPU seen; panels hold at any count.
    assert window in (*WINDOWS, ANY_COUNT), window
    x = torch.randn(90, shape[1], generator=generator).to(dtype)
    alone = torch.cat([product(packed, None, x[i : i + 1]) for i in range(len(x))])
    # Counts inside, below and past the window, from the first row and from the middle.
    for count in (2, 5, 33, 64, 90):
        for first in (0, (len(x) - count) // 2):
            got = product(packed, None, x[first : first + count])
            assert got.shape == (count, shape[0])
            assert torch.equal(got, alone[first : first + count]), (count, first)
    # Leading dimensions are kept.
    assert product(packed, None, x[:6].view(2, 3, -1)).shape == (2, 3, shape[0])


def _model(precision: str, **shape):
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=5, max_position_embeddings=512, **shape).eval()
    if precision != "float32":
        model = sampling_copy(model, getattr(torch, precision))
    return tokenizer, model


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_prompt_prefilled_beside_others_gets_the_bits_it_gets_alone(precision):
    tokenizer, model = _model(
        precision, hidden_size=256, intermediate_size=1536, num_attention_heads=4
    )
    fused = fused_pass(model)
    if fused is None:  # bfloat16 on a CPU where oneDNN packs none: the engine pads instead
        assert not available(next(model.parameters()))
        pytest.skip(f"no fused pass in {precision} on this CPU (oneDNN packs no such weights)")
    dtype = getattr(torch, precision)
    generator = torch.Generator().manual_seed(0)

    def prefill(prompts: list[list[int]]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Each prompt's logits after its last token, and the keys and values it wrote."""
        kv = SlotKV(model.config, dtype, torch.device("cpu"))
        kv.reserve(len(prompts), 256)
        segments = [Segment(slot, 0, prompt) for slot, prompt in enumerate(prompts)]
        plan = SlotPlan(kv, segments, 1)
        logits = fused.forward(plan)
        order = {id(s): i for i, s in enumerate(plan.segments)}
        return [
            (logits[order[id(s)]], [t[s.slot, :, : len(s.tokens)] for t in kv.keys + kv.values])
            for s in segments
        ]

    vocab = len(tokenizer)
    # Ten prompts, each alone (a pass of 20 to 47 rows) and third among four (about 200 rows).
    # Before products kept to their row windows, bfloat16 on an AMX Xeon parted in 2 of them.
    for trial in range(10):
        prompt = torch.randint(3, vocab, (20 + 3 * trial,), generator=generator).tolist()
        others = [torch.randint(3, vocab, (30 + 7 * k,), generator=generator).tolist()
                  for k in range(3)]  # fmt: skip
        [(logits, written)] = prefill([prompt])
        crowd_logits, crowd_written = prefill([others[0], others[1], prompt, others[2]])[2]
        assert torch.equal(crowd_logits, logits), trial
        for a, b in zip(crowd_written, written, strict=True):
            assert torch.equal(a, b), trial


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_seeded_reply_is_the_same_alone_and_in_a_crowd(precision):
    # A down projection over 1,536 inputs: a lone decode row is the case float32 broke on an
    # AMX Xeon (one row's product took another kernel than two rows').
    tokenizer, model = _model(precision, hidden_size=128, intermediate_size=1536)
    engine = TorchEngine(model, tokenizer)

    def request(text: str, **params) -> GenerationRequest:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return GenerationRequest(ids, 1, SamplingParams(12, **params))

    seeded = request("Write a haiku about the sea.", temperature=1.0, seed=7)
    greedy = request("Say rain", temperature=0.0)
    alone = [engine.generate_requests([r])[0][0] for r in (seeded, greedy)]
    others = [request("Write a haiku about snow." * (k % 3 + 1), temperature=1.0, seed=k)
              for k in range(6)]  # fmt: skip
    crowd = engine.generate_requests([*others[:3], seeded, *others[3:], greedy])
    for by_itself, among in zip(alone, (crowd[3][0], crowd[-1][0]), strict=True):
        assert among.token_ids == by_itself.token_ids
        assert among.logprobs == by_itself.logprobs  # exactly, not approximately
    assert len({tuple(c[0].token_ids) for c in crowd[:-1]}) > 1  # the others drew otherwise
