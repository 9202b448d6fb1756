"""Runs: the run directory, the registry that lists them, and handles to watch and control them."""

from palaestra.runs.handles import (
    Checkpoint,
    RunFailedError,
    RunStoppedError,
    TrainingRun,
    TrainResult,
)
from palaestra.runs.registry import list_run_ids

__all__ = [
    "Checkpoint",
    "RunFailedError",
    "RunStoppedError",
    "TrainingRun",
    "TrainResult",
    "list_run_ids",
]
