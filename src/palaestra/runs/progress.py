"""How a training step reads as one line of text, from its metrics row (metrics.jsonl).

``step_line`` is the line the training process prints to train.log after each step;
``is_step_line`` recognises it there (``palaestra train`` shows its own progress line instead,
so it skips these); ``progress_line`` is that progress line: the same step with a bar and the
time left. Light on purpose: the CLI formats these without loading torch.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

_STEP_LINE = re.compile(r"^step \d+/\d+\s")


def step_line(metrics: dict[str, Any], last_step: int, saved: str | Path | None = None) -> str:
    """``step 3/10  reward +1.20 ± 0.30  loss +0.0123  len 20  dropped 1  4.2 s  saved
    step_000003`` (``no update`` in place of the loss for a step that trained on nothing);
    ``saved`` is the checkpoint folder written at this step, if any."""
    parts = [f"step {metrics['step']}/{last_step}"]
    if "reward_mean" in metrics:
        parts.append(f"reward {metrics['reward_mean']:+.2f} ± {metrics['reward_std']:.2f}")
    if metrics.get("updates") == 0:  # e.g. dynamic sampling dropped every group
        parts.append("no update")
    else:
        parts.append(f"loss {metrics.get('loss', math.nan):+.4f}")
    if "response_length_mean" in metrics:
        parts.append(f"len {metrics['response_length_mean']:.0f}")
    else:
        parts.append(f"tokens {metrics.get('response_tokens', 0):.0f}")
    if "dropped_groups" in metrics:
        parts.append(f"dropped {metrics['dropped_groups']}")
    parts.append(f"{metrics['step_s']:.1f} s")
    if saved:
        parts.append(f"saved {Path(saved).name}")
    return "  ".join(parts)


def is_step_line(line: str) -> bool:
    """Whether ``line`` (of a train.log) is a ``step_line``."""
    return _STEP_LINE.match(line) is not None


def progress_line(
    metrics: dict[str, Any], total: int | None, first_step: int, started: float
) -> str:
    """``step 3/10 [######--------------]  reward +0.520 ±0.310  3.4 s/step  eta 24 s``:
    ``started`` is the ``time.monotonic()`` at ``first_step``, which the time left counts from."""
    step = metrics["step"]
    done, span = step - first_step, (total or step) - first_step
    fraction = done / span if span > 0 else 1.0
    bar = "#" * round(20 * fraction) + "-" * (20 - round(20 * fraction))
    parts = [f"step {step}/{total or '?'} [{bar}]"]
    if metrics.get("reward_mean") is not None:
        parts.append(f"reward {metrics['reward_mean']:+.3f} ±{metrics.get('reward_std') or 0:.3f}")
    if metrics.get("loss") is not None:
        parts.append(f"loss {metrics['loss']:+.4f}")
    if metrics.get("step_s") is not None:
        parts.append(f"{metrics['step_s']:.1f} s/step")
    if total and done and step < total:
        remaining = (time.monotonic() - started) / done * (total - step)
        parts.append(f"eta {duration(remaining)}")
    return "  ".join(parts)


def duration(seconds: float | None) -> str:
    """``42 s``, ``3 m 07 s``, ``2 h 05 m``; ``-`` for None."""
    if seconds is None:
        return "-"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} m {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} m"
