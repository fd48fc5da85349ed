"""The code of :func:`headsurgeon.blindness.analytic_rounding`: how finely each head's ALiBi
bias is stored in each dtype, from the slopes alone (exported by
:mod:`headsurgeon.blindness`, whose docstring is the manual; kept apart from
:mod:`headsurgeon.blindness.analysis` by size only).

>>> by_head = analytic_rounding("bloom-560m", dtypes=["bfloat16"]).by_head
>>> by_head.loc[[0, 15], ["slope", "first_position_step_over_0.1", "first_position_step_over_1"]]
       slope  first_position_step_over_0.1  first_position_step_over_1
0   0.707107                          23.0                       362.0
15  0.003906                        4089.0                     65409.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from headsurgeon import families
from headsurgeon.backend import Model
from headsurgeon.blindness.analysis import ANALYSED_DTYPES, alibi_door, dtype_name
from headsurgeon.dtypes import parse_dtype
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.validation import check_int, check_number

__all__ = [
    "RoundingAnalysis",
    "analytic_rounding",
]


# Positions searched for the first-position thresholds (2^40 tokens: beyond any context).
MAX_POSITION = 2**40
ROUNDING_THRESHOLDS = (0.1, 1.0)

# The relative form (headsurgeon's bias hook) in words for the tables' attrs; each family's own
# absolute form is its families.AlibiFamily.own_form_words.
_RELATIVE = "slope x distance from the query in float32, cast to the dtype (the bias hook)"


@dataclasses.dataclass
class RoundingAnalysis:
    """How finely each head's ALiBi bias is stored, per dtype (see :func:`analytic_rounding`).

    ``by_head``: one row per (head, dtype): the first key positions where the absolute bias's
    rounding step exceeds each threshold, where it overflows, and its step at ``n_ctx``.
    ``by_position``: one row per (head, dtype, form, position): the bias and its rounding step.
    """

    by_head: pd.DataFrame
    by_position: pd.DataFrame


def _spacing(values: Tensor) -> Float[Tensor, "..."]:
    """Float64 spacing of ``values``' dtype grid just above ``|values|``: ``nextafter(|v|, inf) -
    |v|`` = ``2^(max(floor(log2 |v|), e_min) - mantissa bits)``; inf from the largest finite.

    >>> _spacing(torch.tensor([1450.0, 0.0], dtype=torch.bfloat16)).tolist()
    [8.0, 9.183549615799121e-41]
    """
    info = torch.finfo(values.dtype)
    mantissa, lowest = round(-math.log2(info.eps)), round(math.log2(info.tiny))
    v = values.double().abs()
    exponent = torch.frexp(v).exponent - 1  # floor(log2 v) for v > 0
    exponent = torch.where(v > 0, exponent, lowest).clamp(min=lowest)  # subnormals: e_min
    step = torch.exp2((exponent - mantissa).double())
    return torch.where(v >= info.max, math.inf, step)


@dataclasses.dataclass(frozen=True)
class _Bias:
    """One model's ALiBi bias as its family stores it (see :func:`analytic_rounding`)."""

    family: families.AlibiFamily
    slopes: Tensor  # per token of distance, float32 (Falcon's divided by sqrt(d_head))
    factors: Tensor  # what the family multiplies positions by, float32 (Falcon: BLOOM's slopes)
    d_head: int

    def stored(
        self, positions: Tensor, dtype: torch.dtype, form: str
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The bias's magnitude (float64), rounding step and error bound (logits) at integer
        ``positions`` (``[position]`` or ``[head, 1]``), as ``[head, position]``."""
        # The hook forms the relative bias as BLOOM forms its own (float32, cast to the dtype).
        relative = form == "relative"
        family = families.BLOOM if relative else self.family
        factors = self.slopes if relative else self.factors
        work = family.product_dtype
        scale = math.sqrt(self.d_head) if family.divides_by_sqrt_d_head else 1.0
        # The positions take the product's dtype first (torch's type promotion; what a
        # vectorised kernel does): past its integers (2^8 in bfloat16, 2^24 in float32)
        # neighbouring keys share one position, and the bias moves in jumps of m ulp(p).
        at = positions.to(work)
        product = factors.to(work)[:, None] * at
        m = factors.to(work).double()[:, None]
        terms = [torch.where(_spacing(at) > 1, m * _spacing(at), 0.0), _spacing(product)]
        terms = [term / scale for term in terms]
        if not family.casts_bias:  # MPT: float32 whatever the dtype
            bias = product
        else:  # cast to the dtype (Falcon: then divided by sqrt(d_head) in it): one more rounding
            bias = product.to(dtype)
            if family.divides_by_sqrt_d_head:
                bias = bias / scale
            if family.divides_by_sqrt_d_head or dtype != work:
                terms.append(_spacing(bias))
        step = functools.reduce(torch.maximum, terms)
        return bias.double().abs(), step, sum(terms) / 2

    def first_position(
        self, dtype: torch.dtype, over: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        """Per head, the first key position ``p`` in ``[1, MAX_POSITION]`` of the absolute form
        where ``over(value, step)`` holds (NaN if none), by bisection: ``over`` is monotone in
        ``p`` (the stored value, a rounded product, and its spacing never decrease)."""
        n = len(self.slopes)
        lo = torch.zeros(n, 1, dtype=torch.int64)  # over(0) is false: the value 0, a tiny step
        hi = torch.full((n, 1), MAX_POSITION, dtype=torch.int64)
        found = over(*self.stored(hi, dtype, "absolute")[:2])[:, 0]
        while bool((hi - lo > 1).any()):
            mid = (lo + hi) // 2
            is_over = over(*self.stored(mid, dtype, "absolute")[:2])
            hi, lo = torch.where(is_over, mid, hi), torch.where(is_over, lo, mid)
        return torch.where(found, hi[:, 0].double(), math.nan)


def _positions(values: Sequence[int] | None, n_ctx: int) -> list[int]:
    """Requested positions, checked; default: powers of two from 1 to at least 16 ``n_ctx``.

    >>> _positions(None, 2048)[-1], len(_positions(None, 2048))
    (32768, 16)
    """
    if values is None:
        return [2**k for k in range((16 * n_ctx - 1).bit_length() + 1)]
    values = _listed(values, "position")
    checked = set()
    for p in values:
        try:
            checked.add(check_int(p, "positions", minimum=1, maximum=MAX_POSITION))
        except InvalidArgumentError:
            raise InvalidArgumentError(
                f"positions must be integers from 1 to 2^40, got {p!r}"
            ) from None
    return sorted(checked)


def analytic_rounding(
    model: str | os.PathLike | Model,
    *,
    dtypes: Sequence[str] = ANALYSED_DTYPES,
    positions: Sequence[int] | None = None,
    thresholds: Sequence[float] = ROUNDING_THRESHOLDS,
) -> RoundingAnalysis:
    """How coarsely each head's ALiBi bias is stored, per dtype and position (no weights needed).

    ``analytic_rounding("bloom-560m").by_head``: per head and dtype, the first key position from
    which the bias transformers' BLOOM adds (``m·p`` cast to the dtype) moves in steps of over
    0.1 and 1 logit; ``by_position``: the bias and its step at each position, in the family's
    absolute form and in the relative one (``m·d`` at distance ``d``, small near the diagonal).
    Each family's formula and an example: docs/tools/blindness.md (Rounding of the bias).

    * ``model``: a name (BLOOM's, ``mpt-7b``, ``falcon-rw-1b``, ``falcon-rw-7b``), an organism,
      a folder, or a loaded model (its :func:`~headsurgeon.loading.model_info` slopes, family);
    * ``dtypes``: the model dtypes analysed (MPT's bias is float32 in every one);
    * ``positions``: ``by_position``'s (default: powers of two up to 16 ``n_ctx``);
    * ``thresholds``: the steps (logits) of ``by_head``'s ``first_position_step_over_<t>``.

    ``rounding_step`` (logits): the spacing ``2^(floor(log2 |v|) - mantissa bits)`` above the
    stored ``|v|``, the largest over the roundings the family applies (positions in the
    product's dtype, the product, the cast); ``max_rounding_error``: half their sum. Thresholds
    are exact (bisection on the monotone step; NaN past :data:`MAX_POSITION`);
    ``first_position_overflow``: the first ``inf`` (float16). One row per head: slopes are the
    same in every layer. One-line errors: :class:`UnsupportedArchitectureError` without ALiBi,
    :class:`InvalidArgumentError` for a bad dtype, position or threshold.
    """
    info, shape, name = alibi_door(model, "analytic_rounding", "it has no ALiBi bias to round")
    is_model = info is not None
    names = [dtype_name(d) for d in _listed(dtypes, "dtype")]
    grid = _positions(positions, shape.n_ctx)
    limits = [
        check_number(t, "thresholds", low=0, low_open=True)
        for t in _listed(thresholds, "threshold")
    ]
    d_head = shape.d_model // shape.n_heads
    family = shape.alibi_family
    per_token = info.slopes.float() if is_model else family.slopes(shape.n_heads, d_head)
    bias = _Bias(family, per_token, family.factors(per_token, d_head), d_head)
    heads, slopes = range(shape.n_heads), per_token.double().numpy()
    position_rows, head_rows = [], []
    for dtype in names:
        torch_dtype = parse_dtype(dtype)
        # The dtype the absolute bias is stored in when the scores are formed.
        stored_in = dtype if family.casts_bias else "float32"
        for form in ("absolute", "relative"):
            value, step, error = bias.stored(torch.tensor(grid), torch_dtype, form)
            position_rows.append(
                pd.DataFrame(
                    {
                        "head": np.repeat(heads, len(grid)),
                        "slope": np.repeat(slopes, len(grid)),
                        "dtype": dtype,
                        "form": form,
                        "bias_dtype": stored_in if form == "absolute" else dtype,
                        "position": np.tile(grid, shape.n_heads),
                        "bias_value": value.flatten().numpy(),
                        "rounding_step": step.flatten().numpy(),
                        "max_rounding_error": error.flatten().numpy(),
                    }
                )
            )
        columns = {
            f"first_position_step_over_{t:g}": bias.first_position(
                torch_dtype, lambda v, s, t=t: s > t
            ).numpy()
            for t in limits
        }
        overflow = bias.first_position(torch_dtype, lambda v, s: v.isinf())
        at_n_ctx = bias.stored(torch.tensor([shape.n_ctx]), torch_dtype, "absolute")[1]
        head_rows.append(
            pd.DataFrame(
                {
                    "head": heads,
                    "slope": slopes,
                    "dtype": dtype,
                    "bias_dtype": stored_in,
                    **columns,
                    "first_position_overflow": overflow.numpy(),
                    "rounding_step_at_n_ctx": at_n_ctx[:, 0].numpy(),
                }
            )
        )
    attrs = {
        "model": name,
        "family": shape.family,
        "n_ctx": shape.n_ctx,
        "thresholds": limits,
        "max_position": MAX_POSITION,
        "absolute": family.own_form_words,
        "relative": _RELATIVE,
        "measures": "the spacing of the float grid the ALiBi bias is stored on (rounding_step, "
        "logits; max_rounding_error: half the sum of its roundings' steps), from the slopes alone",
    }
    result = RoundingAnalysis(
        by_head=pd.concat(head_rows, ignore_index=True),
        by_position=pd.concat(position_rows, ignore_index=True),
    )
    for table in (result.by_head, result.by_position):
        table.attrs.update(attrs)
    return result


def _listed(values: Sequence | str | float, what: str) -> list:
    """One value or several, as a list; one line if there are none."""
    values = [values] if isinstance(values, (str, int, float, torch.dtype)) else list(values)
    if not values:
        raise InvalidArgumentError(f"give at least one {what}")
    return values
