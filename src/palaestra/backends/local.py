"""The local backend: sampler and learner in the run's own process, on its CPU or one GPU.

The engine samples from the learner's very module, or from a bfloat16 copy of it where the
hardware multiplies bfloat16 natively; a weight update then copies the learner's parameters
into that copy (or, for the module itself, copies nothing). Sampling ahead
(``Recipe.max_staleness``) always samples from a copy.
"""

from __future__ import annotations

from palaestra.backends.building import (
    device_of,
    make_engine,
    make_learner,
    make_sampler,
    prepare_data,
    starting_weights,
    tokenizer_of,
)
from palaestra.engine.torch_engine import sampling_copy
from palaestra.rollout.demonstrations import DemonstrationSampler
from palaestra.rollout.sampler import GroupSampler
from palaestra.train.learner import Learner
from palaestra.train.state import Start


def build_local(config, start: Start) -> tuple[GroupSampler | DemonstrationSampler, Learner]:
    """The sampler and learner of ``config``, starting from ``start``."""
    tokenizer = tokenizer_of(config, start)
    data = prepare_data(config, tokenizer)  # a bad dataset fails before the model loads
    learner = make_learner(config, start, tokenizer, device_of(config))
    policy = learner.model
    if config.recipe.max_staleness:
        # The learner updates while the engine samples ahead: they cannot share one module.
        policy = sampling_copy(policy, next(policy.parameters()).dtype)
    engine = make_engine(config, policy, tokenizer, starting_weights(config, start))
    return make_sampler(config, engine, data), learner
