"""The paired statistics of the evaluations: exact McNemar tests and batch-means standard errors.
Pure math, no model I/O.

Both are for paired data: two scorings of the same prompts (with and without a needle, or two
models) or two losses on the same tokens (a cut model against its own). Paired, the prompt's or
the token's own difficulty cancels; intervals of the two sides set side by side would count it
twice and miss differences the pairs show.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from headsurgeon.validation import check_int

__all__ = [
    "SE_BLOCK",
    "batch_means_se",
    "discordant",
    "mcnemar_p",
]

# Predictions per block of batch_means_se: neighbouring tokens of a text are correlated, means of
# 64 consecutive ones much less, so the spread of block means gives the error of the mean.
SE_BLOCK = 64


def mcnemar_p(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value of ``b`` pairs where only the first side is right
    against ``c`` where only the second is (the concordant pairs do not enter).

    Under the null hypothesis each discordant pair goes either way with probability 1/2, so
    ``min(b, c)`` is binomial(``b + c``, 1/2) and ``p = min(1, 2 P(X <= min(b, c)))`` (the
    exact sign test); ``p = 1`` without discordant pairs.

    >>> mcnemar_p(10, 1)  # 2 (C(11, 0) + C(11, 1)) / 2**11 = 24 / 2048
    0.01171875
    >>> mcnemar_p(7, 0), mcnemar_p(0, 6)  # 2 / 2**7; 2 / 2**6
    (0.015625, 0.03125)
    >>> mcnemar_p(3, 3), mcnemar_p(0, 0)
    (1.0, 1.0)
    """
    b, c = check_int(b, "b", minimum=0), check_int(c, "c", minimum=0)
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def discordant(x: Sequence[bool], y: Sequence[bool]) -> tuple[int, int]:
    """The discordant pairs of two paired outcomes: ``(b, c)``, the pairs where ``x`` is right
    and ``y`` wrong, and those where ``y`` is right and ``x`` wrong.

    >>> discordant([True, True, False, False], [False, True, True, False])
    (1, 1)
    """
    x, y = np.asarray(x, dtype=bool), np.asarray(y, dtype=bool)
    return int((x & ~y).sum()), int((~x & y).sum())


def holm(p: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values of a family of ``m`` tests, in the order given: the
    ``k``-th smallest p times ``m - k + 1``, made non-decreasing in that order, at most 1. A
    test is significant at level ``a`` for the whole family when its adjusted p is below ``a``.

    >>> holm([0.01, 0.04, 0.03]).round(4).tolist()  # 0.01 x 3; 0.03 x 2; max(0.04, 0.06)
    [0.03, 0.06, 0.06]
    """
    p = np.asarray(p, dtype=float)
    order = np.argsort(p, kind="stable")
    scaled = p[order] * (len(p) - np.arange(len(p)))
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return adjusted


def batch_means_se(values: Float[Tensor, "seq pos"], block: int = SE_BLOCK) -> float:
    """Standard error of the mean of ``values`` (one row per sequence, its predictions in order)
    by batch means: each row cut into blocks of ``block`` consecutive predictions (the last one
    may be shorter), the standard deviation of the block means (``n - 1``) over the square root
    of their number. NaN with fewer than two blocks. For a paired difference (a ΔNLL: two losses
    on the same tokens) it is the error of the mean difference.

    >>> values = torch.tensor([[1.0, 1.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    >>> round(batch_means_se(values, block=2), 6)  # block means 1, 3, 2, 2: sqrt(2/3) / 2
    0.408248
    >>> batch_means_se(values[:1, :2], block=2)
    nan
    """
    means = torch.cat([part.mean(-1) for part in values.double().split(block, dim=-1)])
    if means.numel() < 2:
        return math.nan
    return (means.std() / math.sqrt(means.numel())).item()


def nll_change(
    delta: Float[Tensor, "seq pos"], base: Float[Tensor, "seq pos"]
) -> dict[str, float | int]:
    """The ΔNLL columns every ``*_effect`` verb reports for a set of predictions: ``tokens``,
    ``base_nll`` (the mean of ``base``, the model's own NLL), ``dnll`` (the mean of ``delta``,
    the changed NLL minus ``base`` on the same tokens) and ``dnll_se``
    (:func:`batch_means_se` of ``delta``: paired, so the tokens' own difficulty cancels).

    >>> row = nll_change(torch.full((2, 128), 0.5), torch.full((2, 128), 3.0))
    >>> row["tokens"], row["base_nll"], row["dnll"], row["dnll_se"]
    (256, 3.0, 0.5, 0.0)
    """
    return {
        "tokens": delta.numel(),
        "base_nll": base.double().mean().item(),
        "dnll": delta.double().mean().item(),
        "dnll_se": batch_means_se(delta),
    }
