"""Datasets: where prompts come from (hub or local files) and how rows become prompts."""

from palaestra.data.dataset import (
    DatasetConfig,
    HuggingFaceDataset,
    LocalDataset,
    builtin_dataset,
)
from palaestra.data.splits import DatasetError

__all__ = [
    "DatasetConfig",
    "DatasetError",
    "HuggingFaceDataset",
    "LocalDataset",
    "builtin_dataset",
]
