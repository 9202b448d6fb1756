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
from typing import NoReturn

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

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise_naming_folder(path, error, "tokenizer")
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
    """A causal LM from an HF-format directory or hub id, on ``device``. A directory whose files
    do not load (truncated, malformed, weights of another shape) is a ValueError naming the
    file, or the directory when no one file is at fault."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, revision=revision, trust_remote_code=trust_remote_code
        )
    except Exception as error:  # safetensors' and transformers' errors name no file
        raise_naming_folder(path, error, "weights")
    return model.to(device)


def raise_naming_folder(path: str | Path, error: Exception, what: str) -> NoReturn:
    """Re-raise ``error`` from loading the local folder ``path`` as a ValueError naming the
    file at fault (a ``*.safetensors`` that does not parse, or holds a tensor of another shape
    than the folder's config.json gives it) or else the folder. An error loading a hub id goes
    on as it is (it names the id already), and so does running out of memory."""
    folder = Path(path).expanduser()
    if not folder.is_dir() or isinstance(error, MemoryError):
        raise error
    fault = _weights_fault(folder) if what == "weights" else None
    reason = f"{type(error).__name__}: {error}" if fault is None else fault[1]
    raise ValueError(
        f"{fault[0] if fault else folder}: cannot load the {what}: {reason}"
    ) from error


def _weights_fault(folder: Path) -> tuple[Path, str] | None:
    """The first safetensors file in ``folder`` that does not open, or whose tensor's shape is
    not the one the folder's config.json makes (checked on the meta device: no memory), with
    why; None when none is at fault."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    expected: dict[str, tuple[int, ...]] | None = None
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        except Exception as error:
            return file, f"{type(error).__name__}: {error}"
        if expected is None:
            try:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
            except Exception:
                return None
            expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        for key, shape in shapes.items():
            if key in expected and shape != expected[key]:
                return file, f"{key} has shape {shape}, but config.json makes it {expected[key]}"
    return None


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
