"""ALiBi as pure tensor math: slopes and bias matrices. No model I/O here.

ALiBi adds ``-m_h * (i - j)`` to the attention logit of query ``i`` on key ``j`` in head ``h``.

Exports:
    slopes(n_heads)                     per-head slopes m_h, exactly as Hugging Face BLOOM
    relative_distance(n_ctx)            the (query, key) matrix of distances i - j (0 above)
    alibi_bias(head_slopes, n_ctx)      the standard bias -m_h * (i - j), [head, query, key]
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor


def slopes(n_heads: int) -> Float[Tensor, "head"]:
    """ALiBi slopes for ``n_heads`` heads, equal to Hugging Face's ``build_alibi_tensor``.

    For a power of two ``H`` the slopes are ``2^(-8(h+1)/H)``. Otherwise the first
    ``2^floor(log2 H)`` heads take that series and the rest take every other element of the series
    for twice as many heads (BLOOM-176B: 112 heads). Computed in float32 with the same operations
    as Hugging Face, so the values agree bit for bit.

    >>> slopes(8)
    tensor([0.5000, 0.2500, 0.1250, 0.0625, 0.0312, 0.0156, 0.0078, 0.0039])
    >>> [round(x, 4) for x in slopes(6).tolist()]
    [0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125]
    >>> round(slopes(16)[0].item(), 4), round(slopes(16)[15].item(), 4)
    (0.7071, 0.0039)
    """
    if not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive integer, got {n_heads!r}")
    closest = 2 ** math.floor(math.log2(n_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    result = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != n_heads:
        extra_base = torch.full(
            (), 2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32
        )
        n_extra = min(closest, n_heads - closest)
        extra_powers = torch.arange(1, 1 + 2 * n_extra, 2, dtype=torch.int32)
        result = torch.cat([result, torch.pow(extra_base, extra_powers)])
    return result


def relative_distance(n_ctx: int) -> Float[Tensor, "query key"]:
    """Distance ``i - j`` from query ``i`` back to key ``j``; 0 for future keys (masked anyway).

    >>> relative_distance(3)
    tensor([[0., 0., 0.],
            [1., 0., 0.],
            [2., 1., 0.]])
    """
    pos = torch.arange(n_ctx)
    return (pos[:, None] - pos[None, :]).clamp(min=0).to(torch.float32)


def alibi_bias(head_slopes: Float[Tensor, "head"], n_ctx: int) -> Float[Tensor, "head query key"]:
    """Standard ALiBi bias ``-m_h * (i - j)`` in float32, laid out like TransformerLens's cache.

    >>> alibi_bias(torch.tensor([0.5]), 3)
    tensor([[[-0.0000, -0.0000, -0.0000],
             [-0.5000, -0.0000, -0.0000],
             [-1.0000, -0.5000, -0.0000]]])
    """
    return -head_slopes.to(torch.float32)[:, None, None] * relative_distance(n_ctx)
