"""Key-value caches on TransformerLens 3.x and 4.x models: made empty or already holding given
keys and values, measured, shared by a batch of continuations, read back; the part of
:mod:`headsurgeon.backend` that :func:`~headsurgeon.backend.forward.run_to_layer`'s ``cache``
and the blocked long-context path use.

3.x keeps TransformerLens's ``TransformerLensKeyValueCache`` (entries ``[batch, pos, head,
d_head]``); 4.x a Hugging Face ``DynamicCache`` (layers ``[batch, head, pos, d_head]``). Both
grow into doubling buffers here, so a long sequence in blocks copies each block once.

Exports:
    new_kv_cache(model, batch, device)  an empty key-value cache for ``run_to_layer(cache=)``
    hf_kv_cache()                    an empty ``DynamicCache`` for a transformers model
    cached_length(cache)             how many positions it holds
    shared_cache(cache, batch)       one prompt's cache, read by ``batch`` rows without copies
    KV_POS_DIM                       the position dimension of a cache's keys and values
    cache_contents(cache)            each layer's cached keys and values (views)
    cache_holding(model, contents, ...)  a cache already holding given keys and values
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from headsurgeon.backend import MAJOR, Model

__all__ = [
    "KV_POS_DIM",
    "cache_contents",
    "cache_holding",
    "cached_length",
    "hf_kv_cache",
    "new_kv_cache",
    "shared_cache",
]


def new_kv_cache(model: Model, batch: int, device: torch.device) -> Any:
    """An empty key-value cache for ``batch`` sequences, as :func:`run_to_layer`'s ``cache``.

    3.x: TransformerLens's ``TransformerLensKeyValueCache``; 4.x: Hugging Face's
    ``DynamicCache``, which the bridge's attention extends (TransformerLens 4.x keeps none). Both
    keep each layer's keys and values in a buffer that doubles when full, so adding a block of
    positions copies that block only: their own ``torch.cat`` copies every earlier position
    again (65,536 tokens in blocks of 16: 490 s of copying alone, measured).
    """
    if MAJOR >= 4:
        return hf_kv_cache()
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    cache = TransformerLensKeyValueCache.init_cache(model.cfg, device, batch_size=batch)
    grow = _growing_entry_class()
    cache.entries = [grow(e.past_keys, e.past_values, e.frozen) for e in cache.entries]
    return cache


def hf_kv_cache() -> Any:
    """An empty Hugging Face ``DynamicCache`` whose layers append into doubling buffers (see
    :func:`new_kv_cache`): what a transformers model (or a 4.x bridge) takes as ``cache=``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = _growing_layer_class()
    return cache


def _appended(store: Tensor | None, current: Tensor, new: Tensor, dim: int) -> Tensor:
    """A buffer whose first ``current.shape[dim] + new.shape[dim]`` positions along ``dim`` are
    ``current`` then ``new``: ``store`` written in place when ``current`` is its front part and
    it has room, else a new buffer of twice the size."""
    length, added = current.shape[dim], new.shape[dim]
    owned = (
        store is not None
        and current.data_ptr() == store.data_ptr()
        and current.shape[:dim] == store.shape[:dim]
        and current.dtype == new.dtype
    )
    if not owned or store.shape[dim] < length + added:
        shape = list(new.shape)
        shape[dim] = max(length + added, 2 * length)
        grown = new.new_empty(shape)
        grown.narrow(dim, 0, length).copy_(current)
        store = grown
    store.narrow(dim, length, added).copy_(new)
    return store


@functools.cache
def _growing_entry_class() -> type:
    from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry

    class GrowingEntry(TransformerLensKeyValueCacheEntry):
        """TransformerLens's cache entry, appending into doubling buffers (see new_kv_cache)."""

        stores: tuple[Tensor | None, Tensor | None] = (None, None)

        def append(self, new_keys: Tensor, new_values: Tensor) -> tuple[Tensor, Tensor]:
            if self.frozen:  # shared by continuations: TransformerLens's own copy
                return super().append(new_keys, new_values)
            n = self.past_keys.shape[1] + new_keys.shape[1]
            keys = _appended(self.stores[0], self.past_keys, new_keys, 1)
            values = _appended(self.stores[1], self.past_values, new_values, 1)
            self.stores = (keys, values)
            self.past_keys, self.past_values = keys.narrow(1, 0, n), values.narrow(1, 0, n)
            return self.past_keys, self.past_values

    return GrowingEntry


@functools.cache
def _growing_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """Hugging Face's dynamic cache layer, appending into doubling buffers (new_kv_cache)."""

        stores: tuple[Tensor | None, Tensor | None] = (None, None)

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            n = self.keys.shape[-2] + key_states.shape[-2]
            keys = _appended(self.stores[0], self.keys, key_states, self.keys.dim() - 2)
            values = _appended(self.stores[1], self.values, value_states, self.values.dim() - 2)
            self.stores = (keys, values)
            self.keys, self.values = keys.narrow(-2, 0, n), values.narrow(-2, 0, n)
            return self.keys, self.values

    return GrowingLayer


def cached_length(cache: Any) -> int:
    """How many positions a :func:`new_kv_cache` holds (0 if the attention ignored it)."""
    return cache.get_seq_length() if MAJOR >= 4 else cache.previous_attention_mask.shape[1]


def shared_cache(cache: Any, batch: int) -> Any:
    """A key-value cache holding one prompt, made to serve a call of ``batch`` continuations:
    each row reads the prompt's keys and values (a view, not a copy) and nothing is added.

    3.x: TransformerLens's ``freeze()``, the entries viewed as ``batch`` rows. 4.x: a
    ``DynamicCache`` over the prompt's layers whose ``update`` returns them before the new keys
    and values but keeps none (``DynamicCache`` itself would keep ``batch`` copies).
    """
    if MAJOR < 4:
        cache.freeze()
        for entry in cache.entries:  # 3.x reads the cache as the call's batch
            entry.past_keys = entry.past_keys[:1].expand(batch, -1, -1, -1)
            entry.past_values = entry.past_values[:1].expand(batch, -1, -1, -1)
        cache.previous_attention_mask = cache.previous_attention_mask[:1].expand(batch, -1)
        return cache
    from transformers import DynamicCache

    class Shared(DynamicCache):
        def update(
            self, keys: Tensor, values: Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[Tensor, Tensor]:
            past = self.layers[layer_idx]
            rows = (len(keys), -1, -1, -1)
            return (
                torch.cat([past.keys.expand(rows), keys], dim=-2),
                torch.cat([past.values.expand(rows), values], dim=-2),
            )

    shared = Shared()
    shared.layers = cache.layers  # the lengths, masks and ALiBi positions follow the prompt's
    return shared


# Where a cache keeps positions: 3.x's entries are [batch, pos, head, d_head], Hugging Face's
# layers [batch, head, pos, d_head].
KV_POS_DIM = 1 if MAJOR < 4 else 2


def cache_contents(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """Each layer's keys and values in a :func:`new_kv_cache` (views, positions along
    :data:`KV_POS_DIM`; empty when the attention left the cache empty)."""
    if MAJOR < 4:
        return [(entry.past_keys, entry.past_values) for entry in cache.entries]
    return [(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized]


def cache_holding(
    model: Model, contents: list[tuple[Tensor, Tensor]], batch: int, device: torch.device
) -> Any:
    """A :func:`new_kv_cache` already holding ``contents`` (each layer's keys and values, laid
    out as :func:`cache_contents` gives them, copied in): the next call continues after them,
    as if they were every earlier position. Any subset of earlier positions works for a model
    whose attention reads positions only through the cache's length (ALiBi: the bias then
    treats cache slots as positions, which the caller's bias hook can replace)."""
    cache = new_kv_cache(model, batch, device)
    n_pos = contents[0][0].shape[KV_POS_DIM] if contents else 0
    if not n_pos:
        return cache
    if MAJOR >= 4:
        for layer, (keys, values) in enumerate(contents):
            cache.update(keys, values, layer)
        return cache
    for entry, (keys, values) in zip(cache.entries, contents, strict=True):
        entry.append(keys, values)
    cache.previous_attention_mask = torch.ones(
        batch, n_pos, dtype=cache.previous_attention_mask.dtype, device=device
    )
    return cache
