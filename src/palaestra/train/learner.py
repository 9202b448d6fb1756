"""The learner: owns the policy's weights, its optimiser and the KL reference, and turns a
step's samples and advantages into updates.

Its interface is small on purpose (``train_step``, ``weights``, ``save``, ``load``), so a
distributed backend can run it as an actor. One ``train_step`` is one rollout's worth of
training: build the batch, score the log-probs the loss compares against (the sampling policy's,
the KL reference's), then ``num_steps_per_rollout`` optimiser steps over consecutive
mini-batches (``update``).

The passes run as ``train.scoring`` lays out (a group's prompt once, bfloat16 autocast where
the hardware has it, the lm head only where tokens are scored); the sampler's log-probs stand
in for a scoring pass whenever they can; AdamW is fused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pickle
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from palaestra.algo.casts import weights_cast_once
from palaestra.algo.importance import (
    add_ratio_sums,
    importance_weights,
    ratio_metrics,
    ratio_metrics_of,
    ratio_sums,
)
from palaestra.algo.losses import (
    LossScale,
    aggregate,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
)
from palaestra.checkpoints import OPTIMIZER_FILE, OPTIMIZER_SHARDS
from palaestra.models.loading import compute_dtype
from palaestra.recipes import Recipe
from palaestra.train.batch import TrainBatch, build_train_batch, micro_batches, mini_batches
from palaestra.train.heap import own_memory, release_free_memory
from palaestra.train.scoring import score_logprobs, score_tokens
from palaestra.types import Sample

# Scores a batch under some fixed policy: logprobs_B_T aligned like the batch's mask.
Scorer = Callable[[TrainBatch], torch.Tensor]


class Learner:
    """Trains ``model`` (float32 master weights) by ``recipe``; ``tokenizer`` is saved beside
    the weights in each checkpoint, and its pad token pads batches."""

    old_from_the_update = True
    """With an off-policy correction and one optimiser step per rollout, ``pi_old`` (the
    policy before the step) is what the step's own forward pass scores: its log-probs,
    detached, serve, and the importance weights are taken per micro-batch, instead of a
    second pass over the batch before the update. (A sharded learner scores it first, as its
    ranks reduce only sums.)"""

    def __init__(
        self,
        model: torch.nn.Module,
        recipe: Recipe,
        reference: Scorer | None = None,
        tokenizer=None,
    ) -> None:
        self.model = model
        self.recipe = recipe
        self.reference = reference
        self.tokenizer = tokenizer
        self.pad_id = 0
        if tokenizer is not None:  # padding is never attended to or scored; any token will do
            pad = tokenizer.pad_token_id
            self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.device = next(model.parameters()).device
        self.dtype = compute_dtype(recipe.precision, self.device)
        trained = [p for p in model.parameters() if p.requires_grad]
        own_memory(trained)  # out of the weights file's mapping: AdamW writes them in place
        self.optimizer = torch.optim.AdamW(
            trained,
            lr=recipe.lr,
            weight_decay=recipe.weight_decay,
            fused=True,  # one kernel for the whole update, on the CPU as on a GPU
        )

    def train_step(self, samples_B: Sequence[Sample], advantages_B: Sequence[float]) -> dict:
        """One rollout's updates on ``samples_B`` (whole groups, group after group), each
        weighted by its advantage over its loss-mask tokens. No samples: no update."""
        if not samples_B:
            return {"updates": 0}
        # Dropout (LoRA's) draws from a seed of the run and the step, so a resumed step
        # repeats it without any random state carried in the checkpoint.
        step = samples_B[0].step
        digest = hashlib.blake2b(f"{self.recipe.seed}/{step}".encode(), digest_size=8).digest()
        torch.manual_seed(int.from_bytes(digest, "big") >> 1)
        batch = build_train_batch(
            samples_B,
            torch.tensor(list(advantages_B), dtype=torch.float32),
            self.pad_id,
            self.recipe.mask_truncated_responses,
        )
        return self.update(batch)

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's parameters by name, for an engine's ``update_weights``: the tensors
        themselves, not copies (an engine over this very module then copies nothing)."""
        return dict(self.model.named_parameters())

    def save(self, folder: Path) -> None:
        """Write the weights (a LoRA model: its adapters), the tokenizer and the optimiser's
        state (unless ``recipe.no_save_optim``) into ``folder``."""
        self.model.save_pretrained(folder)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)
        if not self.recipe.no_save_optim:
            # Without zip checksums: torch.load never checks them, and computing them over the
            # moments (twice the weights) took most of the save: SmolLM2-135M's 1.08 GB in
            # 0.59-1.93 s with them, 0.36-0.40 s without (fsync apart; AVX2 EPYC, in turn).
            with crc32_skipped():
                torch.save(
                    {"optimizer": self.optimizer.state_dict()}, Path(folder) / OPTIMIZER_FILE
                )

    def load(self, folder: Path) -> None:
        """Continue from the optimiser state saved in ``folder`` (the weights were loaded with
        the model). The moments carry over; lr and weight decay come from this run's recipe.
        A file that is not the state of this model's optimiser is a ValueError naming it.
        A sharded learner's state (``OPTIMIZER_SHARDS``, any rank count) loads here whole."""
        if (Path(folder) / OPTIMIZER_SHARDS).is_dir():
            from palaestra.train.optimizer_shards import load_sharded_optimizer

            load_sharded_optimizer(self.model, self.optimizer, Path(folder) / OPTIMIZER_SHARDS)
            self._use_recipe_rates()
            return
        path = Path(folder) / OPTIMIZER_FILE
        try:
            # weights_only: tensors and plain containers; a pickled object's code never runs.
            state = torch.load(path, map_location="cpu", weights_only=True)["optimizer"]
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            check_moment_shapes(state["state"], params)
            self.optimizer.load_state_dict(state)
        except pickle.UnpicklingError as error:
            refused = "".join(
                f" ({line.strip()})" for line in str(error).splitlines() if "GLOBAL" in line
            )
            raise ValueError(
                f"{path}: holds more than tensors, so it was not loaded (unpickling it could run "
                f"code){refused}"
            ) from error
        except (RuntimeError, EOFError, KeyError, TypeError, ValueError) as error:
            reason = error if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            raise ValueError(f"{path}: {reason}") from error
        self._use_recipe_rates()

    def _use_recipe_rates(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.recipe.lr
            group["weight_decay"] = self.recipe.weight_decay

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout's updates: ``num_steps_per_rollout`` optimiser steps on the batch."""
        recipe = self.recipe
        # The importance ratio's denominator is the sampling policy: the sampler's own
        # log-probs when it kept them; else, with several updates, this policy scored once
        # before the first one; else (one update) the ratio is 1 and nothing is needed.
        # With an off-policy correction, the denominator is this policy before the update and
        # the sampler's log-probs only weight each token (algo.importance).
        old_B_T = batch.sampler_logprobs_B_T
        correction, weights_metrics = None, {}
        if recipe.off_policy_correction != "none":
            require_sampler_logprobs(batch, recipe)
            if recipe.num_steps_per_rollout == 1 and self.old_from_the_update:
                old_B_T = None  # the update's own log-probs, detached (old_from_the_update)
            else:
                old_B_T = self._policy_logprobs(batch)
                correction, weights_metrics = off_policy_weights(batch, old_B_T, recipe)
        elif (
            old_B_T is None and recipe.num_steps_per_rollout > 1 and recipe.loss_type != "sft_loss"
        ):
            old_B_T = self._policy_logprobs(batch)
        ref_B_T = None
        if self.reference is not None and recipe.kl_loss_coef > 0:
            ref_B_T = self.reference(batch)
        batch = dataclasses.replace(
            batch, old_logprobs_B_T=old_B_T, ref_logprobs_B_T=ref_B_T, importance_B_T=correction
        )

        updates = [self._update(mini) for mini in mini_batches(batch, recipe.num_steps_per_rollout)]
        metrics = {key: sum(u[key] for u in updates) / len(updates) for key in updates[0]}
        metrics["response_tokens"] = sum(u["response_tokens"] for u in updates)
        metrics["updates"] = len(updates)
        metrics |= weights_metrics
        if "sampler_logprob_abs_diff" in metrics:
            # Only the first update sees the policy the sampler had; later ones differ by design.
            metrics["sampler_logprob_abs_diff"] = updates[0]["sampler_logprob_abs_diff"]
        return metrics

    def _policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``logprobs_B_T`` of ``batch`` under the policy as it is now, no gradients."""
        return score_logprobs(self.model, batch, self.recipe)

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on ``batch``, gradients accumulated over its micro-batches."""
        recipe = self.recipe
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micros = micro_batches(batch, recipe.train_micro_batch_size)
        num_tokens = float(batch.mask_B_T.sum().clamp(min=1))
        scale = LossScale(
            num_tokens, len(batch.advantages_B), len(micros), recipe.rollout_max_response_len
        )
        sums: dict[str, float] = defaultdict(float)
        # The weights stay as they are until the optimiser's step: each is cast to the compute
        # dtype once for all the micro-batches' passes (algo.casts), not at every use.
        with weights_cast_once():
            for micro in micros:
                # What the rollout or the last micro-batch's passes freed goes back to the
                # system first, so that the resident peak is this pass's, not every phase's.
                release_free_memory()
                micro = micro.to(self.device)
                logprobs_B_T, entropy_B_T = score_tokens(
                    self.model, micro, recipe.rollout_temperature, self.dtype
                )
                loss = self._loss(micro, logprobs_B_T, entropy_B_T, scale, sums)
                loss.backward()
                del logprobs_B_T, entropy_B_T, loss
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), recipe.max_grad_norm or float("inf")
        )
        self.optimizer.step()
        # The gradients are spent: freed now, they do not sit beside the next rollout's
        # engine (a float32 copy of every weight) until the next update.
        self.optimizer.zero_grad(set_to_none=True)
        release_free_memory()
        return step_metrics(sums, float(grad_norm), num_tokens, batch, recipe)

    def _loss(
        self,
        micro: TrainBatch,
        logprobs_B_T: torch.Tensor,
        entropy_B_T: torch.Tensor,
        scale: LossScale,
        sums: dict[str, float],
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss; adds its token sums to ``sums``."""
        recipe = self.recipe
        mask_B_T = micro.mask_B_T

        def token_sum(values_B_T: torch.Tensor) -> float:
            return float((values_B_T.detach() * mask_B_T).sum())

        old_B_T = micro.old_logprobs_B_T
        if old_B_T is None:
            old_B_T = logprobs_B_T.detach()
        importance_B_T = micro.importance_B_T
        if importance_B_T is None and recipe.off_policy_correction != "none":
            importance_B_T = self._weights_here(micro, old_B_T, sums)
        if recipe.loss_type == "sft_loss":
            per_token_B_T = -logprobs_B_T
        elif recipe.loss_type == "cispo":
            per_token_B_T, clipped_B_T = cispo_loss(
                logprobs_B_T, old_B_T, micro.advantages_B, recipe.clip_high
            )
        elif recipe.advantage_estimator == "gspo":
            per_token_B_T, clipped_B_T = gspo_loss(
                logprobs_B_T,
                old_B_T,
                micro.advantages_B,
                mask_B_T,
                recipe.eps_clip,
                recipe.clip_high,
            )
        else:
            per_token_B_T, clipped_B_T = ppo_clip_loss(
                logprobs_B_T, old_B_T, micro.advantages_B, recipe.eps_clip, recipe.clip_high
            )
        if recipe.loss_type != "sft_loss":
            sums["clipped"] += token_sum(clipped_B_T)
        if importance_B_T is not None:
            per_token_B_T = per_token_B_T * importance_B_T
        loss = aggregate(per_token_B_T, mask_B_T, recipe.loss_type, scale)

        if recipe.entropy_coef > 0:
            loss = loss - recipe.entropy_coef * aggregate(
                entropy_B_T, mask_B_T, recipe.loss_type, scale
            )
        sums["entropy"] += token_sum(entropy_B_T)

        if micro.ref_logprobs_B_T is not None:
            kl_B_T = kl_penalty(logprobs_B_T, micro.ref_logprobs_B_T, recipe.kl_loss_type)
            loss = loss + recipe.kl_loss_coef * aggregate(kl_B_T, mask_B_T, recipe.loss_type, scale)
            sums["kl"] += token_sum(kl_B_T)
        if micro.sampler_logprobs_B_T is not None:
            sums["sampler_abs_diff"] += token_sum((logprobs_B_T - micro.sampler_logprobs_B_T).abs())
        sums["loss"] += float(loss.detach())
        return loss

    def _weights_here(
        self, micro: TrainBatch, old_B_T: torch.Tensor, sums: dict[str, float]
    ) -> torch.Tensor:
        """The importance weights of ``micro`` against ``old_B_T``, the update's own detached
        log-probs (``old_from_the_update``); adds the ratio's sums to ``sums``."""
        weights = recipe_weights(old_B_T, micro, self.recipe)
        add_ratio_sums(sums, ratio_sums(weights, micro.mask_B_T))
        return weights.weight_B_T


def step_metrics(
    sums: dict[str, float], grad_norm: float, num_tokens: int, batch: TrainBatch, recipe: Recipe
) -> dict[str, float]:
    """An update's metrics from its token sums (``sums``: loss, entropy, clipped, kl,
    sampler_abs_diff over the step's ``num_tokens`` trained tokens); the terms a batch has."""
    metrics = {
        "loss": sums["loss"],
        "grad_norm": grad_norm,
        "entropy": sums["entropy"] / num_tokens,
        "response_tokens": num_tokens,
    }
    if recipe.loss_type != "sft_loss":
        metrics["clip_fraction"] = sums["clipped"] / num_tokens
    if batch.ref_logprobs_B_T is not None:
        metrics["kl"] = sums["kl"] / num_tokens
    if batch.sampler_logprobs_B_T is not None:
        metrics["sampler_logprob_abs_diff"] = sums["sampler_abs_diff"] / num_tokens
    return metrics | ratio_metrics_of(sums, recipe.off_policy_correction)


def require_sampler_logprobs(batch: TrainBatch, recipe: Recipe) -> None:
    """ValueError unless ``batch`` has the sampler's log-probs, which a correction needs."""
    if batch.sampler_logprobs_B_T is None:
        raise ValueError(
            f"off_policy_correction={recipe.off_policy_correction!r} needs the sampler's "
            "log-probs, and this step's samples came without them (the engine did not keep "
            "them); set off_policy_correction='none'"
        )


def off_policy_weights(
    batch: TrainBatch, old_B_T: torch.Tensor, recipe: Recipe
) -> tuple[torch.Tensor, dict[str, float]]:
    """The batch's importance weights of ``recipe.off_policy_correction`` against the
    sampler's log-probs, and the ratio's metrics."""
    require_sampler_logprobs(batch, recipe)
    weights = recipe_weights(old_B_T, batch, recipe)
    return weights.weight_B_T, ratio_metrics(weights, batch.mask_B_T, recipe.off_policy_correction)


def recipe_weights(old_B_T: torch.Tensor, batch: TrainBatch, recipe: Recipe):
    """``importance_weights`` of ``batch`` against ``old_B_T``, by the recipe's correction."""
    return importance_weights(
        old_B_T,
        batch.sampler_logprobs_B_T,
        batch.mask_B_T,
        recipe.off_policy_correction,
        recipe.tis_cap,
        recipe.importance_level,
    )


def crc32_skipped():
    """A block in which ``torch.save`` writes no zip checksums (where this torch can say so)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})


def check_moment_shapes(moments: dict, params: list[torch.Tensor]) -> None:
    """ValueError unless each saved moment has its parameter's shape: AdamW would load moments
    of another model's shapes without a word and fail (or broadcast) at its first step."""
    for index, saved in moments.items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"state of parameter {index!r}; the model has {len(params)}")
        shape = tuple(params[index].shape)
        for name, value in saved.items():
            if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != shape:
                raise ValueError(
                    f"{name} of parameter {index} has shape {tuple(value.shape)}, but the model's "
                    f"parameter {index} has shape {shape}: the state of another model"
                )
