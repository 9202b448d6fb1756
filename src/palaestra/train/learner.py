"""The learner: owns the policy's weights and optimiser, and turns a TrainBatch into an update.

Its interface is small on purpose (``train_step``, ``state_dict``, ``load_state_dict``), so a
distributed backend can run it as an actor.
"""

from __future__ import annotations

import torch

from palaestra.algo.losses import clipped_policy_loss, token_entropy, token_logprobs
from palaestra.recipes import Recipe
from palaestra.train.batch import micro_batches
from palaestra.types import TrainBatch


class Learner:
    def __init__(self, model: torch.nn.Module, recipe: Recipe) -> None:
        self.model = model
        self.recipe = recipe
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=recipe.lr,
            weight_decay=recipe.weight_decay,
        )

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on the whole batch, accumulated over micro-batches."""
        recipe = self.recipe
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = float(batch.mask_B_T.sum().clamp(min=1))
        loss_sum = clipped = entropy_sum = 0.0
        device = next(self.model.parameters()).device
        for micro in micro_batches(batch, recipe.train_micro_batch_size):
            micro = micro.to(device)
            logits_B_T_V = self.model(
                input_ids=micro.input_ids_B_T, attention_mask=micro.attention_mask_B_T
            ).logits
            # Score tokens under the sampling temperature (as the sampler saw them; top-p
            # truncation is not modelled, as in TRL).
            logits_B_T_V = logits_B_T_V[:, :-1].float() / recipe.rollout_temperature
            logprobs_B_T = token_logprobs(logits_B_T_V, micro.input_ids_B_T[:, 1:])
            mask_B_T = micro.mask_B_T[:, :-1]
            # One update per rollout: the sampler's policy is the current one, so the old
            # log-probs are these log-probs detached. The ratio is then 1 and the clip never
            # binds; eps_clip matters once the sampler's log-probs differ (several updates per
            # rollout, a separate inference engine), and this loss is already the one they need.
            loss, num_clipped = clipped_policy_loss(
                logprobs_B_T,
                logprobs_B_T.detach(),
                micro.advantages_B,
                mask_B_T,
                recipe.eps_clip,
                recipe.clip_high,
                num_tokens,
            )
            loss.backward()
            with torch.no_grad():
                entropy_sum += float((token_entropy(logits_B_T_V) * mask_B_T).sum())
            loss_sum += float(loss.detach())
            clipped += float(num_clipped)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), recipe.max_grad_norm or float("inf")
        )
        self.optimizer.step()
        return {
            "loss": loss_sum,
            "grad_norm": float(grad_norm),
            "entropy": entropy_sum / num_tokens,
            "clip_fraction": clipped / num_tokens,
            "response_tokens": num_tokens,
        }

    def state_dict(self) -> dict:
        """Optimiser state for resuming; the weights are saved separately in HF format."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        # Moments carry over from the checkpoint; the knobs come from this run's recipe.
        for group in self.optimizer.param_groups:
            group["lr"] = self.recipe.lr
            group["weight_decay"] = self.recipe.weight_decay
