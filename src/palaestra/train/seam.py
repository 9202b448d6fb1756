"""The two handles the training loop drives, and the backend that builds them.

A **sampler** turns a step's prompts into scored sample groups (engine, rollout function,
reward, dynamic sampling); a **learner** owns the model, the optimiser and the KL reference. A
backend builds both from the config: in one process (``backends.local``), or as actors on a
cluster. The loop sees only these methods, so nothing above them changes between backends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from palaestra.train.state import Start
from palaestra.types import Rollout, Sample

if TYPE_CHECKING:
    from palaestra.config import TrainConfig
    from palaestra.engine.attest import Attestation


class Sampler(Protocol):
    def sample(self, step: int, cursor: int) -> Rollout:
        """The step's scored groups, prompts taken from the dataset order at ``cursor``."""
        ...

    def update_weights(self, weights: Mapping[str, Any], version: int) -> Attestation | None:
        """Sample from ``weights`` (version: the step that produced them) from now on. Where
        the engines hold a copy of them, each is attested against what was sent
        (``engine.attest``): how many and how long, or None where there is no copy."""
        ...

    def evaluate(self, step: int) -> dict[str, float]:
        """Score the eval prompts with the current weights: ``{"eval_reward_mean": ...}``."""
        ...

    def close(self) -> None: ...


class Learner(Protocol):
    def train_step(self, samples_B: Sequence[Sample], advantages_B: Sequence[float]) -> dict:
        """One rollout's updates; returns the step's training metrics."""
        ...

    def weights(self) -> Mapping[str, Any]:
        """The current weights by parameter name, for the sampler's ``update_weights``."""
        ...

    def save(self, folder: Path) -> None:
        """Write weights, tokenizer and optimiser state into a checkpoint folder."""
        ...

    def load(self, folder: Path) -> None:
        """Continue from the optimiser state in a checkpoint folder."""
        ...


Backend = Callable[["TrainConfig", Start], tuple[Sampler, Learner]]
"""Builds a run's sampler and learner from its config and where it starts."""
