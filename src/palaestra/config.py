"""TrainConfig: what to train (model, dataset, recipe, starting checkpoint) and how to start it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from palaestra.checkpoints import Checkpoint, check_model_folder, checkpoint_path
from palaestra.data import DatasetConfig
from palaestra.models import ModelConfig
from palaestra.recipes import Recipe, check_runnable_here
from palaestra.trackers import DashboardMetricConfig, MetricConfig, metric_configs

if TYPE_CHECKING:
    from palaestra.launch.training import TrainingRun
    from palaestra.plan import Layout, Plan
    from palaestra.runs.handles import TrainResult


class TrainConfig(BaseModel):
    """A training run, complete: ``launch()`` starts it in its own process, ``train()`` here."""

    model_config = ConfigDict(
        extra="forbid", arbitrary_types_allowed=True, use_attribute_docstrings=True
    )

    model: ModelConfig
    """The model to train; its weights are the starting point unless ``checkpoint`` is set."""
    dataset: DatasetConfig
    """Prompts to train on."""
    recipe: Recipe = Field(default_factory=Recipe)
    """Every training knob; ``recipe.custom_rm_function`` is the reward."""
    checkpoint: Checkpoint | Path | str | None = None
    """Start from this checkpoint's weights and optimiser state; steps continue from its step.
    A plain HF-format directory (no trainer state) gives the weights alone, from step 0."""
    eval_dataset: DatasetConfig | None = None
    """Scored every ``recipe.eval_interval`` steps, one sample per row."""
    name: str | None = None
    """Prefix of the run id; defaults to the model's name."""
    group_id: str | None = None
    """The sweep (``TrainingGroup``) this run is a variant of; set by the group."""
    group_overrides: dict[str, Any] | None = None
    """This variant's values of the group's grid, by dotted field (``{"recipe.lr": 1e-5}``)."""
    group_axes: list[str] | None = None
    """The group's grid fields, in the grid's order."""
    metrics: MetricConfig | list[MetricConfig] | None = DashboardMetricConfig()
    """Experiment trackers each step's metrics are mirrored to (``TrackioConfig``,
    ``WandbConfig``), besides the run's own metrics.jsonl, which is always written. None or
    ``DashboardMetricConfig()``: no mirror. A tracker that fails is warned about in train.log
    and dropped; it never fails or slows the run."""

    @model_validator(mode="after")
    def _check_eval(self) -> TrainConfig:
        if self.recipe.eval_interval is not None and self.eval_dataset is None:
            raise ValueError("recipe.eval_interval is set but TrainConfig.eval_dataset is not")
        if self.eval_dataset is not None and self.recipe.eval_interval is None:
            raise ValueError(
                "TrainConfig.eval_dataset is set but recipe.eval_interval is None, so it would "
                "never be scored; set eval_interval (steps between evaluations)"
            )
        return self

    def checkpoint_path(self) -> Path | None:
        return None if self.checkpoint is None else checkpoint_path(self.checkpoint)

    def validate_here(self) -> None:
        """Everything that can fail before training, checked in the caller's process: the
        recipe against this machine, the dataset's columns, the model's and checkpoint's files."""
        check_runnable_here(self.recipe)
        if self.recipe.backend == "ray" or self.recipe.rollout_num_gpus > 1:
            from palaestra.launch.checks import check_ray_here, gpu_layout

            check_ray_here(self.recipe)  # Ray installed, its address answering, overlay mapped
            gpu_layout(self.recipe)  # the GPUs divide among the actors
        for dataset in (self.dataset, self.eval_dataset):
            if dataset is not None:
                dataset.check_columns(dataset.load())
        self.model.gguf_path()
        path = self.checkpoint_path()
        if path is not None:
            check_model_folder(path)
        for tracker in metric_configs(self.metrics):
            tracker.check_installed()
        # Refuse a run that cannot fit in memory, before any process starts: in a process
        # forked from a warm launcher where torch is not imported here yet (launch.plan_check).
        from palaestra.launch.plan_check import check_in_launcher
        from palaestra.plan import check_plan, plan_check_skipped

        if plan_check_skipped():
            return
        if "torch" in sys.modules or not check_in_launcher(self):
            check_plan(self)

    def plan(
        self, layout: Layout | None = None, gpu: str | None = None, prompt_tokens: int | None = None
    ) -> Plan:
        """What the run will hold per device (weights, gradients, optimiser, reference,
        activations, engines' weights and KV cache) and how long a step should take; printable
        as a table. ``layout`` plans another layout than the recipe's (``palaestra.plan.Layout``),
        ``gpu`` another GPU (``"H100"``), ``prompt_tokens`` another prompt length."""
        from palaestra.plan import plan_config

        return plan_config(self, layout, gpu, prompt_tokens)

    def to_json_dict(self) -> dict[str, Any]:
        """The resolved config, as written to the run's ``config.json``."""
        path = self.checkpoint_path()
        return {
            "model": self.model.model_dump() | {"class": type(self.model).__name__},
            "dataset": self.dataset.to_dict(),
            "eval_dataset": self.eval_dataset.to_dict() if self.eval_dataset else None,
            "recipe": self.recipe.to_json_dict(),
            "checkpoint": str(path) if path else None,
            "name": self.name,
            "group_id": self.group_id,
            "group_overrides": self.group_overrides,
            "group_axes": self.group_axes,
            "metrics": [tracker.describe() for tracker in metric_configs(self.metrics)],
        }

    def launch(self, show_output: bool = False) -> TrainingRun:
        """Start training in a separate process and return its handle at once.

        With ``show_output`` the run's step lines are printed while ``result()`` waits.
        """
        from palaestra.launch.training import launch

        return launch(self, show_output=show_output)

    def train(self) -> TrainResult:
        """Train in this process and return when done; raises if the run fails."""
        from palaestra.launch.training import train_here

        return train_here(self)
