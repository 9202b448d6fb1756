"""The KL reference: the fixed policy a ``kl_loss_coef`` penalty keeps the trained one close to.

Nothing is loaded unless the coefficient is above zero. With full fine-tuning the reference is
a frozen copy of the model's own weights (``TrainConfig.model``, not a starting checkpoint, so a
run continued from a checkpoint keeps the same anchor). With LoRA the reference is the policy
itself with its adapters switched off: the base weights are already in memory, untouched.
"""

from __future__ import annotations

import torch

from palaestra.models.loading import load_causal_lm
from palaestra.recipes import Recipe
from palaestra.train.batch import TrainBatch
from palaestra.train.learner import Scorer
from palaestra.train.scoring import score_logprobs


def load_reference(
    recipe: Recipe, policy: torch.nn.Module, base_weights: str, config
) -> Scorer | None:
    """A scorer of reference log-probs, or None when ``recipe.kl_loss_coef`` is 0.

    ``config`` is the run's ModelConfig (revision, remote code) for loading ``base_weights``.
    """
    if recipe.kl_loss_coef == 0:
        return None
    if recipe.lora_rank:

        def adapters_off(batch: TrainBatch) -> torch.Tensor:
            with policy.disable_adapter():
                return score_logprobs(policy, batch, recipe)

        return adapters_off

    device = next(policy.parameters()).device
    reference = load_causal_lm(
        base_weights, torch.float32, device, config.revision, config.trust_remote_code
    )
    reference.eval().requires_grad_(False)

    def frozen_copy(batch: TrainBatch) -> torch.Tensor:
        return score_logprobs(reference, batch, recipe)

    return frozen_copy
