"""Single-turn rollout: one prompt, ``G`` replies, each reply one sample; and the seeds they draw.

A rollout function turns a step's prompts into unscored samples on an engine. This is the one
for prompt-in, reply-out tasks; a multi-turn environment is another function of the same shape,
filling each sample's ``loss_mask`` where the environment wrote tokens.

Seeds come from (run seed, step, the prompt's position in the dataset order, sample index),
never from a process-wide generator: the g-th samples of two prompts draw different noise, and a
step split over several processes draws exactly what one process would.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable

from palaestra.engine import GenerationRequest, RolloutEngine, SamplingParams
from palaestra.types import Completion, Prompt, Sample

RolloutFn = Callable[[RolloutEngine, list[Prompt], list[SamplingParams], int, int], list[Sample]]
"""``(engine, prompts_P, params_P, G, step) -> samples_B``, group after group."""


def group_seed(run_seed: int, step: int, position: int) -> int:
    """The seed of the group drawn at ``position`` of the dataset order in ``step``; its sample
    ``g`` draws with ``row_seed(group_seed, g)``. A hash, so nearby inputs share no structure."""
    digest = hashlib.blake2b(f"{run_seed}/{step}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def single_turn(
    engine: RolloutEngine,
    prompts_P: list[Prompt],
    params_P: list[SamplingParams],
    G: int,
    step: int,
) -> list[Sample]:
    """``G`` replies to each prompt in one batched call, flattened group after group."""
    requests = [
        GenerationRequest(prompt.token_ids, G, params)
        for prompt, params in zip(prompts_P, params_P, strict=True)
    ]
    completions_P_G = engine.generate_requests(requests)
    version = engine.weight_version
    return [
        make_sample(prompt, completion, g, step, version)
        for prompt, completions_G in zip(prompts_P, completions_P_G, strict=True)
        for g, completion in enumerate(completions_G)
    ]


def make_sample(
    prompt: Prompt, completion: Completion, group_index: int, step: int, version: int = 0
) -> Sample:
    return Sample(
        prompt=prompt.text,
        response=completion.text,
        label=prompt.label,
        metadata=copy.deepcopy(prompt.metadata),  # a reward may add fields or edit them
        index=prompt.index,
        group_index=group_index,
        step=step,
        messages=copy.deepcopy(prompt.messages),
        prompt_token_ids=prompt.token_ids,
        response_token_ids=completion.token_ids,
        finish_reason=completion.finish_reason,
        response_logprobs=completion.logprobs,
        weight_version=version,
    )
