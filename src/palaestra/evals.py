"""Evaluation: a dataset's prompts sent to an endpoint, each response scored, the mean kept.

    result = EvalConfig(dataset=eval_dataset, eval_fn=score_haiku).evaluate(endpoint)
    result.mean, result.rows

With an ``environment`` (``palaestra.types.Environment``), each row is a multi-turn episode
played against the endpoint: the environment's first messages, the endpoint's reply, the
environment's feedback, and so on until it is done or ``max_turns`` replies were made (the
episode loop of ``rollout/episode.py``, the one training plays); the row scores the sum of the
environment's rewards and keeps the conversation.

Requests go out concurrently (the endpoint batches them into shared generation passes). Every
result is saved as ``<home>/evals/<id>.json`` (mean, total, and each row's prompt, response and
score, with the endpoint's model, checkpoint, run and step), so the dashboard can show it beside
the run whose checkpoint it scored.
"""

from __future__ import annotations

import asyncio
import copy
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from palaestra.calls import UserCodeError, call_blocking
from palaestra.data import DatasetConfig
from palaestra.rollout.episode import Reply, Rules, play
from palaestra.runs.evals import save_eval


@dataclass
class EvalResult:
    mean: float
    """Mean score over the rows (NaN for an empty dataset)."""
    total: int
    """How many rows were scored."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """One dict per dataset row: ``prompt``, ``response``, ``score`` (and ``reasoning``); with
    several samples per prompt, ``score`` is their mean and ``responses`` / ``scores`` hold each."""
    id: str | None = None
    """The saved result's id; the file is ``<home>/evals/<id>.json``."""
    path: Path | None = None

    def __repr__(self) -> str:
        return f"EvalResult(mean={self.mean:.3f}, total={self.total}, id={self.id!r})"


class EvalConfig(BaseModel):
    """How to score an endpoint on a dataset.

    Give exactly one of:

    - ``eval_fn(text) -> float``: scores the response's visible content (``score_haiku``);
    - ``eval_response_fn(message, row) -> float``: gets the whole reply message (``content``,
      ``reasoning_content``) and the dataset row, for scores that need the reference answer;
    - ``environment``: plays each row as a multi-turn episode, scored by its rewards.

    Either may be ``async def``. The dataset may be passed by position:
    ``EvalConfig(eval_dataset, eval_fn=score_haiku)``.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dataset: DatasetConfig
    """The rows to score; each becomes a prompt as in training."""
    eval_fn: Callable[[str], float] | None = None
    """``eval_fn(text) -> float``, on the response's visible content (or its reasoning when the
    content is empty)."""
    eval_response_fn: Callable[[dict[str, Any], dict[str, Any]], float] | None = None
    """``eval_response_fn(message, row) -> float``, on the whole reply message and the row."""
    environment: Callable[[], Any] | None = None
    """A multi-turn environment class or factory (as ``Recipe.environment``), called once per
    row: ``start(row)`` opens the episode, ``step(reply)`` answers each reply of the endpoint;
    the row's score is the sum of the rewards."""
    max_turns: int = Field(4, ge=1)
    """With ``environment``: most replies per episode (an episode that reaches it just ends)."""
    generate_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Sent with every request: ``max_tokens``, ``temperature``, ``seed``,
    ``chat_template_kwargs``... (never ``n``: see ``n_samples_per_prompt``)."""
    name: str | None = None
    """A name for the saved result, shown beside it."""
    seed: int | None = 0
    """Row ``i``'s request is seeded with ``seed + i`` (an episode's turn ``t`` with
    ``seed + i * max_turns + t``), so evaluating the same endpoint again gives the same replies
    and the same mean, whatever else the endpoint is generating and however many requests are
    in flight. ``None`` leaves requests unseeded: new replies each time. A ``seed`` in
    ``generate_kwargs`` takes its place."""
    n_samples_per_prompt: int = 1
    """Answers drawn for each row (one request with ``n``); a row scores their mean. A sampled
    model's mean over a small dataset is noisy, and more samples per row steady it cheaply,
    since the endpoint generates them in one batched pass."""

    def __init__(self, dataset: DatasetConfig, **fields: Any) -> None:
        super().__init__(dataset=dataset, **fields)

    @field_validator("generate_kwargs", mode="before")
    @classmethod
    def _copy_kwargs(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("n_samples_per_prompt")
    @classmethod
    def _check_samples(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"n_samples_per_prompt must be at least 1, got {value}")
        return value

    @model_validator(mode="after")
    def _check_scorer(self) -> EvalConfig:
        scorers = [self.eval_fn, self.eval_response_fn, self.environment]
        if sum(scorer is not None for scorer in scorers) != 1:
            raise ValueError(
                "EvalConfig needs exactly one of eval_fn or eval_response_fn (or an environment)"
            )
        if self.environment is not None and self.n_samples_per_prompt != 1:
            raise ValueError(
                "with an environment, each row plays one episode: n_samples_per_prompt=1"
            )
        if "n" in self.generate_kwargs:
            raise ValueError("set n_samples_per_prompt rather than generate_kwargs['n']")
        return self

    def evaluate(
        self, deployment: Any, max_concurrency: int = 4, show_progress: bool = True
    ) -> EvalResult:
        """Score every row of the dataset against ``deployment`` (an Endpoint), at most
        ``max_concurrency`` requests in flight. Saves and returns the result."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        deployment.wait_until_ready()
        # The endpoint applies its own chat template; here a row only becomes messages.
        plain = copy.copy(self.dataset)
        chat = self.dataset.apply_chat_template
        plain.apply_chat_template = False
        prompts = plain.prepare()
        started = time.monotonic()
        done = 0

        n = self.n_samples_per_prompt
        seed = self.generate_kwargs.get("seed", self.seed)
        extra = {**self.generate_kwargs, **({"n": n} if n > 1 else {})}

        def seeded(index: int) -> dict[str, Any]:
            return extra if seed is None else {**extra, "seed": seed + index}

        def score_one(prompt) -> dict[str, Any]:
            nonlocal done
            if self.environment is not None:
                row = self._play(deployment, prompt, extra, seed)
                done += 1
                return row
            if chat:
                reply = deployment.chat_completion(prompt.messages, **seeded(prompt.index))
                messages = [choice["message"] for choice in reply["choices"]]
            else:
                reply = deployment.completion(prompt.text, **seeded(prompt.index))
                messages = [{"content": choice["text"]} for choice in reply["choices"]]
            scores = [self._score(prompt, message) for message in messages]
            done += 1
            if show_progress:
                print(f"\reval {done}/{len(prompts)}", end="", file=sys.stderr, flush=True)
            first = messages[0]
            row = {
                "index": prompt.index,
                "prompt": prompt.messages[-1]["content"],
                "response": first.get("content") or "",
                "score": sum(scores) / len(scores),
            }
            if first.get("reasoning_content"):
                row["reasoning"] = first["reasoning_content"]
            if n > 1:
                row["responses"] = [m.get("content") or "" for m in messages]
                row["scores"] = scores
            return row

        with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
            rows = list(pool.map(score_one, prompts))
        elapsed = time.monotonic() - started
        if show_progress:
            print(f"\reval {len(rows)}/{len(prompts)} in {elapsed:.1f} s", file=sys.stderr)
        scores = [row["score"] for row in rows]
        mean = sum(scores) / len(scores) if scores else math.nan
        result = EvalResult(mean=mean, total=len(rows), rows=rows)
        self._save(result, deployment, elapsed, max_concurrency)
        return result

    def _play(
        self, deployment: Any, prompt, extra: dict[str, Any], seed: int | None
    ) -> dict[str, Any]:
        """One episode of the environment against ``deployment``, as a result row."""
        conversation = EndpointConversation(deployment, extra)
        if seed is not None:  # turn t of row i: seed + i * max_turns + t
            conversation.seed = seed + prompt.index * self.max_turns
        rules = Rules(self.environment, max_turns=self.max_turns)
        outcome = asyncio.run(
            play(rules, conversation, prompt.metadata, f"eval: row {prompt.index}")
        )
        messages = conversation.messages
        return {
            "index": prompt.index,
            "prompt": messages[0]["content"],
            "response": conversation.reply,
            "score": outcome.reward,
            "turns": outcome.replies,
            "messages": messages,
        }

    def _score(self, prompt, message: dict[str, Any]) -> float:
        where = f"eval: scoring row {prompt.index} ({prompt.messages[-1]['content']!r:.80})"
        content = message.get("content") or ""
        if self.eval_fn is not None:
            args: tuple = (content or message.get("reasoning_content") or "",)
            score = call_blocking(self.eval_fn, args, where=where)
        else:
            score = call_blocking(self.eval_response_fn, (message, prompt.metadata), where=where)
        try:
            return float(score)
        except (TypeError, ValueError) as error:
            raise UserCodeError(where, f"returned {score!r:.80}; a score is a number") from error

    def _save(self, result: EvalResult, deployment: Any, elapsed: float, concurrency: int) -> None:
        info = getattr(deployment, "info", {}) or {}
        dataset = self.dataset
        where = f"{getattr(dataset, 'hf_repo', None)} [{getattr(dataset, 'hf_split', '')}]"
        result.id, result.path = save_eval(
            {
                "name": self.name,
                "created_at": time.time(),
                "dataset": where,
                "endpoint": getattr(deployment, "name", None),
                "model": info.get("model"),
                "checkpoint": info.get("checkpoint"),
                "run_id": info.get("run_id"),
                "step": info.get("step"),
                "generate_kwargs": self.generate_kwargs,
                "seed": self.generate_kwargs.get("seed", self.seed),
                "n_samples_per_prompt": self.n_samples_per_prompt,
                "max_concurrency": concurrency,
                "elapsed_s": elapsed,
                "mean": result.mean,
                "total": result.total,
                "rows": result.rows,
            }
        )


class EndpointConversation:
    """An episode's conversation as chat messages, each reply the endpoint's answer to all of
    them (its own chat template applied); turn ``t`` is seeded ``seed + t``."""

    def __init__(self, deployment: Any, extra: dict[str, Any]) -> None:
        self.deployment = deployment
        self.extra = extra
        self.seed: int | None = None
        self.turns = 0
        self.messages: list[dict[str, Any]] = []
        self.reply = ""
        """The endpoint's last reply."""

    def add(self, messages: list[dict[str, Any]]) -> bool:
        self.messages += messages
        return True

    async def generate(self) -> Reply:
        self.turns += 1
        extra = dict(self.extra)
        if self.seed is not None:
            extra["seed"] = self.seed + self.turns
        answer = await asyncio.to_thread(self.deployment.chat_completion, self.messages, **extra)
        self.reply = answer["choices"][0]["message"].get("content") or ""
        self.messages.append({"role": "assistant", "content": self.reply})
        return Reply(self.reply, answer["choices"][0].get("finish_reason") or "stop")
