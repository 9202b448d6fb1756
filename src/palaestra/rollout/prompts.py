"""A dataset's rows as prompts an engine takes: rendered (chat template or raw) and tokenized."""

from __future__ import annotations

from palaestra.home import palaestra_home
from palaestra.types import Prompt


def prepare_prompts(dataset, tokenizer, chat_template_kwargs: dict) -> list[Prompt]:
    """The dataset's prompts, each with its ``token_ids`` filled in."""
    prompts = dataset.prepare(
        tokenizer, chat_template_kwargs, cache_dir=palaestra_home() / "datasets"
    )
    for prompt in prompts:
        # A chat template writes its own special tokens; a raw prompt gets the tokenizer's.
        ids = tokenizer(prompt.text, add_special_tokens=not dataset.apply_chat_template).input_ids
        prompt.token_ids = list(ids)
    return prompts
