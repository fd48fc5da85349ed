"""Per-head views of the attention weights on TransformerLens 3.x and 4.x models, and the weights
under 3.x's names: the part of :mod:`headsurgeon.backend` that reads and writes parameters.

3.x keeps ``W_Q`` ... ``W_O`` as per-head parameters; a 4.x bridge splits the fused QKV into
``q``/``k``/``v`` linear layers, whose per-head views are built here.

Exports:
    HEAD_TENSORS                     the per-head attention tensors, TransformerLens 3.x names
    HeadTensor, head_tensors(model, layer)   per-head views of the parameters attention uses
    check_head_tensors(model)        one-line error unless every head has its own Q/K/V/O
    check_unprocessed(model)         one-line error if a 4.x bridge's weights were processed
    tl_state_dict(model)             the weights under TransformerLens 3.x's names and layouts
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch  # noqa: F401  (the doctests use it)
from torch import Tensor, nn

from headsurgeon.backend import MAJOR, Model
from headsurgeon.errors import UnsupportedArchitectureError

__all__ = [
    "HEAD_TENSORS",
    "HeadTensor",
    "check_head_tensors",
    "check_unprocessed",
    "head_tensors",
    "tl_state_dict",
]

HEAD_TENSORS = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O")


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


def _same(t: Tensor) -> Tensor:
    return t


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
    attn = model.blocks[layer].attn
    if MAJOR < 4:
        return {
            name: HeadTensor(name, f"blocks.{layer}.attn.{name}", getattr(attn, name), _same)
            for name in HEAD_TENSORS
        }
    n, d_head, d_model = model.cfg.n_heads, model.cfg.d_head, model.cfg.d_model
    paths = _parameter_paths(model)
    out = {}
    for x in "QKV":
        linear = getattr(attn, x.lower()).original_component
        out[f"W_{x}"] = HeadTensor(
            f"W_{x}",
            paths[id(linear.weight)],
            linear.weight,
            lambda t: t.view(n, d_head, d_model).transpose(1, 2),
        )
        if linear.bias is not None:
            out[f"b_{x}"] = HeadTensor(
                f"b_{x}", paths[id(linear.bias)], linear.bias, lambda t: t.view(n, d_head)
            )
    dense = attn.o.original_component.weight
    out["W_O"] = HeadTensor(
        "W_O", paths[id(dense)], dense, lambda t: t.view(d_model, n, d_head).permute(1, 2, 0)
    )
    return {name: out[name] for name in HEAD_TENSORS if name in out}


def _parameter_paths(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def check_head_tensors(model: Model) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless every head has its own Q/K/V/O.

    Q/K/V biases may be absent (all three or none); keys and values shared by several heads
    (Falcon's ``multi_query``, grouped KV, ``new_decoder_architecture``) are refused, naming it.
    """
    reason = _shared_kv(model) or _unsplit(model)
    if reason is not None:
        raise UnsupportedArchitectureError(
            f"{type(model.blocks[0].attn).__name__} has {reason}; head surgery needs every head "
            "to have its own query, key, value and output slices"
        )


def _shared_kv(model: Model) -> str | None:
    """Why the heads share keys and values, or None if each head has its own."""
    config = model.original_model.config if MAJOR >= 4 else None  # read at every head_tensors
    n_kv = getattr(model.cfg, "n_key_value_heads", None)
    if getattr(config, "new_decoder_architecture", False):
        # Its fused QKV is grouped per KV head; TransformerLens 4.3 splits it as [Q; K; V].
        return "Falcon's new_decoder_architecture (grouped key-value heads)"
    if getattr(config, "multi_query", False):
        return f"multi-query attention (all {model.cfg.n_heads} heads share one key and value)"
    if n_kv not in (None, model.cfg.n_heads):
        return f"grouped-query attention ({n_kv} key-value heads for {model.cfg.n_heads} heads)"
    return None


def _unsplit(model: Model) -> str | None:
    """Why the attention has no per-head Q/K/V/O tensors (3.x parameters, 4.x linear layers)."""
    attn = model.blocks[0].attn
    if MAJOR < 4:
        if all(isinstance(getattr(attn, name, None), nn.Parameter) for name in HEAD_TENSORS):
            return None
        return f"no per-head {', '.join(HEAD_TENSORS)} parameters (quantised attention?)"
    linears = [getattr(getattr(attn, x, None), "original_component", None) for x in "qkvo"]
    width = model.cfg.n_heads * model.cfg.d_head
    if not all(isinstance(m, nn.Linear) for m in linears):
        return "no separate q, k, v and o linear layers (fused or quantised attention)"
    if any(m.weight.shape != (width, model.cfg.d_model) for m in linears[:3]):
        return "query, key or value projections narrower than n_heads x d_head"
    if len({m.bias is None for m in linears[:3]}) > 1:
        return "biases on some of its query, key and value projections but not all"
    return None


def check_unprocessed(model: Model) -> None:
    """Raise :class:`UnsupportedArchitectureError` if a 4.x bridge's ``process_weights`` ran.

    Its forward then skips the LayerNorm parameters it folded, so they no longer say what the
    model computes. (3.x records processing in ``cfg.normalization_type``: ``LNPre``.)
    """
    if MAJOR >= 4 and getattr(model, "_weights_processed", False):  # TransformerLens's flag
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
    if MAJOR < 4:
        return model.state_dict()
    check_unprocessed(model)
    sd = {
        "embed.W_E": model.embed.original_component.weight,
        "embed.ln.w": model.embed_ln.original_component.weight,
        "embed.ln.b": model.embed_ln.original_component.bias,
        "ln_final.w": model.ln_final.original_component.weight,
        "ln_final.b": model.ln_final.original_component.bias,
        "unembed.W_U": model.unembed.original_component.weight.T,
        "unembed.b_U": model.unembed.b_U,  # a zero buffer: BLOOM has no unembedding bias
    }
    for layer, block in enumerate(model.blocks):
        p = f"blocks.{layer}."
        for name, tensor in head_tensors(model, layer).items():
            sd[p + "attn." + name] = tensor.heads(tensor.param)
        sd[p + "attn.b_O"] = block.attn.o.original_component.bias
        for ln in ("ln1", "ln2"):
            sd[p + f"{ln}.w"] = getattr(block, ln).original_component.weight
            sd[p + f"{ln}.b"] = getattr(block, ln).original_component.bias
        mlp_in, mlp_out = (
            block.mlp.original_component.dense_h_to_4h,
            block.mlp.original_component.dense_4h_to_h,
        )
        sd[p + "mlp.W_in"], sd[p + "mlp.b_in"] = mlp_in.weight.T, mlp_in.bias
        sd[p + "mlp.W_out"], sd[p + "mlp.b_out"] = mlp_out.weight.T, mlp_out.bias
    return {k: v.detach() for k, v in sd.items()}
