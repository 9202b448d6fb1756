"""LoRA runs on the tiny model: adapters train and checkpoint, runs continue and resume from
them, a KL reference costs no second model, and a merged export is a plain HF model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from palaestra import TrainingRun
from palaestra.runs.registry import list_run_ids
from palaestra.train.lora import export_merged
from tests.support.tiny_runs import make_config

pytest.importorskip("peft")

LORA = dict(lora_rank=4, lora_alpha=8, lr=1e-2)


def test_lora_run_trains_and_checkpoints_adapters_only(home, tiny_model_dir, prompts_file):
    result = make_config(tiny_model_dir, prompts_file, num_rollout=2, **LORA).train()
    (checkpoint,) = result.checkpoints()
    files = {p.name for p in checkpoint.path.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
    } <= files
    assert "model.safetensors" not in files
    adapters = load_file(checkpoint.path / "adapter_model.safetensors")
    # B matrices start at zero; training moved them. No base weight is in the file.
    lora_b = [t for name, t in adapters.items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)
    assert all("lora_" in name for name in adapters)
    info = json.loads((checkpoint.path / "palaestra.json").read_text())
    assert info["lora"] is True and info["base_model_path"] == str(tiny_model_dir)
    assert json.loads((checkpoint.path / "adapter_config.json").read_text())["r"] == 4


def test_continue_from_a_lora_checkpoint(home, tiny_model_dir, prompts_file):
    first = make_config(tiny_model_dir, prompts_file, num_rollout=2, **LORA).train()
    config = make_config(tiny_model_dir, prompts_file, num_rollout=2, **LORA)
    second = config.model_copy(update={"checkpoint": first.checkpoints()[-1]}).train()
    assert [m["step"] for m in second.metrics()] == [3, 4]
    state = torch.load(second.checkpoints()[-1].path / "optimizer.pt", weights_only=True)
    # The adapters' Adam moments carried over: 4 steps, not 2.
    assert {float(v["step"]) for v in state["optimizer"]["state"].values()} == {4.0}

    wrong_rank = make_config(tiny_model_dir, prompts_file, lora_rank=8, lr=1e-2)
    wrong_rank = wrong_rank.model_copy(update={"checkpoint": first.checkpoints()[-1]})
    with pytest.raises(Exception, match="LoRA rank 4 but recipe.lora_rank is 8"):
        wrong_rank.train()


def test_lora_run_resumes_after_a_crash(home, tiny_model_dir, prompts_file, monkeypatch):
    from palaestra.runs.directory import RunDirectory

    real_append = RunDirectory.append_jsonl

    def append_that_dies_at_step_2(self, name, rows):
        if name == "metrics.jsonl" and rows[0]["step"] == 2:
            raise KeyboardInterrupt
        return real_append(self, name, rows)

    monkeypatch.setattr(RunDirectory, "append_jsonl", append_that_dies_at_step_2)
    config = make_config(tiny_model_dir, prompts_file, num_rollout=3, save_interval=1, **LORA)
    with pytest.raises(Exception, match="stopped"):
        config.train()
    monkeypatch.setattr(RunDirectory, "append_jsonl", real_append)
    (run_id,) = list_run_ids()
    run = TrainingRun.from_id(run_id)
    run.resume().result(timeout=120)
    assert [m["step"] for m in run.metrics()] == [1, 2, 3]
    assert [c.step for c in run.checkpoints()] == [1, 2, 3]
    assert (run.checkpoints()[-1].path / "adapter_model.safetensors").is_file()


def test_kl_reference_is_the_adapter_free_base(home, tiny_model_dir, prompts_file):
    result = make_config(
        tiny_model_dir, prompts_file, num_rollout=2, kl_loss_coef=0.1, **LORA
    ).train()
    first, second = result.metrics()
    # Step 1: fresh adapters are zero, so the policy is its base: KL 0 exactly.
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    # Step 2: the adapters moved; the base with adapters off did not.
    assert second["kl"] > 1e-6


def test_merged_export_is_a_plain_model_with_the_adapters_in(
    home, tiny_model_dir, prompts_file, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = make_config(tiny_model_dir, prompts_file, num_rollout=1, **LORA).train()
    checkpoint = result.latest_checkpoint()
    merged_dir = export_merged(checkpoint, tmp_path / "merged")
    assert (merged_dir / "model.safetensors").is_file()
    assert not (merged_dir / "adapter_config.json").exists()
    assert json.loads((merged_dir / "palaestra.json").read_text())["step"] == 1

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(checkpoint.path)
        )
        adapted_logits = adapted(ids).logits
        merged_logits = merged(ids).logits
    assert torch.allclose(merged_logits, adapted_logits, atol=1e-5)
    assert not torch.allclose(merged_logits, base_logits, atol=1e-4)
    with pytest.raises(FileExistsError):
        export_merged(checkpoint, merged_dir)
