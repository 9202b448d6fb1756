"""The training loop, top to bottom: rollout, reward, advantage, update, log, save.

With ``loss_type="sft_loss"`` the first three stages are replaced by the dataset's own
answers; everything after them (update, log, save, resume) is the same.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import statistics
import time
from typing import Any

import torch

from palaestra.algo.advantages import compute_advantages, informative_groups
from palaestra.models.loading import compute_dtype, load_tokenizer
from palaestra.rewards import RewardScorer
from palaestra.rollout import SamplingParams, TorchEngine
from palaestra.runs.directory import RunDirectory
from palaestra.train.batch import build_train_batch, prompt_order
from palaestra.train.checkpoint import load_trainer_state, remove_stale_staging, save_checkpoint
from palaestra.train.config import TrainConfig
from palaestra.train.learner import Learner
from palaestra.train.lora import load_policy
from palaestra.train.reference import load_reference
from palaestra.train.sft import build_sft_batch, demonstration
from palaestra.types import Prompt, Sample


def run_training(config: TrainConfig, run: RunDirectory, resume: bool = False) -> None:
    """Train ``config`` into ``run``. With ``resume``, continue from the run's own latest
    checkpoint to the step the run was launched to reach, dropping what came after it."""
    recipe = config.recipe
    sft = recipe.loss_type == "sft_loss"
    device = "cuda" if recipe.rollout_num_gpus else "cpu"
    remove_stale_staging(run.checkpoints_dir)

    # Where the run starts: a checkpoint of its own (resume), the config's, or the base model.
    start_path = config.checkpoint_path()
    state: dict[str, Any] = {}
    if start_path is not None and (start_path / "trainer_state.pt").is_file():
        state = load_trainer_state(start_path)
    first_step = state.get("step", 0)
    last_step = first_step + recipe.num_rollout
    if resume and run.checkpoint_paths():
        start_path = run.checkpoint_paths()[-1][1]
        state = load_trainer_state(start_path)
        last_step = state["last_step"]
    step = state.get("step", 0)
    if resume:
        restore_log(run, state)

    # Tokenizer and prompts first: a bad dataset fails before the model loads.
    weights = str(start_path) if start_path is not None else config.model.weights_path()
    tokenizer = load_tokenizer(weights, config.model.chat_template, config.model.revision)
    template_kwargs = recipe.apply_chat_template_kwargs
    prompts = prepare_prompts(config.dataset, tokenizer, template_kwargs)
    demos = None
    if sft:
        chat = config.dataset.apply_chat_template
        demos = [demonstration(p, tokenizer, chat, template_kwargs) for p in prompts]
    eval_prompts = None
    if config.eval_dataset is not None:
        eval_prompts = prepare_prompts(config.eval_dataset, tokenizer, template_kwargs)

    torch.manual_seed(recipe.seed)
    model, base_weights, state_fits = load_policy(recipe, weights, start_path, config.model, device)
    model.config.use_cache = True
    reference = load_reference(recipe, model, config.model.weights_path(), config.model)
    learner = Learner(model, recipe, reference)
    if "learner" in state and state_fits:
        learner.load_state_dict(state["learner"])
    if "rng" in state:
        restore_rng(state["rng"])
    engine = make_engine(model, tokenizer, recipe)
    cursor = state.get("cursor", 0)
    P, G = recipe.rollout_batch_size, recipe.n_samples_per_prompt
    run.update_status(state="running", step=step, total_steps=last_step, first_step=first_step)
    print(
        f"training {config.model.name}: steps {step + 1}..{last_step}, "
        + (f"{P} rows per step (sft)" if sft else f"{P} prompts x {G} samples per step")
        + f", {len(prompts)} prompts"
        + (f", LoRA rank {recipe.lora_rank}" if recipe.lora_rank else ""),
        flush=True,
    )

    scorer_context = (
        RewardScorer(recipe.custom_rm_function, recipe, recipe.reward_timeout_s)
        if recipe.custom_rm_function is not None
        else contextlib.nullcontext(None)
    )
    with scorer_context as scorer:
        while step < last_step:
            step += 1
            started = time.monotonic()
            if sft:
                # The dataset's answers are the batch: no rollout, reward or advantage.
                rows = prompt_order(len(demos), recipe.seed, cursor, P)
                cursor += P
                batch = build_sft_batch([demos[i] for i in rows], engine.pad_id)
                samples_B, sample_rows, step_metrics = [], [], {}
                rollout_s = reward_s = 0.0
            else:
                # 1-2. Rollout and reward: G samples for each of P prompts. With dynamic
                # sampling, groups whose rewards all agree are dropped, and with over-sampling
                # further rounds of prompts refill the step up to P groups.
                samples_B, kept_B = [], []
                rollout_s = reward_s = 0.0
                rounds = (
                    recipe.dynamic_sampling_max_rounds if recipe.over_sampling_batch_size else 1
                )
                for round_ in range(rounds):
                    n = recipe.over_sampling_batch_size or P
                    round_prompts = [
                        prompts[i] for i in prompt_order(len(prompts), recipe.seed, cursor, n)
                    ]
                    cursor += n
                    t0 = time.monotonic()
                    new_B = rollout(engine, round_prompts, G, recipe, step, round_)
                    t1 = time.monotonic()
                    for sample, reward in zip(new_B, scorer.score(new_B), strict=True):
                        sample.reward = reward
                    rollout_s, reward_s = rollout_s + t1 - t0, reward_s + time.monotonic() - t1
                    samples_B += new_B
                    kept_B += keep_informative(new_B, G) if recipe.dynamic_sampling else new_B
                    if len(kept_B) >= P * G:
                        break
                kept_B = kept_B[: P * G]

                # 3. Advantages: each reward against its group (or the step's, by estimator).
                rewards_P_G = torch.tensor([s.reward for s in kept_B]).view(-1, G)
                advantages_B = compute_advantages(
                    rewards_P_G, recipe.advantage_estimator, recipe.scale_rewards
                ).view(-1)
                batch = None
                if kept_B:
                    batch = build_train_batch(
                        kept_B, advantages_B, engine.pad_id, recipe.mask_truncated_responses
                    )
                trained = {id(s): float(a) for s, a in zip(kept_B, advantages_B, strict=True)}
                sample_rows = [sample_row(s, trained.get(id(s))) for s in samples_B]
                step_metrics = rollout_metrics(samples_B, G)
                if recipe.dynamic_sampling:
                    step_metrics["dropped_groups"] = (len(samples_B) - len(kept_B)) // G
                    step_metrics["sampling_rounds"] = round_ + 1
            rollout_done = time.monotonic()

            # 4. Update the policy.
            train_metrics = learner.train_step(batch) if batch is not None else {"updates": 0}
            engine.sync_weights(model)
            train_done = time.monotonic()

            # 5. Evaluate, when due.
            eval_metrics = {}
            if eval_prompts and recipe.eval_interval and step % recipe.eval_interval == 0:
                eval_metrics = evaluate_prompts(engine, eval_prompts, scorer, recipe, step)

            # 6. Log and save (every save_interval steps, and always the last). A checkpoint
            # carries its step's log rows, so a crash between saving and logging loses nothing.
            metrics = {
                "step": step,
                **step_metrics,
                **train_metrics,
                "rollout_s": rollout_s,
                "reward_s": reward_s,
                "train_s": train_done - rollout_done,
                **eval_metrics,
            }
            saved = None
            save_started = time.monotonic()
            if step == last_step or (recipe.save_interval and step % recipe.save_interval == 0):
                trainer_state = {
                    "step": step,
                    "last_step": last_step,
                    "cursor": cursor,
                    "learner": learner.state_dict(),
                    "rng": capture_rng(),
                    "run_id": run.run_id,
                    "log": {"samples": sample_rows, "metrics": metrics},
                }
                info = {"run_id": run.run_id, "model": config.model.name}
                if recipe.lora_rank:
                    info |= {"lora": True, "base_model_path": base_weights}
                saved = save_checkpoint(
                    run.checkpoints_dir, step, model, tokenizer, trainer_state, info
                )
            metrics["save_s"] = time.monotonic() - save_started
            metrics["step_s"] = time.monotonic() - started
            metrics["time"] = time.time()
            # Samples first, so a step in metrics always has its traces.
            run.append_jsonl("samples.jsonl", sample_rows)
            run.append_jsonl("metrics.jsonl", [metrics])
            run.update_status(step=step)
            print(step_line(metrics, last_step, saved), flush=True)


def make_engine(model: torch.nn.Module, tokenizer, recipe) -> TorchEngine:
    """The rollout engine for ``model``: sampling in the recipe's precision."""
    dtype = compute_dtype(recipe.precision, next(model.parameters()).device)
    return TorchEngine(model, tokenizer, dtype=None if dtype == torch.float32 else dtype)


def rollout(
    engine, prompts: list[Prompt], G: int, recipe, step: int, round_: int = 0
) -> list[Sample]:
    """G samples of each prompt, flattened group after group. Each (step, round) has its own
    seed, so a resumed step draws the same samples."""
    params = SamplingParams(
        recipe.rollout_max_response_len,
        recipe.rollout_temperature,
        recipe.rollout_top_p,
        seed=recipe.seed * 100_003 + step + 1_000_000_007 * round_,
    )
    completions_P_G = engine.generate([p.token_ids for p in prompts], G, params)
    return [
        make_sample(prompt, completion, g, step)
        for prompt, completions_G in zip(prompts, completions_P_G, strict=True)
        for g, completion in enumerate(completions_G)
    ]


def keep_informative(samples_B: list[Sample], G: int) -> list[Sample]:
    """The samples of the groups whose rewards differ (DAPO's dynamic sampling)."""
    rewards_P_G = torch.tensor([s.reward for s in samples_B]).view(-1, G)
    keep_P = informative_groups(rewards_P_G).tolist()
    return [s for b, s in enumerate(samples_B) if keep_P[b // G]]


def step_line(metrics: dict[str, Any], last_step: int, saved) -> str:
    parts = [f"step {metrics['step']}/{last_step}"]
    if "reward_mean" in metrics:
        parts.append(f"reward {metrics['reward_mean']:+.2f} ± {metrics['reward_std']:.2f}")
    parts.append(f"loss {metrics.get('loss', math.nan):+.4f}")
    if "response_length_mean" in metrics:
        parts.append(f"len {metrics['response_length_mean']:.0f}")
    else:
        parts.append(f"tokens {metrics.get('response_tokens', 0):.0f}")
    if "dropped_groups" in metrics:
        parts.append(f"dropped {metrics['dropped_groups']}")
    parts.append(f"{metrics['step_s']:.1f} s")
    if saved:
        parts.append(f"saved {saved.name}")
    return "  ".join(parts)


def rollout_metrics(samples_B: list[Sample], G: int) -> dict[str, float]:
    """What the step's samples looked like (all of them, dropped groups too): rewards, groups
    without signal, lengths."""
    rewards_B = [s.reward for s in samples_B]
    rewards_P_G = torch.tensor(rewards_B, dtype=torch.float32).view(-1, G)
    lengths_B = [len(s.response_token_ids) for s in samples_B]
    return {
        "reward_mean": statistics.fmean(rewards_B),
        "reward_std": statistics.pstdev(rewards_B),
        "reward_min": min(rewards_B),
        "reward_max": max(rewards_B),
        # Groups whose rewards all agree have zero advantage: no gradient from them.
        "zero_std_groups": int((~informative_groups(rewards_P_G)).sum()),
        "response_length_mean": statistics.fmean(lengths_B),
        "response_length_max": max(lengths_B),
        "truncated_fraction": sum(s.finish_reason == "length" for s in samples_B) / len(samples_B),
    }


def restore_log(run: RunDirectory, state: dict[str, Any]) -> None:
    """Make the run's logs end exactly at the checkpoint it restarts from: drop rows written
    after it, and put back the checkpoint's own rows if a crash came before they were logged."""
    step = state.get("step", 0)
    run.truncate_after_step("metrics.jsonl", step)
    run.truncate_after_step("samples.jsonl", step)
    log = state.get("log")
    if log and state.get("run_id") == run.run_id and step not in {m["step"] for m in run.metrics()}:
        run.truncate_after_step("samples.jsonl", step - 1)
        run.append_jsonl("samples.jsonl", log["samples"])
        run.append_jsonl("metrics.jsonl", [log["metrics"]])


def prepare_prompts(dataset, tokenizer, chat_template_kwargs: dict) -> list[Prompt]:
    """The dataset's prompts, each with its ``token_ids`` filled in."""
    from palaestra.home import palaestra_home

    prompts = dataset.prepare(
        tokenizer, chat_template_kwargs, cache_dir=palaestra_home() / "datasets"
    )
    for prompt in prompts:
        # A chat template writes its own special tokens; a raw prompt gets the tokenizer's.
        ids = tokenizer(prompt.text, add_special_tokens=not dataset.apply_chat_template).input_ids
        prompt.token_ids = list(ids)
    return prompts


def make_sample(prompt: Prompt, completion, group_index: int, step: int) -> Sample:
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
    )


def sample_row(sample: Sample, advantage: float | None) -> dict[str, Any]:
    """A samples.jsonl row; ``advantage`` None: the sample's group was dropped, not trained."""
    return {
        "step": sample.step,
        "index": sample.index,
        "group_index": sample.group_index,
        "prompt": sample.prompt,
        "response": sample.response,
        "reward": sample.reward,
        "advantage": 0.0 if advantage is None else advantage,
        "trained": advantage is not None,
        "label": sample.label,
        "finish_reason": sample.finish_reason,
        "response_tokens": len(sample.response_token_ids),
        "metadata": sample.metadata,
    }


def evaluate_prompts(engine, prompts, scorer: RewardScorer, recipe, step: int) -> dict[str, float]:
    """Mean reward of one sample per eval prompt, at a fixed seed so steps compare fairly."""
    params = SamplingParams(
        recipe.rollout_max_response_len,
        recipe.rollout_temperature,
        recipe.rollout_top_p,
        seed=recipe.seed,
    )
    completions = engine.generate([p.token_ids for p in prompts], 1, params)
    samples = [make_sample(p, c[0], 0, step) for p, c in zip(prompts, completions, strict=True)]
    return {"eval_reward_mean": statistics.fmean(scorer.score(samples, context="eval "))}


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
