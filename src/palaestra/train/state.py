"""Where a run starts and what a checkpoint remembers of the loop.

``TrainerState`` is the loop's part of a checkpoint (trainer_state.json): the step, the step the
run is to reach, the data cursor, and the step's own log rows (so a crash between saving and
logging loses nothing). The learner saves its own part (weights, optimiser) beside it. No random
state: sampling seeds derive from the run's seed and the step, so nothing else is needed to
draw the same samples again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from palaestra.checkpoints import TRAINER_STATE_FILE, has_trainer_state, read_trainer_state


@dataclass
class TrainerState:
    step: int = 0
    """The last step completed."""
    last_step: int = 0
    """The step the run was launched to reach."""
    cursor: int = 0
    """Position in the dataset's endless shuffled order."""
    run_id: str | None = None
    """The run that saved it (a checkpoint may start another run)."""
    log_samples: list[dict[str, Any]] = field(default_factory=list)
    """samples.jsonl rows of ``step``."""
    log_metrics: dict[str, Any] | None = None
    """The metrics.jsonl row of ``step``."""
    ledger: list[list[Any]] = field(default_factory=list)
    """What became of each prompt position of the data order (``train.ledger``)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> TrainerState:
        """The state in ``data``; ValueError naming ``where`` (its file) when it does not fit."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown trainer state fields {unknown}")
        for name in ("step", "last_step", "cursor"):
            value = data.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where}: {name} is {value!r}, not a whole number >= 0")
        return cls(**data)


@dataclass
class Start:
    """Where a run starts: the checkpoint whose weights and optimiser (or adapters) continue,
    and the loop's state."""

    checkpoint: Path | None
    """The checkpoint to continue from; None starts from the model's weights."""
    state: TrainerState
    """``state.step`` is where the loop resumes; ``state.last_step`` where it stops."""


def resolve_start(
    config_checkpoint: Path | None,
    num_rollout: int,
    own_checkpoints: list[Path],
    resume: bool,
) -> Start:
    """A new run starts from ``config_checkpoint`` (its weights, optimiser and step; a plain
    HF folder gives the weights alone, from step 0) or the model, and trains ``num_rollout``
    steps. A resumed run restarts from its own latest checkpoint, to the step it was launched
    to reach."""
    path = config_checkpoint
    state = TrainerState()
    if path is not None and has_trainer_state(path):
        state = TrainerState.from_json(read_trainer_state(path), path / TRAINER_STATE_FILE)
    last_step = state.step + num_rollout
    if resume and own_checkpoints:
        path = own_checkpoints[-1]
        state = TrainerState.from_json(read_trainer_state(path), path / TRAINER_STATE_FILE)
        last_step = state.last_step
    state = dataclasses.replace(state, last_step=last_step)
    return Start(path, state)
