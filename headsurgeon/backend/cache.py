"""Key-value caches on TransformerLens 3.x and 4.x models: made empty or already holding given
keys and values, measured, shared by a batch of continuations, read back; the part of
:mod:`headsurgeon.backend` that :func:`~headsurgeon.backend.forward.run_to_layer`'s ``cache``
and the blocked long-context path use.

3.x keeps TransformerLens's ``TransformerLensKeyValueCache`` (entries ``[batch, pos, head,
d_head]``); 4.x a Hugging Face ``DynamicCache`` (layers ``[batch, head, pos, d_head]``). Both
grow into doubling buffers here, so a long sequence in blocks copies each block once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headsurgeon.backend import BACKEND, Model
from headsurgeon.backend.shared import hf_kv_cache

__all__ = [
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
    return BACKEND.new_kv_cache(model, batch, device)


def cached_length(cache: Any) -> int:
    """How many positions a :func:`new_kv_cache` holds (0 if the attention ignored it)."""
    return BACKEND.cached_length(cache)


def shared_cache(cache: Any, batch: int) -> Any:
    """A key-value cache holding one prompt, made to serve a call of ``batch`` continuations:
    each row reads the prompt's keys and values (a view, not a copy) and nothing is added.

    3.x: TransformerLens's ``freeze()``, the entries viewed as ``batch`` rows. 4.x: a
    ``DynamicCache`` over the prompt's layers whose ``update`` returns them before the new keys
    and values but keeps none (``DynamicCache`` itself would keep ``batch`` copies).
    """
    return BACKEND.shared_cache(cache, batch)


# Where a cache keeps positions: 3.x's entries are [batch, pos, head, d_head], Hugging Face's
# layers [batch, head, pos, d_head].
KV_POS_DIM = BACKEND.kv_pos_dim


def cache_contents(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """Each layer's keys and values in a :func:`new_kv_cache` (views, positions along
    :data:`KV_POS_DIM`; empty when the attention left the cache empty)."""
    return BACKEND.cache_contents(cache)


def cache_holding(
    model: Model,
    contents: list[tuple[Tensor, Tensor]],
    batch: int,
    device: torch.device,
    *,
    first_layer: int = 0,
) -> Any:
    """A :func:`new_kv_cache` already holding ``contents`` (the keys and values of each layer
    from ``first_layer`` on, laid out as :func:`cache_contents` gives them, copied in): the next
    call continues after them, as if they were every earlier position. Any subset of earlier
    positions works for a model whose attention reads positions only through the cache's length
    (ALiBi: the bias then treats cache slots as positions, which the caller's bias hook can
    replace). ``first_layer`` > 0: for :func:`~headsurgeon.backend.forward.run_layers`."""
    cache = new_kv_cache(model, batch, device)
    if not (contents and contents[0][0].shape[KV_POS_DIM]):
        return cache
    return BACKEND.fill_cache(cache, contents, batch, device, first_layer)
