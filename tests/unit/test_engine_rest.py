"""A synchronous run's engine drops its packed weights after each rollout, before the update
(``backends.local.rests``, ``CheckedSampler.rest``)."""

from __future__ import annotations

import torch

from palaestra import Recipe
from palaestra.backends.local import rests
from palaestra.backends.sharded import CheckedSampler
from palaestra.engine import GenerationRequest, SamplingParams
from palaestra.engine.torch_engine import TorchEngine
from tests.support.tiny_models import build_tiny_model, build_tokenizer


class Config:
    def __init__(self, **fields):
        self.recipe = Recipe(**fields)


class OneRollout:
    """A sampler whose rollout is one generation on ``engine``; it notes what the engine held
    right after generating."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine
        self.packed_at = None

    def sample(self, step: int, cursor: int):
        request = GenerationRequest([5, 6, 7], 2, SamplingParams(4, 1.0, seed=step))
        completions = self.engine.generate_requests([request])
        self.packed_at = self.engine._packed_version
        return completions

    def update_weights(self, weights, version: int) -> None:
        self.engine.update_weights(weights, version)


def bfloat16_engine() -> TorchEngine:
    tokenizer = build_tokenizer()
    return TorchEngine(build_tiny_model(tokenizer), tokenizer, dtype=torch.bfloat16)


def test_only_a_torch_engine_in_step_rests():
    engine = bfloat16_engine()
    assert rests(Config(), engine)
    assert not rests(Config(max_staleness=1), engine)  # it samples through the update
    assert not rests(Config(), object())  # vLLM and remote pools sleep on their own terms


def test_a_resting_engine_holds_no_packed_weights_between_rollout_and_update():
    engine = bfloat16_engine()  # samples from its own bfloat16 copy, which it keeps packed
    for rest, packed_after in ((False, 0), (True, None)):
        rollout = OneRollout(engine)
        sampler = CheckedSampler(rollout, engine, rest=rest)
        completions = sampler.sample(step=1, cursor=0)
        assert len(completions[0]) == 2
        assert rollout.packed_at == 0  # packed for version 0 while it generated
        assert engine._packed_version == packed_after


def test_a_resting_engine_lends_its_weights_to_the_update_and_takes_the_new_ones_attested():
    tokenizer = build_tokenizer()
    learner_model = build_tiny_model(tokenizer)
    engine = TorchEngine(learner_model, tokenizer, dtype=torch.bfloat16)
    sampler = CheckedSampler(OneRollout(engine), engine, rest=True, rest_weights=True)
    sampler.sample(step=1, cursor=0)
    assert all(p.numel() == 0 for p in engine.model.parameters())  # gone through the update
    with torch.no_grad():
        for parameter in learner_model.parameters():
            parameter.add_(0.5)  # the update
    attestation = sampler.update_weights(dict(learner_model.named_parameters()), version=1)
    assert attestation.engines == 1  # the copy holds what was sent, digests compared
    held = dict(engine.model.named_parameters())
    for name, parameter in learner_model.named_parameters():
        assert torch.equal(held[name], parameter.detach().to(torch.bfloat16)), name
    assert len(sampler.sample(step=2, cursor=0)[0]) == 2
