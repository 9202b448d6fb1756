"""A tiny run end to end with its learner sharded over 2 CPU ranks: steps, weight syncs that
the engine is checked against, a checkpoint transformers loads, and a resume on one rank."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.support.tiny_runs import tiny_config


def test_two_rank_run_trains_syncs_and_saves(home, tiny_model_dir, prompts_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tiny_config(
        tiny_model_dir,
        prompts_file,
        num_rollout=2,
        precision="float32",
        actor_num_gpus_per_node=2,
        train_micro_batch_size=3,
    )
    result = config.train()
    metrics = result.metrics()
    assert [m["step"] for m in metrics] == [1, 2]
    # The tiny model's float32 weights, every tensor after the first sync and after each step
    # (full fine-tuning: all trainable): 4 bytes a parameter.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    float32_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert [m["weight_sync_bytes"] for m in metrics] == [float32_bytes, float32_bytes]
    assert all(m["loss"] == m["loss"] and m["grad_norm"] > 0 for m in metrics)
    # The engine's copy is attested after each sync against the ranks' gathered tensors.
    assert [m["attested_engines"] for m in metrics] == [1, 1]
    assert all(m["attest_s"] > 0 for m in metrics)

    (checkpoint,) = result.checkpoints()
    assert checkpoint.step == 2
    assert (checkpoint.path / "optimizer_shards" / ".metadata").is_file()
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(checkpoint.path / "model.safetensors")
    assert set(before) == set(after)
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(moved) > 0.9 * len(before)
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    output = loaded.generate(
        **tokenizer("Say sun", return_tensors="pt"), max_new_tokens=3, do_sample=False
    )
    assert output.shape[1] == len("Say sun") + 3

    # The same checkpoint continued by the one-process learner: Adam's moments carry over.
    config = tiny_config(tiny_model_dir, prompts_file, num_rollout=1, precision="float32")
    second = config.model_copy(update={"checkpoint": checkpoint}).train()
    assert [m["step"] for m in second.metrics()] == [3]
    folder = second.checkpoints()[-1].path
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"]
    assert {float(v["step"]) for v in optimizer["state"].values()} == {3.0}
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["step"] == 3


def test_two_rank_lora_run_saves_adapters_that_moved(home, tiny_model_dir, prompts_file):
    """A LoRA run's checkpoint from 2 ranks holds its adapters (the gathered ones), as one
    process's does: B matrices start at zero, so a step moved them off it."""
    config = tiny_config(
        tiny_model_dir,
        prompts_file,
        num_rollout=1,
        precision="float32",
        lora_rank=4,
        actor_num_gpus_per_node=2,
    )
    (checkpoint,) = config.train().checkpoints()
    assert (checkpoint.path / "adapter_config.json").is_file()
    assert not (checkpoint.path / "model.safetensors").exists()
    adapters = load_file(checkpoint.path / "adapter_model.safetensors")
    lora_b = [tensor for name, tensor in adapters.items() if "lora_B" in name]
    assert lora_b and all(tensor.abs().max() > 0 for tensor in lora_b)
    assert all("lora_" in name for name in adapters)
