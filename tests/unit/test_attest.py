"""Weight-sync attestation (``engine.attest``): the digest by hand, which tensors are picked, and
runs on the local backend that attest each sync (``attest_s`` in metrics.jsonl) or fail on an
engine that kept its old weights, naming the engine and the version."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from palaestra.engine.attest import (
    WeightSyncError,
    attest_engine,
    compare,
    held_digests,
    pick_names,
    sent_digests,
    tensor_digest,
)
from palaestra.engine.torch_engine import TorchEngine
from palaestra.runs.handles import RunFailedError
from tests.support.tiny_runs import tiny_config


def blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def test_the_digest_is_blake2b_of_the_values_in_the_dtype_asked():
    # bfloat16 1.0 is 0x3F80 and -2.0 is 0xC000, stored little-endian: 80 3F 00 C0.
    values = torch.tensor([1.0, -2.0])
    assert tensor_digest(values, torch.bfloat16) == blake(bytes([0x80, 0x3F, 0x00, 0xC0]))
    # float32 1.0 is 0x3F800000, -2.0 is 0xC0000000: 00 00 80 3F 00 00 00 C0.
    assert tensor_digest(values, torch.float32) == blake(bytes([0, 0, 0x80, 0x3F, 0, 0, 0, 0xC0]))
    # 1 + 2^-8 lies halfway between bfloat16's 1.0 and 1 + 2^-7: it rounds to even, 1.0. So
    # an engine holding bfloat16 attests equal, and a float32 one would not.
    nudged = torch.tensor([1.0 + 2**-8, -2.0])
    assert tensor_digest(nudged, torch.bfloat16) == tensor_digest(values, torch.bfloat16)
    assert tensor_digest(nudged, torch.float32) != tensor_digest(values, torch.float32)


def test_a_large_tensor_is_hashed_on_every_kth_row():
    values = torch.arange(8.0).view(4, 2)
    # 8 values over a limit of 4: k = ceil(8 / 4) = 2, rows 0 and 2 = [0, 1] and [4, 5].
    rows = torch.tensor([0.0, 1.0, 4.0, 5.0])
    assert tensor_digest(values, torch.float32, limit=4) == tensor_digest(rows, torch.float32)
    assert tensor_digest(values, torch.float32, limit=8) != tensor_digest(rows, torch.float32)


def test_picks_are_first_last_and_one_moving_with_the_version():
    names = ["c", "a", "b", "d"]
    # Sorted a, b, c, d: indices 0 and 3, and version 5 % 4 = 1.
    assert pick_names(names, 5) == ["a", "d", "b"]
    # Version 4 % 4 = 0 repeats the first: two tensors.
    assert pick_names(names, 4) == ["a", "d"]
    assert pick_names([], 3) == []
    # Over as many versions as tensors, every one is picked.
    assert {n for v in range(4) for n in pick_names(names, v)} == set(names)


def test_held_digests_skip_tensors_held_under_another_shape_and_compare_in_the_held_dtype():
    held_tensors = {"w": torch.tensor([1.0, -2.0], dtype=torch.bfloat16), "fused": torch.zeros(4)}
    sent = {"w": torch.tensor([1.0 + 2**-8, -2.0]), "fused": torch.zeros(2)}
    # "fused" is held under another shape: the picks are among the rest, "w" alone.
    held = held_digests(held_tensors, {name: tuple(t.shape) for name, t in sent.items()}, 5)
    assert held == {"w": ("bfloat16", blake(bytes([0x80, 0x3F, 0x00, 0xC0])))}
    assert compare(sent_digests(sent, held), held, "engine 0", 7) == 1


def test_a_mismatch_names_the_engine_the_version_and_the_tensor():
    held = {"a": ("float32", "x"), "b": ("float32", "y")}
    with pytest.raises(WeightSyncError) as error:
        compare({"a": ("float32", "x"), "b": ("float32", "z")}, held, "rollout worker 1", 12)
    assert "version 12" in str(error.value)
    assert "rollout worker 1" in str(error.value)
    assert "for b " in str(error.value)


def test_a_torch_engine_copy_attests_until_a_load_is_skipped(tiny_model_dir):
    from palaestra.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm(tiny_model_dir, torch.float32)
    engine = TorchEngine(model, load_tokenizer(tiny_model_dir), dtype=torch.bfloat16)
    assert engine.model is not model  # a bfloat16 copy
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5)
    weights = dict(model.named_parameters())
    with pytest.raises(WeightSyncError, match="version 1"):
        attest_engine(engine, weights, 1, "the engine")  # not loaded yet: stale
    engine.update_weights(weights, 1)
    assert attest_engine(engine, weights, 1, "the engine") == 3


def metrics_of(result) -> list[dict]:
    lines = (Path(result.path) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    "copy", [{"precision": "bfloat16"}, {"precision": "float32", "max_staleness": 1}]
)
def test_a_local_run_attests_the_engines_copy_every_step(home, tiny_model_dir, prompts_file, copy):
    result = tiny_config(tiny_model_dir, prompts_file, **copy).train()
    metrics = metrics_of(result)
    assert [m["attested_engines"] for m in metrics] == [1, 1, 1]
    assert all(0 < m["attest_s"] <= m["weight_sync_s"] for m in metrics)


def test_an_engine_sharing_the_learners_tensors_has_nothing_to_attest(
    home, tiny_model_dir, prompts_file
):
    result = tiny_config(tiny_model_dir, prompts_file, precision="float32").train()
    assert [(m["attested_engines"], m["attest_s"]) for m in metrics_of(result)] == [(0, 0.0)] * 3


def test_a_run_whose_engine_keeps_its_old_weights_fails_naming_it(
    home, tiny_model_dir, prompts_file, monkeypatch
):
    load = TorchEngine.update_weights

    def stale_after_the_first(self, weights, version):
        if self.weight_version == 0 and version == 0:
            return load(self, weights, version)
        self.weight_version = version  # says it loaded, holds the old weights

    monkeypatch.setattr(TorchEngine, "update_weights", stale_after_the_first)
    with pytest.raises(RunFailedError) as error:  # the run's status.json error, raised
        tiny_config(tiny_model_dir, prompts_file, precision="bfloat16").train()
    message = str(error.value)
    assert "WeightSyncError: weight sync to version 1" in message
    assert f"the engine (pid {os.getpid()})" in message
