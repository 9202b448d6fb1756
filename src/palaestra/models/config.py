"""ModelConfig: which weights to load, which chat template to use, how to read responses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from palaestra.models.parsing import ParsedResponse, parse_response


class ModelNotFoundError(FileNotFoundError):
    """The weights a ModelConfig names are not on this machine and cannot be fetched."""


class ModelConfig(BaseModel):
    """A causal language model that palaestra can train and serve.

    ``source`` is a Hugging Face hub id or a local directory in HF format. A model shipped as a
    GGUF file (inside a Python package, or in a local directory) is dequantised once into
    safetensors under the palaestra home, then loads like any other local directory.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str
    """Short name, used in run ids and endpoint names."""
    source: str
    """Hub id (``Qwen/Qwen3-4B``) or local directory holding config.json and weights."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``source`` is a hub id."""
    gguf_file: str | None = None
    """File name of a GGUF checkpoint inside ``source`` (or inside ``gguf_package``)."""
    gguf_package: str | None = None
    """Python package whose directory ships ``gguf_file``; ``source`` is ignored when set."""
    install_hint: str | None = None
    """What to tell the user when the weights are missing."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own."""
    think_open: str = "<think>"
    """Tag that opens the model's reasoning."""
    think_close: str = "</think>"
    """Tag that closes the model's reasoning."""
    trust_remote_code: bool = False
    """Passed to transformers when loading; needed by models with custom code on the hub."""
    default_max_tokens: int | None = Field(None, ge=1)
    """New tokens an endpoint generates at most when a request leaves ``max_tokens`` out
    (always bounded by the context left after the prompt); None: 512."""
    default_temperature: float | None = Field(None, ge=0.0, le=2.0)
    """An endpoint's sampling temperature when a request leaves ``temperature`` out; None:
    1.0, OpenAI's default."""

    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, name: str | None = None) -> ModelConfig:
        """Any causal LM that transformers can load, by local directory or hub id."""
        source = str(path_or_id)
        return cls(name=name or Path(source.rstrip("/")).name, source=source)

    def parse_response(self, text: str) -> ParsedResponse:
        """Split a raw response into ``.content``, ``.thinking`` and ``.tool_calls``."""
        return parse_response(text, self.think_open, self.think_close)

    def gguf_path(self) -> Path | None:
        """The GGUF file this model loads from, or None for an HF-format model."""
        if self.gguf_file is None:
            return None
        if self.gguf_package is not None:
            spec = importlib.util.find_spec(self.gguf_package)
            # The package's __init__ may import heavy dependencies; its directory is enough.
            if spec is None or not spec.submodule_search_locations:
                raise ModelNotFoundError(
                    f"{self.name} ships its weights in the Python package {self.gguf_package!r}, "
                    f"which is not installed. {self.install_hint or ''}".strip()
                )
            folder = Path(list(spec.submodule_search_locations)[0])
        else:
            folder = Path(self.source).expanduser()
        path = folder / self.gguf_file
        if not path.is_file():
            raise ModelNotFoundError(f"{self.name}: GGUF file not found at {path}")
        return path

    def weights_path(self) -> str:
        """A local HF-format directory, or a hub id, that transformers loads directly.

        Converts a GGUF model on first use (printing progress); later calls reuse the cache.
        """
        gguf = self.gguf_path()
        if gguf is not None:
            from palaestra.models.loading import convert_gguf

            return str(convert_gguf(gguf, self.name))
        local = Path(self.source).expanduser()
        if local.exists():
            if not (local / "config.json").is_file():
                raise ModelNotFoundError(f"{self.name}: {local} has no config.json")
            return str(local)
        if self.source.startswith(("/", "./", "../", "~")):
            raise ModelNotFoundError(f"{self.name}: no model directory at {local}")
        return self.source
