"""The number-guessing game of ``examples/number_guess.py``, written as an environment.

No generate function and no token bookkeeping: the environment says what the user says, and
palaestra runs the turns (all episodes batched, one engine call per turn), renders the
feedback through the chat template as user messages, masks it out of the loss and keeps the
model's tokens as sampled. The same class evaluates a checkpoint against an endpoint
(``EvalConfig(environment=...)``), so training and evaluation play the same game.

    python examples/number_guess_env.py [--steps 12]

The reward is the tutorial's (2.0 - 0.1 per extra turn for a success, -2.0 for a reply without a
guess, -1.0 for running out of turns), returned by ``step`` as the game ends. One difference:
a reply without the ``<answer>`` tags is read for its first number between 1 and 20, since a
135M model seldom writes the tags unprompted (``number_guess.py`` opens each reply with
``<answer>`` instead, which an environment, whose messages are the user's, cannot).
"""

import argparse
import re
import tempfile
from pathlib import Path

from palaestra import (
    Endpoint,
    EvalConfig,
    LocalDataset,
    SmolLM2_135M,
    SmolLM2_135M_Recipe,
    Step,
    TrainConfig,
)

MAX_VALUE, MAX_TURNS = 20, 4
PROMPT = (
    "You are playing a number guessing game. The hidden integer is between 1 and 20. "
    "Reply with only your guess in this exact format: <answer>N</answer>, for example "
    "<answer>10</answer>. After each guess you are told higher or lower."
)
ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>", re.IGNORECASE)
NUMBER = re.compile(r"\b(\d+)\b")


def read_guess(reply: str) -> int | None:
    """The last tagged answer, else the first number in range; None: no guess."""
    tagged = [int(m.group(1)) for m in ANSWER.finditer(reply)]
    numbers = tagged[-1:] or [int(m.group(1)) for m in NUMBER.finditer(reply)][:1]
    return numbers[0] if numbers and 1 <= numbers[0] <= MAX_VALUE else None


class NumberGuess:
    """One game: the row's target, a guess per reply, feedback until found or out of turns."""

    def start(self, row: dict) -> str:
        self.target, self.turns = int(row["target"]), 0
        return PROMPT

    def step(self, reply: str) -> Step:
        self.turns += 1
        guess = read_guess(reply)
        info = {"success": float(guess == self.target), "turns_taken": self.turns}
        if guess is None:
            return Step(reward=-2.0, done=True, metadata=info)
        if guess == self.target:
            return Step(reward=2.0 - 0.1 * (self.turns - 1), done=True, metadata=info)
        if self.turns == MAX_TURNS:
            return Step(reward=-1.0, done=True, metadata=info)
        return Step("higher" if guess < self.target else "lower", metadata=info)


def dataset(folder: Path, name: str, targets: list[int], repeats: int = 1) -> LocalDataset:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(f'{{"target": {t}}}\n' for t in targets for _ in range(repeats)))
    # The environment writes the prompt; the template only has to name a column.
    return LocalDataset(path=str(path), input_column="target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="number-guess-env-"))
    train = dataset(folder, "train", list(range(1, MAX_VALUE + 1, 2)), repeats=20)
    held_out = dataset(folder, "eval", list(range(2, MAX_VALUE + 1, 2)))
    model = SmolLM2_135M()
    evaluation = EvalConfig(
        held_out, environment=NumberGuess, max_turns=MAX_TURNS, generate_kwargs={"max_tokens": 12}
    )

    base = Endpoint.launch(model, unauthenticated=True, recreate_if_existing=True)
    base_mean = evaluation.evaluate(base).mean
    base.stop()

    config = TrainConfig(
        model=model,
        dataset=train,
        recipe=SmolLM2_135M_Recipe(
            environment=NumberGuess,
            max_turns=MAX_TURNS,
            num_rollout=options.steps,
            rollout_batch_size=2,
            n_samples_per_prompt=8,
            rollout_max_response_len=12,
        ),
    )
    result = config.launch(show_output=True).result()
    trained = Endpoint.launch(
        model, result.checkpoints()[-1], unauthenticated=True, recreate_if_existing=True
    )
    trained_mean = evaluation.evaluate(trained).mean
    trained.stop()
    print(f"held-out reward, base model: {base_mean:+.3f}")
    print(f"held-out reward, after {options.steps} steps: {trained_mean:+.3f}")


if __name__ == "__main__":
    main()
