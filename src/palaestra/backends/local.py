"""The local backend: sampler and learner in the run's own process, on its CPU or one GPU.

The engine samples from the learner's very module, or from a bfloat16 copy of it where the
hardware multiplies bfloat16 natively; a weight update then copies the learner's parameters
into that copy (or, for the module itself, copies nothing), and the copy is attested after each
sync (``engine.attest``: a few tensors' digests against what was sent). Sampling ahead
(``Recipe.max_staleness``) always samples from a copy. With a sharded learner
(``Recipe.learner_ranks`` above 1) the learner's ranks are processes of their own and the
engine samples from a copy of the policy in this process (``backends.sharded``).
"""

from __future__ import annotations

from palaestra.backends.building import (
    device_of,
    load_trainable_policy,
    make_engine,
    make_learner,
    make_sampler,
    prepare_data,
    starting_weights,
    tokenizer_of,
)
from palaestra.backends.sharded import CheckedSampler, make_sharded_learner
from palaestra.engine.torch_engine import TorchEngine, sampling_copy
from palaestra.rollout.demonstrations import DemonstrationSampler
from palaestra.rollout.sampler import GroupSampler
from palaestra.train.learner import Learner
from palaestra.train.state import Start


def build_local(
    config, start: Start
) -> tuple[GroupSampler | DemonstrationSampler | CheckedSampler, Learner]:
    """The sampler and learner of ``config``, starting from ``start``."""
    tokenizer = tokenizer_of(config, start)
    data = prepare_data(config, tokenizer)  # a bad dataset fails before the model loads
    if config.recipe.learner_ranks > 1:
        return build_sharded(config, start, tokenizer, data)
    learner = make_learner(config, start, tokenizer, device_of(config))
    policy = learner.model
    if config.recipe.max_staleness:
        # The learner updates while the engine samples ahead: they cannot share one module.
        policy = sampling_copy(policy, next(policy.parameters()).dtype)
    engine = make_engine(config, policy, tokenizer, starting_weights(config, start))
    sampler = make_sampler(config, engine, data)
    if getattr(engine, "model", None) is learner.model:
        # The engine samples from the learner's own tensors: a sync copies nothing, so there
        # is nothing that could go stale, and nothing to attest.
        return sampler, learner
    # Each sync sends every parameter (``Learner.weights``): a resting engine's copy may go.
    rest = rests(config, engine)
    return CheckedSampler(sampler, engine, rest=rest, rest_weights=rest), learner


def build_sharded(config, start: Start, tokenizer, data) -> tuple[CheckedSampler, object]:
    """A sharded learner's ranks, and a sampler over an engine with its own copy of the
    policy (the ranks' weights reach it at the first sync, every tensor of them)."""
    learner = make_sharded_learner(config, start)
    try:
        model, _ = load_trainable_policy(config, start, device_of(config))
        engine = make_engine(config, model, tokenizer, starting_weights(config, start))
        sampler = CheckedSampler(
            make_sampler(config, engine, data), engine, learner, rest=rests(config, engine)
        )
        sampler.update_weights(learner.weights(everything=True), start.state.step)
    except BaseException:
        learner.close()
        raise
    return sampler, learner


def rests(config, engine) -> bool:
    """Whether the run's torch engine sleeps after each rollout (``CheckedSampler.rest``): in
    step (no sampling ahead), each rollout is followed by the update and then new weights, so
    its packed weights are rebuilt anyway. Sampling ahead samples through the update, and
    vLLM's sleep is its own (a colocated layout's)."""
    return not config.recipe.max_staleness and isinstance(engine, TorchEngine)
