"""Supervised fine-tuning: which tokens carry loss, and which recipes may use it."""

from __future__ import annotations

import pytest
import torch

from palaestra import Recipe
from palaestra.recipes import check_runnable_here
from palaestra.rollout.demonstrations import demonstration, demonstration_sample
from palaestra.train.batch import build_train_batch
from palaestra.types import Prompt
from tests.support.tiny_models import build_tokenizer


def targets_text(tokenizer, demo) -> str:
    pairs = zip(demo.token_ids, demo.targets, strict=True)
    return tokenizer.decode([token for token, is_target in pairs if is_target])


def test_output_column_answer_is_the_only_target():
    tokenizer = build_tokenizer()
    messages = [{"role": "user", "content": "Say sun"}]
    prompt = Prompt(index=3, messages=messages, text="", label="SUN")
    demo = demonstration(prompt, tokenizer, chat_template=True, kwargs={})
    # The whole rendering, and of it only the assistant's turn (with its end token) is a target.
    assert tokenizer.decode(demo.token_ids) == (
        "<|im_start|>user\nSay sun<|im_end|>\n<|im_start|>assistant\nSUN<|im_end|>\n"
    )
    assert targets_text(tokenizer, demo) == "SUN<|im_end|>\n"


def test_every_assistant_turn_of_a_conversation_is_a_target():
    tokenizer = build_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ok"},
    ]
    prompt = Prompt(0, messages, "")
    demo = demonstration(prompt, tokenizer, True, {})
    assert targets_text(tokenizer, demo) == "Yo<|im_end|>\nOk<|im_end|>\n"
    # As a sample, the tokens before the first target are its prompt, the rest its response,
    # and its loss mask is the rest's target flags: the user turn between the answers is 0.
    sample = demonstration_sample(demo, prompt, step=1)
    assert sample.prompt_token_ids + sample.response_token_ids == demo.token_ids
    assert tokenizer.decode(sample.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert sample.loss_mask == [int(t) for t in demo.targets[len(sample.prompt_token_ids) :]]
    assert 0 in sample.loss_mask
    # The batch mask is the target flags shifted onto the logits that predict them.
    batch = build_train_batch([sample], torch.ones(1), pad_id=0)
    assert batch.mask_B_T[0, :-1].tolist() == [float(t) for t in demo.targets[1:]]


def test_plain_prompt_learns_answer_then_end_of_sequence():
    tokenizer = build_tokenizer()
    demo = demonstration(
        Prompt(0, [{"role": "user", "content": "Say"}], "Say", label="ok"),
        tokenizer,
        chat_template=False,
        kwargs={},
    )
    assert targets_text(tokenizer, demo) == "ok<|im_end|>"


def test_a_row_without_an_answer_is_an_error_naming_it():
    with pytest.raises(ValueError, match="row 7.*no assistant message and no output_column"):
        demonstration(
            Prompt(7, [{"role": "user", "content": "x"}], "x"), build_tokenizer(), True, {}
        )


def test_sft_needs_no_reward():
    check_runnable_here(Recipe(loss_type="sft_loss"))
    with pytest.raises(ValueError, match="dynamic_sampling needs rewards"):
        Recipe(loss_type="sft_loss", dynamic_sampling=True)
