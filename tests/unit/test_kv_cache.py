"""``models.kv_cache.select_rows``: a prompt's keys and values repeated for its answers, with
gradients summed back into the prompt by ``index_select``'s backward."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from palaestra.models.kv_cache import select_rows
from tests.support.tiny_models import build_tiny_model, build_tokenizer


def test_a_prompts_keys_repeat_for_its_answers_and_their_gradients_sum_back():
    model = build_tiny_model(build_tokenizer())
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 5, model.config.hidden_size, generator=generator, requires_grad=True)
    cache = DynamicCache(config=model.config)
    model.model(inputs_embeds=embeds, use_cache=True, past_key_values=cache)
    before = [(layer.keys, layer.values) for layer in cache.layers]
    rows = torch.tensor([0, 0, 0, 1, 1])  # three answers of prompt 0, two of prompt 1
    select_rows(cache, rows)
    upstream = []
    for (keys, values), layer in zip(before, cache.layers, strict=True):
        assert torch.equal(layer.keys, keys[rows]) and torch.equal(layer.values, values[rows])
        # The backward sums with index_add, not through an accumulating index_put.
        assert layer.keys.grad_fn.name() == "IndexSelectBackward0"
        upstream += [torch.randn(layer.keys.shape, generator=generator) for _ in range(2)]
    picked = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    got = torch.autograd.grad(picked, embeds, upstream, retain_graph=True)[0]
    indexed = [t[rows] for pair in before for t in pair]
    expected = torch.autograd.grad(indexed, embeds, upstream)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
