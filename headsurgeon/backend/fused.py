"""Per-row attention statistics from a fused attention kernel, without the ``T x T`` pattern.

One call of :func:`attention_stats` per layer gives, for every (sequence, head, query row), what
the census reduces each pattern row to: the log-sum-exp of the scores, the largest weight, the
weights on key 0, on the query itself and on the previous key, the entropy and the mean
attended distance, and the head outputs ``z``. The fused kernel (PyTorch's CPU flash attention,
``_scaled_dot_product_flash_attention_for_cpu``) returns the output and the log-sum-exp ``lse``;
every other statistic follows from them and from single scores:

* a weight ``A[t, j] = exp(s[t, j] - lse[t])`` (``j`` = 0, ``t``, ``t - 1``: one dot product each);
* extra value columns (the keys and the distance ``b - j`` to the block's middle row ``b``) give
  ``Σ_j A[t, j] k_j`` and ``Σ_j A[t, j] (t - j)``, so ``Σ_j A s = scale q_t · Σ_j A k_j + Σ_j A
  bias`` and the entropy ``lse - Σ_j A s`` (the bias, ``-m (t - j)``, is linear in the distance;
  a bias of the key alone, a family's own ``m j``, is one more column);
* the largest weight ``exp(max_j s[t, j] - lse[t])``: the row maxima from one product of scores
  per block of query rows (a matrix product and a maximum, no exponential: the CPU kernel does
  not return them).

Query rows run in blocks of 64 against their causal keys only, each block's bias a view of one
Toeplitz matrix, so memory is linear in the length. The entropy ``lse - Σ A s`` cancels: its
float32 error grows with the scores' size, the distance's with the distances
(``ENTROPY_ROUNDINGS``). Heads whose error bound of the mean entropy or distance exceeds
``tolerance`` times the mean (or 1, if larger) are computed in float64
(``AttentionStats.refined``), never silently. A row with one key (query 0) is set exactly:
weight 1 on itself, entropy 0.

On CUDA the kernel is FlexAttention (``torch.nn.attention.flex_attention``, compiled, ALiBi as
a ``score_mod``), which also returns the row maxima. Not on CPU with this torch (2.13): eager, it
materialises the scores and returns no maxima; compiled, inductor refuses ``return_lse`` on CPU.
Its ``score_mod`` is tested here eager, on CPU; the CUDA path itself is not run by the tests.

:func:`windowed_attention` gives a layer's head outputs with the keys beyond a window or a
StreamingLLM cache cut (the window and sink-cache tests): each block of query rows runs the same
CPU kernel against only the keys it may see, so a cut pass costs ``T x (kept + 64)`` entries.

>>> q, k, v = (torch.randn(1, 5, 2, 4) for _ in range(3))
>>> stats = attention_stats(q, k, v, torch.tensor([0.5, 0.25]))
>>> stats.entropy.shape, float(stats.self_weight[0, 0, 0])
(torch.Size([1, 2, 5]), 1.0)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from headsurgeon.errors import InvalidArgumentError

__all__ = [
    "AttentionStats",
    "attention_stats",
    "census_row_sums",
    "windowed_attention",
]

# Query rows per kernel call: the fewer, the smaller the distance column's values near the rows
# (its float32 sums' rounding) and the bias matrix; 64 costs no measurable kernel time.
BLOCK_ROWS = 64
# Bytes of the largest per-block tensor (the scores block of the row maxima), at most.
BLOCK_BYTES = 64 * 2**20
# Multiple of the epsilon in the entropy's error bound: lse and Σ A s are each within a few
# roundings of their size. Measured on the organism's layer 2 (512 tokens), the largest error of
# a row is 3.8 epsilon x that size, of a head's mean 1/40 of the mean bound at 1.
ENTROPY_ROUNDINGS = 8


@dataclasses.dataclass(frozen=True)
class AttentionStats:
    """One layer's attention, reduced per (sequence, head, query row): ``[batch, head, query]``
    tensors in float64, ``z`` as ``hook_z`` gives it (in the inputs' dtype)."""

    z: Float[Tensor, "batch pos head_index d_head"]
    lse: Float[Tensor, "batch head_index pos"]  # log-sum-exp of the row's scores
    max_weight: Float[Tensor, "batch head_index pos"]
    bos_weight: Float[Tensor, "batch head_index pos"]  # A[t, 0]
    self_weight: Float[Tensor, "batch head_index pos"]  # A[t, t]
    prev_weight: Float[Tensor, "batch head_index pos"]  # A[t, t - 1]; 0 in row 0
    entropy: Float[Tensor, "batch head_index pos"]  # -Σ A ln A, nats
    distance: Float[Tensor, "batch head_index pos"]  # Σ A (t - j), tokens
    refined: Bool[Tensor, " head_index"]  # heads computed in float64 (error bounds)


def attention_stats(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos head_index d_head"],
    v: Float[Tensor, "batch pos head_index d_head"],
    slopes: Float[Tensor, " head_index"] | None = None,
    *,
    key_bias: Float[Tensor, "head_index pos"] | None = None,
    scale: float | None = None,
    block_size: int | None = None,
    tolerance: float = 1e-6,
    weights: Callable[[Tensor, int, Tensor], None] | None = None,
) -> AttentionStats:
    """Causal attention of ``q``, ``k``, ``v`` with an ALiBi bias, reduced per query row.

    ``stats = attention_stats(q, k, v, slopes)`` with ``hook_q``/``hook_k``/``hook_v`` of one
    layer; the scores are ``scale q_t·k_j + bias``, the bias one of:

    - ``slopes``: ``-m_h (t - j)`` (headsurgeon's bias hook, TransformerLens 3.x's own);
    - ``key_bias``: ``[head, key]`` added to every row (a family's own, ``m_h j``: BLOOM's,
      MPT's, Falcon's rounded products; ``family.own_bias(...)[:, 0]``);
    - ``scale``: default ``1 / sqrt(d_head)``;
    - ``block_size``: query rows per kernel call (default: what ``BLOCK_BYTES`` allows);
    - ``tolerance``: the largest error bound of a head's mean entropy or mean distance (rows
      1...), relative to the mean (absolute below 1), left in float32; above it, float64;
    - ``weights``: for statistics that need every weight (the census's reach), called per block
      of query rows and group of heads as ``weights(heads, first_row, A)`` with ``A = exp(s -
      lse)``, ``[batch, len(heads), rows, keys]`` (the block's causal keys), in the heads' final
      dtype; one exponential per entry more.
    """
    _check(q, k, v, slopes, key_bias)
    n_pos, d_head = q.shape[1], q.shape[-1]
    scale = 1 / math.sqrt(d_head) if scale is None else float(scale)
    fits = max(1, BLOCK_BYTES // (4 * q.shape[0] * q.shape[2] * n_pos))
    rows = min(block_size or min(BLOCK_ROWS, fits), n_pos)
    z = torch.empty_like(q)
    stats = {
        name: q.new_empty(q.shape[0], q.shape[2], n_pos, dtype=torch.float64) for name in ROW_STATS
    }
    maxima = set()  # the dtypes whose kernel gave no row maxima (the scores pass finds them)

    def pick(t: Tensor | None, heads: Tensor, dtype: torch.dtype, dim: int = 0) -> Tensor | None:
        return None if t is None else t.to(heads.device).index_select(dim, heads).to(dtype)

    def run(heads: Tensor, dtype: torch.dtype) -> Tensor:
        """Compute ``heads`` in ``dtype``; the bound of each one's mean entropy (rows 1...)."""
        part = _stats(
            *(pick(t, heads, dtype, 2) for t in (q, k, v)),
            _Bias.of(pick(slopes, heads, dtype), pick(key_bias, heads, dtype), rows, n_pos),
            scale,
            rows,
        )
        z[:, :, heads] = part.pop("z").to(q.dtype)
        if "max_weight" not in part:
            maxima.add(dtype)
        for name, value in part.items():
            stats[name][:, heads] = value
        return _relative_bound(part)

    heads = torch.arange(q.shape[2], device=q.device)
    if q.dtype == torch.float64:
        refined = torch.zeros(len(heads), dtype=torch.bool, device=q.device)
    else:
        # Heads whose bound's |q·k| term alone exceeds the tolerance times the largest entropy
        # a row can have (ln n_pos) go to float64 at once.
        sizes = q.norm(dim=-1) * k.norm(dim=-1).cummax(1).values * abs(scale)  # [batch, pos, head]
        floor = ENTROPY_ROUNDINGS * torch.finfo(q.dtype).eps * sizes[:, 1:].mean(1).amax(0)
        refined = floor > tolerance * max(1.0, math.log(n_pos))
        if not refined.all():
            rest = heads[~refined]
            refined[rest[run(rest, q.dtype) > tolerance]] = True
    if refined.any() or q.dtype == torch.float64:
        run(heads[refined] if q.dtype != torch.float64 else heads, torch.float64)
    # The row maxima (where the kernel gave none) and the weights, in each head's final dtype.
    for group, dtype in ((heads[~refined], q.dtype), (heads[refined], torch.float64)):
        if len(group) and (dtype in maxima or weights is not None):
            bias = _Bias.of(pick(slopes, group, dtype), pick(key_bias, group, dtype), rows, n_pos)
            stats["max_weight"][:, group] = _scores_pass(
                *(pick(t, group, dtype, 2) for t in (q, k)),
                bias,
                scale,
                rows,
                stats["lse"][:, group],
                None if weights is None else functools.partial(weights, group),
            )
    del stats["entropy_bound"], stats["distance_bound"]
    return AttentionStats(z=z, **stats, refined=refined.cpu())


def windowed_attention(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos head_index d_head"],
    v: Float[Tensor, "batch pos head_index d_head"],
    slopes: Float[Tensor, " head_index"] | None = None,
    *,
    key_bias: Float[Tensor, "head_index pos"] | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: int | Sequence[int] = 1,
    heads: Sequence[int] | None = None,
    cache_distance: bool = False,
) -> Float[Tensor, "batch pos head_index d_head"]:
    """Causal ALiBi attention's head outputs (``hook_z``), the keys beyond a window cut.

    ``z = windowed_attention(q, k, v, slopes, window=64)``: each query ``t`` of the ``heads``
    cut (default: all) sees its first ``sinks`` keys and the keys ``t - window ... t`` only,
    the others every earlier key; the cut keys get no weight and the kept ones renormalise
    (:func:`headsurgeon.window.window_hook`; a StreamingLLM cache,
    :mod:`headsurgeon.sink_cache`). A cut head's block of query rows runs against its kept
    keys alone, ``sinks + window + 64`` of them whatever the length, through PyTorch's CPU
    flash kernel (CPU tensors only).

    - ``slopes``, ``key_bias``, ``scale``: the bias and scale, as :func:`attention_stats`;
    - ``window``: the recent keys kept besides the query itself (``None``: nothing is cut);
    - ``sinks``: the first keys kept at any distance, for every head or one per head;
    - ``heads``: the heads cut;
    - ``cache_distance``: a sink's bias at its cache-slot distance ``min(t, sinks + window) -
      j`` (StreamingLLM's), not ``t - j`` (``slopes`` only).
    """
    _check(q, k, v, slopes, key_bias)
    n_pos, n_heads, d_head = q.shape[1:]
    scale = 1 / math.sqrt(d_head) if scale is None else float(scale)
    if cache_distance and key_bias is not None:
        raise InvalidArgumentError("cache_distance measures the bias from slopes, not key_bias")
    rows = min(BLOCK_ROWS, n_pos)
    kept = torch.as_tensor(sinks).expand(n_heads).tolist()
    cut = [window is not None and (heads is None or h in heads) for h in range(n_heads)]
    # Heads alike are one kernel call a block: uncut, or cut with the same sinks.
    groups: dict[int | None, list[int]] = {}
    for h in range(n_heads):
        groups.setdefault(kept[h] if cut[h] else None, []).append(h)
    z = q.new_empty(q.shape[0], n_heads, n_pos, d_head)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    for x, members in groups.items():
        group = torch.tensor(members, device=q.device)
        qh, kh, vh = (t.index_select(2, group).transpose(1, 2) for t in (q, k, v))
        bias = _Bias.of(
            None if slopes is None else slopes[group],
            None if key_bias is None else key_bias[group],
            rows,
            n_pos,
            window=None if x is None else window,
        )._replace(sinks=x or 0, cache_distance=cache_distance)
        for start in range(0, n_pos, rows):
            block = bias.rows(start, min(start + rows, n_pos))
            keys = block.key_positions()
            z[:, group, start : block.stop] = flash(
                qh[:, :, start : block.stop],
                kh[:, :, keys],
                vh[:, :, keys],
                attn_mask=block.mask()[None],
                scale=scale,
            )[0]
    return z.transpose(1, 2)


def _relative_bound(part: dict[str, Tensor]) -> Float[Tensor, " head_index"]:
    """Per head, the largest over sequences of the error bound of the mean entropy and of the
    mean distance (rows 1...) over that mean, or over 1 where the mean is smaller."""
    ratios = [
        (part[f"{name}_bound"][..., 1:].mean(-1) / part[name][..., 1:].mean(-1).abs().clamp(min=1))
        for name in ("entropy", "distance")
    ]
    return torch.maximum(*ratios).amax(0)


def _check(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor | None, key_bias: Tensor | None):
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape or not q.shape[1]:
        raise InvalidArgumentError(
            f"q, k, v must be [batch, pos >= 1, head, d_head] of one shape (hook_q/k/v), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; repeat shared heads"
        )
    if (slopes is None) == (key_bias is None):
        raise InvalidArgumentError(
            "attention_stats takes one bias: slopes (-m (t - j)) or key_bias (a family's own)"
        )
    n_heads, n_pos = q.shape[2], q.shape[1]
    if slopes is not None and slopes.shape != (n_heads,):
        raise InvalidArgumentError(f"slopes must be [{n_heads}], got {tuple(slopes.shape)}")
    if key_bias is not None and key_bias.shape != (n_heads, n_pos):
        raise InvalidArgumentError(
            f"key_bias must be [{n_heads}, {n_pos}] (head, key), got {tuple(key_bias.shape)}"
        )


def _stats(q: Tensor, k: Tensor, v: Tensor, bias: _Bias, scale: float, rows: int) -> dict:
    """The kernel pass: :func:`attention_stats`' tensors in the inputs' dtype but the row maxima
    (unless the kernel gives them), and each row's error bound."""
    batch, n_pos, n_heads, d_head = q.shape
    device, dtype = q.device, q.dtype
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # [batch, head, pos, d_head]
    # The values followed by the keys, the distance column and, for a key bias, the bias.
    with_keys = bias.key_bias is not None
    values = torch.cat(
        [v.transpose(1, 2), kh, qh.new_zeros(batch, n_heads, n_pos, 1 + with_keys)], -1
    )
    m = bias.slopes.double()[:, None]
    kernel = _block_kernel(device)
    positions = torch.arange(n_pos, device=device)
    # The entropy's error bound: ‖q_t‖ times the largest key norm so far bounds |Σ A q·k|.
    key_norms = kh.norm(dim=-1).cummax(-1).values * qh.norm(dim=-1) * abs(scale)
    # Per row in float64: the differences below cancel, their inputs' rounding is all they keep.
    out = {name: qh.new_empty(batch, n_heads, n_pos, dtype=torch.float64) for name in ROW_STATS}
    z = qh.new_empty(batch, n_heads, n_pos, d_head)
    given_maxima = True
    for start in range(0, n_pos, rows):
        stop = min(start + rows, n_pos)
        block = slice(start, stop)
        bias = bias.rows(start, stop)
        if with_keys:
            values[:, :, :stop, -1] = bias.keys
        middle = (start + stop) // 2  # Σ A (middle - j) is small where the weights are
        values[:, :, :stop, 2 * d_head] = (middle - positions[:stop]).to(dtype)
        result, lse, row_max = kernel(
            qh[:, :, block], kh[:, :, :stop], values[:, :, :stop], scale, bias
        )
        z[:, :, block] = result[..., :d_head]
        result, lse = result.double(), lse.double()
        t = positions[block].double()
        mean_distance = (t - middle) + result[..., 2 * d_head]  # Σ A (t - j)
        content = scale * (qh[:, :, block].double() * result[..., d_head : 2 * d_head]).sum(-1)
        weighted_bias = result[..., -1] if with_keys else -m * mean_distance
        out["lse"][..., block] = lse
        out["entropy"][..., block] = lse - content - weighted_bias
        out["distance"][..., block] = mean_distance
        # What each sum above is within a few roundings of: the distance Σ A |middle - j| <=
        # |t - middle| + Σ A (t - j); the entropy |lse|, |Σ A q·k|, the slope times the
        # distance's, the bias column's largest value.
        distance_size = (t - middle).abs() + mean_distance
        entropy_size = lse.abs() + key_norms[..., block] + m * distance_size
        if with_keys:
            entropy_size = entropy_size + result[..., -1].abs()
        roundings = ENTROPY_ROUNDINGS * torch.finfo(dtype).eps
        out["entropy_bound"][..., block] = roundings * entropy_size
        out["distance_bound"][..., block] = roundings * distance_size
        query, own = qh[:, :, block], positions[block]
        picked = {
            "bos_weight": _score(query, kh[:, :, :1], scale, bias, own, 0),
            "self_weight": _score(query, kh[:, :, block], scale, bias, own, own),
            "prev_weight": _score(query, kh[:, :, own - 1], scale, bias, own, own - 1),
        }
        given_maxima = given_maxima and row_max is not None
        if given_maxima:
            picked["max_weight"] = row_max
        for name, score in picked.items():
            out[name][..., block] = (score.double() - lse).exp()
    if not given_maxima:
        del out["max_weight"]
    # Row 0 has one key: its weight 1, exactly (the formulas above round); prev_weight's
    # key -1 above read the last key.
    first = {"max_weight": 1, "bos_weight": 1, "self_weight": 1, "prev_weight": 0}
    for name in out:
        if name != "lse":
            out[name][..., 0] = first.get(name, 0)
    return {"z": z.transpose(1, 2), **out}


def _scores_pass(
    q: Tensor,
    k: Tensor,
    bias: _Bias,
    scale: float,
    rows: int,
    lse: Tensor,
    weights: Callable[[int, Tensor], None] | None,
) -> Float[Tensor, "batch head_index pos"]:
    """The largest weight of each row, ``exp(max_j s - lse)``, from one product of scores per
    block and sequence (the bias broadcast over heads, not copied); ``weights(start, A)`` with
    the block's weights when asked."""
    batch, n_pos, n_heads, _ = q.shape
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    out = lse.new_empty(batch, n_heads, n_pos)
    for start in range(0, n_pos, rows):
        stop = min(start + rows, n_pos)
        bias = bias.rows(start, stop)
        scores = qh.new_empty(batch, n_heads, stop - start, stop)
        mask = bias.mask()
        for i in range(batch):
            keys = kh[i, :, :stop].transpose(1, 2)
            torch.baddbmm(mask, qh[i, :, start:stop], keys, alpha=scale, out=scores[i])
        block_lse = lse[..., start:stop].to(scores.dtype)
        out[..., start:stop] = (scores.amax(-1).double() - lse[..., start:stop]).exp()
        if weights is not None:
            weights(start, scores.sub_(block_lse[..., None]).exp_())
    out[..., 0] = 1  # row 0: one key, weight 1 exactly
    return out


class _Bias(NamedTuple):
    """The causal ALiBi bias, ``-m (t - j)`` plus ``key_bias[h, j]`` (a family's own bias), for
    the block of query rows ``start ... stop - 1`` against keys ``0 ... stop - 1``; with a
    ``window``, against the first ``sinks`` keys and the keys within ``window`` of the block's
    rows only (:func:`windowed_attention`)."""

    slopes: Tensor  # [head]: 0 for a bias of the key alone
    toeplitz: Tensor  # _toeplitz's matrix, of which every block's mask is a view
    key_bias: Tensor | None  # [head, pos]
    start: int = 0
    stop: int = 0
    window: int | None = None
    sinks: int = 1
    cache_distance: bool = False

    @classmethod
    def of(
        cls,
        slopes: Tensor | None,
        key_bias: Tensor | None,
        rows: int,
        n_pos: int,
        window: int | None = None,
    ) -> _Bias:
        m = slopes if slopes is not None else key_bias.new_zeros(len(key_bias))
        return cls(m, _toeplitz(m, rows, n_pos, window), key_bias, window=window)

    def rows(self, start: int, stop: int) -> _Bias:
        return self._replace(start=start, stop=stop)

    def key_positions(self) -> slice | Tensor:
        """The block's keys: ``0 ... stop - 1``, or with a window its sinks and the keys from
        the first row's farthest recent one on."""
        if self.window is None:
            return slice(0, self.stop)
        return torch.cat([torch.arange(self._sink_count()), torch.arange(*self._recent())])

    def _sink_count(self) -> int:
        return min(self.sinks, self.stop)

    def _recent(self) -> tuple[int, int]:
        return min(max(self.sinks, self.start - self.window), self.stop), self.stop

    @property
    def keys(self) -> Tensor | None:
        """The key bias of the block's keys less its last key's (a constant per row, so the
        weights are unchanged and the values near the rows small)."""
        if self.key_bias is None:
            return None
        return self.key_bias[:, : self.stop] - self.key_bias[:, self.stop - 1 : self.stop]

    def mask(self) -> Float[Tensor, "head_index query key"]:
        """The block's mask over :meth:`key_positions`."""
        span = slice(0, self.stop) if self.window is None else slice(*self._recent())
        offset = self.toeplitz.shape[-1] - self.toeplitz.shape[-2] - self.start
        mask = self.toeplitz[:, : self.stop - self.start, offset + span.start : offset + span.stop]
        if self.key_bias is not None:
            mask = mask + self.keys[:, None, span]
        if self.window is None:
            return mask
        # The sinks are kept at any distance: their columns from the bias itself.
        t = torch.arange(self.start, self.stop, device=mask.device)[:, None]
        j = torch.arange(self._sink_count(), device=mask.device)
        seen = t.clamp(max=self.sinks + self.window) if self.cache_distance else t
        sinks = -self.slopes[:, None, None] * (seen - j).to(self.slopes.dtype)
        if self.key_bias is not None:
            sinks = sinks + self.keys[:, None, : len(j)]
        return torch.cat([sinks.masked_fill(j > t, -math.inf), mask], -1)

    def at(self, t: Tensor, j: Tensor | int) -> Float[Tensor, "head_index query"]:
        """The bias of query positions ``t`` on keys ``j`` (one per query, or one for all)."""
        j = torch.as_tensor(j, device=t.device).expand_as(t)
        bias = -self.slopes[:, None] * (t - j).to(self.slopes.dtype)
        return bias if self.key_bias is None else bias + self.keys[:, j]


def _score(query: Tensor, keys: Tensor, scale: float, bias: _Bias, t: Tensor, j: Tensor | int):
    """The scores of ``query`` (``[batch, head, query, d]``) on one key each: ``keys`` is one
    key or one per query."""
    return scale * (query * keys).sum(-1) + bias.at(t, j)


def _block_kernel(device: torch.device) -> Callable:
    """The fused kernel of one block of query rows on ``device``: ``kernel(q, k, values,
    scale, bias) -> (out, lse, row maxima or None)``; CPU's flash kernel, FlexAttention on CUDA."""
    return _flex_block if device.type == "cuda" else _flash_block


def _flash_block(
    query: Tensor, keys: Tensor, values: Tensor, scale: float, bias: _Bias
) -> tuple[Tensor, Tensor, None]:
    # One head width for all three: q and k padded with zeros (their dot products unchanged).
    pad = values.shape[-1] - query.shape[-1]
    query, keys = (torch.nn.functional.pad(t, (0, pad)) for t in (query, keys))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(query, keys, values, attn_mask=bias.mask()[None], scale=scale)
    return out, lse, None


def _flex_block(
    query: Tensor, keys: Tensor, values: Tensor, scale: float, bias: _Bias
) -> tuple[Tensor, Tensor, Tensor | None]:
    """FlexAttention with ALiBi as a ``score_mod``: compiled on CUDA, where it also returns the
    row maxima; eager (it materialises the block's scores) in float64 and on CPU (the tests)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    slopes, keys_bias = bias.slopes, bias.keys
    # A tensor, not an int: compiled, a captured int is a constant (one compilation per block).
    start = torch.tensor(bias.start, device=query.device)

    def alibi(score: Tensor, b: Tensor, h: Tensor, q_index: Tensor, kv_index: Tensor) -> Tensor:
        t = q_index + start
        biased = score - slopes[h] * (t - kv_index)
        if keys_bias is not None:
            biased = biased + keys_bias[h, kv_index]
        return torch.where(kv_index <= t, biased, -math.inf)

    # Compiled on CUDA; float64 (the refinement) eager, a block's scores at a time.
    compiled = query.device.type == "cuda" and query.dtype != torch.float64
    attend = _compiled_flex() if compiled else flex_attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager: "materialises the scores" (the CPU tests)
        out, aux = attend(
            query,
            keys,
            values,
            score_mod=alibi,
            scale=scale,
            return_aux=AuxRequest(lse=True, max_scores=compiled),
        )
    return out, aux.lse, aux.max_scores if compiled else None


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _toeplitz(
    slopes: Float[Tensor, " head_index"], rows: int, n_pos: int, window: int | None = None
) -> Float[Tensor, "head_index query key"]:
    """``T[h, i, x] = -m_h (i - c)`` for ``c = x - n_pos <= i`` (and ``i - c <= window``),
    ``-inf`` beyond: the slice ``[:, :Q, n_pos - b : n_pos - b + K]`` is the causal bias of
    query rows ``b ... b + Q - 1`` against keys ``0 ... K - 1``, a view."""
    i = torch.arange(rows, device=slopes.device)[:, None]
    c = torch.arange(n_pos + rows, device=slopes.device)[None, :] - n_pos
    distance = (i - c).to(slopes.dtype)
    cut = distance < 0
    if window is not None:
        cut |= distance > window
    return (-slopes[:, None, None] * distance).masked_fill(cut, -math.inf)


# What _stats gives per (sequence, head, query row), besides z.
ROW_STATS = (
    "lse",
    "max_weight",
    "bos_weight",
    "self_weight",
    "prev_weight",
    "entropy",
    "distance",
    "entropy_bound",
    "distance_bound",
)


def census_row_sums(
    stats: AttentionStats, min_query_pos: int = 1
) -> tuple[Float[Tensor, "stat batch head_index"], list[int]]:
    """The census's pattern sums from :func:`attention_stats`, as
    :func:`headsurgeon.probes.pattern_sums` gives them for whole sequences: float64 sums over
    query rows of bos_mass (rows ``t >= min_query_pos``), sink_score (every row), entropy,
    max_weight, mean_distance, self_mass, prev_mass (rows ``t >= max(min_query_pos, 1)``), and
    how many rows each sums."""
    first, first_prev = min_query_pos, max(min_query_pos, 1)
    rows = [
        stats.bos_weight[..., first:],
        stats.bos_weight,
        stats.entropy[..., first:],
        stats.max_weight[..., first:],
        stats.distance[..., first:],
        stats.self_weight[..., first:],
        stats.prev_weight[..., first_prev:],
    ]
    n_pos = stats.lse.shape[-1]
    counts = [
        max(n_pos - first, 0),
        n_pos,
        *[max(n_pos - first, 0)] * 4,
        max(n_pos - first_prev, 0),
    ]
    return torch.stack([r.double().sum(-1) for r in rows]), counts
