"""What both TransformerLens majors' backends (:mod:`~headsurgeon.backend.tl3`,
:mod:`~headsurgeon.backend.tl4`) build on: the record of a per-head view of a weight, the doubling
buffer of their key-value caches, Hugging Face's cache made to use it, and the ALiBi bias pre-hook
of a transformers attention layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from headsurgeon.families import attention_family

__all__ = [
    "appended",
    "hf_kv_cache",
]

HEAD_TENSORS = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O")


def supported_models(major: int, others: str) -> str:
    """What headsurgeon loads on TransformerLens ``major``, in words; ``others`` ends the list."""
    return (
        "headsurgeon loads BLOOM (model_type bloom, BloomForCausalLM) and the causal language "
        f"models TransformerLens {major}.x converts (e.g. LlamaForCausalLM, GPTNeoXForCausalLM, "
        f"OPTForCausalLM{others})"
    )


def fused_config_refusal(cfg: Any) -> str | None:
    """Why a model of TransformerLens config ``cfg`` cannot take the fused attention on either
    major (positions, dtype, device), or None."""
    if cfg.positional_embedding_type != "alibi":
        return f"its positions are {cfg.positional_embedding_type}, not ALiBi"
    if cfg.dtype not in (torch.float32, torch.float64):
        return f"it computes in {cfg.dtype} (the fused path: float32, float64)"
    if torch.device(cfg.device or "cpu").type != "cpu":
        return f"it runs on {cfg.device} (the fused path is checked on CPU only)"
    return None


def unfired_hook(attn: nn.Module, layer: int) -> str | None:
    """A hook on ``attn``'s scores or pattern, which the fused attention would not fire, in
    words, or None."""
    for name in ("hook_attn_scores", "hook_pattern"):
        point = getattr(attn, name)
        if point._forward_hooks or point._backward_hooks or point._forward_pre_hooks:
            return f"a hook on blocks.{layer}.attn.{name} would not fire"
    return None


@contextlib.contextmanager
def held_pre_hooks(modules: Sequence[nn.Module], kind: type) -> Iterator[list[bool]]:
    """Each module's forward pre-hooks of class ``kind`` taken off for the ``with`` block, and
    every module's pre-hooks put back as they were after it (an exception too); yields, per
    module, whether it held one."""
    saved = [(module, module._forward_pre_hooks.copy()) for module in modules]
    held = []
    for module in modules:
        ours = [key for key, hook in module._forward_pre_hooks.items() if isinstance(hook, kind)]
        for key in ours:
            del module._forward_pre_hooks[key]
        held.append(bool(ours))
    try:
        yield held
    finally:
        for module, hooks in saved:
            module._forward_pre_hooks.clear()
            module._forward_pre_hooks.update(hooks)


# A fused attention's head outputs (hook_z) from one layer's hook_q/k/v, [batch, pos, head,
# d_head]: attend(layer, q, k, v, slopes= or key_bias=, scale=), as backend.fused's functions.
Attend = Callable[..., Float[Tensor, "batch pos head_index d_head"]]

BiasBuilder = Callable[[int, int, torch.device], Float[Tensor, "head_index query_pos key_pos"]]

# A key-value cache's contents: each layer's keys and values (``backend.cache.cache_contents``).
KVContents = list[tuple[Tensor, Tensor]]


@dataclasses.dataclass(frozen=True)
class HeadTensor:
    """One per-head attention tensor: the parameter the forward pass uses, and how to see it
    with heads first in TransformerLens 3.x's layout (``W_Q``: ``[head, d_model, d_head]``).

    ``heads(t)`` is a view of ``t`` (the parameter, a mask or a copy of the same shape), so
    writing ``heads(t)[h]`` writes head ``h``'s slice of ``t``.
    """

    name: str
    path: str
    param: nn.Parameter
    heads: Callable[[Tensor], Tensor]


def appended(store: Tensor | None, current: Tensor, new: Tensor, dim: int) -> Tensor:
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


def hf_kv_cache() -> Any:
    """An empty Hugging Face ``DynamicCache`` whose layers append into doubling buffers
    (:func:`appended`): what a transformers model (or a 4.x bridge) takes as ``cache=``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = _growing_layer_class()
    return cache


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
            keys = appended(self.stores[0], self.keys, key_states, self.keys.dim() - 2)
            values = appended(self.stores[1], self.values, value_states, self.values.dim() - 2)
            self.stores = (keys, values)
            self.keys, self.values = keys.narrow(-2, 0, n), values.narrow(-2, 0, n)
            return self.keys, self.values

    return GrowingLayer


class HFBiasHook:
    """:func:`headsurgeon.backend.hf_bias_pre_hook`'s hook: a class, not a closure, so that a
    model carrying it can be pickled (``torch.save(model)``, ``copy.deepcopy``) whenever
    ``build`` can."""

    def __init__(self, build: BiasBuilder) -> None:
        self.build = build

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        batch, n_queries = hidden.shape[:2]
        family = attention_family(module)  # each takes its bias through another argument
        key_count = kwargs.get(family.bias_argument)
        n_keys = n_queries if key_count is None else key_count.shape[-1]
        bias = self.build(n_queries, n_keys, hidden.device).to(hidden.dtype)
        return args, family.with_bias(kwargs, bias, batch)
