"""The run store: run directories and the registry that lists them, read-only run handles,
saved eval records, endpoint records, and the readers the CLI and dashboard show them with.

Only files and the liveness of the processes they name: nothing here starts or stops a process
(that is ``palaestra.launch``) or loads torch, so any process can read the store.
"""

from palaestra.runs.directory import RunDirectory
from palaestra.runs.handles import RunFailedError, RunStoppedError, RunView, TrainResult
from palaestra.runs.registry import list_run_ids, open_run

__all__ = [
    "RunDirectory",
    "RunFailedError",
    "RunStoppedError",
    "RunView",
    "TrainResult",
    "list_run_ids",
    "open_run",
]
