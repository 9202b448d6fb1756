"""The tiny model and tokenizer the tests build in code: a character-level tokenizer with ChatML
special tokens and a 2-layer Llama over it. Nothing is downloaded."""

from __future__ import annotations

import string

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(extra_tokens: tuple[str, ...] = ()):
    """A character-level tokenizer with ChatML special tokens; nothing downloaded.
    ``extra_tokens`` join the vocabulary last; encoding never produces them (the
    pre-tokenizer splits every character), though a model can sample them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {token: i for i, token in enumerate(specials + chars + list(extra_tokens))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer, seed: int = 0, **overrides):
    """A 2-layer Llama over ``tokenizer``; ``overrides`` change its LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(LlamaConfig(**(fields | overrides)))


def save_tiny_model_dir(path, **overrides):
    """``build_tiny_model`` (``overrides`` change its LlamaConfig fields) and the character
    tokenizer, saved as an HF-format directory at ``path``; returns ``path``."""
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, **overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_endless_model_dir(path):
    """The tiny model with an 8192-token context that never ends on its own: its tokenizer's
    end-of-sequence token lies past the model's vocabulary, so it is never sampled and every
    completion runs to ``max_tokens``."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<|never|>"})  # the last id; pad stays <|im_end|>
    model = build_tiny_model(
        tokenizer, vocab_size=len(tokenizer) - 1, max_position_embeddings=8192, eos_token_id=None
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def samples_of(tokenizer, prompts, responses):
    """One group of samples, a prompt and a response each, tokenized by ``tokenizer``."""
    from palaestra.types import Sample

    samples = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        samples.append(
            Sample(
                prompt=prompt,
                response=response,
                label=None,
                metadata={},
                index=i,
                group_index=0,
                prompt_token_ids=tokenizer(prompt, add_special_tokens=False).input_ids,
                response_token_ids=tokenizer(response, add_special_tokens=False).input_ids,
            )
        )
    return samples
