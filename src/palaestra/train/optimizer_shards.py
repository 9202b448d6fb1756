"""AdamW's state across rank counts: a sharded learner's ``OPTIMIZER_SHARDS`` folder
(torch.distributed.checkpoint) read into any optimiser, sharded or whole, and one process's
``optimizer.pt`` read into a sharded one. The one learner and the sharded ranks both load
through here, so a run resumes with the same or a different number of ranks.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


def load_sharded_optimizer(model: torch.nn.Module, optimizer, path: Path) -> None:
    """AdamW's state from a torch.distributed.checkpoint folder written by ``RankLearner.save``
    with any number of ranks, into ``optimizer`` over ``model`` (sharded or not: without a
    process group the whole state loads into this one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    try:
        state = get_optimizer_state_dict(model, optimizer)  # the layout to read into
        with warnings.catch_warnings():  # one process reading it whole is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({"optimizer": state}, checkpoint_id=str(path))
        set_optimizer_state_dict(model, optimizer, state)
    except (RuntimeError, KeyError, ValueError) as error:
        raise ValueError(f"{path}: {type(error).__name__}: {error}") from error


def load_whole_optimizer(model: torch.nn.Module, optimizer, path: Path) -> None:
    """AdamW's state from one process's ``optimizer.pt`` (moments indexed by trainable
    parameter, in ``model.named_parameters()`` order) into a sharded ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    saved = torch.load(path, map_location="cpu", weights_only=True)["optimizer"]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    try:
        state = {
            "state": {names[index]: moments for index, moments in saved["state"].items()},
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]}
                for group in saved["param_groups"]
            ],
        }
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)
    except (IndexError, KeyError, RuntimeError, ValueError) as error:
        raise ValueError(f"{path}: {type(error).__name__}: {error}") from error
