"""The ALiBi slopes a model applies, read from its record, and switching a model to exact ones.

Which formula applies is decided in one place, :func:`headsurgeon.loading.facts.applied_slopes`;
the formulas are pure math in :mod:`headsurgeon.alibi`, and which family applies which is
:mod:`headsurgeon.families`.
"""

from __future__ import annotations

import warnings

import torch
from jaxtyping import Float
from torch import Tensor

from headsurgeon import families
from headsurgeon.backend import Model
from headsurgeon.errors import UnsupportedArchitectureError
from headsurgeon.exact_alibi import install_exact_alibi
from headsurgeon.inuse import holds_model
from headsurgeon.loading.facts import ModelInfo, model_info

__all__ = [
    "alibi_slopes",
    "use_exact_alibi",
]


def alibi_slopes(model: Model) -> Float[Tensor, " head_index"]:
    """The ALiBi slopes ``model`` applies (float32), read from the model, never assumed: the
    ``slopes`` field of :func:`~headsurgeon.loading.model_info`, refused in one line for a model
    without ALiBi.

    Models from :func:`~headsurgeon.loading.load_model` (and after :func:`use_exact_alibi`) use
    Hugging Face's exact slopes; any other model uses what its attention class builds
    (TransformerLens 3.x: ``2^(-8(h+1)/H)`` for every head count ``H``, exact only for powers of
    two). Mitigations (:func:`headsurgeon.blindness.mitigation`) change the bias, not these
    slopes.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=6, d_model=24, d_vocab=9, n_ctx=8))
    >>> [round(x, 4) for x in alibi_slopes(model).tolist()]
    [0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125]
    """
    info = model_info(model, "alibi_slopes")
    if info.slopes is None:
        raise UnsupportedArchitectureError(
            f"the model uses {info.shape.positional} positions, not ALiBi; it has no ALiBi slopes"
        )
    return info.slopes


@holds_model("use_exact_alibi")
def use_exact_alibi(model: Model) -> None:
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
    info = model_info(model, "use_exact_alibi")
    if info.slopes is None:
        raise UnsupportedArchitectureError(
            f"use_exact_alibi applies to ALiBi models; this one uses {info.shape.positional} "
            "positions"
        )
    exact = _exact(info)
    if not torch.equal(info.slopes, exact):
        warnings.warn(
            "use_exact_alibi changes this model's ALiBi slopes from "
            f"{_rounded(info.slopes)} to Hugging Face's {_rounded(exact)}: its outputs change",
            stacklevel=2,
        )
    install_exact_alibi(model)


def inexact_slopes(info: ModelInfo) -> str | None:
    """Why the slopes of the model ``info`` describes are not BLOOM's for its head count, in
    words; else None (None too for a model without ALiBi: it has no slopes to compare)."""
    if info.slopes is None:
        return None
    exact = _exact(info)
    if torch.allclose(info.slopes, exact, rtol=1e-6, atol=0.0):
        return None
    return (
        f"ALiBi slopes {_rounded(info.slopes)} are not BLOOM's for {info.shape.n_heads} heads "
        f"{_rounded(exact)} (TransformerLens's power-of-two formula): "
        "headsurgeon.loading.use_exact_alibi(model) switches them, changing its outputs"
    )


def _exact(info: ModelInfo) -> Tensor:
    return families.transformers_slopes(info.hf_config, info.shape.n_heads)


def _rounded(values: Tensor) -> list[float]:
    return [float(f"{x:.3g}") for x in values.tolist()]
