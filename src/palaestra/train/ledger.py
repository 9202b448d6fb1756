"""The rollout ledger: what became of every prompt position of the dataset order.

The data order is an endless sequence addressed by a cursor (``rollout.sampler.prompt_order``).
Each position the run takes is, in turn, ``issued`` (handed to the sampler), ``sampled`` (its
group drawn, not yet trained) and then settled once: ``trained``, ``dropped_dynamic``,
``dropped_surplus`` or ``dropped_stale``. The ledger is saved with each checkpoint (inside its
trainer state, so the checkpoint's atomic rename covers it); a resumed run forgets the
positions that were only issued or sampled, as its cursor restarts at the first of them, so
every position is settled exactly once over any number of kills and resumes.

Entries are ranges ``[first, last, state, step]`` (positions ``first .. last - 1``; ``last``
None while an issued step's extent is unknown), so a checkpoint stays small on long runs.
Thread-safe: a sampler running ahead records issued and sampled steps from its own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from palaestra.types import Rollout

SETTLED = ("trained", "dropped_dynamic", "dropped_surplus", "dropped_stale")
IN_FLIGHT = ("issued", "sampled")


class RolloutLedger:
    """Ranges of prompt positions and their state; see the module's docstring."""

    def __init__(self, entries: Sequence[Sequence] = ()) -> None:
        self._lock = threading.Lock()
        self._entries: list[list] = [list(entry) for entry in entries]

    @classmethod
    def resumed(cls, entries: Sequence[Sequence], cursor: int) -> RolloutLedger:
        """The ledger a run resumes with from a checkpoint's ``entries`` and ``cursor``: the
        settled positions before the cursor; what was in flight is issued again."""
        kept = []
        for first, last, state, step in entries:
            if state not in SETTLED + IN_FLIGHT:
                raise ValueError(f"ledger entry of step {step}: unknown state {state!r}")
            if state in SETTLED:
                if last > cursor:
                    raise ValueError(
                        f"ledger entry of step {step}: positions {first}..{last - 1} settled "
                        f"beyond the checkpoint's cursor {cursor}"
                    )
                kept.append([first, last, state, step])
        return cls(kept)

    def issued(self, step: int, first: int) -> None:
        self._put_in_flight(step, [first, None, "issued", step])

    def sampled(self, step: int, first: int, last: int) -> None:
        self._put_in_flight(step, [first, last, "sampled", step])

    def settle(self, step: int, first: int, rollout: Rollout) -> None:
        """Record the step's positions ``first .. rollout.cursor - 1`` as the rollout says
        (``rollout.prompt_states``; none: each trained), replacing the step's in-flight entry."""
        count = rollout.cursor - first
        states = rollout.prompt_states or ["trained"] * count
        if len(states) != count:
            raise ValueError(
                f"step {step}: {len(states)} prompt states for the {count} positions "
                f"{first}..{rollout.cursor - 1}"
            )
        ranges: list[list] = []
        for offset, state in enumerate(states):
            if state not in SETTLED:
                raise ValueError(f"step {step}: prompt state {state!r} is not one of {SETTLED}")
            if ranges and ranges[-1][2] == state:
                ranges[-1][1] += 1
            else:
                ranges.append([first + offset, first + offset + 1, state, step])
        with self._lock:
            self._entries = [e for e in self._entries if not (e[3] == step and e[2] in IN_FLIGHT)]
            self._entries += ranges

    def to_json(self) -> list[list]:
        with self._lock:
            return [list(entry) for entry in sorted(self._entries, key=_order)]

    def _put_in_flight(self, step: int, entry: list) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if not (e[3] == step and e[2] in IN_FLIGHT)]
            self._entries.append(entry)


def _order(entry: list) -> tuple[int, int]:
    return entry[0], entry[3]


def ledger_problems(entries: Sequence[Sequence], cursor: int) -> list[str]:
    """Why ``entries`` do not settle every position ``0 .. cursor - 1`` exactly once (gaps,
    overlaps, a position left in flight); empty when they do."""
    problems = []
    settled = sorted((e for e in entries if e[2] in SETTLED), key=lambda e: e[0])
    position = 0
    for first, last, _state, _step in settled:
        if first > position:
            problems.append(f"positions {position}..{first - 1} never settled")
        elif first < position:
            problems.append(f"positions {first}..{min(last, position) - 1} settled twice")
        position = max(position, last)
    if position < cursor:
        problems.append(f"positions {position}..{cursor - 1} never settled")
    if position > cursor:
        problems.append(f"positions {cursor}..{position - 1} settled beyond the cursor")
    for first, _last, state, step in entries:
        if state in IN_FLIGHT and first < cursor:
            problems.append(f"step {step}: positions from {first} still {state}")
    return problems
