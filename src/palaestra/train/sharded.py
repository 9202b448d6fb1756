"""One rank of a sharded learner: the learner's step, run by each of N processes in a
``torch.distributed`` group over weights, gradients and AdamW moments sharded with FSDP2.

The policy is sharded as the field does it: ``fully_shard`` on each transformer block, then on
the root (here ``ScoringPass``, a module whose forward is the learner's scoring pass, so the
root's own weights, the embeddings, final norm and lm head, are gathered once per micro-batch).
Master weights, gradient reduction and optimiser state are float32; with bfloat16 precision the
weights are gathered in bfloat16 for the passes (``MixedPrecisionPolicy``).

A step's numbers are those of one process (``train.learner.Learner``): each optimiser step's
micro-batches are laid out exactly as one process lays them out, dealt to the ranks in turn,
and each rank's loss is its micro-batches' share of the *whole* step's loss (every normaliser
is a count over the step's batch, ``LossScale``). Gradients are then summed over ranks, not
averaged. Every layer all-gathers its weights on each call, so every rank makes the same calls:
one plain decoder pass per micro-batch (no shared-prompt passes, whose count depends on the
rows), and a rank with fewer micro-batches, or one with nothing to score, runs a pass whose
loss is multiplied by zero.

The driver's side (processes, commands, weight buckets) is ``train.sharded_driver``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from palaestra.algo.losses import LossScale
from palaestra.checkpoints import OPTIMIZER_FILE, OPTIMIZER_SHARDS
from palaestra.recipes import Recipe
from palaestra.train.batch import TrainBatch, micro_batch_rows, take_rows
from palaestra.train.heap import release_free_memory
from palaestra.train.learner import Learner, step_metrics
from palaestra.train.optimizer_shards import load_sharded_optimizer, load_whole_optimizer
from palaestra.train.scoring import score_tokens

SUM_KEYS = ("loss", "entropy", "clipped", "kl", "sampler_abs_diff")
"""The token sums a step's metrics are made of, summed over ranks."""


@dataclass
class RankParts:
    """What a rank builds before sharding (every rank the same, from the same seed)."""

    policy: torch.nn.Module
    """The trained model, float32 (a LoRA model: with its adapters)."""
    reference: torch.nn.Module | None
    """A frozen copy for the KL term of a full fine-tune; None otherwise (LoRA's reference is
    the policy with its adapters off)."""
    tokenizer: object = None


class ScoringPass(torch.nn.Module):
    """The learner's forward pass as a module, so that FSDP2's root hooks wrap all of it."""

    def __init__(
        self, policy: torch.nn.Module, temperature: float, dtype: torch.dtype, lean: bool
    ) -> None:
        super().__init__()
        self.policy = policy
        self.temperature = temperature
        self.dtype = dtype
        self.lean = lean

    def forward(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return score_tokens(
            self.policy, batch, self.temperature, self.dtype, share_prefixes=False, lean=self.lean
        )


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layers of a Hugging Face causal LM (a LoRA model's too)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: no decoder.layers to shard; the sharded learner needs a "
            "decoder whose transformer blocks are a ModuleList named layers"
        )
    return layers


def shard(
    model: torch.nn.Module, recipe: Recipe, mesh, dtype: torch.dtype, device: torch.device
) -> ScoringPass:
    """``model`` sharded over ``mesh`` (each block, then the root), wrapped as a ScoringPass."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

    if recipe.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    param_dtype = torch.bfloat16 if dtype == torch.bfloat16 else None
    options: dict = {"mesh": mesh}
    if recipe.optimizer_offload and device.type == "cuda":
        options["offload_policy"] = CPUOffloadPolicy()
    for block in transformer_blocks(model):
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        fully_shard(block, mp_policy=policy, **options)
    # Recomputed blocks run outside the lean layers' context: with checkpointing, stock ones.
    lean = not recipe.activation_checkpointing
    root = ScoringPass(model, recipe.rollout_temperature, dtype, lean)
    # The root's input is a TrainBatch: its float tensors (advantages) are not activations.
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    fully_shard(root, mp_policy=policy, **options)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            # Each rank's loss is its share of the step's whole loss: sum, never average.
            # (A plain sum, not a pre-multiplied one, which gloo does not have.)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


class RankLearner(Learner):
    """One rank's learner: ``Learner``'s step over its share of each optimiser step's
    micro-batches, on a policy sharded by ``shard``. Every method is collective: all ranks
    call it, in the same order, with the same arguments."""

    old_from_the_update = False  # the ranks reduce sums only: pi_old is scored first

    def __init__(self, parts: RankParts, recipe: Recipe, mesh, device: torch.device) -> None:
        from palaestra.models.loading import compute_dtype

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dtype = compute_dtype(recipe.precision, device)
        parts.policy.to(device)
        self.scorer = shard(parts.policy, recipe, mesh, dtype, device)
        self.reference_pass = None
        reference = None
        if recipe.kl_loss_coef > 0:
            if parts.reference is not None:
                parts.reference.to(device).eval().requires_grad_(False)
                self.reference_pass = shard(parts.reference, recipe, mesh, dtype, device)
                reference = self._reference_logprobs
            elif recipe.lora_rank:
                reference = self._adapters_off_logprobs
        super().__init__(parts.policy, recipe, reference, parts.tokenizer)
        self.device, self.dtype = device, dtype

    # -- Scoring without gradients (old and reference log-probs), split like the updates.
    def _policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._score_all(batch, self.scorer)

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._score_all(batch, self.reference_pass)

    def _adapters_off_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        with self.model.disable_adapter():
            return self._score_all(batch, self.scorer)

    @torch.no_grad()
    def _score_all(self, batch: TrainBatch, scorer: torch.nn.Module) -> torch.Tensor:
        """``logprobs_B_T`` of the whole batch under ``scorer``: each rank scores its share,
        and the shares are summed (zeros elsewhere) so that every rank holds all of it."""
        was_training = scorer.training
        scorer.eval()
        out_B_T = torch.zeros(batch.input_ids_B_T.shape, dtype=torch.float32)
        try:
            for rows, micro in self._my_micro_batches(batch):
                if rows is None:
                    scorer(void(micro).to(self.device))
                    continue
                logprobs_B_T, _ = scorer(micro.to(self.device))
                out_B_T[rows, : logprobs_B_T.shape[1]] = logprobs_B_T.float().cpu()
        finally:
            scorer.train(was_training)
        dist.all_reduce(out_B_T)
        return out_B_T

    def _my_micro_batches(self, batch: TrainBatch) -> list[tuple[torch.Tensor | None, TrainBatch]]:
        """This rank's micro-batches of ``batch`` (one process's layout, dealt in turn), padded
        to as many passes as the busiest rank makes; ``rows`` None marks a pass whose result
        is thrown away (padding, or a micro-batch with no token to score)."""
        layout = micro_batch_rows(batch, self.recipe.train_micro_batch_size)
        passes = math.ceil(len(layout) / self.world)
        mine = []
        for index in range(passes):
            position = index * self.world + self.rank
            rows = layout[position] if position < len(layout) else layout[0]
            micro = take_rows(batch, rows)
            useful = position < len(layout) and bool(micro.mask_B_T.any())
            mine.append((rows if useful else None, micro))
        return mine

    # -- One optimiser step.
    def _update(self, batch: TrainBatch) -> dict[str, float]:
        recipe = self.recipe
        self.scorer.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = float(batch.mask_B_T.sum().clamp(min=1))
        layout_size = len(micro_batch_rows(batch, recipe.train_micro_batch_size))
        scale = LossScale(
            num_tokens, len(batch.advantages_B), layout_size, recipe.rollout_max_response_len
        )
        sums: dict[str, float] = defaultdict(float)
        for rows, micro in self._my_micro_batches(batch):
            release_free_memory()
            if rows is None:
                logprobs_B_T, _ = self.scorer(void(micro).to(self.device))
                (logprobs_B_T.sum() * 0.0).backward()  # gathers and reduces like the others
                continue
            micro = micro.to(self.device)
            logprobs_B_T, entropy_B_T = self.scorer(micro)
            loss = self._loss(micro, logprobs_B_T, entropy_B_T, scale, sums)
            loss.backward()
            del logprobs_B_T, entropy_B_T, loss
        trainable = [p for p in self.scorer.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, recipe.max_grad_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        release_free_memory()
        totals = torch.tensor([sums[key] for key in SUM_KEYS], dtype=torch.float64)
        dist.all_reduce(totals)
        sums = dict(zip(SUM_KEYS, totals.tolist(), strict=True))
        return step_metrics(sums, float(grad_norm), num_tokens, batch, recipe)

    # -- Weights, checkpoints.
    def gather_weights(
        self, everything: bool, dtype: torch.dtype, bucket_bytes: int, send: Callable
    ) -> int:
        """Each parameter (the trainable ones unless ``everything``) gathered whole, in
        ``dtype``; rank 0 hands them to ``send`` in buckets of about ``bucket_bytes``. Returns
        the bytes rank 0 sent."""
        bucket: dict[str, torch.Tensor] = {}
        size = sent = 0
        for name, parameter in self.model.named_parameters():
            if not (everything or parameter.requires_grad):
                continue
            full = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
            if self.rank != 0:
                continue
            tensor = full.detach().to("cpu", dtype, copy=True)
            bucket[name] = tensor
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                send(bucket)
                bucket, sent, size = {}, sent + size, 0
        if self.rank == 0 and bucket:
            send(bucket)
            sent += size
        return sent

    def save(self, folder: Path) -> None:
        """The consolidated HF folder (rank 0 writes it; a LoRA model: its adapters) and the
        sharded optimiser state (every rank writes its shard) into ``folder``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        folder = Path(folder)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.model, options=options)
        # A tied weight appears under each of its names; the HF folder keeps the one that
        # named_parameters() keeps, as save_pretrained does on its own.
        kept = {name for name, _ in self.model.named_parameters()}
        kept |= {name for name, _ in self.model.named_buffers()}
        full = {name: tensor for name, tensor in full.items() if name in kept}
        if self.rank == 0:
            self.model.save_pretrained(folder, state_dict=full)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(folder)
        del full
        state = get_optimizer_state_dict(self.model, self.optimizer)
        dcp.save({"optimizer": state}, checkpoint_id=str(folder / OPTIMIZER_SHARDS))
        dist.barrier()

    def load(self, folder: Path) -> None:
        """The optimiser state in ``folder``: shards of any rank count, or one process's file."""
        folder = Path(folder)
        if (folder / OPTIMIZER_SHARDS).is_dir():
            load_sharded_optimizer(self.model, self.optimizer, folder / OPTIMIZER_SHARDS)
        else:
            load_whole_optimizer(self.model, self.optimizer, folder / OPTIMIZER_FILE)
        self._use_recipe_rates()


def void(micro: TrainBatch) -> TrainBatch:
    """``micro`` with one token scored, for a pass whose result is thrown away: a pass with
    nothing to score would skip the layers, and with them the other ranks' collectives."""
    mask_B_T = torch.zeros_like(micro.mask_B_T)
    mask_B_T[0, 0] = 1.0
    return dataclasses.replace(micro, mask_B_T=mask_B_T)
