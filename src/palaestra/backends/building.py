"""The parts every backend builds the same way: the tokenizer and prompts, the learner, the
engine over a policy, and the sampler around an engine.

A backend decides only where each part lives: the local one puts them all in the run's process;
the Ray one puts the learner in one actor and an engine in each rollout worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from palaestra.checkpoints import has_optimizer_state
from palaestra.devices import torch_device_type
from palaestra.engine import RolloutEngine
from palaestra.engine.torch_engine import TorchEngine
from palaestra.models.loading import compute_dtype, load_tokenizer
from palaestra.rewards import RewardScorer
from palaestra.rollout.demonstrations import DemonstrationSampler, demonstration
from palaestra.rollout.multi_turn import MultiTurnRollout, RunArgs
from palaestra.rollout.prompts import prepare_prompts
from palaestra.rollout.sampler import GroupSampler
from palaestra.rollout.single_turn import single_turn
from palaestra.train.learner import Learner
from palaestra.train.lora import load_policy
from palaestra.train.reference import load_reference
from palaestra.train.state import Start


def device_of(config) -> str:
    """Where the run's engines and one-process learner compute: ``"cuda"`` for a GPU recipe,
    ``"cpu"`` otherwise or in a rehearsal (``devices.torch_device_type``)."""
    return torch_device_type(config.recipe.rollout_num_gpus)


def starting_weights(config, start: Start) -> str:
    """The full weights a run starts from: its checkpoint's, or its model's."""
    return str(start.checkpoint) if start.checkpoint is not None else config.model.weights_path()


def tokenizer_of(config, start: Start):
    model = config.model
    return load_tokenizer(starting_weights(config, start), model.chat_template, model.revision)


@dataclass
class PreparedData:
    """A run's prompts, tokenized: what a sampler draws from and evaluates on."""

    prompts: list
    eval_prompts: list | None
    demonstrations: list | None
    """For ``loss_type="sft_loss"``: the rows' answers to imitate."""


def prepare_data(config, tokenizer) -> PreparedData:
    """Tokenized prompts (and SFT demonstrations) of the run's datasets. Called before any
    model loads, so a bad dataset fails first."""
    recipe = config.recipe
    template_kwargs = recipe.apply_chat_template_kwargs
    prompts = prepare_prompts(config.dataset, tokenizer, template_kwargs)
    demos = None
    if recipe.loss_type == "sft_loss":
        chat = config.dataset.apply_chat_template
        demos = [demonstration(p, tokenizer, chat, template_kwargs) for p in prompts]
    eval_prompts = None
    if config.eval_dataset is not None:
        eval_prompts = prepare_prompts(config.eval_dataset, tokenizer, template_kwargs)
    return PreparedData(prompts, eval_prompts, demos)


def load_trainable_policy(config, start: Start, device: str) -> tuple[torch.nn.Module, bool]:
    """The policy as the run trains it (LoRA adapters included, seeded so that fresh ones start
    alike in every process), and whether the checkpoint's optimiser state fits it."""
    torch.manual_seed(config.recipe.seed)
    model, _, state_fits = load_policy(
        config.recipe, starting_weights(config, start), start.checkpoint, config.model, device
    )
    model.config.use_cache = True
    return model, state_fits


def make_learner(config, start: Start, tokenizer, device: str) -> Learner:
    """The run's learner: its policy, KL reference and (from a checkpoint) optimiser state."""
    recipe, model_config = config.recipe, config.model
    model, state_fits = load_trainable_policy(config, start, device)
    reference = load_reference(recipe, model, model_config.weights_path(), model_config)
    learner = Learner(model, recipe, reference, tokenizer)
    checkpoint = start.checkpoint
    if checkpoint is not None and state_fits and has_optimizer_state(checkpoint):
        learner.load(checkpoint)
    return learner


def engine_kind(recipe, device: str) -> str:
    """``"torch"`` or ``"vllm"``: what ``recipe.rollout_engine`` resolves to on ``device``.
    Auto takes vLLM on a CUDA GPU when it is installed; on a CPU, the torch engine (vLLM's CPU
    build is faster per token but takes minutes to start: ask for it by name)."""
    if recipe.rollout_engine != "auto":
        return recipe.rollout_engine
    from palaestra.engine.vllm_engine import vllm_available

    return "vllm" if device == "cuda" and vllm_available() else "torch"


def make_engine(config, model: torch.nn.Module | None, tokenizer, weights: str) -> RolloutEngine:
    """The engine of ``config``: the torch engine over ``model`` (the learner's module, or a
    worker's copy; in bfloat16, from a copy, where the precision asks), or vLLM loaded from the
    folder ``weights`` (what ``model`` was loaded from; a vLLM worker loads no ``model``)."""
    from palaestra.launch.checks import colocated

    recipe = config.recipe
    device = device_of(config)
    dtype = compute_dtype(recipe.precision, device)
    shared = colocated(recipe)  # asleep through each update
    if engine_kind(recipe, device) == "vllm":
        from palaestra.engine.vllm_engine import VLLMEngine

        return VLLMEngine(
            weights,
            tokenizer,
            dtype=str(dtype).removeprefix("torch."),
            seed=recipe.seed,
            # Beside a learner (or a learner's rank) on the same GPU: this share of its memory.
            gpu_memory_utilization=VLLM_GPU_SHARE
            if recipe.rollout_num_gpus == 1 or shared
            else 0.9,
            lora_rank=recipe.lora_rank,
            lora_alpha=recipe.lora_alpha,
            sleep_mode=shared,
        )
    return TorchEngine(model, tokenizer, dtype=None if dtype == torch.float32 else dtype)


VLLM_GPU_SHARE = 0.4
"""Share of a GPU's memory vLLM's engine takes (weights, activations, KV cache) when it sits
beside the learner on one GPU (``rollout_num_gpus=1``; with more, each engine has a GPU of
its own and takes 90%): the rest holds the learner's float32 weights, gradients, Adam
moments and activations (about 16 bytes a parameter before activations: 64 GB for a 4B model,
so a 4B model trains on one 141 GB H200 with 56 GB left to vLLM)."""


def make_sampler(
    config, engine: RolloutEngine, data: PreparedData
) -> GroupSampler | DemonstrationSampler:
    """The sampler of ``config`` over ``engine``: scored groups, or demonstrations for SFT."""
    recipe = config.recipe
    scorer = None
    if recipe.custom_rm_function is not None:
        # With extra_config, the reward reads its keys as attributes of args, as the episode does.
        args = RunArgs(recipe) if recipe.extra_config else recipe
        scorer = RewardScorer(recipe.custom_rm_function, args, recipe.reward_timeout_s)
    rollout_fn = single_turn
    if recipe.multi_turn:
        # The Ray backend's engine is a pool of workers without a tokenizer of its own.
        tokenizer = getattr(engine, "tokenizer", None) or load_tokenizer(
            config.model.weights_path(), config.model.chat_template, config.model.revision
        )
        rollout_fn = MultiTurnRollout(recipe, tokenizer, getattr(engine, "max_context", None))
    sampler = GroupSampler(
        engine, data.prompts, recipe, scorer, data.eval_prompts, rollout_fn=rollout_fn
    )
    if data.demonstrations is not None:
        return DemonstrationSampler(data.demonstrations, data.prompts, recipe, sampler)
    return sampler


def without_reward(config):
    """``config`` as the actors get it: the reward, an episode's functions (environment, tools,
    custom generate function) and the datasets run in the driver, so they never travel."""
    driver_only = {
        "custom_rm_function": None,
        "image_overlay": None,
        "custom_generate_function": None,
        "environment": None,
        "tools": [],
        "extra_config": {},
    }
    recipe = config.recipe.model_copy(update=driver_only)
    return config.model_copy(update={"recipe": recipe, "eval_dataset": None})
