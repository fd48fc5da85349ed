"""Per-head views of the attention weights on TransformerLens 3.x and 4.x models, and the weights
under 3.x's names: the part of :mod:`headsurgeon.backend` that reads and writes parameters.

3.x keeps ``W_Q`` ... ``W_O`` as per-head parameters; a 4.x bridge splits the fused QKV into
``q``/``k``/``v`` linear layers, whose per-head views
:class:`~headsurgeon.backend.tl4.TransformerLens4` builds.
"""

from __future__ import annotations

import torch  # noqa: F401  (the doctests use it)
from torch import Tensor

from headsurgeon.backend import BACKEND, Model
from headsurgeon.backend.shared import HeadTensor
from headsurgeon.errors import UnsupportedArchitectureError

__all__ = [
    "head_tensors",
    "tl_state_dict",
]


def head_tensors(model: Model, layer: int) -> dict[str, HeadTensor]:
    """``{name: HeadTensor}`` for ``W_Q, W_K, W_V, b_Q, b_K, b_V, W_O`` of one layer: those the
    model has. Attention without biases (MPT, Falcon with ``bias=False``) has no ``b_Q``, ``b_K``,
    ``b_V``: callers iterate over what is there, or test ``name in tensors``.

    On 4.x every family's bridge (BLOOM, MPT, Falcon-ALiBi) splits its fused QKV into ``q``/``k``/
    ``v`` linear layers, each ``[head * d_head, d_model]`` with heads in order (the forward pass
    reads those, never the stale fused copy), and ``o`` is the Hugging Face output projection:
    the views are the same for all three.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    >>> w = head_tensors(model, 0)["W_Q"]
    >>> tuple(w.heads(w.param).shape), torch.equal(w.heads(w.param), model.blocks[0].attn.W_Q)
    ((4, 32, 8), True)
    """
    check_head_tensors(model)
    return BACKEND.head_tensors(model, layer)


def check_head_tensors(model: Model) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless every head has its own Q/K/V/O.

    Q/K/V biases may be absent (all three or none); keys and values shared by several heads
    (Falcon's ``multi_query``, grouped KV, ``new_decoder_architecture``) are refused, naming it.
    """
    reason = _shared_kv(model) or BACKEND.unsplit(model)
    if reason is not None:
        raise UnsupportedArchitectureError(
            f"{type(model.blocks[0].attn).__name__} has {reason}; head surgery needs every head "
            "to have its own query, key, value and output slices"
        )


def _shared_kv(model: Model) -> str | None:
    """Why the heads share keys and values, or None if each head has its own."""
    config = BACKEND.original_config(model)  # read at every head_tensors
    n_kv = getattr(model.cfg, "n_key_value_heads", None)
    if getattr(config, "new_decoder_architecture", False):
        # Its fused QKV is grouped per KV head; TransformerLens 4.3 splits it as [Q; K; V].
        return "Falcon's new_decoder_architecture (grouped key-value heads)"
    if getattr(config, "multi_query", False):
        return f"multi-query attention (all {model.cfg.n_heads} heads share one key and value)"
    if n_kv not in (None, model.cfg.n_heads):
        return f"grouped-query attention ({n_kv} key-value heads for {model.cfg.n_heads} heads)"
    return None


def check_unprocessed(model: Model) -> None:
    """Raise :class:`UnsupportedArchitectureError` if a 4.x bridge's ``process_weights`` ran.

    Its forward then skips the LayerNorm parameters it folded, so they no longer say what the
    model computes. (3.x records processing in ``cfg.normalization_type``: ``LNPre``.)
    """
    if BACKEND.processed(model):
        raise UnsupportedArchitectureError(
            "the model has processed weights (process_weights folded LayerNorm into the next "
            "layer); load it with headsurgeon.load_model, which keeps weights unprocessed"
        )


def tl_state_dict(model: Model) -> dict[str, Tensor]:
    """The weights under TransformerLens 3.x's names and layouts (``blocks.0.attn.W_Q``, ...).

    3.x: ``model.state_dict()``. 4.x (BLOOM): assembled from the tensors the bridge's forward pass
    uses (its ``q``/``k``/``v`` layers, not the stale fused ``qkv`` copy); a bridge whose weights
    ``process_weights`` folded (its LayerNorm parameters are then unused) raises.
    """
    check_unprocessed(model)
    return BACKEND.tl_state_dict(model)
