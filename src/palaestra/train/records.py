"""What a step leaves in the run directory: its samples.jsonl rows, its metrics.jsonl row, and,
on resume, logs cut back to the checkpoint the run restarts from."""

from __future__ import annotations

import time
from typing import Any

from palaestra.runs.directory import RunDirectory
from palaestra.train.state import TrainerState
from palaestra.types import Sample


def sample_rows(samples_B: list[Sample], trained_B: list[Sample], advantages_B) -> list[dict]:
    """samples.jsonl rows of every sample drawn; a sample of a dropped group was not trained."""
    trained = {id(s): float(a) for s, a in zip(trained_B, advantages_B, strict=True)}
    return [sample_row(s, trained.get(id(s))) for s in samples_B]


def sample_row(sample: Sample, advantage: float | None) -> dict[str, Any]:
    """A samples.jsonl row; ``advantage`` None: the sample's group was dropped, not trained. A
    multi-turn sample's row also has the conversation (``messages``, the model's turns marked
    ``"trained"``), its ``status`` and the loss mask as ``mask_spans``."""
    row = {
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
        "weight_version": sample.weight_version,
        "metadata": sample.metadata,
    }
    if sample.loss_mask is not None:
        row |= {
            "status": sample.status,
            "messages": sample.messages,
            "mask_spans": mask_spans(sample.loss_mask),
        }
    return row


def mask_spans(loss_mask: list[int]) -> list[list[int]]:
    """The mask as ``[start, end)`` ranges of response tokens that are trained on: exact, and
    short however long the episode."""
    spans: list[list[int]] = []
    for t, value in enumerate(loss_mask):
        if value and spans and spans[-1][1] == t:
            spans[-1][1] = t + 1
        elif value:
            spans.append([t, t + 1])
    return spans


def metrics_row(step: int, *parts: dict[str, Any], timings: dict[str, float]) -> dict[str, Any]:
    """The step's metrics.jsonl row: its number, each stage's metrics, then the timings."""
    row: dict[str, Any] = {"step": step}
    for part in parts:
        row |= part
    return row | timings | {"time": time.time()}


def append_step(run: RunDirectory, samples: list[dict], metrics: dict[str, Any]) -> None:
    """Samples first, so a step in metrics.jsonl always has its traces."""
    run.append_jsonl("samples.jsonl", samples)
    run.append_jsonl("metrics.jsonl", [metrics])
    run.update_status(step=metrics["step"])


def restore_log(run: RunDirectory, state: TrainerState) -> None:
    """Make the run's logs end exactly at the checkpoint it restarts from: drop rows written
    after it, and put back the checkpoint's own rows if a crash came before they were logged."""
    step = state.step
    run.truncate_after_step("metrics.jsonl", step)
    run.truncate_after_step("samples.jsonl", step)
    logged = {m["step"] for m in run.metrics()}
    if state.log_metrics is not None and state.run_id == run.run_id and step not in logged:
        run.truncate_after_step("samples.jsonl", step - 1)
        run.append_jsonl("samples.jsonl", state.log_samples)
        run.append_jsonl("metrics.jsonl", [state.log_metrics])
