"""Sampling ahead of training: a thread that draws steps s+1..s+k while the learner trains s.

``AheadSampler`` wraps a backend's sampler and is a sampler itself, so the loop reads the same
with ``Recipe.max_staleness`` k > 0 as with 0. A thread takes a slot (k in all) before drawing
a step, from the cursor where the step before ended; the loop hands the slot back when it takes
that step's rollout. So at most k steps are drawn, or being drawn, ahead of the one training,
and the weights that drew a step are at most k versions older than the learner's.

Drawing and loading weights exclude each other (one lock): a step's samples all come from one
weight version, which the thread stamps on them. A group whose version is more than k behind
the learner's is dropped and counted (``stale_dropped_groups``): the slots make that rare
locally, but an engine that is late to load its weights would otherwise train on old policy.

The thread is a thread, not a process: torch releases the GIL in its kernels, so a pass of the
engine and one of the learner overlap where there are cores for both.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any

from palaestra.train.ledger import RolloutLedger
from palaestra.train.seam import Sampler
from palaestra.types import Rollout


class AheadSampler:
    """``inner``'s rollouts for steps ``first_step + 1 .. last_step``, drawn up to
    ``max_staleness`` steps ahead; ``version`` is the weight version ``inner`` holds now."""

    def __init__(
        self,
        inner: Sampler,
        max_staleness: int,
        ledger: RolloutLedger,
        version: int,
        last_step: int,
        group_size: int,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(
                f"max_staleness must be at least 1 to sample ahead, got {max_staleness}"
            )
        self.inner = inner
        self.max_staleness = max_staleness
        self.ledger = ledger
        self.version = version
        """The weights ``inner`` samples from (the engine's count starts at 0 even when they
        are a checkpoint's, so the loop's version is the one kept)."""
        self.last_step = last_step
        self.group_size = group_size
        self._engine = threading.Lock()
        self._slots = threading.Semaphore(max_staleness)
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, step: int, cursor: int) -> Rollout:
        """The rollout of ``step``, drawn from ``cursor`` on (the first call starts the thread
        there; later calls continue where the previous step ended)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._draw, args=(step, cursor), name="ahead-sampler", daemon=True
            )
            self._thread.start()
        drawn = self._ready.get()
        if isinstance(drawn, BaseException):
            raise drawn
        drawn_step, drawn_cursor, rollout = drawn
        if (drawn_step, drawn_cursor) != (step, cursor):
            raise RuntimeError(
                f"the sampler ran ahead from step {drawn_step} at cursor {drawn_cursor}, but the "
                f"loop asked for step {step} at cursor {cursor}"
            )
        self._slots.release()
        # The learner holds version step - 1 while it trains this step.
        return drop_stale(rollout, step - 1, self.max_staleness, self.group_size)

    def update_weights(self, weights: Mapping[str, Any], version: int) -> Any:
        with self._engine:
            attested = self.inner.update_weights(weights, version)
            self.version = version
        return attested

    def evaluate(self, step: int) -> dict[str, float]:
        with self._engine:
            return self.inner.evaluate(step)

    def close(self) -> None:
        """Stop drawing (the step being drawn finishes first), then close ``inner``."""
        self._stop.set()
        for _ in range(self.max_staleness):
            self._slots.release()  # wake a thread waiting for a slot, so it sees the stop
        if self._thread is not None:
            self._thread.join()
        self.inner.close()

    def _draw(self, step: int, cursor: int) -> None:
        try:
            while step <= self.last_step:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                self.ledger.issued(step, cursor)
                with self._engine:
                    rollout = self.inner.sample(step, cursor)
                    for sample in rollout.samples_B + rollout.trained_B:
                        sample.weight_version = self.version
                self.ledger.sampled(step, cursor, rollout.cursor)
                self._ready.put((step, cursor, rollout))
                step, cursor = step + 1, rollout.cursor
        except BaseException as error:  # the loop raises it where it waits for the step
            self._ready.put(error)


def drop_stale(rollout: Rollout, learner_version: int, max_staleness: int, G: int) -> Rollout:
    """``rollout`` without the groups drawn by weights more than ``max_staleness`` versions
    older than ``learner_version``; their prompts become ``dropped_stale``. Adds
    ``stale_dropped_groups`` and ``sample_staleness_mean`` (versions behind the learner, over
    the groups kept)."""
    oldest = learner_version - max_staleness
    groups = [rollout.trained_B[i : i + G] for i in range(0, len(rollout.trained_B), G)]
    kept = [group for group in groups if group[0].weight_version >= oldest]
    states = list(rollout.prompt_states) or ["trained"] * len(groups)
    trained_at = [i for i, state in enumerate(states) if state == "trained"]
    for position, group in zip(trained_at, groups, strict=True):
        if group[0].weight_version < oldest:
            states[position] = "dropped_stale"
    rollout.trained_B = [sample for group in kept for sample in group]
    rollout.prompt_states = states
    rollout.metrics["stale_dropped_groups"] = len(groups) - len(kept)
    if kept:
        behind = [learner_version - group[0].weight_version for group in kept]
        rollout.metrics["sample_staleness_mean"] = sum(behind) / len(behind)
    return rollout
