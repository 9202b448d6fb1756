"""Opening a Weights & Biases run that mirrors a palaestra run; wandb is imported only here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.trackers import TrackedRun, TrackerClient, import_client

if TYPE_CHECKING:
    from palaestra.trackers import WandbConfig


def open_wandb(config: WandbConfig, run: TrackedRun) -> TrackerClient:
    """``wandb.init`` for ``run``; the returned ``wandb.Run`` takes ``log`` and ``finish``.

    W&B's console capture is off: the run's stdout is its train.log, and W&B would otherwise
    wrap it from the mirror's thread. ``reinit="create_new"`` keeps a second palaestra run in
    the same process (a notebook) from finishing the first one's W&B run. The W&B run id is
    the palaestra run id, so a resumed run continues its W&B run.
    """
    wandb = import_client("wandb")
    return wandb.init(
        project=config.project,
        entity=config.entity,
        group=config.group or run.group,
        name=config.name or run.run_id,
        id=run.run_id,
        resume="allow" if run.resumed else None,
        mode=config.mode,
        dir=config.dir or str(run.directory),
        tags=config.tags or None,
        config=run.config,
        settings=wandb.Settings(console="off"),
        reinit="create_new",
    )
