"""vLLM loads palaestra's weight loader into its workers by a dotted path (a string no import
checks): that path must name the class, wherever the engine's modules live."""

from __future__ import annotations

import importlib


def test_the_worker_extension_path_names_the_weight_loader():
    from palaestra.engine import vllm_engine, vllm_worker

    module, _, name = vllm_engine.WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is vllm_worker.WeightLoader
