"""The GRPO training loop, top to bottom: rollout, reward, advantage, update, log, save."""

from __future__ import annotations

import copy
import random
import statistics
import time
from typing import Any

import torch

from palaestra.algo.advantages import group_normalized_advantages
from palaestra.models.loading import load_causal_lm, load_tokenizer
from palaestra.rewards import RewardScorer
from palaestra.rollout import SamplingParams, TorchEngine
from palaestra.runs.directory import RunDirectory
from palaestra.train.batch import build_train_batch, prompt_order
from palaestra.train.checkpoint import load_trainer_state, remove_stale_staging, save_checkpoint
from palaestra.train.config import TrainConfig
from palaestra.train.learner import Learner
from palaestra.types import Prompt, Sample


def run_training(config: TrainConfig, run: RunDirectory, resume: bool = False) -> None:
    """Train ``config`` into ``run``. With ``resume``, continue from the run's own latest
    checkpoint to the step the run was launched to reach, dropping what came after it."""
    recipe = config.recipe
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
    prompts = prepare_prompts(config.dataset, tokenizer, recipe.apply_chat_template_kwargs)
    eval_prompts = None
    if config.eval_dataset is not None:
        eval_prompts = prepare_prompts(
            config.eval_dataset, tokenizer, recipe.apply_chat_template_kwargs
        )

    torch.manual_seed(recipe.seed)
    model = load_causal_lm(
        weights, torch.float32, device, config.model.revision, config.model.trust_remote_code
    )
    model.config.use_cache = True
    learner = Learner(model, recipe)
    if "learner" in state:
        learner.load_state_dict(state["learner"])
    if "rng" in state:
        restore_rng(state["rng"])
    engine = TorchEngine(model, tokenizer)
    cursor = state.get("cursor", 0)
    P, G = recipe.rollout_batch_size, recipe.n_samples_per_prompt
    run.update_status(state="running", step=step, total_steps=last_step, first_step=first_step)
    print(
        f"training {config.model.name}: steps {step + 1}..{last_step}, "
        f"{P} prompts x {G} samples per step, {len(prompts)} prompts",
        flush=True,
    )

    with RewardScorer(recipe.custom_rm_function, recipe, recipe.reward_timeout_s) as scorer:
        while step < last_step:
            step += 1
            started = time.monotonic()

            # 1. Rollout: G samples for each of P prompts.
            batch_prompts_P = [
                prompts[i] for i in prompt_order(len(prompts), recipe.seed, cursor, P)
            ]
            cursor += P
            params = SamplingParams(
                recipe.rollout_max_response_len,
                recipe.rollout_temperature,
                recipe.rollout_top_p,
                seed=recipe.seed * 100_003 + step,
            )
            completions_P_G = engine.generate([p.token_ids for p in batch_prompts_P], G, params)
            samples_B = [
                make_sample(prompt, completion, g, step)
                for prompt, completions_G in zip(batch_prompts_P, completions_P_G, strict=True)
                for g, completion in enumerate(completions_G)
            ]
            rollout_done = time.monotonic()

            # 2. Reward every sample, concurrently.
            rewards_B = scorer.score(samples_B)
            for sample, reward in zip(samples_B, rewards_B, strict=True):
                sample.reward = reward
            reward_done = time.monotonic()

            # 3. Advantages: each reward against its own group.
            rewards_P_G = torch.tensor(rewards_B, dtype=torch.float32).view(P, G)
            advantages_B = group_normalized_advantages(rewards_P_G).view(-1)

            # 4. Update the policy.
            batch = build_train_batch(samples_B, advantages_B, engine.pad_id)
            train_metrics = learner.train_step(batch)
            engine.sync_weights(model)
            train_done = time.monotonic()

            # 5. Evaluate, when due.
            eval_metrics = {}
            if eval_prompts and recipe.eval_interval and step % recipe.eval_interval == 0:
                eval_metrics = evaluate_prompts(engine, eval_prompts, scorer, recipe, step)

            # 6. Log and save (every save_interval steps, and always the last). A checkpoint
            # carries its step's log rows, so a crash between saving and logging loses nothing.
            sample_rows = [
                sample_row(s, float(a)) for s, a in zip(samples_B, advantages_B, strict=True)
            ]
            metrics = {
                "step": step,
                **rollout_metrics(samples_B, rewards_P_G),
                **train_metrics,
                "rollout_s": rollout_done - started,
                "reward_s": reward_done - rollout_done,
                "train_s": train_done - reward_done,
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
            print(
                f"step {step}/{last_step}  reward {metrics['reward_mean']:+.2f} "
                f"± {metrics['reward_std']:.2f}  loss {metrics['loss']:+.4f}  "
                f"len {metrics['response_length_mean']:.0f}  {metrics['step_s']:.1f} s"
                + (f"  saved {saved.name}" if saved else ""),
                flush=True,
            )


def rollout_metrics(samples_B: list[Sample], rewards_P_G: torch.Tensor) -> dict[str, float]:
    """What the step's samples looked like: rewards, groups without signal, lengths."""
    rewards_B = rewards_P_G.view(-1).tolist()
    lengths_B = [len(s.response_token_ids) for s in samples_B]
    return {
        "reward_mean": statistics.fmean(rewards_B),
        "reward_std": statistics.pstdev(rewards_B),
        "reward_min": min(rewards_B),
        "reward_max": max(rewards_B),
        # Groups whose rewards all agree have zero advantage: no gradient from them.
        "zero_std_groups": int((rewards_P_G.std(dim=1, correction=0) == 0).sum()),
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


def sample_row(sample: Sample, advantage: float) -> dict[str, Any]:
    return {
        "step": sample.step,
        "index": sample.index,
        "group_index": sample.group_index,
        "prompt": sample.prompt,
        "response": sample.response,
        "reward": sample.reward,
        "advantage": advantage,
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
