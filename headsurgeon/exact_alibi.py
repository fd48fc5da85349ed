"""The exact-ALiBi patch and the attention bias protocol that it and the mitigations share.

TransformerLens 3.x computes ALiBi slopes with the power-of-two formula ``2^(-8(h+1)/H)`` for
every head count ``H``; Hugging Face BLOOM interleaves a second series when ``H`` is not a power of
two. Models from :func:`headsurgeon.loading.load_model` get Hugging Face's exact slopes through a
forward pre-hook on each attention module (:func:`install_exact_alibi`). The same protocol, a
pre-hook that puts a bias tensor built for the call's query and key counts in place
(:func:`bias_pre_hook`, :func:`shared_bias`), is how :func:`headsurgeon.blindness.mitigation`
changes the bias.

Exports:
    alibi_slopes(model)                      the ALiBi slopes a model applies, read from it
    use_exact_alibi(model)                   Hugging Face's ALiBi slopes for any head count
    install_exact_alibi(model)               the same, silently (for models built from checkpoints)
    inexact_slopes(model)                    why a model's slopes are not BLOOM's, or None
    bias_pre_hook(build), shared_bias(...)   the attention pre-hook protocol for ALiBi biases
    BiasBuilder                              the type of a bias builder
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import HookedTransformer

from headsurgeon import alibi
from headsurgeon.errors import UnsupportedArchitectureError

__all__ = [
    "BiasBuilder",
    "alibi_slopes",
    "bias_pre_hook",
    "inexact_slopes",
    "install_exact_alibi",
    "shared_bias",
    "use_exact_alibi",
]

_ATTENTION_ARGS = ("query_input", "key_input", "value_input", "past_kv_cache_entry")

# Builds the [head, query, key] bias for the last n_queries of n_keys positions on a device.
BiasBuilder = Callable[[int, int, torch.device], Float[Tensor, "head_index query_pos key_pos"]]


def bias_pre_hook(build: BiasBuilder) -> Callable[[torch.nn.Module, tuple, dict], None]:
    """A forward pre-hook for an attention module that puts ``build``'s bias in place.

    TransformerLens adds ``module.alibi[:, -query_ctx:, :key_ctx]`` and rebuilds the tensor with
    its power-of-two slopes only when ``key_ctx`` outgrows it. A tensor holding exactly this call's
    rows is used as is, and keeps ``hook_attn_scores`` equal to ``q.k/sqrt(d) + bias``: a longer
    cached one would shift every row by a constant (harmless to the softmax, wrong logits).
    Hooks run in registration order, so the last one registered decides the bias.
    """

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
        cache_entry = inputs.get("past_kv_cache_entry")
        # Position is dim 1 with or without split per-head inputs ([batch, pos, (head,) d_model]).
        n_queries = inputs["query_input"].shape[1]
        n_keys = inputs["key_input"].shape[1]
        if cache_entry is not None:
            n_keys += cache_entry.past_keys.shape[1]
        module.alibi = build(n_queries, n_keys, inputs["query_input"].device)

    return hook


@functools.lru_cache(maxsize=8)
def shared_bias(
    kind: str,
    params: tuple[tuple[str, Any], ...],
    head_slopes: tuple[float, ...],
    n_queries: int,
    n_keys: int,
    device: torch.device,
) -> Float[Tensor, "head_index query_pos key_pos"]:
    """One bias tensor per kind and shape, shared by all layers (TransformerLens only reads it).

    ``params`` and ``head_slopes`` are tuples so that the call can be cached.
    """
    distance = alibi.distance_rows(n_queries, n_keys, device)
    return alibi.bias_from_distance(kind, torch.tensor(head_slopes), distance, **dict(params))


def install_exact_alibi(model: HookedTransformer) -> None:
    """The exact-slope pre-hook on every attention layer, silently (idempotent)."""
    head_slopes = tuple(alibi.slopes(model.cfg.n_heads).tolist())
    build = functools.partial(shared_bias, "standard", (), head_slopes)
    for block in model.blocks:
        attn = block.attn
        if getattr(attn, "headsurgeon_alibi_hook", None) is None:
            attn.headsurgeon_alibi_hook = attn.register_forward_pre_hook(
                bias_pre_hook(build), with_kwargs=True
            )
        attn.alibi = None


def use_exact_alibi(model: HookedTransformer) -> None:
    """Give every attention layer Hugging Face's exact ALiBi slopes (idempotent).

    **This changes the model's outputs** whenever its head count is not a power of two:
    TransformerLens 3.x uses ``2^(-8(h+1)/H)`` for every ``H``, Hugging Face BLOOM interleaves a
    second series (a random 6-head model's logits moved by ~1 here). Call it to make a model built
    from a TransformerLens config compute what the BLOOM checkpoint it stands for computes
    (models from :func:`~headsurgeon.loading.load_model` have it already); a warning says when
    the slopes change. Nothing in headsurgeon needs it: every tool reads the slopes the model
    uses (:func:`alibi_slopes`).

    A forward pre-hook on each attention module, so ``model.reset_hooks()`` keeps it; its handle
    is ``block.attn.headsurgeon_alibi_hook``.
    """
    if model.cfg.positional_embedding_type != "alibi":
        raise UnsupportedArchitectureError(
            f"use_exact_alibi applies to ALiBi models; this one uses "
            f"{model.cfg.positional_embedding_type} positions"
        )
    before, exact = alibi_slopes(model), alibi.slopes(model.cfg.n_heads)
    if not torch.equal(before, exact):
        warnings.warn(
            "use_exact_alibi changes this model's ALiBi slopes from "
            f"{_rounded(before)} to Hugging Face's {_rounded(exact)}: its outputs change",
            stacklevel=2,
        )
    install_exact_alibi(model)


def _rounded(values: Tensor) -> list[float]:
    return [float(f"{x:.3g}") for x in values.tolist()]


def alibi_slopes(model: HookedTransformer) -> Float[Tensor, " head_index"]:
    """The ALiBi slopes ``model`` applies (float32), read from the model, never assumed.

    Models from :func:`~headsurgeon.loading.load_model` (and after :func:`use_exact_alibi`) use
    Hugging Face's exact slopes; any other HookedTransformer uses what its attention class builds
    (TransformerLens 3.x: ``2^(-8(h+1)/H)`` for every head count ``H``, exact only for powers of
    two). Mitigations (:func:`headsurgeon.blindness.mitigation`) change the bias, not these
    slopes.

    >>> from transformer_lens import HookedTransformerConfig
    >>> cfg = HookedTransformerConfig(n_layers=1, d_model=24, n_heads=6, d_head=4, n_ctx=8,
    ...                               d_vocab=9, act_fn="gelu_new",
    ...                               positional_embedding_type="alibi")
    >>> [round(x, 4) for x in alibi_slopes(HookedTransformer(cfg)).tolist()]
    [0.3969, 0.1575, 0.0625, 0.0248, 0.0098, 0.0039]
    """
    if model.cfg.positional_embedding_type != "alibi":
        raise UnsupportedArchitectureError(
            f"the model uses {model.cfg.positional_embedding_type} positions, not ALiBi; "
            "it has no ALiBi slopes"
        )
    attn = model.blocks[0].attn
    if getattr(attn, "headsurgeon_alibi_hook", None) is not None:
        return alibi.slopes(model.cfg.n_heads)
    # The bias the attention class itself builds for two positions: row 1 is [-m_h, 0].
    bias = type(attn).create_alibi_bias(model.cfg.n_heads, 2, "cpu")
    return -bias[:, 1, 0].to(torch.float32)


def inexact_slopes(model: HookedTransformer) -> str | None:
    """Why ``model``'s ALiBi slopes are not BLOOM's for its head count, in words; else None.

    None too for a model without ALiBi (it has no slopes to compare).
    """
    cfg = model.cfg
    if cfg.positional_embedding_type != "alibi":
        return None
    applied, exact = alibi_slopes(model), alibi.slopes(cfg.n_heads)
    if torch.allclose(applied, exact, rtol=1e-6, atol=0.0):
        return None
    return (
        f"ALiBi slopes {_rounded(applied)} are not BLOOM's for {cfg.n_heads} heads "
        f"{_rounded(exact)} (TransformerLens's power-of-two formula): "
        "headsurgeon.exact_alibi.use_exact_alibi(model) switches them, changing its outputs"
    )
