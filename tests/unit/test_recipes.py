"""Recipe validation: typed fields, misspelt knobs, JSON kwargs, what this machine refuses."""

import re

import pytest
from pydantic import ValidationError

from palaestra.recipes import (
    Recipe,
    RecipeNotRunnableError,
    SmolLM2_135M_Recipe,
    check_runnable_here,
)


async def reward(args, sample, **kwargs):
    return 0.0


def test_misspelt_field_is_an_error_naming_it():
    with pytest.raises(ValidationError) as error:
        SmolLM2_135M_Recipe(num_rollouts=3)
    assert "num_rollouts" in str(error.value)
    assert "Extra inputs are not permitted" in str(error.value)


def test_chat_template_kwargs_as_json_string_or_dict():
    assert Recipe(
        apply_chat_template_kwargs='{"enable_thinking": false}'
    ).apply_chat_template_kwargs == {"enable_thinking": False}
    assert Recipe(apply_chat_template_kwargs={"a": 1}).apply_chat_template_kwargs == {"a": 1}
    with pytest.raises(ValidationError, match="apply_chat_template_kwargs"):
        Recipe(apply_chat_template_kwargs="{enable_thinking: false}")
    with pytest.raises(ValidationError, match="must be a JSON object"):
        Recipe(apply_chat_template_kwargs="[1, 2]")


def test_values_are_checked():
    with pytest.raises(ValidationError, match="n_samples_per_prompt"):
        Recipe(n_samples_per_prompt=0)
    with pytest.raises(ValidationError, match="eps_clip must be below 1"):
        Recipe(eps_clip=1.5)
    with pytest.raises(ValidationError, match="module:function"):
        Recipe(custom_rm_function="my_reward")
    assert Recipe(eps_clip=0.2).clip_high == 0.2
    assert Recipe(eps_clip=0.2, eps_clip_high=0.28).clip_high == 0.28


def test_preset_defaults_and_docs():
    recipe = SmolLM2_135M_Recipe(num_rollout=3)
    assert (recipe.num_rollout, recipe.rollout_batch_size, recipe.n_samples_per_prompt) == (3, 4, 8)
    assert recipe.rollout_num_gpus == 0
    assert "Prompts per step" in Recipe.model_fields["rollout_batch_size"].description
    # A preset's own defaults keep the base field's doc and checks.
    assert (recipe.rollout_max_response_len, recipe.rollout_temperature, recipe.lr) == (
        20,
        0.8,
        3e-5,
    )
    assert SmolLM2_135M_Recipe.model_fields["lr"].description == "AdamW learning rate."
    for name, field in SmolLM2_135M_Recipe.model_fields.items():
        assert field.description, name
    with pytest.raises(ValidationError, match="rollout_max_response_len"):
        SmolLM2_135M_Recipe(rollout_max_response_len=0)


def test_more_gpus_than_the_machine_has(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RecipeNotRunnableError, match="rollout_num_gpus=8, but this machine has 0"):
        check_runnable_here(Recipe(rollout_num_gpus=8, custom_rm_function=reward))
    check_runnable_here(Recipe(rollout_num_gpus=0, custom_rm_function=reward))


def test_a_reward_is_required():
    with pytest.raises(RecipeNotRunnableError, match="custom_rm_function is not set"):
        check_runnable_here(Recipe())


def test_json_form_names_the_reward():
    data = Recipe(custom_rm_function=reward).to_json_dict()
    assert data["custom_rm_function"] == f"{__name__}:reward"
    assert data["class"] == "Recipe"
    assert data["image_overlay"] is None  # no overlay: nothing to replay


def test_algorithm_defaults_are_grpo_advantages_and_token_level_loss():
    recipe = Recipe()
    assert (recipe.advantage_estimator, recipe.scale_rewards, recipe.loss_type) == (
        "grpo",
        "group",
        "dapo",
    )
    assert (recipe.num_steps_per_rollout, recipe.kl_loss_coef, recipe.lora_rank) == (1, 0.0, 0)
    assert "Bessel" in Recipe.model_fields["advantage_estimator"].description
    assert "1e-4" in Recipe.model_fields["advantage_estimator"].description


def test_algorithm_combinations_that_make_no_sense_are_refused():
    with pytest.raises(ValidationError, match="over_sampling_batch_size is set but dynamic"):
        Recipe(over_sampling_batch_size=8)
    with pytest.raises(ValidationError, match="two different importance ratios"):
        Recipe(advantage_estimator="gspo", loss_type="cispo")
    with pytest.raises(ValidationError, match="num_steps_per_rollout=40 is more than the 32"):
        Recipe(num_steps_per_rollout=40)
    with pytest.raises(ValidationError, match="loss_type"):
        Recipe(loss_type="ppo")
    with pytest.raises(ValidationError, match="kl_loss_type"):
        Recipe(kl_loss_type="k4")


def test_docstring_groups_every_field_once_in_source_order():
    """The class docstring lists the fields by concern; the source orders them the same way."""
    listed = re.findall(r"``(\w+)``", Recipe.__doc__.split("by concern:", 1)[1])
    assert listed == list(Recipe.model_fields)


def test_the_embedded_model_is_served_as_its_preset_trains_it():
    from palaestra import SmolLM2_135M

    model, recipe = SmolLM2_135M(), SmolLM2_135M_Recipe()
    assert model.default_max_tokens == recipe.rollout_max_response_len
    assert model.default_temperature == recipe.rollout_temperature


def test_the_qwen_presets_follow_their_published_recipes():
    from palaestra import Qwen3_4B_Recipe, Qwen3_5_4B_Recipe

    recipe = Qwen3_4B_Recipe()  # verl's Qwen3 GRPO example
    assert (recipe.lr, recipe.kl_loss_coef, recipe.clip_high) == (1e-6, 0.001, 0.28)
    assert (recipe.rollout_max_response_len, recipe.rollout_temperature) == (1024, 1.0)
    recipe = Qwen3_5_4B_Recipe()  # the Training Gym's Qwen3.5-4B recipe on 8 GPUs
    assert (recipe.lr, recipe.kl_loss_coef, recipe.clip_high) == (5e-7, 0.0, 0.28)
    assert (recipe.rollout_batch_size, recipe.n_samples_per_prompt) == (16, 8)
    assert (recipe.rollout_max_response_len, recipe.rollout_num_gpus) == (4096, 8)


def test_rollout_engine_resolves_to_vllm_only_where_it_can_run(monkeypatch):
    import importlib.util

    from palaestra.backends.building import engine_kind

    installed = {"vllm": True}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if installed.get(name) else real_find_spec(name, *a),
    )
    assert engine_kind(Recipe(), "cuda") == "vllm"
    assert engine_kind(Recipe(), "cpu") == "torch"  # vLLM-CPU only when asked for
    assert engine_kind(Recipe(lora_rank=8), "cuda") == "vllm"  # adapters as a LoRA request
    assert engine_kind(Recipe(rollout_engine="torch"), "cuda") == "torch"
    assert engine_kind(Recipe(rollout_engine="vllm"), "cpu") == "vllm"
    installed["vllm"] = False
    assert engine_kind(Recipe(), "cuda") == "torch"


def test_vllm_engine_is_refused_with_what_to_install_or_change(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a),
    )
    recipe = Recipe(rollout_engine="vllm", custom_rm_function=reward)
    with pytest.raises(RecipeNotRunnableError, match=r"pip install 'palaestra\[vllm\]'"):
        check_runnable_here(recipe)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    check_runnable_here(Recipe(rollout_engine="vllm", lora_rank=4, custom_rm_function=reward))
    with pytest.raises(ValidationError, match="rollout_engine"):
        Recipe(rollout_engine="sglang")


def test_gpus_divide_into_one_learner_gpu_and_one_engine_per_other_gpu():
    from palaestra.launch.checks import GpuLayout, gpu_layout

    assert gpu_layout(Recipe()) == GpuLayout(learner=0.0, workers=1, per_worker=0.0)
    # One GPU: learner and engine share it (half each in Ray's accounting).
    assert gpu_layout(Recipe(rollout_num_gpus=1)) == GpuLayout(0.5, 1, 0.5)
    two = Recipe(backend="ray", rollout_num_gpus=1, num_rollout_workers=2)
    assert gpu_layout(two) == GpuLayout(0.5, 2, 0.25)
    # The tutorial's 8: one trains, seven sample, one worker (one engine) each.
    assert gpu_layout(Recipe(rollout_num_gpus=8)) == GpuLayout(1.0, 7, 1.0)
    # Workers chosen by hand may share GPUs, but never span two.
    assert gpu_layout(Recipe(rollout_num_gpus=3, num_rollout_workers=4)) == GpuLayout(1.0, 4, 0.5)
    with pytest.raises(RecipeNotRunnableError, match="set num_rollout_workers=7"):
        gpu_layout(Recipe(rollout_num_gpus=8, num_rollout_workers=2))


def test_more_than_one_gpu_runs_on_ray_and_the_refusal_is_gone(monkeypatch):
    import torch

    from palaestra.launch.worker import backend_of

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    check_runnable_here(Recipe(rollout_num_gpus=8, custom_rm_function=reward))

    class Config:
        recipe = Recipe(rollout_num_gpus=8)

    assert backend_of(Config).__name__ == "build_ray"
    Config.recipe = Recipe(rollout_num_gpus=1)
    assert backend_of(Config).__name__ == "build_local"
