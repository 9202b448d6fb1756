"""The local backend: sampler and learner in the run's own process, on its CPU or one GPU.

The engine samples from the learner's very module, or from a bfloat16 copy of it where the
hardware multiplies bfloat16 natively; a weight update then copies the learner's parameters
into that copy (or, for the module itself, copies nothing).
"""

from __future__ import annotations

import torch

from palaestra.checkpoints import has_optimizer_state
from palaestra.models.loading import compute_dtype, load_tokenizer
from palaestra.rewards import RewardScorer
from palaestra.rollout import TorchEngine
from palaestra.rollout.demonstrations import DemonstrationSampler, demonstration
from palaestra.rollout.prompts import prepare_prompts
from palaestra.rollout.sampler import GroupSampler
from palaestra.train.learner import Learner
from palaestra.train.lora import load_policy
from palaestra.train.reference import load_reference
from palaestra.train.state import Start


def build_local(config, start: Start) -> tuple[GroupSampler | DemonstrationSampler, Learner]:
    """The sampler and learner of ``config``, starting from ``start``."""
    recipe, model_config = config.recipe, config.model
    device = "cuda" if recipe.rollout_num_gpus else "cpu"
    checkpoint = start.checkpoint
    weights = str(checkpoint) if checkpoint is not None else model_config.weights_path()

    # Tokenizer and prompts first: a bad dataset fails before the model loads.
    tokenizer = load_tokenizer(weights, model_config.chat_template, model_config.revision)
    template_kwargs = recipe.apply_chat_template_kwargs
    prompts = prepare_prompts(config.dataset, tokenizer, template_kwargs)
    demos = None
    if recipe.loss_type == "sft_loss":
        chat = config.dataset.apply_chat_template
        demos = [demonstration(p, tokenizer, chat, template_kwargs) for p in prompts]
    eval_prompts = None
    if config.eval_dataset is not None:
        eval_prompts = prepare_prompts(config.eval_dataset, tokenizer, template_kwargs)

    torch.manual_seed(recipe.seed)  # fresh LoRA adapters start the same way every time
    model, _, state_fits = load_policy(recipe, weights, checkpoint, model_config, device)
    model.config.use_cache = True
    reference = load_reference(recipe, model, model_config.weights_path(), model_config)
    learner = Learner(model, recipe, reference, tokenizer)
    if checkpoint is not None and state_fits and has_optimizer_state(checkpoint):
        learner.load(checkpoint)

    dtype = compute_dtype(recipe.precision, next(model.parameters()).device)
    engine = TorchEngine(model, tokenizer, dtype=None if dtype == torch.float32 else dtype)
    scorer = None
    if recipe.custom_rm_function is not None:
        scorer = RewardScorer(recipe.custom_rm_function, recipe, recipe.reward_timeout_s)
    sampler = GroupSampler(engine, prompts, recipe, scorer, eval_prompts)
    if demos is not None:
        return DemonstrationSampler(demos, prompts, recipe, sampler), learner
    return sampler, learner
