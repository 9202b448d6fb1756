"""LoRA through peft: building the policy a run trains, adapter checkpoints, merged export.

peft is an optional dependency (``pip install 'palaestra[lora]'``), imported only here and only
when ``Recipe.lora_rank`` is above zero or an adapter checkpoint is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from palaestra.checkpoints import (
    ADAPTER_CONFIG,
    adapter_base,
    adapter_rank,
    is_adapter_checkpoint,
    read_info,
    write_folder_atomic,
    write_info,
)
from palaestra.models.loading import load_causal_lm, load_tokenizer
from palaestra.recipes import Recipe


def load_policy(
    recipe: Recipe,
    weights: str,
    start_path: Path | None,
    model_config: Any,
    device: str,
) -> tuple[torch.nn.Module, str, bool]:
    """The model a run trains, its base weights, and whether ``start_path``'s optimiser state
    fits it (it does not when a LoRA run starts from a fully fine-tuned checkpoint).

    ``weights`` is the full model to start from (the config's model, or a full checkpoint).
    An adapter checkpoint at ``start_path`` is loaded over the base it names, trainable.
    """
    revision, remote = model_config.revision, model_config.trust_remote_code
    if is_adapter_checkpoint(start_path):
        if not recipe.lora_rank:
            raise ValueError(
                f"checkpoint {start_path} holds LoRA adapters but recipe.lora_rank is 0; set "
                "lora_rank to the adapters' rank to continue them, or export_merged() the "
                "checkpoint and start a full fine-tuning run from the merged folder"
            )
        rank = adapter_rank(start_path)
        if rank != recipe.lora_rank:
            raise ValueError(
                f"checkpoint {start_path} has LoRA rank {rank} but recipe.lora_rank "
                f"is {recipe.lora_rank}; set lora_rank={rank} to continue it"
            )
        from peft import PeftModel

        base = adapter_base(start_path)
        model = load_causal_lm(base, torch.float32, device, revision, remote)
        model = PeftModel.from_pretrained(model, str(start_path), is_trainable=True)
        return model, base, True
    model = load_causal_lm(weights, torch.float32, device, revision, remote)
    if not recipe.lora_rank:
        return model, weights, True
    return apply_lora(model, recipe), weights, start_path is None


def apply_lora(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """``model`` with fresh LoRA adapters; only the adapters require grad."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=recipe.lora_rank,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=recipe.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def export_merged(checkpoint: Any, out_dir: str | Path) -> Path:
    """Write ``checkpoint``'s adapters merged into their base as a plain HF-format model at
    ``out_dir`` (new; written atomically): what an endpoint or ``AutoModelForCausalLM`` loads
    without peft. ``checkpoint`` is a Checkpoint handle or its path."""
    from peft import PeftModel

    path = Path(getattr(checkpoint, "path", checkpoint)).expanduser()
    if not is_adapter_checkpoint(path):
        raise ValueError(
            f"{path} is not a LoRA checkpoint (no {ADAPTER_CONFIG}); a full checkpoint is a "
            "plain HF model already"
        )
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; export_merged writes a new folder")
    base = load_causal_lm(adapter_base(path), torch.float32, "cpu")
    merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    tokenizer = load_tokenizer(str(path))
    info = {k: v for k, v in read_info(path).items() if k != "lora"}

    def write(staging: Path) -> None:
        merged.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_info(staging, {**info, "merged_from": str(path)})

    return write_folder_atomic(out_dir, write)
