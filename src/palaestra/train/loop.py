"""The training loop, top to bottom: sample, advantages, update, sync, evaluate, record, save.

It drives two handles a backend builds (``train.seam``): a sampler that returns scored sample
groups and a learner that owns the weights. Supervised fine-tuning is the same loop over a
sampler whose samples are the dataset's own answers, each with advantage 1.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from palaestra.algo.advantages import compute_advantages
from palaestra.checkpoints import (
    adapter_base,
    is_adapter_checkpoint,
    remove_stale_staging,
    write_checkpoint,
)
from palaestra.recipes import Recipe
from palaestra.runs.directory import RunDirectory
from palaestra.runs.progress import step_line
from palaestra.trackers.mirror import Trackers, open_trackers
from palaestra.train import records
from palaestra.train.ahead import AheadSampler
from palaestra.train.ledger import RolloutLedger
from palaestra.train.retention import apply_retention, bytes_needed
from palaestra.train.seam import Backend
from palaestra.train.state import Start, TrainerState, resolve_start
from palaestra.types import Sample

if TYPE_CHECKING:
    from palaestra.config import TrainConfig


def run_training(
    config: TrainConfig, run: RunDirectory, backend: Backend, resume: bool = False
) -> None:
    """Train ``config`` into ``run`` on the sampler and learner ``backend`` builds. With
    ``resume``, continue from the run's own latest checkpoint to the step the run was launched
    to reach, dropping what came after it."""
    recipe = config.recipe
    remove_stale_staging(run.checkpoints_dir)
    own = [path for _, path in run.checkpoint_paths()]
    start = resolve_start(config.checkpoint_path(), recipe.num_rollout, own, resume)
    state = start.state
    if resume:
        records.restore_log(run, state)
    sampler, learner = backend(config, start)
    ledger = RolloutLedger.resumed(state.ledger, state.cursor)  # in-flight prompts: drawn again
    if recipe.max_staleness:  # a thread draws up to k steps ahead while the learner trains
        G = 1 if recipe.loss_type == "sft_loss" else recipe.n_samples_per_prompt
        sampler = AheadSampler(
            sampler, recipe.max_staleness, ledger, state.step, state.last_step, G
        )
    trackers = open_trackers(config, run, resume)  # mirrors of metrics.jsonl, never blocking
    info = checkpoint_info(config, run, start)
    run.update_status(
        state="running", step=state.step, total_steps=state.last_step, first_step=state.step
    )
    say(describe(config, state))
    try:
        while state.step < state.last_step:
            state = train_one_step(config, run, sampler, learner, state, info, trackers, ledger)
    finally:
        trackers.close()  # never raises; waits at most a few seconds
        sampler.close()


def train_one_step(
    config,
    run: RunDirectory,
    sampler,
    learner,
    state: TrainerState,
    info: dict,
    trackers: Trackers,
    ledger: RolloutLedger,
):
    """One step of the algorithm; returns the loop's state after it. ``info`` goes into each
    checkpoint's palaestra.json; ``trackers`` get the step's metrics row; ``ledger`` records
    what became of the step's prompts and is saved with each checkpoint."""
    recipe = config.recipe
    step = state.step + 1
    started = time.monotonic()

    # 1. Sample: P groups of G scored samples (with dynamic sampling, groups whose rewards all
    #    agree are dropped and further rounds of prompts refill the step).
    #    With max_staleness k, this step was drawn up to k weight versions ago.
    rollout = sampler.sample(step, state.cursor)
    sampled = time.monotonic()
    ledger.settle(step, state.cursor, rollout)

    # 2. Advantages: each reward against its group (or the step's, by estimator).
    advantages_B = step_advantages(rollout.trained_B, recipe)

    # 3. Update the policy, then 4. sync the sampler to it (the new weights are version `step`).
    train_metrics = learner.train_step(rollout.trained_B, advantages_B)
    trained = time.monotonic()
    #    Each engine holding a copy reports a digest of a few tensors, checked against what
    #    was sent; a stale one fails the run (engine.attest.WeightSyncError).
    attested = sampler.update_weights(learner.weights(), version=step)
    synced = time.monotonic()
    timings = {
        "sample_wait_s": sampled - started,
        "train_s": trained - sampled,
        "weight_sync_s": synced - trained,  # attesting included
        "attest_s": attested.seconds if attested else 0.0,
        "attested_engines": attested.engines if attested else 0,
    }
    if getattr(learner, "last_sync_bytes", None) is not None:  # bytes sent to the engine
        timings["weight_sync_bytes"] = learner.last_sync_bytes

    # 5. Evaluate, when due.
    eval_metrics = {}
    if recipe.eval_interval and step % recipe.eval_interval == 0:
        eval_metrics = sampler.evaluate(step)

    # 6. Record and save (every save_interval steps, and always the last). A checkpoint carries
    #    its step's log rows, so a crash between saving and logging loses nothing.
    rows = records.sample_rows(rollout.samples_B, rollout.trained_B, advantages_B)
    metrics = records.metrics_row(
        step,
        rollout.metrics,
        train_metrics,
        eval_metrics,
        timings=timings,
    )
    state = TrainerState(
        step, state.last_step, rollout.cursor, run.run_id, rows, metrics, ledger.to_json()
    )
    saved = None
    save_started = time.monotonic()
    if step == state.last_step or (recipe.save_interval and step % recipe.save_interval == 0):
        needed = bytes_needed(run.checkpoints_dir, recipe, config.model)
        saved = write_checkpoint(
            run.checkpoints_dir, step, learner.save, info, state.to_json(), needed
        )
        apply_retention(run.checkpoints_dir, recipe, saved)  # keep what the recipe asks for
    metrics["save_s"] = time.monotonic() - save_started
    metrics["step_s"] = time.monotonic() - started
    records.append_step(run, rows, metrics)
    trackers.log(metrics)
    say(step_line(metrics, state.last_step, saved))
    return state


def say(line: str) -> None:
    """A line of train.log in one write: print() writes the text and the newline apart, and a
    tracker's warning from its own thread could land between them."""
    print(f"{line}\n", end="", flush=True)


def step_advantages(samples_B: list[Sample], recipe: Recipe) -> list[float]:
    """One advantage per sample. Demonstrations (supervised fine-tuning) count once each."""
    if recipe.loss_type == "sft_loss":
        return [1.0] * len(samples_B)
    if not samples_B:
        return []
    rewards_P_G = torch.tensor([s.reward for s in samples_B]).view(-1, recipe.n_samples_per_prompt)
    advantages_P_G = compute_advantages(
        rewards_P_G, recipe.advantage_estimator, recipe.scale_rewards
    )
    return advantages_P_G.view(-1).tolist()


def checkpoint_info(config, run: RunDirectory, start: Start) -> dict[str, Any]:
    """What each checkpoint's palaestra.json says: its run and model, and for LoRA adapters the
    full weights they apply to."""
    info: dict[str, Any] = {"run_id": run.run_id, "model": config.model.name}
    if config.recipe.lora_rank:
        if is_adapter_checkpoint(start.checkpoint):
            base = adapter_base(start.checkpoint)
        else:
            base = str(start.checkpoint or config.model.weights_path())
        info |= {"lora": True, "base_model_path": base}
    return info


def describe(config, state: TrainerState) -> str:
    recipe = config.recipe
    P, G = recipe.rollout_batch_size, recipe.n_samples_per_prompt
    sft = recipe.loss_type == "sft_loss"
    return (
        f"training {config.model.name}: steps {state.step + 1}..{state.last_step}, "
        + (f"{P} rows per step (sft)" if sft else f"{P} prompts x {G} samples per step")
        + (f", LoRA rank {recipe.lora_rank}" if recipe.lora_rank else "")
    )
