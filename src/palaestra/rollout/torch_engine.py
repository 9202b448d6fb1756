"""The torch rollout engine: batched sampling with transformers' KV-cached ``generate``.

It samples from the very module the trainer updates, so weight sync is free on one machine.
"""

from __future__ import annotations

import torch

from palaestra.types import Completion


class TorchEngine:
    """Generates with a transformers causal LM, ``max_batch`` sequences per pass."""

    def __init__(self, model: torch.nn.Module, tokenizer, max_batch: int = 64) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = sorted(eos_ids)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompts_P: list[list[int]], n: int, params) -> list[list[Completion]]:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,  # sample from the full distribution: the trainer scores tokens under it
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        flat_B = [prompt for prompt in prompts_P for _ in range(n)]
        if params.seed is not None:
            torch.manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        completions_B: list[Completion] = []
        try:
            for start in range(0, len(flat_B), self.max_batch):
                completions_B += self._generate_chunk(
                    flat_B[start : start + self.max_batch], config
                )
        finally:
            self.model.train(was_training)
        return [completions_B[p * n : (p + 1) * n] for p in range(len(prompts_P))]

    def _generate_chunk(self, prompts: list[list[int]], config) -> list[Completion]:
        # Left padding keeps every prompt's last token in the final column, where decoding starts.
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        device = next(self.model.parameters()).device
        output = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
        )
        completions = []
        eos = set(self.eos_ids)
        for row in output[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in eos), None)
            tokens = row if end is None else row[: end + 1]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            completions.append(Completion(tokens, text, "length" if end is None else "stop"))
        return completions
