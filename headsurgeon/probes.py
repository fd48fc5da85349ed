"""Streaming hook reducers: per-head attention statistics without keeping any activation.

Each reducer turns one layer's activation for one batch (or one block of its query rows, see
:mod:`headsurgeon.long_context`) into a few numbers per sequence and head, as soon as the forward
pass produces it; an accumulator adds them up in float64. Nothing of size
``[batch, head, query_pos, key_pos]`` outlives the hook, so memory does not grow with the number of
batches, and the unembedding is never computed.

The attention weights themselves, pooled for pictures: :mod:`headsurgeon.pattern_samples`.

>>> from headsurgeon.loading import ModelShape, random_model
>>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
>>> stats = HeadStats(model)
>>> stream(model, torch.randint(0, 64, (3, 8)), stats.hooks(), batch_size=2, progress=False)
>>> means = stats.means()
>>> means["bos_mass"].shape, int(stats.n_seqs)
((2, 4), 3)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon import alibi, long_context
from headsurgeon.allocator import available_memory
from headsurgeon.backend import TRANSFORMER_LENS, HookPoint, Model, resident
from headsurgeon.backend.fused import AttentionStats, census_row_sums
from headsurgeon.data import batches
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.loading import model_info
from headsurgeon.long_context import FORWARD_BYTES_PER_ENTRY
from headsurgeon.progress import tqdm
from headsurgeon.validation import check_int, check_number

__all__ = [
    "pattern_stats",
    "write_norms",
    "HeadStats",
    "stream",
    "check_batch_memory",
    "check_training_memory",
]

logger = logging.getLogger(__name__)

PATTERN_STATS = (
    "bos_mass",
    "sink_score",
    "entropy",
    "max_weight",
    "mean_distance",
    "self_mass",
    "prev_mass",
)
# What HeadStats sums over the rows (positions) of a sequence: the pattern statistics, each
# head's write norm ‖z W_O‖ (rows from min_query_pos) and the norm ‖z‖ of its output before W_O
# (every position: Sandoval-Segura et al. average over all tokens, the first one included).
ROW_STATS = (*PATTERN_STATS, "output_norm", "head_norm")
# Per-sequence statistics HeadStats accumulates over sequences: the row means, except that the
# mean ‖z‖ becomes AHON-LN (over its layer's mean across heads, in the same sequence), and Gu et
# al.'s per-sequence sink indicator (sink_score > sink_eps).
HEAD_STATS = (*PATTERN_STATS, "output_norm", "ahon_ln", "sink_share")
# The hooks HeadStats reads in each layer (``blocks.{layer}.`` + name).
HEAD_HOOKS = ("attn.hook_pattern", "attn.hook_z", "hook_attn_out")

Hook = tuple[str | Callable[[str], bool], Callable[[Tensor, HookPoint], None]]
# Query rows distance_sums adds up in float32 before it adds them to its float64 sums.
_DISTANCE_ROWS = 64


def _rows(n_rows: int, offset: int, first: int) -> int:
    """Local index of the first of ``n_rows`` rows (query positions ``offset ...``) at or after
    query position ``first``."""
    return min(max(first - offset, 0), n_rows)


def pattern_sums(
    pattern: Float[Tensor, "batch head_index query_pos key_pos"], min_query_pos: int = 1
) -> tuple[Float[Tensor, "stat batch head_index"], list[int]]:
    """Sums over query rows of each :data:`PATTERN_STATS` value, and how many rows each sums.

    ``pattern`` is a causal pattern or a block of its rows (:mod:`headsurgeon.long_context`):
    ``[.., Q, K]`` holds query positions ``K - Q ... K - 1``. Rows are those at query positions
    ``t >= min_query_pos`` (``sink_score``: every row; ``prev_mass``: ``t >= max(min_query_pos,
    1)``); see :func:`pattern_stats` for each statistic.
    """
    p = pattern if pattern.dtype in (torch.float32, torch.float64) else pattern.float()
    n_rows, n_keys = p.shape[-2:]
    offset = n_keys - n_rows
    if offset < 0:
        raise ValueError(f"expected a causal pattern (query_pos <= key_pos), got {tuple(p.shape)}")
    first = _rows(n_rows, offset, min_query_pos)
    first_prev = _rows(n_rows, offset, max(min_query_pos, 1))
    rows = p[..., first:, :]
    # Element i of the (offset - 1) diagonal is A[i, offset + i - 1] (rows from 1 when offset is
    # 0): the weight of query offset + i on its previous token.
    previous = p.diagonal(offset=offset - 1, dim1=-2, dim2=-1)
    previous = previous[..., first_prev - max(1 - offset, 0) :]
    sums = torch.stack(
        [
            rows[..., 0].sum(-1),
            p[..., 0].sum(-1),
            _entropy_sums(rows),
            rows.amax(-1).sum(-1),
            _distance_sums(rows, offset, first),
            p.diagonal(offset=offset, dim1=-2, dim2=-1)[..., first:].sum(-1),
            previous.sum(-1),
        ]
    )
    n = n_rows - first
    return sums, [n, n_rows, n, n, n, n, n_rows - first_prev]


def _entropy_sums(
    rows: Float[Tensor, "batch head_index query_pos key_pos"],
) -> Float[Tensor, "batch head_index"]:
    """``-Σ_t Σ_k A[t, k] ln A[t, k]`` with ``0 ln 0 = 0``, the census's costliest reduction.

    ``ln`` of the weights clamped to the smallest normal float, times the weights, in place:
    1.5-2x faster than ``torch.special.entr`` on CPU, with the same pairwise sum. The clamp
    changes only subnormal weights' terms (< 1e-36 each in float32), below any sum's rounding.

    >>> a = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    >>> round(_entropy_sums(a).item(), 6)  # 0 + ln 2
    0.693147
    """
    logs = rows.clamp_min(torch.finfo(rows.dtype).tiny).log_()
    return -logs.mul_(rows).sum((-2, -1))


def _distance_sums(
    rows: Float[Tensor, "batch head_index query_pos key_pos"], offset: int, first: int
) -> Float[Tensor, "batch head_index"]:
    """``Σ_t Σ_k A[t, k] (t - k)`` over causal rows of query positions ``offset + first ...``.

    As two matrix-vector products, 15x faster than weighting every entry by its distance (the
    ``[Q, K]`` distance tensor, multiplied and summed): with ``t = offset + i``,
    ``Σ_k A[t, k] (t - k) = Σ_k A[t, k] (offset - k) + i Σ_k A[t, k]`` (masked weights are 0).
    Centred on the block, the terms cancel by at most ``i`` (< one block), not by ``t``.
    """
    keys = torch.arange(rows.shape[-1], device=rows.device, dtype=rows.dtype)
    local = torch.arange(first, first + rows.shape[-2], device=rows.device, dtype=rows.dtype)
    return (rows @ (offset - keys) + rows.sum(-1) * local).sum(-1)


def distance_sums(
    pattern: Float[Tensor, "batch head_index query_pos key_pos"], min_query_pos: int = 1
) -> Float[Tensor, "head_index distance"]:
    """``H[h, k] = Σ_b Σ_t A[b, h, t, t - k]`` over query rows ``t >= min_query_pos`` and keys
    ``t - k >= 1`` (position 0 left out): each head's attention mass by distance, in float64.

    ``pattern`` is a causal pattern or a block of its rows, as in :func:`pattern_sums`; the
    result has one column per distance ``0 ... K - 1`` (``K`` keys). Summing the blocks of a
    sequence gives the dense pattern's histogram.

    A view of the pattern whose row stride is one more than the keys puts every distance in one
    column (as :func:`headsurgeon.blindness.measure_blindness` counts zeros): one read of the
    pattern, no copy, no ``[Q, K]`` distance index.

    >>> uniform = torch.tril(torch.ones(3, 3)) / torch.arange(1, 4)[:, None]
    >>> distance_sums(uniform[None, None])[0]  # rows 1, 2: A[1, 1]; A[2, 2], A[2, 1]
    tensor([0.8333, 0.3333, 0.0000], dtype=torch.float64)
    """
    return _mass_by_distance(pattern, min_query_pos)


def _mass_by_distance(
    pattern: Float[Tensor, "batch head_index query_pos key_pos"], min_query_pos: int
) -> Float[Tensor, "head_index distance"]:
    """:func:`distance_sums`, read in place through a strided view of the pattern."""
    p = pattern if pattern.is_contiguous() else pattern.contiguous()
    n_rows, n_keys = p.shape[-2:]
    offset = n_keys - n_rows
    first = _rows(n_rows, offset, min_query_pos)
    sums = p.new_zeros(p.shape[1], n_keys, dtype=_accumulator_dtype(p.device))
    if first == n_rows:
        return sums
    if first == 0:  # row 0 has no row before it to read (below): its keys, by distance
        sums[:, :offset] += p[:, :, 0, 1 : offset + 1].sum(0, dtype=torch.float32).flip(-1)
        first = 1
    n = n_rows - first
    # Row i, column c of this view is key i + c - (n - 1) of row first + i: distance
    # n_keys - 1 - c in every row. A negative key reads the end of the row before, which is
    # past its diagonal (masked: 0), so the view needs no padding and nothing is copied.
    b, h, q, k = p.stride()
    start = p.storage_offset() + first * q - (n - 1)
    shifted = p.as_strided((len(p), p.shape[1], n, n_keys), (b, h, q + 1, k), start)
    # float32 sums of a few rows each, added in float64: a float64 reduction of float32 rows is
    # ~30x slower on CPU, one float32 sum over thousands of rows loses digits.
    by_column = torch.zeros_like(sums)
    for chunk in shifted.split(_DISTANCE_ROWS, dim=2):
        by_column += chunk.sum(2, dtype=torch.float32).sum(0)  # 10x faster than sum((0, 2))
    sums[:, :n_keys] += by_column.flip(-1)
    # Position 0 is left out: row first + i has it at distance offset + first + i.
    sums[:, offset + first :] -= p[:, :, first:, 0].sum(0, dtype=torch.float32)
    return sums


def pattern_stats(
    pattern: Float[Tensor, "batch head_index query_pos key_pos"], min_query_pos: int = 1
) -> Float[Tensor, "stat batch head_index"]:
    """Reduce a causal attention pattern to per-sequence means, one per :data:`PATTERN_STATS`.

    Rows are query positions ``t >= min_query_pos`` (``sink_score`` uses every row; ``prev_mass``
    rows ``t >= max(min_query_pos, 1)``, which have a previous token):

    * ``bos_mass``: ``A[t, 0]``; ``sink_score``: ``A[t, 0]`` over all rows (Gu et al.'s α_0);
    * ``entropy``: ``-Σ_k A[t, k] ln A[t, k]`` in nats, with ``0 ln 0 = 0``;
    * ``max_weight``: ``max_k A[t, k]``; ``mean_distance``: ``Σ_k A[t, k] (t - k)`` in tokens;
    * ``self_mass``: ``A[t, t]``; ``prev_mass``: ``A[t, t - 1]``.

    Computed in float32 (or float64 for float64 patterns). A block of rows (``[.., Q, K]``,
    query positions ``K - Q ...``) gives the means over its own rows; a statistic with no row
    in it is 0.

    >>> uniform = torch.tril(torch.ones(3, 3)) / torch.arange(1, 4)[:, None]
    >>> [round(x, 4) for x in pattern_stats(uniform[None, None], 1)[:, 0, 0].tolist()]
    [0.4167, 0.6111, 0.8959, 0.4167, 0.75, 0.4167, 0.4167]
    """
    n_pos = pattern.shape[-1]
    if not 0 <= min_query_pos < n_pos:
        raise ValueError(f"min_query_pos {min_query_pos} outside 0..{n_pos - 1}")
    sums, rows = pattern_sums(pattern, min_query_pos)
    return (
        sums / torch.tensor(rows, dtype=sums.dtype, device=sums.device).clamp(min=1)[:, None, None]
    )


def write_sums(
    z: Float[Tensor, "batch pos head_index d_head"],
    W_O: Float[Tensor, "head_index d_head d_model"],
    first: int = 1,
) -> Float[Tensor, "batch head_index"]:
    """Sum over positions ``first ...`` of ``z`` of ``‖z[t, h] @ W_O[h]‖``, per sequence and head.

    Uses the per-head Gram matrix ``W_O[h] W_O[h]ᵀ`` (``[d_head, d_head]``), so the
    ``[batch, pos, head, d_model]`` tensor of per-head writes is never formed.
    """
    return _write_norms_by_position(z[:, first:], W_O).sum(1)


def _write_norms_by_position(
    z: Float[Tensor, "batch pos head_index d_head"], W_O: Float[Tensor, "head_index d_head d_model"]
) -> Float[Tensor, "batch pos head_index"]:
    """``‖z[t, h] @ W_O[h]‖`` at every position, in float32 (see :func:`write_sums`)."""
    return _norms_from_gram(z, _gram(W_O, z.device))


def _gram(
    W_O: Float[Tensor, "head_index d_head d_model"], device: torch.device
) -> Float[Tensor, "head_index d_head d_head"]:
    """Each head's ``W_O[h] W_O[h]ᵀ`` in float32."""
    w = W_O.to(device=device, dtype=torch.float32)
    return torch.einsum("hdm,hem->hde", w, w)


def _norms_from_gram(
    z: Float[Tensor, "batch pos head_index d_head"], gram: Float[Tensor, "head_index d_head d_head"]
) -> Float[Tensor, "batch pos head_index"]:
    zf = z.float()
    squared = torch.einsum("bphd,hde,bphe->bph", zf, gram, zf)
    return squared.clamp(min=0).sqrt()  # rounding can make a zero norm slightly negative


def write_norms(
    z: Float[Tensor, "batch pos head_index d_head"],
    W_O: Float[Tensor, "head_index d_head d_model"],
    min_query_pos: int = 1,
) -> Float[Tensor, "batch head_index"]:
    """Mean over positions ``t >= min_query_pos`` of ``‖z[t, h] @ W_O[h]‖``, per sequence and head.

    >>> W_O = torch.eye(2).repeat(3, 1, 1)  # three heads that copy z into the residual stream
    >>> z = torch.tensor([[[[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]]]]).repeat(1, 2, 1, 1)
    >>> write_norms(z, W_O, 0)
    tensor([[5., 0., 1.]])
    """
    return write_sums(z, W_O, min_query_pos) / max(z.shape[1] - min_query_pos, 1)


def _accumulator_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class HeadStats:
    """Per-head running sums of :data:`PATTERN_STATS`, write norms and the two standard scores
    (Gu et al.'s per-sequence sink indicator, Sandoval-Segura et al.'s AHON-LN), fed by forward
    hooks.

    ``stats = HeadStats(model); stream(model, tokens, stats.hooks())``, then ``stats.means()``,
    ``stats.stds()`` (over sequences), ``stats.far_mass()`` and ``stats.reach(eps)``;
    ``stats.reset()`` starts over and ``stats.check_fired(n_seqs)`` raises
    :class:`~headsurgeon.errors.UnsupportedArchitectureError` for a hook that never fired. All
    sums are float64 on the model's device; a sequence run in blocks of query rows is summed block
    by block, and nothing is kept per sequence beyond the batch in progress.

    - ``model``: the model whose ``hook_pattern``, ``hook_z`` and ``hook_attn_out`` it reads.
    - ``min_query_pos``: the first query row of the pattern statistics.
    - ``sink_eps``: the ``sink_score`` above which a sequence counts in ``sink_share``.

    How the three hooks meet, the write norm, reach and the per-sequence scores: [Data, census,
    labels: streaming hook reducers](census.md#streaming-hook-reducers-probes).
    """

    def __init__(self, model: Model, *, min_query_pos: int = 1, sink_eps: float = 0.3):
        self.model = model
        self.min_query_pos = min_query_pos
        self.sink_eps = check_number(sink_eps, "sink_eps", low=0, high=1)
        self.device = torch.device(model.cfg.device or "cpu")
        self.reset()

    def reset(self) -> None:
        n_layers, n_heads = self.model.cfg.n_layers, self.model.cfg.n_heads
        dtype = _accumulator_dtype(self.device)
        self.sums = torch.zeros(len(HEAD_STATS), n_layers, n_heads, dtype=dtype, device=self.device)
        self.squares = torch.zeros_like(self.sums)
        self.layer_write = torch.zeros(n_layers, dtype=dtype, device=self.device)
        self.counts = torch.zeros(n_layers, dtype=dtype, device=self.device)
        # Per layer, the batch in progress: [stat, batch, head] sums over rows, rows per stat,
        # the layer's write-norm sums [batch], the query offset of the block being run.
        self._batch: list[_Batch | None] = [None] * n_layers
        # Per layer, what each hook gave for the block of rows whose hooks are not all in yet.
        self._pending: list[dict[str, Any]] = [{} for _ in range(n_layers)]
        # Per layer, the blocks each hook has fired for.
        self.fired = {name: [0] * n_layers for name in HEAD_HOOKS}
        # Per layer, each head's W_O W_Oᵀ (float32, [head, d_head, d_head]), made at first use.
        self._grams: dict[int, Tensor] = {}
        # Pooled over every sequence: attention mass by head and distance (distance_sums), and
        # the query rows counted, by position; both as long as the longest sequence seen.
        self.distance_mass = torch.zeros(n_layers, n_heads, 0, dtype=dtype, device=self.device)
        self.query_rows = torch.zeros(n_layers, 0, dtype=dtype, device=self.device)
        # Heads the fused path computed in float64 in some batch (its error bound), [layer, head].
        self.refined = torch.zeros(n_layers, n_heads, dtype=torch.bool)

    def _flush(self, layer: int) -> None:
        """Add the per-sequence means of ``layer``'s finished batch to the running sums."""
        batch = self._batch[layer]
        if batch is None:
            return
        self._batch[layer] = None
        rows = torch.tensor(batch.rows, dtype=self.sums.dtype, device=self.sums.device)
        means = batch.sums / rows.clamp(min=1)[:, None, None]  # [ROW_STATS, batch, head]
        per_sequence = self._per_sequence(means)
        self.sums[:, layer] += per_sequence.sum(1)
        self.squares[:, layer] += per_sequence.square().sum(1)
        written = rows[ROW_STATS.index("output_norm")].item()
        self.layer_write[layer] += (batch.layer_write / max(written, 1)).sum()
        self.counts[layer] += means.shape[1]

    def _per_sequence(
        self, means: Float[Tensor, "stat batch head_index"]
    ) -> Float[Tensor, "stat batch head_index"]:
        """:data:`HEAD_STATS` of each finished sequence from its :data:`ROW_STATS` means."""
        norms = means[ROW_STATS.index("head_norm")]
        ahon_ln = norms / norms.mean(-1, keepdim=True)  # 0 / 0 (a silent layer): NaN
        sink = means[PATTERN_STATS.index("sink_score")] > self.sink_eps  # strict, as Gu's code
        kept = means[: ROW_STATS.index("output_norm") + 1]
        return torch.cat([kept, ahon_ln[None], sink[None].to(means.dtype)])

    def _arrive(self, layer: int, name: str, value: Any) -> None:
        """Keep one hook's values for ``layer``'s current block; add the block once all are in."""
        pending = self._pending[layer]
        if name in pending:  # the others did not fire for the previous block: they never will
            missing = [hook for hook in HEAD_HOOKS if hook not in pending]
            raise unfired(self.model, "the census", f"blocks.{layer}.{missing[0]}", [layer])
        pending[name] = value
        self.fired[name][layer] += 1
        if len(pending) == len(HEAD_HOOKS):
            self._pending[layer] = {}
            self._add_block(layer, *(pending[hook] for hook in HEAD_HOOKS))

    def _add_block(
        self,
        layer: int,
        pattern: tuple[Tensor, list[int], int, int],
        head_outputs: tuple[Tensor, Tensor],
        layer_write: Tensor,
    ) -> None:
        sums, rows, offset, n_keys = pattern
        writes, head_norms = head_outputs
        if offset == 0:
            self._flush(layer)  # a new batch of sequences
        batch = self._batch[layer]
        if batch is None:
            batch = self._batch[layer] = _Batch.empty(sums.shape[1], self.sums)
        elif offset != batch.next_offset:
            raise RuntimeError(
                f"HeadStats: layer {layer} got query rows from {offset}, expected "
                f"{batch.next_offset}: blocks must come in order"
            )
        first = _rows(writes.shape[1], offset, self.min_query_pos)
        batch.sums[: len(PATTERN_STATS)] += sums
        batch.sums[len(PATTERN_STATS)] += writes[:, first:].sum(1).to(self.sums.dtype)
        batch.sums[len(PATTERN_STATS) + 1] += head_norms.sum(1).to(self.sums.dtype)
        batch.layer_write += layer_write[:, first:].sum(-1).to(self.sums.dtype)
        n_written, n_rows = writes.shape[1] - first, head_norms.shape[1]
        added = [*rows, n_written, n_rows]
        batch.rows = [r + n for r, n in zip(batch.rows, added, strict=True)]
        batch.offset, batch.next_offset = offset, n_keys

    def _pattern_hook(self, pattern: Tensor, hook: HookPoint) -> None:
        n_rows, n_keys = pattern.shape[-2:]
        sums, rows = pattern_sums(pattern, self.min_query_pos)
        sums = sums.to(self.sums.device, self.sums.dtype)
        self._add_distances(hook.layer(), pattern)
        self._arrive(hook.layer(), "attn.hook_pattern", (sums, rows, n_keys - n_rows, n_keys))

    def fused_sums(self, layer: int, stats: AttentionStats) -> None:
        """Take one layer's fused statistics of whole sequences in place of its pattern: the
        census hands it per layer on its fused path (no reach histogram)."""
        sums, rows = census_row_sums(stats, self.min_query_pos)
        sums = sums.to(self.sums.device, self.sums.dtype)
        self.refined[layer] |= stats.refined
        n_pos = stats.lse.shape[-1]
        self._arrive(layer, "attn.hook_pattern", (sums, rows, 0, n_pos))

    def _add_distances(self, layer: int, pattern: Tensor) -> None:
        """Add a block's mass by distance, and its rows, to the pooled histograms."""
        n_rows, n_keys = pattern.shape[-2:]
        mass = _mass_by_distance(pattern, self.min_query_pos)
        grow = n_keys - self.query_rows.shape[-1]
        if grow > 0:
            pad = torch.nn.functional.pad
            self.distance_mass = pad(self.distance_mass, (0, grow))
            self.query_rows = pad(self.query_rows, (0, grow))
        self.distance_mass[layer, :, :n_keys] += mass.to(self.device, self.distance_mass.dtype)
        first = max(n_keys - n_rows, self.min_query_pos)
        self.query_rows[layer, first:n_keys] += len(pattern)

    def _z_hook(self, z: Tensor, hook: HookPoint) -> None:
        layer = hook.layer()
        if layer not in self._grams:  # weights are frozen during a census: once per layer
            with resident(self.model.blocks[layer].attn) as attn:
                self._grams[layer] = _gram(attn.W_O, z.device)
        writes = _norms_from_gram(z, self._grams[layer]).to(self.sums.device)
        head_norms = z.float().norm(dim=-1).to(self.sums.device)  # [batch, pos, head]
        self._arrive(layer, "attn.hook_z", (writes, head_norms))

    def _attn_out_hook(self, out: Tensor, hook: HookPoint) -> None:
        with resident(self.model.blocks[hook.layer()].attn) as attn:
            b_O = attn.b_O
            written = out.float() if b_O is None else out.float() - b_O.float()
        self._arrive(hook.layer(), "hook_attn_out", written.norm(dim=-1).to(self.sums.device))

    def hooks(self, *, pattern: bool = True) -> list[Hook]:
        """Forward hooks for ``hook_pattern`` (unless ``pattern`` is False: the fused path
        hands its statistics to :meth:`fused_sums`), ``hook_z`` and ``hook_attn_out`` of each
        layer."""
        readers = (self._pattern_hook, self._z_hook, self._attn_out_hook)
        return [
            (f"blocks.{layer}.{name}", reader)
            for layer in range(self.model.cfg.n_layers)
            for name, reader in zip(HEAD_HOOKS, readers, strict=True)
            if pattern or name != "attn.hook_pattern"
        ]

    def finish(self) -> None:
        """Take the means of the sequences in progress (``means()`` and ``stds()`` call it)."""
        for layer in range(self.model.cfg.n_layers):
            self._flush(layer)

    def check_fired(self, n_seqs: int, analysis: str = "the census") -> None:
        """Raise :class:`~headsurgeon.errors.UnsupportedArchitectureError` unless every layer's
        hooks fired for all ``n_seqs`` sequences streamed (a hook that never fired would leave
        its statistics at 0)."""
        self.finish()
        short = [layer for layer, count in enumerate(self.counts.tolist()) if count != n_seqs]
        if short:
            most = max(self.fired[name][short[0]] for name in HEAD_HOOKS)
            lagging = (n for n in HEAD_HOOKS if self.fired[n][short[0]] < most or not most)
            missing = next(lagging, HEAD_HOOKS[0])
            raise unfired(self.model, analysis, f"blocks.{short[0]}.{missing}", short)

    @property
    def n_seqs(self) -> int:
        """Sequences seen so far."""
        self.finish()
        return int(self.counts[0].item())

    def means(self) -> dict[str, np.ndarray]:
        """Mean over sequences of each statistic, ``[layer, head]``; plus ``output_share``.

        ``output_share`` is a head's mean write norm over the mean norm of its layer's whole
        attention write.
        """
        self.finish()
        counts = self.counts.clamp(min=1)[:, None]
        means = (self.sums / counts).double().cpu()
        result = {name: means[i].numpy() for i, name in enumerate(HEAD_STATS)}
        layer_mean = (self.layer_write / self.counts.clamp(min=1)).double().cpu()[:, None]
        result["output_share"] = (means[HEAD_STATS.index("output_norm")] / layer_mean).numpy()
        return result

    def far_mass(self) -> np.ndarray:
        """``[layer, head, distance]``: for each distance ``d``, the mean over query rows ``t >=
        max(d + 1, min_query_pos)`` of every sequence of the attention mass on keys at distance
        ``d`` or more, position 0 left out (NaN where no row is that far from position 1).

        Rows are pooled over sequences (each row counts once). Exact from the pooled histograms
        whatever the blocks: ``Σ_t Σ_{k >= d} A[t, t - k]`` is the suffix sum of the mass by
        distance, since a row ``t`` has keys ``t - k >= 1`` at distance ``k >= d`` only when
        ``t >= d + 1``.
        """
        mass = self.distance_mass.double().cpu()
        tail = mass.flip(-1).cumsum(-1).flip(-1)
        rows = self.query_rows.double().cpu().flip(-1).cumsum(-1).flip(-1)  # rows t >= d
        beyond = torch.nn.functional.pad(rows[:, 1:], (0, 1))  # rows t >= d + 1
        means = tail / beyond[:, None, :]
        return torch.where(beyond[:, None, :] > 0, means, math.nan).numpy()

    def reach(self, eps: float) -> np.ndarray:
        """``[layer, head]``: the smallest distance ``d`` whose :meth:`far_mass` is at most
        ``eps`` (``inf`` when none is, within the longest sequence seen: the head still puts
        more than ``eps`` on the farthest keys measured)."""
        return alibi.reach_from_far_mass(self.far_mass(), eps)

    def stds(self) -> dict[str, np.ndarray]:
        """Standard deviation across sequences (ddof=1; 0 for one sequence), ``[layer, head]``."""
        self.finish()
        n = self.counts.double().cpu()[:, None]
        sums, squares = self.sums.double().cpu(), self.squares.double().cpu()
        variance = (squares - sums.square() / n.clamp(min=1)) / (n - 1).clamp(min=1)
        return {name: variance[i].clamp(min=0).sqrt().numpy() for i, name in enumerate(HEAD_STATS)}


def unfired(
    model: Model, analysis: str, hook: str, layers: Sequence[int]
) -> UnsupportedArchitectureError:
    """The one-line error for a hook that never fired: an analysis reports nothing it did not
    see (its sums would read as zeros)."""
    info = model_info(model)
    architecture = (
        (info.hf_config.get("architectures") or [None])[0]
        or getattr(model.cfg, "original_architecture", None)
        or type(model).__name__
    )
    where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {', '.join(map(str, layers))}"
    return UnsupportedArchitectureError(
        f"{analysis} cannot measure {info.name} ({architecture}, attention "
        f"{type(model.blocks[0].attn).__name__}): {hook} never fired in {where} under "
        f"{TRANSFORMER_LENS}, so there is nothing exact to report (models converted by "
        "headsurgeon.loading.from_hf_model run eager attention, which shows what it can)"
    )


def check_fired(model: Model, analysis: str, counts: dict[str, Sequence[int]]) -> None:
    """Raise :func:`unfired`'s error unless each hook (``{name: calls per layer}``, names with a
    ``{layer}`` field) fired at least once in every layer."""
    for name, per_layer in counts.items():
        silent = [layer for layer, n in enumerate(per_layer) if not n]
        if silent:
            raise unfired(model, analysis, name.format(layer=silent[0]), silent)


@dataclasses.dataclass
class _Batch:
    """One layer's sums over the rows seen so far of the batch of sequences in progress."""

    sums: Tensor  # [ROW_STATS, batch, head]: sums over rows (norms over positions)
    rows: list[int]  # rows (positions) each statistic summed
    layer_write: Tensor  # [batch]: the layer's write norm summed over positions
    offset: int  # query position of the current block's first row
    next_offset: int

    @classmethod
    def empty(cls, n_seqs: int, like: Tensor) -> _Batch:
        sums = like.new_zeros(len(ROW_STATS), n_seqs, like.shape[-1])
        return cls(sums, [0] * len(ROW_STATS), like.new_zeros(n_seqs), 0, 0)


def stream(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    fwd_hooks: Sequence[Hook],
    *,
    batch_size: int = 8,
    stop_at_layer: int | None = None,
    progress: bool = True,
    desc: str = "forward",
    block_size: int | None = None,
    bytes_per_entry: int = FORWARD_BYTES_PER_ENTRY,
) -> None:
    """Run ``tokens`` through ``model`` in batches with ``fwd_hooks``, keeping no output.

    Gradients are off and the pass stops after block ``stop_at_layer - 1`` (default: the last
    block), so neither the final LayerNorm nor the unembedding is computed. Sequences longer
    than ``block_size`` query rows run in blocks (:func:`headsurgeon.long_context.run_in_blocks`:
    exact causal attention through the key-value cache; each hook fires once per block). The
    default block is the longest whose attention fits
    :data:`~headsurgeon.long_context.DEFAULT_BLOCK_BYTES` at ``bytes_per_entry`` bytes per
    ``(batch, head, query, key)`` entry (the forward's own tensors plus what the hooks keep).
    """
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if block_size is not None:
        block_size = check_int(block_size, "block_size", minimum=1)
    stop = model.cfg.n_layers if stop_at_layer is None else stop_at_layer
    n_pos = tokens.shape[1]
    rows = [
        block_size
        or long_context.block_size(model, n_pos, batch=len(b), bytes_per_entry=bytes_per_entry)
        for b in batches(tokens, batch_size)
    ]
    if rows:  # the first batch is the largest: checked before anything is allocated
        check_batch_memory(model, len(tokens[:batch_size]), n_pos, rows[0], bytes_per_entry)
    bar = tqdm(total=sum(-(-n_pos // r) for r in rows), desc=desc, disable=not progress)
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks)), bar:
        for batch, block in zip(batches(tokens, batch_size), rows, strict=True):
            for _ in long_context.run_in_blocks(model, batch, block_size=block, stop_at_layer=stop):
                bar.update()


# Activations of one block per (sequence, position): the residual stream, the MLP's hidden layer
# (4 d_model) and their copies, counted generously as 16 d_model values.
ACTIVATION_VALUES_PER_D_MODEL = 16


def check_batch_memory(
    model: Model,
    batch: int,
    n_pos: int,
    block: int,
    bytes_per_entry: int = FORWARD_BYTES_PER_ENTRY,
    available: int | None = None,
) -> int:
    """The bytes one forward of ``batch`` sequences of ``n_pos`` tokens in blocks of ``block``
    query rows needs (attention: ``batch x head x block x n_pos x bytes_per_entry``; the rest:
    ``batch x n_pos x 16 d_model`` values), or one line naming ``--batch-size`` when that is
    more than the memory ``available`` (default: free memory on the model's device, from
    ``/proc/meminfo`` or CUDA; not checked where neither says). An estimate, checked before the
    first allocation, so ``--batch-size 100000`` is refused at once rather than killed later.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=9, n_ctx=16))
    >>> check_batch_memory(model, 4, 16, 16, available=10**9)
    65536
    >>> check_batch_memory(model, 10**6, 16, 16, available=10**9)
    Traceback (most recent call last):
    ...
    headsurgeon.errors.InvalidArgumentError: a batch of 1000000 sequences of 16 tokens needs ...
    """
    cfg = model.cfg
    itemsize = torch.finfo(cfg.dtype).bits // 8 if cfg.dtype.is_floating_point else 4
    attention = batch * cfg.n_heads * min(block, n_pos) * n_pos * bytes_per_entry
    rest = batch * n_pos * ACTIVATION_VALUES_PER_D_MODEL * cfg.d_model * itemsize
    needed = attention + rest
    device = torch.device(getattr(cfg, "device", None) or "cpu")  # where activations go
    free = _free_memory(device) if available is None else available
    if free is not None and needed > free:
        raise InvalidArgumentError(
            f"a batch of {batch} sequences of {n_pos} tokens needs about {needed / 2**30:.1f} GiB "
            f"for one forward, more than the {free / 2**30:.1f} GiB free; use a smaller batch "
            f"size (--batch-size {max(1, batch * free // needed // 2)} or less)"
        )
    return needed


# Entries of one attention pattern kept for the backward pass: the scores, the pattern and its
# hook's copy.
TRAINING_ATTENTION_COPIES = 3
# The float32 logits of the next-token loss: the logits, their log-softmax and its gradient.
LOGIT_COPIES = 3


def check_training_memory(
    model: Model,
    batch: int,
    n_pos: int,
    *,
    gradient_checkpointing: bool = False,
    loss_chunk: int | None = None,
    logits: bool = True,
    available: int | None = None,
) -> int:
    """The bytes one fine-tuning step of ``batch`` sequences of ``n_pos`` tokens keeps for its
    backward pass, or one line naming ``--batch-size`` when that is more than the memory
    ``available`` (default: free memory on the model's device, as :func:`check_batch_memory`
    reads it). Every layer keeps ``batch x n_pos x 16 d_model`` activations and its attention
    patterns (``batch x head x n_pos^2``, three copies); with ``gradient_checkpointing`` only each
    layer's input and one layer's activations. With ``logits`` (the next-token loss) the float32
    logits of ``loss_chunk`` positions (default all) at a time, three copies. An estimate
    checked before training, so a batch far too large is refused at once rather than killed by
    the kernel mid-run.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=2, n_heads=2, d_model=8, d_vocab=9, n_ctx=16))
    >>> check_training_memory(model, 4, 16, available=10**9)
    121600
    >>> check_training_memory(model, 10**7, 16, available=10**9)
    Traceback (most recent call last):
    ...
    headsurgeon.errors.InvalidArgumentError: fine-tuning a batch of 10000000 sequences of 16 ...
    """
    cfg = model.cfg
    itemsize = torch.finfo(cfg.dtype).bits // 8 if cfg.dtype.is_floating_point else 4
    layer = (
        batch
        * n_pos
        * itemsize
        * (
            ACTIVATION_VALUES_PER_D_MODEL * cfg.d_model
            + TRAINING_ATTENTION_COPIES * cfg.n_heads * n_pos
        )
    )
    inputs = batch * n_pos * cfg.d_model * itemsize  # one layer's input: all checkpointing keeps
    needed = cfg.n_layers * inputs + layer if gradient_checkpointing else cfg.n_layers * layer
    if logits:
        needed += batch * min(loss_chunk or n_pos, n_pos) * cfg.d_vocab * 4 * LOGIT_COPIES
    device = torch.device(getattr(cfg, "device", None) or "cpu")
    free = _free_memory(device) if available is None else available
    if free is not None and needed > free:
        also = "" if gradient_checkpointing else ", or --gradient-checkpointing"
        raise InvalidArgumentError(
            f"fine-tuning a batch of {batch} sequences of {n_pos} tokens keeps about "
            f"{needed / 2**30:.1f} GiB of activations for the backward pass, more than the "
            f"{free / 2**30:.1f} GiB free; use a smaller batch size (--batch-size "
            f"{max(1, batch * free // needed // 2)} or less, with --grad-accum to keep the "
            f"batch the optimiser sees{also})"
        )
    return needed


def _free_memory(device: torch.device) -> int | None:
    """Free bytes where ``device`` keeps its tensors: CUDA's count, or on the CPU
    :func:`headsurgeon.allocator.available_memory`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    return available_memory()
