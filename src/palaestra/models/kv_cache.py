"""A KV cache that writes each step in place instead of concatenating.

transformers' ``DynamicLayer`` grows by ``torch.cat``, copying the whole cache of every layer at
every decode step; on a CPU that copy costs as much as the matmuls of a small model. This layer
reserves room for the whole generation once and hands attention a view of the filled part.
"""

from __future__ import annotations

import inspect

import torch
from transformers import cache_utils
from transformers.cache_utils import DynamicCache, DynamicLayer

# Linear-attention cache layers (Qwen3.5's Gated DeltaNet); absent before transformers 5.
LINEAR_LAYER = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of ``capacity`` positions, filled left to right."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        self.key_buffer = key_states.new_empty((batch, heads, self.capacity, dim))
        self.value_buffer = value_states.new_empty(
            (batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} were asked for")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _refresh_views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count, got {tokens_to_remove}")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._refresh_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._refresh_views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            # Only the filled part is copied; the rest of the room is reserved afresh.
            keys, values = self.keys[indices], self.values[indices]
            self.key_buffer = keys.new_empty((*keys.shape[:2], self.capacity, keys.shape[-1]))
            self.value_buffer = values.new_empty(
                (*values.shape[:2], self.capacity, values.shape[-1])
            )
            self.key_buffer[:, :, : self.length] = keys
            self.value_buffer[:, :, : self.length] = values
            self._refresh_views()


def make_cache(config, capacity: int) -> DynamicCache:
    """A cache for a model with ``config`` holding up to ``capacity`` positions.

    Models whose layers are all plain full-attention layers get preallocated layers; any other
    layout (sliding windows, linear attention) keeps transformers' own layers, which know it.
    """
    cache = DynamicCache(config=config)
    if has_plain_attention(config):
        cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


def select_rows(cache: DynamicCache, indices: torch.Tensor) -> None:
    """Keep (or repeat) rows ``indices`` of every layer of ``cache``. transformers'
    ``batch_select_indices`` misses linear-attention layers: their convolution and recurrent
    states (and the keys and values of a layer holding both) are selected by ``reorder_cache``.

    Plain layers' keys and values are picked by ``index_select``, not by transformers'
    ``keys[indices]``: the same tensors, but where they carry gradients (a learner's prompt
    pass, whose keys each of a group's answers reads) the backward of ``index_select`` sums
    the rows' gradients with ``index_add``, where that of indexing goes through an
    accumulating ``index_put``, 10 to 20 times slower on a CPU (a group of 8 answers over a
    39-token prompt of SmolLM2: 0.82 ms against 0.04 ms a layer's keys on the AMX Xeon)."""
    for layer in cache.layers:
        if LINEAR_LAYER is not None and isinstance(layer, LINEAR_LAYER):
            layer.reorder_cache(indices)
        elif type(layer) is DynamicLayer:
            if layer.get_seq_length() > 0:
                layer.keys = layer.keys.index_select(0, indices)
                layer.values = layer.values.index_select(0, indices)
        else:
            layer.batch_select_indices(indices)


def plain_state(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values as they are now, for ``restore_plain_state``: a pass over
    the cache grows them, and ``select_rows`` replaces them. For plain attention layers only
    (``has_plain_attention``)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def restore_plain_state(cache: DynamicCache, state: list[tuple[torch.Tensor, torch.Tensor]]):
    """Put back the keys and values ``plain_state`` took from ``cache``."""
    for layer, (keys, values) in zip(cache.layers, state, strict=True):
        layer.keys, layer.values = keys, values


def has_plain_attention(config) -> bool:
    """Whether every layer of a model with ``config`` is full attention over a growing cache
    of keys and values (no sliding window, no linear attention)."""
    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def cache_argument(module: torch.nn.Module) -> str:
    """The keyword ``module.forward`` takes a KV cache by: transformers 5 renamed
    ``past_key_values`` to ``cache``; older releases know only the first."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
