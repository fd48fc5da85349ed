"""ALiBi as pure tensor math: slopes and bias matrices. No model I/O here.

ALiBi adds ``-m_h * (i - j)`` to the attention logit of query ``i`` on key ``j`` in head ``h``.

The mitigations of the ALiBi blindness paper (arXiv:2608.03994) are not public as formulas; the
definitions here are ours and are stated exactly in :func:`bias_from_distance`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from headsurgeon.defaults import BIAS_KINDS, LIMITS, ROBUST_MODES
from headsurgeon.dtypes import parse_dtype
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.validation import check_int, check_number

__all__ = [
    "slopes",
    "mpt_slopes",
    "falcon_slopes",
    "relative_distance",
    "alibi_bias",
    "LIMITS",
    "BIAS_KINDS",
    "ROBUST_MODES",
    "FloatLimits",
    "float_limits",
    "log_limit",
    "robust_slopes",
    "log_match_scale",
    "check_bias_params",
    "bias_from_distance",
    "soft_cap",
    "blind_distance",
    "blind_share",
]


def slopes(n_heads: int) -> Float[Tensor, " head_index"]:
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
    n_heads = check_int(n_heads, "n_heads", minimum=1)
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


def mpt_slopes(n_heads: int, alibi_bias_max: float = 8) -> Float[Tensor, " head_index"]:
    """MPT's ALiBi slopes, equal bit for bit to transformers' ``build_mpt_alibi_tensor``.

    With ``P = 2^ceil(log2 H)`` the slopes are ``2^(-b k / P)``, ``k = 1 ... P`` and ``b =
    alibi_bias_max``; for a head count that is not a power of two MPT takes the odd-numbered
    ``k`` first, then the even ones, and keeps ``H``. With ``b = 8`` they equal BLOOM's
    (:func:`slopes`) for every head count. transformers' ``MptModel`` calls it without
    ``alibi_bias_max`` (8 whatever ``config.attn_config`` says): see :func:`config_slopes`.

    >>> [round(x, 6) for x in mpt_slopes(4, alibi_bias_max=16).tolist()]
    [0.0625, 0.003906, 0.000244, 1.5e-05]
    >>> all(torch.allclose(mpt_slopes(h), slopes(h), rtol=1e-6) for h in (4, 6, 12, 16, 112))
    True
    """
    n_heads = check_int(n_heads, "n_heads", minimum=1)
    alibi_bias_max = check_number(alibi_bias_max, "alibi_bias_max", low=0, low_open=True)
    power = 2 ** math.ceil(math.log2(n_heads))
    base = torch.arange(1, power + 1, dtype=torch.int64).float() * (alibi_bias_max / power)
    result = 1.0 / torch.pow(2, base)
    if power != n_heads:
        result = torch.cat([result[1::2], result[::2]])[:n_heads]
    return result


def falcon_slopes(n_heads: int, d_head: int) -> Float[Tensor, " head_index"]:
    """The ALiBi slopes a Falcon model with ``alibi=True`` applies, per token of distance.

    transformers' Falcon builds BLOOM's bias ``m_h j`` (key position ``j``) in bfloat16 and
    adds ``m_h j / sqrt(d_head)`` to the already scaled logits ``q.k / sqrt(d_head)``, so the
    slope is ``bf16(m_h) / sqrt(d_head)`` (float32, computed as transformers does). The product
    ``m_h j`` is a bfloat16 too, rounded to 8 significant bits at every position (relative error
    up to 2^-9; for a slope that is not a power of two from a few positions on, for one that is
    past 256): the bias transformers applies scatters around the line these slopes draw. The
    measured tools read the logits themselves and are exact there.

    >>> falcon_slopes(4, 16)
    tensor([0.0625, 0.0156, 0.0039, 0.0010])
    >>> round(falcon_slopes(16, 64)[0].item(), 6), round(slopes(16)[0].item() / 8, 6)
    (0.088379, 0.088388)
    """
    n_heads = check_int(n_heads, "n_heads", minimum=1)
    d_head = check_int(d_head, "d_head", minimum=1)
    return slopes(n_heads).bfloat16().float() / math.sqrt(d_head)


def relative_distance(n_ctx: int) -> Float[Tensor, "query_pos key_pos"]:
    """Distance ``i - j`` from query ``i`` back to key ``j``; 0 for future keys (masked anyway).

    >>> relative_distance(3)
    tensor([[0., 0., 0.],
            [1., 0., 0.],
            [2., 1., 0.]])
    """
    pos = torch.arange(n_ctx)
    return (pos[:, None] - pos[None, :]).clamp(min=0).to(torch.float32)


def alibi_bias(
    head_slopes: Float[Tensor, " head_index"], n_ctx: int
) -> Float[Tensor, "head_index query_pos key_pos"]:
    """Standard ALiBi bias ``-m_h * (i - j)`` in float32, laid out like TransformerLens's cache.

    >>> alibi_bias(torch.tensor([0.5]), 3)
    tensor([[[-0.0000, -0.0000, -0.0000],
             [-0.5000, -0.0000, -0.0000],
             [-1.0000, -0.5000, -0.0000]]])
    """
    return -head_slopes.to(torch.float32)[:, None, None] * relative_distance(n_ctx)


# --- Float limits, blind distances and mitigated biases ---------------------------------------


class FloatLimits(NamedTuple):
    """Natural logs of a float format's underflow points.

    ``normal``: smallest normal number (below it precision degrades); ``subnormal``: smallest
    subnormal number; ``zero``: half of it, at and below which a value rounds to exactly 0.
    """

    normal: float
    subnormal: float
    zero: float


def float_limits(dtype: str | torch.dtype) -> FloatLimits:
    """Underflow points of float32, bfloat16 or float16 as natural logs.

    >>> [round(x, 2) for x in float_limits("float32")]
    [-87.34, -103.28, -103.97]
    >>> [round(x, 2) for x in float_limits("bfloat16")]
    [-87.34, -92.19, -92.88]
    >>> [round(x, 2) for x in float_limits(torch.float16)]
    [-9.7, -16.64, -17.33]
    """
    info = torch.finfo(parse_dtype(dtype))
    normal = math.log(info.tiny)
    subnormal = normal + math.log(info.eps)  # 2^(min_exp - 1) * 2^(-mantissa bits)
    return FloatLimits(normal, subnormal, subnormal - math.log(2))


def log_limit(dtype: str | torch.dtype, limit: str | float = "normal") -> float:
    """The natural log of an underflow limit: a name from :data:`LIMITS` or a negative log.

    >>> round(log_limit("float16", "zero"), 2), log_limit("float32", -50.0)
    (-17.33, -50.0)
    """
    if isinstance(limit, str):
        if limit not in LIMITS:
            raise InvalidArgumentError(
                f"unknown limit {limit!r}; use one of {', '.join(LIMITS)} or a negative natural log"
            )
        return getattr(float_limits(dtype), limit)
    if not isinstance(limit, (int, float)) or not -math.inf < limit < 0:
        raise InvalidArgumentError(f"a numeric limit is a natural log below 0, got {limit}")
    return float(limit)


def robust_slopes(
    head_slopes: Float[Tensor, " head_index"],
    context: int,
    dtype: str | torch.dtype = "float32",
    limit: str | float = "normal",
    mode: str = "scale",
) -> Float[Tensor, " head_index"]:
    """Slopes lowered so that no key within ``context`` tokens reaches the underflow limit.

    With ``T = -log_limit(dtype, limit)`` the largest allowed slope is ``T / context``:
    the bias at the farthest key of the context, distance ``context - 1``, stays above ``-T``.
    ``mode="scale"`` multiplies every slope by ``min(1, T / (context * max_h m_h))``, keeping the
    geometric ratios between heads; ``mode="clip"`` lowers only the heads above the limit to it.

    >>> robust = robust_slopes(slopes(16), 2048)
    >>> round(robust.max().item(), 5), round(robust.max().item() * 2047, 2)  # ln 2^-126 = -87.34
    (0.04264, 87.29)
    >>> s = robust_slopes(torch.tensor([1.0, 0.01]), 1000, mode="clip")
    >>> [round(x, 5) for x in s.tolist()]
    [0.08734, 0.01]
    """
    if mode not in ROBUST_MODES:
        raise InvalidArgumentError(f"unknown robust mode {mode!r}; use one of scale, clip")
    check_int(context, "robust context", minimum=1)
    max_slope = -log_limit(dtype, limit) / context
    m = head_slopes.to(torch.float64)
    if mode == "clip":
        return m.clamp(max=max_slope).to(torch.float32)
    return (m * min(1.0, max_slope / m.max().item())).to(torch.float32)


# A parameter that may be left out (its default is None); None itself marks a required one.
_OPTIONAL = object()


def log_match_scale(match: int | None) -> float:
    """The factor on a ``log`` bias's slopes that makes its penalty at distance ``match`` equal
    standard ALiBi's (``m' ln(1 + L) = m L``): ``L / ln(1 + L)``; 1 when ``match`` is None.

    >>> round(log_match_scale(512), 2)
    82.05
    """
    return 1.0 if match is None else match / math.log1p(match)


def check_bias_params(kind: str, **params: object) -> dict[str, object]:
    """Validate the parameters of a bias kind; return them with defaults filled in.

    ``standard`` and ``relative`` take none; ``log`` takes ``match`` (a distance ``L``: its
    slopes rescaled so that its penalty at ``L`` equals standard ALiBi's, see
    :func:`log_match_scale`; left out: unscaled); ``clamped`` and ``softcap`` need ``c > 0``;
    ``robust`` needs ``context`` and takes ``dtype`` (float32), ``limit`` (normal), ``mode``
    (scale).

    >>> check_bias_params("robust", context=256)
    {'context': 256, 'dtype': 'float32', 'limit': 'normal', 'mode': 'scale'}
    >>> check_bias_params("log"), check_bias_params("log", match=512)
    ({}, {'match': 512})
    """
    allowed: dict[str, dict[str, object]] = {
        "standard": {},
        "relative": {},
        "log": {"match": _OPTIONAL},
        "clamped": {"c": None},
        "softcap": {"c": None},
        "robust": {"context": None, "dtype": "float32", "limit": "normal", "mode": "scale"},
    }
    if kind not in allowed:
        raise InvalidArgumentError(
            f"unknown bias kind {kind!r}; use one of {', '.join(BIAS_KINDS)}"
        )
    unknown = set(params) - set(allowed[kind])
    if unknown:
        names = ", ".join(allowed[kind]) or "none"
        raise InvalidArgumentError(
            f"{kind} takes no parameter {', '.join(sorted(unknown))}; its parameters: {names}"
        )
    full = {**allowed[kind], **params}
    missing = [
        name for name, value in full.items() if value is None and allowed[kind][name] is None
    ]
    if missing:
        raise InvalidArgumentError(f"{kind} needs {', '.join(missing)}")
    # An optional parameter left out stays out, so records of older models read the same.
    full = {name: value for name, value in full.items() if value not in (_OPTIONAL, None)}
    if "match" in full:
        full["match"] = check_int(full["match"], "the match distance of log", minimum=1)
    if "c" in full:
        full["c"] = check_number(full["c"], f"the c of {kind}", low=0, low_open=True)
    if kind == "robust":
        robust_slopes(torch.ones(1), **full)  # validates context, dtype, limit and mode
    return full


def distance_rows(
    n_queries: int, n_keys: int, device: torch.device | str | None = None
) -> Float[Tensor, "query_pos key_pos"]:
    """Distances ``i - j`` for the last ``n_queries`` of ``n_keys`` positions (0 for future keys).

    >>> distance_rows(2, 3)
    tensor([[1., 0., 0.],
            [2., 1., 0.]])
    """
    queries = torch.arange(n_keys - n_queries, n_keys, device=device)
    keys = torch.arange(n_keys, device=device)
    return (queries[:, None] - keys[None, :]).clamp(min=0).to(torch.float32)


def causal_rows(
    n_queries: int, n_keys: int, device: torch.device | str | None = None
) -> Bool[Tensor, "query_pos key_pos"]:
    """Which keys the last ``n_queries`` of ``n_keys`` positions may attend to (``j <= i``).

    Masked scores are ``-inf`` in TransformerLens 3.x and the float minimum in 4.x (Hugging
    Face's mask); the positions say which is which on both.

    >>> causal_rows(2, 3)
    tensor([[ True,  True, False],
            [ True,  True,  True]])
    """
    queries = torch.arange(n_keys - n_queries, n_keys, device=device)
    return queries[:, None] >= torch.arange(n_keys, device=device)[None, :]


def bias_from_distance(
    kind: str,
    head_slopes: Float[Tensor, " head_index"],
    distance: Float[Tensor, "query_pos key_pos"],
    **params,
) -> Float[Tensor, "head_index query_pos key_pos"]:
    """The float32 bias of a kind of ALiBi at distances ``d = i - j`` (see :data:`BIAS_KINDS`).

    * ``standard``: ``-m d``;
    * ``relative``: ``-m d``, the same numbers: what it changes is where a model that adds
      ALiBi as ``m j`` (transformers' BLOOM and Falcon: slope times key position, exact only up
      to a constant per row) forms it. Formed from distances, each row's scores stay small near
      the diagonal at any position, so a bfloat16 or float16 rounding of the scores keeps the
      content logits there (:mod:`headsurgeon.precision`); on the hooks of a headsurgeon model,
      which always add ``-m (i - j)``, it is ``standard``;
    * ``clamped``: ``max(-m d, -c)``: no key is ever penalised by more than ``c``;
    * ``log``: ``-m ln(1 + d)``: the penalty grows with the log of the distance; with
      ``match=L``, ``-m L ln(1 + d) / ln(1 + L)``: standard's penalty at ``d = L``;
    * ``robust``: ``-m' d`` with ``m' = robust_slopes(m, context, dtype, limit, mode)``;
    * ``softcap``: ``-m d`` (standard); the cap ``c tanh(logit / c)`` acts on the whole logit,
      content plus bias, after the bias is added (:func:`soft_cap`).

    >>> d = distance_rows(1, 4)
    >>> bias_from_distance("clamped", torch.tensor([1.0]), d, c=2.0)
    tensor([[[-2., -2., -1., -0.]]])
    >>> bias_from_distance("log", torch.tensor([1.0]), d).exp()  # 1 / (1 + d)
    tensor([[[0.2500, 0.3333, 0.5000, 1.0000]]])
    """
    params = check_bias_params(kind, **params)
    m = head_slopes.to(device=distance.device, dtype=torch.float32)
    if kind == "robust":
        m = robust_slopes(m, **params)
    d = distance.to(torch.float32)[None]
    if kind == "log":
        return -m[:, None, None] * log_match_scale(params.get("match")) * torch.log1p(d)
    bias = -m[:, None, None] * d
    if kind == "clamped":
        return bias.clamp(min=-params["c"])
    return bias


def soft_cap(scores: Float[Tensor, "..."], c: float) -> Float[Tensor, "..."]:
    """``c tanh(scores / c)``, leaving masked cells (``-inf``) masked.

    >>> soft_cap(torch.tensor([0.0, 5.0, -100.0, -math.inf]), 10.0)
    tensor([  0.0000,   4.6212, -10.0000,     -inf])
    """
    check_bias_params("softcap", c=c)
    return torch.where(scores == -math.inf, scores, c * torch.tanh(scores / c))


def blind_distance(
    slope: float | Float[Tensor, " head_index"],
    dtype: str | torch.dtype = "float32",
    limit: str | float = "normal",
    bias: str = "standard",
    **params,
) -> float | Float[Tensor, " head_index"]:
    """The distance from which a key's attention weight must be at most the dtype's underflow limit.

    Assumes every key has the same content logit, so the bias alone sets how far a key at distance
    ``d`` falls below the query's own logit: the head is blind from the first ``d`` with
    ``bias(0) - bias(d) >= -log_limit(dtype, limit)``. Returns a float (``inf``: never blind) or,
    for a tensor of slopes, a float64 tensor.

    - ``slope``: one ALiBi slope or a tensor of them.
    - ``dtype``: the dtype whose underflow limit counts.
    - ``limit``: ``"normal"``, ``"subnormal"``, ``"zero"`` or a negative natural log.
    - ``bias``: ``standard``, ``clamped``, ``log``, ``softcap`` or ``robust``.
    - ``**params``: the kind's parameters (``c``, ``match``, ``context``, ``mode``).

    The formula of each kind and what the assumption leaves out: [ALiBi math: blind
    distances](alibi.md#blind-distances).

    >>> m = slopes(16)
    >>> blind_distance(m[0].item()), blind_distance(m[15].item())
    (124.0, 22359.0)
    >>> f"{blind_distance(m[0].item(), bias='log'):.3g}"
    '4.37e+53'
    >>> blind_distance(m[:2], "float16", "zero")
    tensor([25., 35.], dtype=torch.float64)
    >>> blind_distance(0.5, bias="clamped", c=50.0)
    inf
    >>> blind_distance(0.5, bias="robust", context=512) >= 512
    True
    """
    scalar = not isinstance(slope, Tensor)
    m = torch.as_tensor(slope, dtype=torch.float64)
    if (m <= 0).any() or not torch.isfinite(m).all():
        raise InvalidArgumentError("ALiBi slopes must be positive and finite")
    t = -log_limit(dtype, limit)
    if bias == "robust":
        params = check_bias_params(bias, dtype=dtype, limit=limit, **params)
        m = robust_slopes(m.reshape(-1), **params).to(torch.float64).reshape(m.shape)
    else:
        params = check_bias_params(bias, **params)
    if bias == "log":
        distance = torch.expm1(t / (m * log_match_scale(params.get("match")))).ceil()
    elif bias == "softcap":
        c = params["c"]
        distance = (c * math.atanh(t / c) / m).ceil() if c > t else torch.full_like(m, math.inf)
    else:
        distance = (t / m).ceil()
        if bias == "clamped" and params["c"] < t:
            distance = torch.full_like(m, math.inf)
    distance = distance.clamp(min=1)
    return distance.item() if scalar else distance


def blind_share(distances: Float[Tensor, " head_index"] | Sequence[float], context: int) -> float:
    """Share of causal attention entries of a ``context``-token sequence at or beyond blindness.

    Counts entries ``(i, j)``, ``j <= i < context``, with ``i - j >= δ_h``, over all heads: the
    analytic counterpart of the measured share (content logits all equal).

    >>> blind_share([2.0, math.inf], 4)  # head 0: 3 of 10 entries (distances 2, 2, 3)
    0.15
    """
    check_int(context, "context length", minimum=1)
    delta = torch.as_tensor(distances, dtype=torch.float64).clamp(max=context)
    n_blind = (context - delta) * (context - delta + 1) / 2
    return (n_blind.sum() / (len(delta) * context * (context + 1) / 2)).item()


# --- Reach of a head with no preference for content -------------------------------------------


def reach_from_far_mass(far: np.ndarray, eps: float) -> np.ndarray:
    """The smallest distance (last axis) whose far mass is at most ``eps``; ``inf`` if none
    (NaN, no row that far, never qualifies): the census's ``reach`` from
    :meth:`headsurgeon.probes.HeadStats.far_mass`.

    >>> reach_from_far_mass(np.array([[0.5, 0.2, 0.05], [0.9, 0.5, math.nan]]), 0.1)
    array([ 2., inf])
    """
    within = far <= eps  # NaN (no row) never qualifies
    first = within.argmax(-1).astype(np.float64)
    return np.where(within.any(-1), first, math.inf)


def content_free_far_mass(
    bias: Float[Tensor, "head_index distance"] | np.ndarray, min_query_pos: int = 1
) -> np.ndarray:
    """``[head, distance]``: :meth:`headsurgeon.probes.HeadStats.far_mass` of a head whose
    logits are its positional bias alone, over sequences of ``T`` tokens, exactly in float64.

    ``bias[h, k]`` is the bias the head adds at distance ``k = 0 ... T - 1`` (``T`` is the
    sequence length; standard ALiBi: ``-m k``). Row ``t`` then weighs key ``t - k`` by
    ``w_k / W_t`` (``W_t = w_0 + ... + w_t``, position 0 included in the softmax), so the mass
    at distance ``d`` or more, position 0 left out, summed over rows ``t >= max(d + 1,
    min_query_pos)``, is ``Σ_{k >= d} w_k Σ_{t >= max(k + 1, min_query_pos)} 1 / W_t``: suffix
    sums of positive terms, O(T) per head and no cancellation. Divided by the number of rows
    (NaN where there is none), as ``far_mass`` pools them. The census's ``reach_baseline``
    reads it with the bias the model applies (:func:`headsurgeon.blindness.analysis.applied_bias`).

    >>> bias = -np.log(2) * np.arange(3.0)[None]  # weights 1, 1/2, 1/4 at distances 0, 1, 2
    >>> content_free_far_mass(bias)  # d = 0: rows 1, 2: 1 / (3/2), (1 + 1/2) / (7/4)
    array([[0.76190476, 0.28571429,        nan]])
    """
    b = np.asarray(bias, dtype=np.float64)
    n_pos = b.shape[-1]
    w = np.exp(b - b.max(-1, keepdims=True))
    inverse = 1 / np.cumsum(w, -1)  # 1 / W_t, per row t
    rows_from = np.concatenate([np.cumsum(inverse[..., ::-1], -1)[..., ::-1], 0 * w[..., :1]], -1)
    first_row = np.maximum(np.arange(1, n_pos + 1), min_query_pos)  # for key distance k
    terms = w * rows_from[..., np.minimum(first_row, n_pos)]
    tail = np.cumsum(terms[..., ::-1], -1)[..., ::-1]
    n_rows = n_pos - np.maximum(np.arange(n_pos) + 1, min_query_pos)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_rows > 0, tail / n_rows, math.nan)


def content_free_reach(
    bias: Float[Tensor, "head_index distance"] | np.ndarray, eps: float, min_query_pos: int = 1
) -> np.ndarray:
    """``[head]``: the :meth:`headsurgeon.probes.HeadStats.reach` of a head whose logits are its
    positional bias alone (:func:`content_free_far_mass`): how far a head with no preference for
    content looks, which its slope alone decides. ``inf`` when no distance within the ``T``
    tokens qualifies.

    For standard ALiBi (``-m k``) row ``t``'s far mass tends to ``e^{-m d}``, so on long
    sequences the reach tends to ``ceil(ln(1 / eps) / m)``:

    >>> slopes = np.array([0.5, 0.0625])
    >>> content_free_reach(-slopes[:, None] * np.arange(100_000), 0.01)
    array([10., 74.])
    >>> np.ceil(np.log(1 / 0.01) / slopes)
    array([10., 74.])
    """
    return reach_from_far_mass(content_free_far_mass(bias, min_query_pos), eps)
