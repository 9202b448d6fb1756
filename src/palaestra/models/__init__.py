"""Models: what to load (ModelConfig and the catalogue), how to load it, how to read its output."""

from palaestra.models.catalogue import (
    Qwen3_0_6B,
    Qwen3_1_7B,
    Qwen3_4B,
    Qwen3_5_0_8B,
    Qwen3_5_2B,
    Qwen3_5_4B,
    Qwen3_5_9B,
    Qwen3_8B,
    SmolLM2_1_7B,
    SmolLM2_135M,
    SmolLM2_360M,
)
from palaestra.models.config import ModelConfig, ModelNotFoundError
from palaestra.models.parsing import ParsedResponse, ToolCall, parse_response

__all__ = [
    "ModelConfig",
    "ModelNotFoundError",
    "ParsedResponse",
    "ToolCall",
    "parse_response",
    "Qwen3_0_6B",
    "Qwen3_1_7B",
    "Qwen3_4B",
    "Qwen3_8B",
    "Qwen3_5_0_8B",
    "Qwen3_5_2B",
    "Qwen3_5_4B",
    "Qwen3_5_9B",
    "SmolLM2_135M",
    "SmolLM2_360M",
    "SmolLM2_1_7B",
]
