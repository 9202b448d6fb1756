"""Opening a trackio run that mirrors a palaestra run; trackio is imported only here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.trackers import TrackedRun, TrackerClient, import_client

if TYPE_CHECKING:
    from palaestra.trackers import TrackioConfig


def open_trackio(config: TrackioConfig, run: TrackedRun) -> TrackerClient:
    """``trackio.init`` for ``run``; the returned ``trackio.Run`` takes ``log`` and ``finish``.
    Called on the mirror's own thread, so it never touches trackio's current-run globals."""
    trackio = import_client("trackio")
    return trackio.init(
        project=config.project,
        name=config.name or run.run_id,
        group=config.group or run.group,
        space_id=config.space_id,
        server_url=config.server_url,
        config=run.config,
        resume="allow" if run.resumed else "never",
        embed=False,  # a notebook's dashboard embed would open from this background thread
    )
