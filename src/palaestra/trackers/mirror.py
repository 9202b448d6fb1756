"""Mirroring a run's metrics rows to trackers without ever holding up or failing training.

Each tracker gets a ``Mirror``: its own daemon thread, fed through a bounded queue, runs every
call to the tracker (opening its run, logging, finishing). The training loop only puts rows on
queues. A tracker that raises is disabled for the rest of the run with one warning line on
stdout (the run's train.log); a full queue drops rows (one warning) rather than block; closing
waits a bounded time for the queues to drain and then gives up with a warning.
"""

from __future__ import annotations

import functools
import json
import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from palaestra.trackers import DashboardMetricConfig, TrackedRun, TrackerClient, metric_configs

if TYPE_CHECKING:
    from palaestra.config import TrainConfig
    from palaestra.runs.directory import RunDirectory

QUEUE_ROWS = 1000
"""Rows a mirror holds before it drops new ones: far more steps than a live tracker lags."""
CLOSE_TIMEOUT_S = 10.0
"""How long the end of a run waits for its trackers to take the last rows and finish."""
NOT_MIRRORED = {"step", "time"}
"""Keys of a metrics row that are not values: the step is the x-axis, a tracker stamps time."""


_WARN_LOCK = threading.Lock()


def warn(label: str, message: str) -> None:
    """One line on stdout, which is the run's train.log. Written whole, under a lock: mirrors
    that fail at the same moment on their own threads would otherwise run their lines together
    (print writes the text and the newline separately)."""
    text = " ".join(message.split())
    line = f"palaestra: warning: metrics mirror to {label}: {text[:500]}\n"
    with _WARN_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


class Mirror:
    """One tracker, called only from its own thread. ``open_client`` starts the tracker's run
    there (it may be slow: a login, a network round trip) and returns what takes the rows."""

    def __init__(
        self, label: str, open_client: Callable[[], TrackerClient], queue_rows: int = QUEUE_ROWS
    ) -> None:
        self.label = label
        self._rows: queue.Queue[tuple[int, dict[str, float]]] = queue.Queue(maxsize=queue_rows)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._disabled = False
        self._dropping = False
        self._thread = threading.Thread(
            target=self._work, args=(open_client,), name=f"palaestra-mirror {label}", daemon=True
        )
        self._thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        """Queue one step's values; never blocks."""
        if self._disabled or self._closing.is_set():
            return
        try:
            self._rows.put_nowait((step, values))
        except queue.Full:
            if not self._dropping:
                self._dropping = True
                warn(
                    self.label,
                    f"it is not keeping up: {self._rows.maxsize} rows wait, so rows from step "
                    f"{step} on are dropped while its queue is full",
                )

    def close(self) -> None:
        """Take no more rows; the thread logs what is queued, then finishes the tracker's run."""
        self._closing.set()

    def wait_closed(self, deadline: float) -> None:
        """Wait for ``close`` to complete until ``deadline`` (a ``time.monotonic()`` value);
        past it, give up on the tracker (its thread is a daemon: it never holds the process)."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            left = self._rows.qsize()
            self._disable(f"still busy when the run ended; gave up on it ({left} rows unsent)")

    def _work(self, open_client: Callable[[], TrackerClient]) -> None:
        stage = "opening its run"
        try:
            client = open_client()
            if client is None:
                return
            stage = "logging"
            while not (self._closing.is_set() and self._rows.empty()):
                try:
                    step, values = self._rows.get(timeout=0.1)
                except queue.Empty:
                    continue
                if self._disabled:  # given up on while it was busy: the run has moved on
                    return
                client.log(values, step=step)
            stage = "finishing its run"
            client.finish()
        except BaseException as error:  # a tracker never fails training
            name = type(error).__name__
            self._disable(f"disabled for the rest of the run after {name} while {stage}: {error}")

    def _disable(self, message: str) -> None:
        with self._lock:
            if self._disabled:
                return
            self._disabled = True
        warn(self.label, message)


class Trackers:
    """The mirrors of one run; ``log`` takes each metrics row, ``close`` ends them all."""

    def __init__(self, mirrors: list[Mirror]) -> None:
        self.mirrors = mirrors

    def log(self, row: dict[str, Any]) -> None:
        if self.mirrors:
            values = numeric_values(row)
            for mirror in self.mirrors:
                mirror.log(row["step"], values)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for mirror in self.mirrors:
            mirror.close()  # all drain at once, within one deadline
        for mirror in self.mirrors:
            mirror.wait_closed(deadline)


def numeric_values(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers; None, strings, NaN and infinities are not mirrored."""
    return {
        key: value
        for key, value in row.items()
        if key not in NOT_MIRRORED
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def open_trackers(config: TrainConfig, run: RunDirectory, resume: bool = False) -> Trackers:
    """A mirror for each tracker of ``config.metrics`` (the run's own files are written
    regardless). Returns at once: each tracker's run opens on its mirror's thread. With
    ``resume`` (the run continues from its own checkpoint) trackers continue their runs."""
    trackers = [
        t for t in metric_configs(config.metrics) if not isinstance(t, DashboardMetricConfig)
    ]
    if not trackers:
        return Trackers([])
    tracked = TrackedRun(
        run_id=run.run_id,
        group=config.group_id,
        directory=run.path,
        config=tracker_run_config(config, run),
        resumed=resume,
    )
    return Trackers([Mirror(t.label(), functools.partial(t.open, tracked)) for t in trackers])


def tracker_run_config(config: TrainConfig, run: RunDirectory) -> dict[str, Any]:
    """The resolved config as in config.json, with the run id and, flat at the top where a
    tracker's run table can filter on them, the variant's grid values (``recipe.lr``)."""
    resolved = {"run_id": run.run_id, **config.to_json_dict(), **(config.group_overrides or {})}
    return json.loads(json.dumps(resolved, default=str))
