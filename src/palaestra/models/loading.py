"""Loading weights and tokenizers, the one-time GGUF to safetensors conversion, and the
precision the passes run in."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from palaestra.atomic import fsync_tree
from palaestra.home import palaestra_home


def convert_gguf(gguf: Path, name: str) -> Path:
    """Dequantise ``gguf`` into an HF-format safetensors directory under the palaestra home.

    Loading a GGUF through transformers takes tens of seconds, so it happens once; the cache
    key covers the file's path, size and mtime so a reinstalled package converts again.
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = palaestra_home() / "models" / f"{name}-{key[:12]}"
    if (target / "config.json").is_file():
        return target

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(
        f"palaestra: converting {gguf.name} to safetensors (once) ...", file=sys.stderr, flush=True
    )
    started = time.monotonic()
    folder, file = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # The loaded model still carries its GGUF quantization config and refuses save_pretrained:
    # rebuild a plain model from the config without it and move the dequantised weights over.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        fsync_tree(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process converted the same file meanwhile: its copy is as good as ours.
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(
        f"palaestra: converted in {time.monotonic() - started:.0f} s, cached at {target}",
        file=sys.stderr,
        flush=True,
    )
    return target


def load_tokenizer(path: str, chat_template: str | None = None, revision: str | None = None):
    """The tokenizer at ``path`` with a pad token set (generation pads batches)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    trust_remote_code: bool = False,
):
    """A causal LM from an HF-format directory or hub id, on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, revision=revision, trust_remote_code=trust_remote_code
    )
    return model.to(device)


def compute_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """The dtype ``Recipe.precision`` resolves to on ``device``: "auto" is bfloat16 where the
    hardware multiplies it natively (a CUDA GPU that supports it, a CPU with AVX-512 BF16 or
    AMX), else float32, which is also what a CPU without them would emulate bfloat16 in."""
    if precision == "float32":
        return torch.float32
    if precision == "bfloat16":
        return torch.bfloat16
    if torch.device(device).type == "cuda":
        native = torch.cuda.is_bf16_supported()
    else:
        try:
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bfloat16
            native = False
    return torch.bfloat16 if native else torch.float32
