"""Forward passes cut at a block on TransformerLens 3.x and 4.x models: the residual stream after
a block, or the logits from a block on; the part of :mod:`headsurgeon.backend` that runs models.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon.backend import BACKEND, Model

__all__ = ["run_from_layer", "run_to_layer"]


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
