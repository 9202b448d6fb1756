"""LoRA through peft: building the policy a run trains, adapter checkpoints, merged export.

peft is an optional dependency (``pip install 'palaestra[lora]'``), imported only here and only
when ``Recipe.lora_rank`` is above zero or an adapter checkpoint is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from palaestra.models.loading import load_causal_lm, load_tokenizer
from palaestra.recipes import Recipe
from palaestra.train.checkpoint import write_folder_atomic

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_checkpoint(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> str:
    """The weights the adapters at ``path`` were trained on."""
    path = Path(path)
    info_file = path / "palaestra.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    base = info.get("base_model_path")
    if base is None:
        base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}: the adapter checkpoint does not name its base model")
    return base


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
        saved = json.loads((start_path / ADAPTER_CONFIG).read_text())
        if saved.get("r") != recipe.lora_rank:
            raise ValueError(
                f"checkpoint {start_path} has LoRA rank {saved.get('r')} but recipe.lora_rank "
                f"is {recipe.lora_rank}; set lora_rank={saved.get('r')} to continue it"
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
    info_file = path / "palaestra.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}

    def write(staging: Path) -> None:
        merged.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        merged_info = {k: v for k, v in info.items() if k != "lora"}
        (staging / "palaestra.json").write_text(
            json.dumps({**merged_info, "merged_from": str(path)}, indent=2)
        )

    return write_folder_atomic(out_dir, write)
