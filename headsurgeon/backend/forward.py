"""Forward passes cut at a block on TransformerLens 3.x and 4.x models: the residual stream after
a block (from the tokens, or from a later block's input), or the logits from a block on; the part
of :mod:`headsurgeon.backend` that runs models.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon.backend import BACKEND, Model

__all__ = ["resumes_at_layer", "run_from_layer", "run_layers", "run_to_layer"]


def run_to_layer(
    model: Model, tokens: Int[Tensor, "batch pos"], stop_at_layer: int, *, cache: Any = None
) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream after block ``stop_at_layer - 1``; no later block, no unembedding.

    Hooks already on the model fire as usual. (4.x's own ``stop_at_layer`` runs the final
    LayerNorm and unembedding when it equals the number of layers.) With ``cache`` (from
    :func:`new_kv_cache`) the tokens continue the cached positions, and the cache grows by them.
    """
    return BACKEND.run_to_layer(model, tokens, stop_at_layer, cache)


def run_from_layer(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    resid_pre: Float[Tensor, "batch pos d_model"],
    start_at_layer: int,
) -> Float[Tensor, "batch pos d_vocab"]:
    """The logits of a pass whose block ``start_at_layer`` gets ``resid_pre`` as its input.

    3.x starts at that block. 4.x's own ``start_at_layer`` gives wrong logits on BLOOM (off by
    2.4 nats at block 0 on the organism) and runs the earlier blocks anyway: here the pass runs
    from ``tokens`` and a hook swaps ``resid_pre`` in.
    """
    return BACKEND.run_from_layer(model, tokens, resid_pre, start_at_layer)


def resumes_at_layer(model: Model) -> bool:
    """Whether :func:`run_layers` can start a pass at a block without running the blocks
    before it: TransformerLens 3.x yes; 4.x no (its bridge runs the Hugging Face model from the
    tokens, every block)."""
    return BACKEND.resumes_at_layer


def run_layers(
    model: Model,
    resid_pre: Float[Tensor, "batch pos d_model"],
    start_at_layer: int,
    stop_at_layer: int,
    *,
    cache: Any = None,
) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream after block ``stop_at_layer - 1`` of a pass whose block
    ``start_at_layer`` gets ``resid_pre``: only those blocks run; no unembedding.

    Hooks on those blocks fire as usual. With ``cache`` (from
    :func:`~headsurgeon.backend.cache.cache_holding` with ``first_layer=start_at_layer``) the
    positions continue the cached ones in those blocks, and the cache grows by them: the same
    numbers as :func:`run_to_layer` from the tokens when ``resid_pre`` is what its earlier blocks
    give. Refused (:class:`~headsurgeon.errors.UnsupportedArchitectureError`) where
    :func:`resumes_at_layer` is false.
    """
    return BACKEND.run_layers(model, resid_pre, start_at_layer, stop_at_layer, cache)
