"""Recipe: every knob of a training run, typed and documented, with per-model presets.

A misspelt knob is an error naming the field (``extra="forbid"``), never a silent default.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo


class Recipe(BaseModel):
    """How to train: rollout sizes, sampling, optimiser, clipping, saving and the reward."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, arbitrary_types_allowed=True
    )

    num_rollout: int = Field(10, ge=1)
    """Training steps this run takes (one rollout and one update each). A run continued from a
    checkpoint numbers its steps after the checkpoint's: 10 more steps from step 10 end at 20."""
    rollout_batch_size: int = Field(4, ge=1)
    """Prompts per step (P). Rows are drawn in a shuffled order, one epoch after another."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Samples per prompt (G), the group whose rewards are normalised against each other."""
    rollout_max_response_len: int = Field(64, ge=1)
    """Most tokens generated per sample; longer responses are cut (finish_reason "length")."""
    rollout_temperature: float = Field(1.0, gt=0)
    """Sampling temperature. The trainer scores tokens under the same temperature."""
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold; 1.0 samples from the full distribution."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient norm clip; None disables clipping."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip range below 1: the importance ratio is kept above ``1 - eps_clip``."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Clip range above 1 (DAPO's clip-higher); None uses ``eps_clip``."""
    train_micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward pass; gradients accumulate over a step's micro-batches.
    Smaller uses less memory, larger runs faster. It never changes the loss."""
    save_interval: int | None = Field(None, ge=1)
    """Save a checkpoint every this many steps; the last step is always saved."""
    eval_interval: int | None = Field(None, ge=1)
    """Score ``TrainConfig.eval_dataset`` (one sample per row, fixed seed) every this many
    steps, logged as ``eval_reward_mean``; None: never."""
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template, as a dict or a JSON string
    (``'{"enable_thinking": false}'``)."""
    custom_rm_function: Callable[..., Any] | str | None = None
    """The reward: ``async def rm(args, sample, **kwargs) -> float`` (a plain ``def`` works too),
    or ``"module:function"``. ``args`` is this recipe; ``sample`` a ``palaestra.Sample``."""
    reward_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one reward call may take before the run fails naming the sample; None: no limit."""
    rollout_num_gpus: int = Field(0, ge=0)
    """GPUs for generation and training; 0 runs on the CPU. More than the machine has is an
    error."""
    seed: int = 42
    """Seeds data order, sampling and initialisation; a resumed run restores the RNG state."""
    image_overlay: Any = None
    """Container-image customisation for a cloud backend. The local backend runs in this Python
    environment, so it rejects this field: install packages with pip instead."""

    @field_validator("apply_chat_template_kwargs", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON ({error}): {value!r}") from None
            if not isinstance(value, dict):
                raise ValueError(f"must be a JSON object, got {value!r}")
        return value

    @field_validator("custom_rm_function")
    @classmethod
    def _check_reward(cls, value: Any) -> Any:
        if isinstance(value, str) and ":" not in value:
            raise ValueError(f"a reward named by string must be 'module:function', got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_clip(self) -> Recipe:
        if self.eps_clip >= 1:
            raise ValueError(
                f"eps_clip must be below 1 (ratio floor 1 - eps_clip), got {self.eps_clip}"
            )
        return self

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def to_json_dict(self) -> dict[str, Any]:
        """The resolved recipe for ``config.json``; the reward appears as ``module:function``."""
        data = self.model_dump(exclude={"custom_rm_function", "image_overlay"})
        data["class"] = type(self).__name__
        reward = self.custom_rm_function
        if reward is None or isinstance(reward, str):
            data["custom_rm_function"] = reward
        else:
            name = getattr(reward, "__qualname__", type(reward).__qualname__)
            module = getattr(reward, "__module__", type(reward).__module__)
            data["custom_rm_function"] = f"{module}:{name}"
        return data


class RecipeNotRunnableError(ValueError):
    """The recipe asks for something this machine or the local backend cannot give."""


def check_runnable_here(recipe: Recipe) -> None:
    """Fail before launching when the local backend cannot run ``recipe``."""
    if recipe.image_overlay is not None:
        raise RecipeNotRunnableError(
            "image_overlay customises a cloud container image, but the local backend trains in "
            "this Python environment: remove image_overlay and pip install what the reward needs."
        )
    if recipe.rollout_num_gpus:
        import torch

        available = torch.cuda.device_count()
        if recipe.rollout_num_gpus > available:
            raise RecipeNotRunnableError(
                f"rollout_num_gpus={recipe.rollout_num_gpus}, but this machine has {available} "
                f"CUDA GPU(s). Set rollout_num_gpus={available} "
                + ("to train on the CPU." if available == 0 else "or fewer.")
            )
        if recipe.rollout_num_gpus > 1:
            raise RecipeNotRunnableError(
                f"rollout_num_gpus={recipe.rollout_num_gpus}: the local backend uses one GPU; "
                "set rollout_num_gpus=1."
            )
    if recipe.custom_rm_function is None:
        raise RecipeNotRunnableError(
            "custom_rm_function is not set: GRPO needs a reward, e.g. "
            "custom_rm_function=my_reward with async def my_reward(args, sample, **kwargs) -> float"
        )
    if isinstance(recipe.custom_rm_function, str):
        from palaestra.rewards import resolve_reward

        resolve_reward(recipe.custom_rm_function)  # a misspelt name fails here, not in the run


def preset(name: str, default: Any) -> Any:
    """``Recipe``'s field ``name`` with another default, keeping its checks and its doc."""
    return FieldInfo.merge_field_infos(Recipe.model_fields[name], default=default)


class SmolLM2_135M_Recipe(Recipe):
    """CPU-sized defaults for the embedded SmolLM2-135M-Instruct on a 2-core laptop."""

    rollout_max_response_len: int = preset("rollout_max_response_len", 48)
    lr: float = preset("lr", 2e-6)
    train_micro_batch_size: int = preset("train_micro_batch_size", 16)


class Qwen3_5_4B_Recipe(Recipe):
    """Single-GPU defaults for Qwen3.5-4B."""

    rollout_batch_size: int = preset("rollout_batch_size", 16)
    rollout_max_response_len: int = preset("rollout_max_response_len", 1024)
    rollout_num_gpus: int = preset("rollout_num_gpus", 1)
    train_micro_batch_size: int = preset("train_micro_batch_size", 4)
