"""The Training Gym's multi-turn tutorial, on a laptop: guess a hidden number from 1 to 20.

Each episode, the model answers ``<answer>N</answer>``; a wrong guess gets
``<feedback>higher</feedback>`` or ``<feedback>lower</feedback>`` and another try, up to
``max_turns`` guesses. The reward is the tutorial's: 2.0 - 0.1 per extra turn for a success,
-2.0 for a reply without a well-formed guess, -1.0 for running out of turns.

As in the Gym, the loop is a ``custom_generate_function`` and the reward reads what it left in
``sample.metadata``. Unlike the Gym's, it never re-tokenises text: each turn's token ids are
the ones the engine sampled (with their log-probs), the feedback's ids are appended with loss
mask 0, and the next turn is sampled from exactly that sequence. All episodes of a step ask for
their next turn together, so each turn is one batched pass of the engine.

    python examples/number_guess.py [--steps 12]     # or: make number-guess

It runs on the embedded SmolLM2-135M-Instruct (no GPU, no network). Training takes the odd
targets, evaluation the even ones (``eval_reward_mean``, on held-out targets, with the same
loop); the reward at the start is step 1's, sampled before any update. The same game written
as an environment is ``examples/number_guess_env.py``.
"""

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from palaestra import LocalDataset, SmolLM2_135M, SmolLM2_135M_Recipe, TrainConfig

_MAX_VALUE = 20
_MAX_TURNS = 4
# The Gym's prompt, with one example of the format: a 135M model rarely guesses it unshown.
_PROMPT = (
    "You are playing a number guessing game.\n"
    "The hidden integer is between 1 and 20.\n"
    "Return only guesses in this exact format: <answer>N</answer> "
    "where N is an integer between 1 and 20, for example <answer>10</answer>.\n"
    "After each guess, you will receive <feedback>higher</feedback> or "
    "<feedback>lower</feedback>, and must update your next guess accordingly."
)
TRAIN_TARGETS = list(range(1, _MAX_VALUE + 1, 2))
TEST_TARGETS = list(range(2, _MAX_VALUE + 1, 2))


def write_rows(path: Path, targets: list[int], repeats: int = 1) -> Path:
    """The dataset: one chat prompt per target, the target as the label."""
    rows = [
        {
            "messages": [{"role": "user", "content": _PROMPT}],
            "label": json.dumps({"answer": target}),
            "target": target,
        }
        for target in targets
        for _ in range(repeats)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


_ANSWER_RE = re.compile(r"<answer>\s*(\d+)\s*</answer>", re.IGNORECASE)


def _extract_answer(text: str) -> int | None:
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return None
    guess = int(matches[-1].group(1))
    return guess if 1 <= guess <= _MAX_VALUE else None


async def number_guess_generate(args, sample, sampling_params):
    """One game: the model's turns as sampled (mask 1), the feedback's tokens (mask 0)."""
    target = int(json.loads(sample.label)["answer"])
    max_turns = args.max_turns
    tokenizer = args.tokenizer
    response_ids, loss_mask, logprobs = [], [], []
    success, format_error, turns_taken = False, False, max_turns
    status = "completed"

    # The environment opens each reply with "<answer>" (mask 0), so the model writes only the
    # number and the closing tag: a 135M model seldom finds the format unaided.
    opening = tokenizer("<answer>", add_special_tokens=False).input_ids
    for turn in range(max_turns):
        response_ids += opening
        loss_mask += [0] * len(opening)
        logprobs += [0.0] * len(opening)
        output = await args.engine.generate(sample.prompt_token_ids + response_ids, sampling_params)
        if output.finish_reason == "abort":
            sample.status = "aborted"
            return sample
        if not output.token_ids:  # the context is full
            status, turns_taken = "truncated", turn
            break
        response_ids += output.token_ids
        loss_mask += [1] * len(output.token_ids)
        logprobs += output.logprobs or [0.0] * len(output.token_ids)

        guess = _extract_answer("<answer>" + output.text)
        if guess is None:
            format_error, turns_taken = True, turn + 1
            break
        if guess == target:
            success, turns_taken = True, turn + 1
            break
        if turn + 1 == max_turns:
            status = "truncated"
            break
        feedback = "higher" if guess < target else "lower"
        feedback_ids = tokenizer(
            f"\n<feedback>{feedback}</feedback>\n", add_special_tokens=False
        ).input_ids
        response_ids += feedback_ids
        loss_mask += [0] * len(feedback_ids)
        logprobs += [0.0] * len(feedback_ids)

    sample.response_token_ids = response_ids
    sample.loss_mask = loss_mask
    sample.response_logprobs = logprobs
    sample.response = tokenizer.decode(response_ids, skip_special_tokens=True)
    sample.status = status
    sample.metadata["guessing"] = {
        "target": target,
        "success": success,
        "format_error": format_error,
        "turns_taken": turns_taken,
    }
    # Numbers at the top level of metadata are charted per step on the dashboard.
    sample.metadata["success"] = float(success)
    sample.metadata["turns_taken"] = turns_taken
    return sample


def _trajectory_reward(success: bool, format_error: bool, turns_taken: int) -> float:
    if success:
        return float(2.0 - 0.1 * max(0, turns_taken - 1))
    if format_error:
        return -2.0
    return -1.0


async def number_guess_rm(args, sample, **kwargs) -> float:
    guessing = sample.metadata.get("guessing", {})
    return _trajectory_reward(
        success=bool(guessing.get("success", False)),
        format_error=bool(guessing.get("format_error", False)),
        turns_taken=int(guessing.get("turns_taken", args.max_turns)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--eval-interval", type=int, default=12)
    options = parser.parse_args()
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="number-guess-"))
    train_dataset = LocalDataset(
        path=str(write_rows(folder / "train.jsonl", TRAIN_TARGETS, repeats=20)),
        messages_column="messages",
        output_column="label",
    )
    eval_dataset = LocalDataset(
        path=str(write_rows(folder / "eval.jsonl", TEST_TARGETS)),
        messages_column="messages",
        output_column="label",
    )
    config = TrainConfig(
        model=SmolLM2_135M(),
        dataset=train_dataset,
        eval_dataset=eval_dataset,
        recipe=SmolLM2_135M_Recipe(
            custom_generate_function=number_guess_generate,
            custom_rm_function=number_guess_rm,
            max_turns=_MAX_TURNS,
            extra_config={"log_multi_turn": True},
            num_rollout=options.steps,
            rollout_batch_size=2,
            n_samples_per_prompt=8,
            rollout_max_response_len=12,
            eval_interval=options.eval_interval,
            save_interval=options.steps,
        ),
    )
    run = config.launch(show_output=True)
    print(f"run id: {run.training_run_id}")
    result = run.result()
    metrics = [m for m in result.metrics() if "reward_mean" in m]
    rewards = [m["reward_mean"] for m in metrics]
    evals = [(m["step"], m["eval_reward_mean"]) for m in metrics if "eval_reward_mean" in m]
    print()
    print(f"reward at the start (step 1, before any update): {rewards[0]:+.3f}")
    print(f"reward over the last 5 steps:                    {statistics.fmean(rewards[-5:]):+.3f}")
    for step, value in evals:
        print(f"held-out eval reward at step {step}: {value:+.3f}")
    print(f"checkpoint: {result.checkpoints()[-1].path}")
    print(f"wall time: {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
