"""Where a run's metrics go besides its own files: the tracker configs of ``TrainConfig.metrics``.

The run directory (metrics.jsonl, samples.jsonl, train.log) is always written: it is what
palaestra's dashboard, CLI and store read. A tracker config adds a mirror of each step's metrics
row to an experiment tracker (trackio, Weights & Biases), fed from a background thread so that
a slow or failing tracker never holds up or fails training (``trackers.mirror``). A tracker
config's ``open`` starts the tracker's run and returns its client (``log``, ``finish``): the one
place a tracker's library is called from.

This module loads only pydantic; a tracker's client is imported when a run opens its mirror.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field


class TrackerClient(Protocol):
    """What a mirror calls: a tracker's own run object (``trackio.Run``, ``wandb.Run``)."""

    def log(self, data: dict[str, Any], step: int | None = None) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told about the run it mirrors."""

    run_id: str
    """The palaestra run id: the tracker run's name unless its config names it."""
    group: str | None
    """The sweep the run is a variant of, if any."""
    directory: Path
    """The run directory."""
    config: dict[str, Any] = field(default_factory=dict)
    """The tracker run's config: the resolved TrainConfig and the variant's grid values."""
    resumed: bool = False
    """The run continues from its own checkpoint: a tracker continues its run of it too."""


class _Tracker(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    def describe(self) -> dict[str, Any]:
        """This config as written to the run's config.json."""
        return self.model_dump()

    def check_installed(self) -> None:
        """Raise ImportError, naming the extra to install, when the tracker's client is missing;
        checked before training starts, in the caller's process."""

    def label(self) -> str:
        """How warnings name this tracker."""
        return getattr(self, "kind", type(self).__name__)

    def open(self, run: TrackedRun) -> TrackerClient | None:
        """Start the tracker's run (on the mirror's thread); None: nothing to mirror."""
        return None


class DashboardMetricConfig(_Tracker):
    """The run's own files (metrics.jsonl and the rest), read by palaestra's dashboard and CLI.
    They are always written; this config mirrors them nowhere else."""

    kind: Literal["dashboard"] = "dashboard"
    """Which tracker; a TOML ``[[metrics]]`` table chooses by it."""


class TrackioConfig(_Tracker):
    """Mirror each step's metrics to trackio: local first (its own SQLite files under
    ``$TRACKIO_DIR``, by default ``~/.cache/huggingface/trackio``; ``trackio show`` opens its
    dashboard), or a Hugging Face Space (``space_id``) or a self-hosted server (``server_url``).
    Needs ``pip install 'palaestra[trackio]'``."""

    kind: Literal["trackio"] = "trackio"
    """Which tracker; a TOML ``[[metrics]]`` table chooses by it."""
    project: str
    """The trackio project the run is logged to."""
    name: str | None = None
    """The trackio run's name; defaults to the palaestra run id."""
    group: str | None = None
    """The trackio group; defaults to the run's sweep (``TrainConfig.group_id``)."""
    space_id: str | None = None
    """Log to this Hugging Face Space (``user/space``) instead of local storage."""
    server_url: str | None = None
    """Log to this self-hosted trackio server; its ``write_token`` query parameter (or the
    ``TRACKIO_WRITE_TOKEN`` environment variable) authorises writes. Not written to
    config.json with the token."""

    def describe(self) -> dict[str, Any]:
        return self.model_dump() | {"server_url": _without_token(self.server_url)}

    def check_installed(self) -> None:
        require_client("trackio")

    def label(self) -> str:
        return f"trackio (project {self.project!r})"

    def open(self, run: TrackedRun) -> TrackerClient:
        from palaestra.trackers.to_trackio import open_trackio

        return open_trackio(self, run)


class WandbConfig(_Tracker):
    """Mirror each step's metrics to Weights & Biases (``mode="offline"`` writes the W&B run
    under ``dir`` for a later ``wandb sync``). Needs ``pip install 'palaestra[wandb]'``."""

    kind: Literal["wandb"] = "wandb"
    """Which tracker; a TOML ``[[metrics]]`` table chooses by it."""
    project: str
    """The W&B project the run is logged to."""
    group: str | None = None
    """The W&B group; defaults to the run's sweep (``TrainConfig.group_id``)."""
    entity: str | None = None
    """The W&B user or team; defaults to W&B's own default (``WANDB_ENTITY``, your login)."""
    name: str | None = None
    """The W&B run's display name; defaults to the palaestra run id."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """W&B's mode; None leaves it to W&B (``WANDB_MODE``, whether you are logged in)."""
    dir: str | None = None
    """Where W&B writes its ``wandb/`` folder; defaults to the run directory."""
    tags: list[str] = []
    """Tags of the W&B run."""

    def check_installed(self) -> None:
        require_client("wandb")

    def label(self) -> str:
        return f"wandb (project {self.project!r})"

    def open(self, run: TrackedRun) -> TrackerClient:
        from palaestra.trackers.to_wandb import open_wandb

        return open_wandb(self, run)


MetricConfig = Annotated[
    DashboardMetricConfig | TrackioConfig | WandbConfig, Field(discriminator="kind")
]
"""One destination of a run's metrics."""


def metric_configs(metrics: MetricConfig | list[MetricConfig] | None) -> list[MetricConfig]:
    """``TrainConfig.metrics`` as a list (None: no mirrors)."""
    if metrics is None:
        return []
    return list(metrics) if isinstance(metrics, list) else [metrics]


def require_client(module: str) -> None:
    """ImportError naming the extra that installs the tracker client ``module``, checked
    without importing it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or one blocked in sys.modules
        found = False
    if not found:
        raise ImportError(_missing(module))


def import_client(module: str) -> ModuleType:
    """The tracker client ``module``, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{_missing(module)} ({error})") from error


def _missing(module: str) -> str:
    return f"mirroring metrics to {module} needs its client: pip install 'palaestra[{module}]'"


def _without_token(url: str | None) -> str | None:
    if url is None:
        return None
    parts = urlsplit(url)
    query = [(key, value) for key, value in parse_qsl(parts.query) if key != "write_token"]
    return urlunsplit(parts._replace(query=urlencode(query)))
