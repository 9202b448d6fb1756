"""palaestra: RL post-training of language models with verifiable rewards, local first.

The public names of the tutorial API. They import lazily, so ``import palaestra`` (and the
CLI's ``--help``) stays instant and torch loads only when a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "palaestra.evals": ["EvalConfig", "EvalResult"],
    "palaestra.data": ["DatasetConfig", "HuggingFaceDataset", "LocalDataset", "builtin_dataset"],
    "palaestra.models": [
        "ModelConfig",
        "Qwen3_0_6B",
        "Qwen3_1_7B",
        "Qwen3_4B",
        "Qwen3_8B",
        "Qwen3_5_0_8B",
        "Qwen3_5_2B",
        "Qwen3_5_4B",
        "Qwen3_5_9B",
        "SmolLM2_135M",
        "SmolLM2_360M",
        "SmolLM2_1_7B",
    ],
    "palaestra.recipes": ["Recipe", "SmolLM2_135M_Recipe", "Qwen3_4B_Recipe", "Qwen3_5_4B_Recipe"],
    "palaestra.checkpoints": ["Checkpoint"],
    "palaestra.launch.training": ["TrainingRun"],
    "palaestra.launch.sweeps": ["GroupResult", "GroupRun", "TrainingGroup"],
    "palaestra.runs.handles": ["RunFailedError", "RunStoppedError", "TrainResult"],
    "palaestra.serve": ["Endpoint", "EndpointError"],
    "palaestra.config": ["TrainConfig"],
    "palaestra.trackers": ["DashboardMetricConfig", "TrackioConfig", "WandbConfig"],
    "palaestra.types": ["Environment", "Sample", "Step"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'palaestra' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
