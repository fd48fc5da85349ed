"""The code of :mod:`headsurgeon.blindness` (underflow blindness of ALiBi heads: predicted,
measured, and mitigated through hooks), which serves these names lazily; its docstring is the
manual.

>>> df = analytic_blindness("bloom-560m", dtypes=["float32"], limits=["normal"])
>>> df[df.layer == 0].blind_distance.iloc[[0, -1]].tolist()
[124.0, 22359.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from headsurgeon import alibi, long_context
from headsurgeon.backend import HookPoint, Model, add_bias_hook, fused_refusal
from headsurgeon.data import Cut, Data, Sequences, verb_sequences
from headsurgeon.defaults import ANALYSED_DTYPES, CONVENTIONS
from headsurgeon.dtypes import parse_dtype
from headsurgeon.errors import (
    InvalidArgumentError,
    UnsupportedArchitectureError,
)
from headsurgeon.exact_alibi import bias_builder, trained_bias
from headsurgeon.families import attention_family
from headsurgeon.inuse import holds_model, hooked
from headsurgeon.loading import ModelInfo, ModelShape, model_info, model_shape
from headsurgeon.loading.facts import model_metadata
from headsurgeon.probes import stream, unfired
from headsurgeon.validation import check_choice, check_int

__all__ = [
    "ANALYSED_DTYPES",
    "CONVENTIONS",
    "BlindnessMeasurement",
    "analytic_blindness",
    "measure_blindness",
    "BLINDNESS_CUT",
    "mitigation",
]

logger = logging.getLogger(__name__)

BLINDNESS_CUT = Cut(seq_len=1024, n_seqs=8)
"""How :func:`measure_blindness` cuts texts: 8 sequences of 1,024 tokens (at most the context
of a model with learned or rotary positions)."""
# Keys per skipped tile: a multiple of the widest SIMD vector (16 float32 or 32 bfloat16 lanes
# in AVX-512), so that a row's softmax without its skipped keys (each exactly 0 after exp) sums
# its other terms in the same lanes and gives the same bits.
_SKIP_TILE = 64
# Nats beyond float32's zero-rounding point (-103.97: the widest of the analysed formats, and
# the one every softmax kernel computes exp in) at which a skipped weight is certainly 0, even
# where a kernel subtracts the row's maximum in bfloat16 (a relative error of 2^-8).
_SKIP_MARGIN = 8.0
# Entries of one chunk (one sequence, one head, rows x keys): its ~40 bytes an entry of
# temporaries stay near the cache, and the hook's memory does not grow with the block.
_CHUNK_ENTRIES = 2**17
# Bytes a block's forward pass keeps per (batch, head, query, key) entry, measured: ~40 on
# TransformerLens 3.x, ~55 on 4.x (long_context.FORWARD_BYTES_PER_ENTRY counts 16), with room;
# the hook adds one chunk, not a share of the block.
_BYTES_PER_ENTRY = 64
# A causal-masked score is below this (no real logit is).
_MASKED = -1e4


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name of a float format.

    >>> dtype_name("bf16"), dtype_name(torch.float16)
    ('bfloat16', 'float16')
    """
    return str(parse_dtype(dtype)).removeprefix("torch.")


def _names(values: Sequence[str] | str, what: str) -> list[str]:
    values = [values] if isinstance(values, str) else list(values)
    if not values:
        raise InvalidArgumentError(f"give at least one {what}")
    return values


def alibi_door(
    model: str | os.PathLike | Model, caller: str, instead: str
) -> tuple[ModelInfo | None, ModelShape, str]:
    """The door of a weight-free analysis: a model's info (``None`` for a name or folder), its
    shape and name; one line (naming ``instead``) for a model without ALiBi."""
    is_model = isinstance(model, Model)
    info = model_info(model, caller) if is_model else None
    shape = info.shape if is_model else model_shape(model)
    name = info.name if is_model else str(model)
    if shape.positional != "alibi":
        raise UnsupportedArchitectureError(
            f"{caller.replace('_', ' ')} applies to ALiBi models only; {name} uses "
            f"{shape.positional} positions ({instead})"
        )
    return info, shape, name


def analytic_blindness(
    model: str | os.PathLike | Model,
    *,
    dtypes: Sequence[str] = ANALYSED_DTYPES,
    limits: Sequence[str] = alibi.LIMITS,
    bias: str | None = None,
    context_length: int | None = None,
    **params,
) -> pd.DataFrame:
    """Blind distance of every head, predicted from its ALiBi slope alone (no weights needed).

    ``bias`` (with ``params``) is the ALiBi kind to predict for; default: the one the model was
    trained with (``standard`` unless its ``headsurgeon.json`` records a variant).

    One row per (layer, head, dtype, limit): ``slope``, ``blind_distance`` (tokens; ``inf``
    if never, see :func:`headsurgeon.alibi.blind_distance` for the definition and the bias kinds),
    ``blind_share`` (share of the head's causal entries in a ``context_length``-token sequence at
    or beyond its blind distance) and ``label``: ``blind`` if some key within ``context_length``
    tokens is blind, else ``sighted``. ``context_length`` defaults to the model's. Slopes are the
    same in every layer, so layers repeat. Raises :class:`UnsupportedArchitectureError` for
    models without ALiBi (use :func:`measure_blindness`, which applies to every model).
    """
    info, shape, name = alibi_door(
        model, "analytic_blindness", "measure_blindness / --measure still runs"
    )
    is_model = info is not None
    if context_length is None:
        context_length = shape.n_ctx
    context_length = check_int(context_length, "context_length", minimum=1)
    if is_model:
        head_slopes = info.slopes
    else:  # the slopes transformers applies to a model of the family (MPT's, Falcon's, BLOOM's)
        head_slopes = shape.alibi_family.slopes(shape.n_heads, shape.d_model // shape.n_heads)
    if bias is None:
        bias, params = trained_bias(info.metadata if is_model else model_metadata(model))
    frames = []
    for dtype in map(dtype_name, _names(dtypes, "dtype")):
        for limit in _names(limits, "limit"):
            distance = alibi.blind_distance(head_slopes, dtype, limit, bias, **params)
            share = [alibi.blind_share([d], context_length) for d in distance.tolist()]
            frames.append(
                pd.DataFrame(
                    {
                        "layer": 0,
                        "head": range(shape.n_heads),
                        "slope": head_slopes.double().numpy(),
                        "dtype": dtype,
                        "limit": str(limit),
                        "bias": bias,
                        "blind_distance": distance.numpy(),
                        "context_length": context_length,
                        "blind_share": share,
                    }
                )
            )
    # Grouped by dtype and limit in the order given, then layer and head.
    df = pd.concat(
        [frame.assign(layer=layer) for frame in frames for layer in range(shape.n_layers)],
        ignore_index=True,
    )
    df["label"] = (df["blind_distance"] < df["context_length"]).map(
        {True: "blind", False: "sighted"}
    )
    df.attrs.update(model=name, bias=bias, context_length=context_length, params=dict(params))
    return df


@dataclasses.dataclass
class BlindnessMeasurement:
    """Measured underflow of attention weights (see :func:`measure_blindness`).

    ``by_head``: one row per (layer, head, dtype). ``by_distance``: one row per (layer, head,
    dtype, distance bucket). ``by_length``: one row per (dtype, context length): the share of all
    causal attention entries, over every layer and head, that underflow.
    """

    by_head: pd.DataFrame
    by_distance: pd.DataFrame
    by_length: pd.DataFrame
    convention: str
    n_seqs: int
    seq_len: int


class _UnderflowCounter:
    """Float64 sums of underflowed weights per (dtype, layer, head, distance) and query position.

    A weight underflows in a dtype when the dtype's softmax gives exactly 0 for a causal entry
    (finite logit), whose exact weight is always positive: past ~745 nats below the row's
    maximum even float64 rounds it to 0, so float64 cannot be the judge. Lost mass is the
    float64 weight (0 for those far entries, which lose less than 1e-323 each). ``hf``: softmax
    in float32, probabilities cast to the dtype (Hugging Face BLOOM); ``tl``: logits cast to the
    dtype and softmax computed in it (TransformerLens 3.x).

    The hook takes square scores or a block's rows (``[batch, head, Q, offset + Q]``) and works
    through them in chunks of rows of one head of one sequence, each cut at its last query's
    diagonal. Tiles of keys so far below every row's largest logit that they are 0 in every
    dtype (see :func:`_skip_bound`) are counted without being computed, and their weights (each
    below ``e^-skip_nats``) are left out of the mass.
    """

    def __init__(
        self, info: ModelInfo, dtypes: list[str], convention: str, n_pos: int, device: str | None
    ):
        self.name = info.name
        self.dtypes = [parse_dtype(d) for d in dtypes]
        self.convention = convention
        n_layers, n_heads = info.shape.n_layers, info.shape.n_heads
        shape = (len(dtypes), n_layers, n_heads, n_pos)
        device = torch.device(device or "cpu")
        self.counted = torch.zeros(shape, dtype=torch.float64, device=device)  # by distance
        self.mass = torch.zeros_like(self.counted)  # float64 weight lost, by distance
        self.max_weight = torch.zeros_like(self.counted)  # largest weight lost, by distance
        self.by_query = torch.zeros_like(self.counted)  # underflowed entries, by query position
        # Skipped entries (0 in every dtype) by distance, as differences: +1 where a row's
        # skipped keys begin, -1 past its end (a running sum gives the counts).
        self.skipped = torch.zeros(n_layers, n_heads, n_pos + 1, dtype=torch.float64, device=device)
        self.rows = [0] * n_layers  # query rows seen, per layer
        self.skip_nats, self.rounding = _skip_bound(self.dtypes, convention)
        # One chunk's rows, and their shifts (see _shifted), reused from chunk to chunk.
        self.count_buffer = torch.empty(0, device=device)
        self.mass_buffer = torch.empty(0, dtype=torch.float64, device=device)
        self.nothing = torch.zeros((), dtype=torch.float64, device=device)

    @property
    def zeros(self) -> Float[Tensor, "dtype layer head_index distance"]:
        """Underflowed entries by distance: those computed plus the skipped ones."""
        return self.counted + self.skipped.cumsum(-1)[..., :-1]

    def hook(
        self, scores: Float[Tensor, "batch head_index query_pos key_pos"], hook: HookPoint
    ) -> None:
        layer = hook.layer()
        n_queries, n_keys = scores.shape[-2:]
        offset = long_context.query_offset(scores)
        require_scores(
            self.name, scores, layer, "measure_blindness", "underflow cannot be counted exactly"
        )
        rows = max(1, _CHUNK_ENTRIES // n_keys)
        size = rows * (n_keys + 1)  # a chunk's shifted rows (one row when a row is over budget)
        if self.count_buffer.numel() < size:
            self.count_buffer = self.count_buffer.new_empty(size)
            self.mass_buffer = self.mass_buffer.new_empty(size)
        for sequence in scores.detach().float():
            for head, logits in enumerate(sequence):
                for first in range(0, n_queries, rows):
                    pos = offset + first
                    n = min(rows, n_queries - first)
                    # Keys past the last row's diagonal are masked for every row of the chunk.
                    self._count(layer, head, pos, logits[first : first + n, : pos + n])
        self.rows[layer] += scores.shape[0] * n_queries

    def _count(self, layer: int, head: int, pos: int, logits: Float[Tensor, "query key"]) -> None:
        """Add one chunk: rows ``pos ...`` of one head of one sequence, keys up to the last row."""
        skip = self._skippable(logits, pos)
        if skip:
            n = logits.shape[0]
            self.skipped[layer, head, pos - skip + 1 : pos - skip + 1 + n] += 1
            self.skipped[layer, head, pos + 1 : pos + 1 + n] -= 1
            self.by_query[:, layer, head, pos : pos + n] += skip
        logits = logits[:, skip:].contiguous()
        n, width = logits.shape
        causal = alibi.causal_rows(n, n, logits.device)  # of the last n keys
        exact = torch.softmax(logits.double(), dim=-1)
        shared = torch.softmax(logits, dim=-1) if self.convention == "hf" else None
        count_rows, counts = _shifted(self.count_buffer, n, width)
        lost_rows, lost = _shifted(self.mass_buffer, n, width)
        for i, dtype in enumerate(self.dtypes):
            if shared is not None:
                weights = shared.to(dtype)
            else:
                weights = torch.softmax(logits.to(dtype), dim=-1)
            underflowed = weights == 0
            underflowed[:, width - n :] &= causal
            count_rows.copy_(underflowed)
            torch.where(underflowed, exact, self.nothing, out=lost_rows)
            self.by_query[i, layer, head, pos : pos + n] += count_rows.sum(-1)
            self.counted[i, layer, head, :width] += counts.sum(0).flip(0)
            self.mass[i, layer, head, :width] += lost.sum(0).flip(0)
            top = self.max_weight[i, layer, head, :width]
            torch.maximum(top, lost.amax(0).flip(0), out=top)

    def _skippable(self, logits: Float[Tensor, "query key"], pos: int) -> int:
        """How many leading keys of the chunk are 0 in every dtype for every row (whole tiles,
        ending a tile before the first row's diagonal, so that what is left is never narrow)."""
        n_tiles = (pos + 1) // _SKIP_TILE - 1
        if n_tiles <= 0:
            return 0
        top = logits.amax(-1, keepdim=True)
        tiles = logits[:, : n_tiles * _SKIP_TILE].unflatten(-1, (n_tiles, _SKIP_TILE)).amax(-1)
        # The dtype's rounding of the logits (tl) moves the gap by at most its relative error.
        gap = tiles - top + self.rounding * (tiles.abs() + top.abs())
        below = (gap < -self.skip_nats).all(0)
        return _SKIP_TILE * int(below.cumprod(0).sum())


def require_scores(
    name: str,
    scores: Float[Tensor, "batch head_index query_pos key_pos"],
    layer: int,
    analysis: str,
    consequence: str,
) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless ``scores`` (a block of
    ``hook_attn_scores``) holds causal-masked pre-softmax scores.

    Real scores mask the keys after each query (-inf, or the float minimum on 4.x); a bridge
    that passes the softmax weights there (OPT's on 4.x) has 0 instead. A block of one row has
    no masked key to check.
    """
    n_queries = scores.shape[-2]
    offset = long_context.query_offset(scores)
    if n_queries > 1 and not bool((scores[..., 0, offset + 1] < _MASKED).all()):
        raise UnsupportedArchitectureError(
            f"{analysis} cannot measure {name}: its "
            f"blocks.{layer}.attn.hook_attn_scores does not hold the causal-masked "
            "pre-softmax scores (the attention runs inside transformers, which passes its "
            f"softmax weights there), so {consequence}"
        )


def _skip_bound(dtypes: list[torch.dtype], convention: str) -> tuple[float, float]:
    """``(nats, rounding)``: a causal weight whose logit ``x`` has ``m - x - rounding (|x| + |m|)
    > nats`` (``m`` its row's largest logit) is exactly 0 in every dtype of ``dtypes``.

    Its softmax weight is at most ``e^(x - m)`` (the row's sum is at least 1), and ``exp`` in
    float32 (where ``hf`` computes, and the widest of the three formats) rounds it to 0 past
    ``nats``; ``tl`` first rounds the logits to the dtype, each by a relative error of at most
    the dtype's epsilon.
    """
    nats = -min(alibi.float_limits(dtype).zero for dtype in [torch.float32, *dtypes])
    rounding = max(torch.finfo(dtype).eps for dtype in dtypes) if convention == "tl" else 0.0
    return nats + _SKIP_MARGIN, rounding


def _shifted(
    buffer: Float[Tensor, " size"], n: int, width: int
) -> tuple[Float[Tensor, "query key"], Float[Tensor, "query shifted"]]:
    """Two views of ``buffer`` for the last ``n`` rows of ``width`` keys: the rows, to be filled
    (0 past each row's diagonal), and the same rows with row ``i`` shifted right by ``i``, so
    that column ``c`` of every row is distance ``width - 1 - c``.

    The buffer holds ``n - 1`` zeros, then the rows; the shifted view's row stride is one more
    than the width. Its row ``i``, column ``c`` is key ``i + c - (n - 1)``; where that is
    negative it reads the end of row ``i - 1`` (past that row's diagonal: 0) or the leading
    zeros. Summing its columns counts by distance without a per-entry index.
    """
    flat = buffer[: n - 1 + n * width]
    flat[: n - 1] = 0
    return flat[n - 1 :].view(n, width), flat.as_strided((n, width), (width + 1, 1))


@holds_model("measure_blindness")
def measure_blindness(
    model: Model,
    data: Data | Sequences = None,
    *,
    dtypes: Sequence[str] = ANALYSED_DTYPES,
    convention: str = "hf",
    batch_size: int = 1,
    n_buckets: int = 64,
    context_lengths: Sequence[int] | None = None,
    progress: bool = True,
    block_size: int | None = None,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> BlindnessMeasurement:
    """Measure which attention weights become exactly 0 in each dtype, per head and distance.

    ``m = measure_blindness(model, hs.to_sequences(model, seq_len=4096, n_seqs=1))``:
    ``m.by_head`` has per head and dtype the first distance with an exact zero, the share of zeros
    and the weight lost; ``m.by_distance`` the same per bucket of distances; ``m.by_length`` the
    share of zeros at each context length (see :class:`BlindnessMeasurement`). The model runs in
    float32; the softmax of its exact logits (``hook_attn_scores``: ALiBi, any active
    :func:`mitigation`, the causal mask) is recomputed in each dtype.

    - ``model``: any model whose ``hook_attn_scores`` holds the pre-softmax scores in every layer.
    - ``data``: texts, a token tensor or :class:`Sequences`; texts cut as :data:`BLINDNESS_CUT`.
    - ``dtypes``: the dtypes whose softmax is recomputed (default :data:`ANALYSED_DTYPES`).
    - ``convention``: ``"hf"`` (float32 softmax, then cast) or ``"tl"`` (softmax in the dtype).
    - ``batch_size``: sequences per forward pass.
    - ``n_buckets``: equal-width distance buckets of ``by_distance``.
    - ``context_lengths``: the lengths of ``by_length`` (default: powers of two, and ``seq_len``).
    - ``progress``: show a progress bar.
    - ``block_size``: query rows per block (default: what memory allows; ``seq_len``: dense).
    - ``seq_len``, ``n_seqs``, ``prepend_bos``: deprecated (they warn): ``hs.to_sequences`` cuts.

    What counts as an underflow, the columns, exactness and cost: [Blindness: measured
    zeros](../tools/blindness.md#measured-zeros-measure_blindness).
    """
    info = model_info(model, "measure_blindness")
    names, seqs = _check_measure_args(
        model, info, data, dtypes, convention, seq_len, n_seqs, n_buckets, prepend_bos
    )
    tokens = seqs.tokens
    n_rows, n_pos = tokens.shape
    lengths = _context_lengths(n_pos, context_lengths)
    counter = _UnderflowCounter(info, names, convention, n_pos, model.cfg.device)
    hooks = [(lambda name: name.endswith("attn.hook_attn_scores"), counter.hook)]
    stream(
        model,
        tokens,
        hooks,
        batch_size=batch_size,
        progress=progress,
        desc="blindness",
        block_size=block_size,
        bytes_per_entry=_BYTES_PER_ENTRY,
    )
    unread = [layer for layer, rows in enumerate(counter.rows) if rows != n_rows * n_pos]
    if unread:  # zeros from a hook that never fired would read as a sighted model
        raise unfired(
            model, "measure_blindness", f"blocks.{unread[0]}.attn.hook_attn_scores", unread
        )

    by_head, by_distance = _head_tables(info, counter, names, convention, n_rows, n_buckets)
    by_length = _length_table(info, counter, names, lengths, n_rows)
    for table in (by_head, by_length):
        table.attrs.update(model=info.name, n_seqs=n_rows, seq_len=n_pos, data=seqs.source)
    return BlindnessMeasurement(
        by_head=by_head,
        by_distance=by_distance,
        by_length=by_length,
        convention=convention,
        n_seqs=n_rows,
        seq_len=n_pos,
    )


def _check_measure_args(
    model: Model,
    info: ModelInfo,
    data: Data | Sequences,
    dtypes: Sequence[str],
    convention: str,
    seq_len: int | None,
    n_seqs: int | None,
    n_buckets: int,
    prepend_bos: bool | None,
) -> tuple[list[str], Sequences]:
    """:func:`measure_blindness`'s arguments checked: the dtype names and the token sequences."""
    check_choice(convention, "convention", CONVENTIONS)
    weights_dtype = next(model.parameters()).dtype
    if weights_dtype != torch.float32:
        raise InvalidArgumentError(
            f"measure_blindness needs the model in float32 (it is {weights_dtype}) and emulates "
            "the other dtypes; load it with dtype='float32'"
        )
    check_int(n_buckets, "n_buckets", minimum=1)
    names = [dtype_name(d) for d in _names(dtypes, "dtype")]
    cut = BLINDNESS_CUT
    if info.max_length is not None and info.max_length < cut.seq_len:
        cut = dataclasses.replace(cut, seq_len=info.max_length)
    seqs = verb_sequences(info, data, "measure_blindness", cut, seq_len, n_seqs, prepend_bos)
    return names, seqs


def _head_tables(
    info: ModelInfo,
    counter: _UnderflowCounter,
    names: list[str],
    convention: str,
    n_rows: int,
    n_buckets: int,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``by_head`` and ``by_distance`` from the counter's sums (see :func:`measure_blindness`)."""
    shape, is_alibi = info.shape, info.is_alibi
    head_slopes = info.slopes.double() if is_alibi else None
    zeros, mass, top = counter.zeros.cpu(), counter.mass.cpu(), counter.max_weight.cpu()
    n_pos = zeros.shape[-1]
    distance = torch.arange(n_pos, dtype=torch.float64)
    entries = n_rows * (n_pos - distance)  # causal entries at each distance
    head_rows, bucket_rows = [], []
    width = math.ceil(n_pos / n_buckets)
    for i, dtype in enumerate(names):
        analytic = (
            alibi.blind_distance(head_slopes, dtype, "zero")
            if is_alibi
            else torch.full((shape.n_heads,), math.nan)
        )
        for layer in range(shape.n_layers):
            z, w, t = zeros[i, layer], mass[i, layer], top[i, layer]
            seen = z > 0
            first = torch.where(seen, distance, math.inf).amin(-1)
            head_rows.append(
                pd.DataFrame(
                    {
                        "layer": layer,
                        "head": range(shape.n_heads),
                        "slope": head_slopes.numpy() if is_alibi else math.nan,
                        "dtype": dtype,
                        "convention": convention,
                        "first_zero_distance": first.where(first < math.inf, math.nan).numpy(),
                        "zero_fraction": (z.sum(-1) / entries.sum()).numpy(),
                        "lost_mass": (w.sum(-1) / (n_rows * n_pos)).numpy(),
                        "max_lost_weight": t.amax(-1).numpy(),
                        "analytic_distance": analytic.numpy(),
                    }
                )
            )
            bucket_rows.append(_bucket_rows(layer, dtype, z, w, t, entries, n_rows, width))
    by_head = pd.concat(head_rows, ignore_index=True)
    by_head["label"] = by_head["first_zero_distance"].notna().map({True: "blind", False: "sighted"})
    return by_head, pd.concat(bucket_rows, ignore_index=True)


def _bucket_rows(
    layer: int,
    dtype: str,
    zeros: Tensor,
    mass: Tensor,
    top: Tensor,
    entries: Tensor,
    n_rows: int,
    width: int,
) -> pd.DataFrame:
    """One layer's ``by_distance`` rows in one dtype: per bucket of ``width`` distances, a row
    per head.

    ``zeros``, ``mass`` and ``top`` are ``[head, distance]`` sums; ``entries`` the causal entries
    at each distance."""
    n_heads, n_pos = zeros.shape
    n_buckets = -(-n_pos // width)

    def buckets(values: Tensor, reduce) -> Tensor:  # [..., bucket]; the last one padded with 0
        padded = torch.nn.functional.pad(values, (0, n_buckets * width - n_pos))
        return reduce(padded.unflatten(-1, (n_buckets, width)), -1)

    lo = np.arange(0, n_pos, width)
    n = buckets(entries, torch.sum)
    z = buckets(zeros, torch.sum)
    return pd.DataFrame(
        {
            "layer": layer,
            "head": np.tile(np.arange(n_heads), n_buckets),
            "dtype": dtype,
            "distance_lo": lo.repeat(n_heads),
            "distance_hi": np.minimum(lo + width, n_pos).repeat(n_heads),
            "entries": n.numpy().repeat(n_heads),
            "zero_entries": z.T.flatten().numpy(),
            "zero_fraction": (z / n).T.flatten().numpy(),
            "lost_mass": (buckets(mass, torch.sum) / (n_rows * n_pos)).T.flatten().numpy(),
            "max_lost_weight": buckets(top, torch.amax).T.flatten().numpy(),
        }
    )


def _length_table(
    info: ModelInfo,
    counter: _UnderflowCounter,
    names: list[str],
    lengths: list[int],
    n_rows: int,
) -> pd.DataFrame:
    """``by_length``: the share of all heads' causal entries up to each length that underflow."""
    per_query = counter.by_query.cpu().sum((1, 2)).cumsum(-1)  # [dtype, query]: up to each row
    n_heads_total = info.shape.n_layers * info.shape.n_heads
    by_length = pd.DataFrame(
        [
            {
                "dtype": dtype,
                "context_length": length,
                "entries": n_rows * n_heads_total * length * (length + 1) // 2,
                "zero_entries": per_query[i, length - 1].item(),
            }
            for i, dtype in enumerate(names)
            for length in lengths
        ]
    )
    by_length["share"] = by_length["zero_entries"] / by_length["entries"]
    return by_length


def _context_lengths(n_pos: int, lengths: Sequence[int] | None) -> list[int]:
    """Requested lengths, checked; default: powers of two from 16 below ``n_pos``, and ``n_pos``.

    >>> _context_lengths(100, None)
    [16, 32, 64, 100]
    """
    if lengths is None:
        return sorted({2**k for k in range(4, n_pos.bit_length()) if 2**k < n_pos} | {n_pos})
    bad = [x for x in lengths if not isinstance(x, int) or not 1 <= x <= n_pos]
    if bad:
        raise InvalidArgumentError(
            f"context lengths must be between 1 and the sequence length {n_pos}, got {bad}"
        )
    return sorted(set(lengths))


def _soft_cap_hook(scores: Tensor, hook: HookPoint, *, c: float) -> Tensor:
    # Masked cells are -inf (3.x) or the float minimum plus the logit (4.x, for future keys and
    # padding alike): capping would unmask them, so they are left as they are.
    keep = alibi.causal_rows(*scores.shape[-2:], scores.device)
    keep = keep & (scores > torch.finfo(scores.dtype).min)
    return torch.where(keep, alibi.soft_cap(scores, c), scores)


@contextlib.contextmanager
def mitigation(model: Model, kind: str, **params) -> Iterator[Model]:
    """Run ``model`` with a mitigated ALiBi (see :data:`headsurgeon.alibi.BIAS_KINDS`).

    No weight changes: ``clamped``, ``log``, ``robust`` (and ``standard``, ``relative``) replace
    each attention layer's ALiBi bias through a forward pre-hook, built from the slopes the model
    uses (:func:`headsurgeon.loading.alibi_slopes`: a TransformerLens-built model keeps its
    own); ``softcap`` adds a hook at ``hook_attn_scores`` that maps every unmasked logit (content
    plus bias) to ``c tanh(x / c)`` and leaves masked cells masked (``-inf`` on TransformerLens
    3.x, the float minimum on 4.x). On exit the model is exactly
    as before: the same parameters (never touched) and cached biases, no hook left. Contexts
    nest (the inner bias wins; ``softcap`` composes with a bias kind). The formulas of every
    kind: :func:`headsurgeon.alibi.bias_from_distance`. The hooks act on every thread, so the
    block holds the model (:mod:`headsurgeon.inuse`): another thread's verb on it is refused
    in one line until the block ends; give that thread its own ``copy.deepcopy(model)``, made
    before the block (inside it a copy would keep the block's hooks and compute mitigated
    numbers forever: it is refused in one line).

    Usage::

        with mitigation(model, "log"):
            loss = model(tokens, return_type="loss")
        with mitigation(model, "clamped", c=40.0), mitigation(model, "softcap", c=30.0):
            ...
    """
    info = model_info(model, "mitigation")
    params = alibi.check_bias_params(kind, **params)
    # Held for the whole block (its hooks act on every thread's forward of this model), and
    # not copied inside it (a copy would keep the hooks).
    with hooked(model, "mitigation"):
        # Which mitigations are active, innermost last (read by active_mitigations).
        active = model.__dict__.setdefault("headsurgeon_mitigations", [])
        active.append((kind, params))
        try:
            with _mitigated(model, info, kind, params):
                yield model
        finally:
            active.pop()


def active_mitigations(model: Model) -> list[str]:
    """The kinds of the :func:`mitigation` blocks ``model`` runs in, innermost last.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=9, n_ctx=8))
    >>> with mitigation(model, "relative"):
    ...     active_mitigations(model)
    ['relative']
    >>> active_mitigations(model)
    []
    """
    return [kind for kind, _ in getattr(model, "headsurgeon_mitigations", [])]


def applied_bias(
    model: Model, n_pos: int, info: ModelInfo | None = None
) -> Float[Tensor, "head_index distance"] | None:
    """``[head, distance]``: the positional bias ``model``'s attention adds now at distances
    ``0 ... n_pos - 1`` (float32, as the forward builds it); ``None`` without ALiBi, and for a
    standard Falcon, whose bias is transformers' own: ``m_h j`` by key position ``j``, rounded in
    bfloat16 at every position (not a function of the distance alone).

    The variant it was trained with (its ``headsurgeon.json``, :func:`trained_bias`) with the
    slopes it applies (``model_info(model).slopes``), unless a :func:`mitigation` block replaces
    it (the innermost bias kind wins); each ``softcap`` block then maps it to ``c tanh(b / c)``,
    as it maps the whole logit. This is what a head adds to ``q.k / sqrt(d_head)``, not the
    rounding of the scores in the model's dtype (:mod:`headsurgeon.precision`).
    ``info``: the model's record when a verb already read it at its door (else read here).

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=9, n_ctx=8))
    >>> applied_bias(model, 3)
    tensor([[-0.0000, -0.0625, -0.1250],
            [-0.0000, -0.0039, -0.0078]])
    >>> with mitigation(model, "clamped", c=0.1):
    ...     applied_bias(model, 3)
    tensor([[-0.0000, -0.0625, -0.1000],
            [-0.0000, -0.0039, -0.0078]])
    """
    info = info or model_info(model, "applied_bias")
    active = getattr(model, "headsurgeon_mitigations", [])
    replaced = [(k, p) for k, p in active if k != "softcap"]
    kind, params = replaced[-1] if replaced else trained_bias(info.metadata)
    own = not replaced and kind == "standard"  # no hook of ours on a standard Falcon
    keeps_own = attention_family(model.blocks[0].attn).keeps_own_standard_bias
    if not info.is_alibi or (own and keeps_own):
        return None
    caps = [p["c"] for k, p in active if k == "softcap"]
    distance = torch.arange(n_pos, dtype=torch.float32)[None]
    bias = alibi.bias_from_distance(kind, info.slopes, distance, **params)[:, 0]
    for c in caps:
        bias = alibi.soft_cap(bias, c)
    return bias


@contextlib.contextmanager
def _mitigated(model: Model, info: ModelInfo, kind: str, params: dict) -> Iterator[None]:
    """:func:`mitigation`'s hooks for one kind, removed on exit."""
    if kind == "softcap":
        hook = functools.partial(_soft_cap_hook, c=params["c"])
        with model.hooks(fwd_hooks=[(lambda name: name.endswith("attn.hook_attn_scores"), hook)]):
            yield
        return
    if not info.is_alibi:
        raise UnsupportedArchitectureError(
            f"the {kind} mitigation changes an ALiBi bias, and this model uses "
            f"{info.shape.positional} positions; only softcap applies"
        )
    # The model's own slopes (TransformerLens's or the exact ones), so only the bias kind changes.
    head_slopes = tuple(info.slopes.tolist())
    build = bias_builder(kind, params, head_slopes)
    # Registered after any exact-ALiBi hook, so it runs last and its bias is the one used.
    handles = [add_bias_hook(block.attn, build) for block in model.blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def fused_path_refusal(model: Model, info: ModelInfo, n_pos: int) -> str | None:
    """Why ``model``'s attention cannot run on :mod:`headsurgeon.backend.fused` now, in words
    (:func:`headsurgeon.backend.fused_refusal`, an active mitigation, no ALiBi, a bias other
    than ``-m (t - j)`` or a family's own one), or None; ``info``: the model's record.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=9, n_ctx=8))
    >>> fused_path_refusal(model, model_info(model), 8) is None
    True
    >>> with mitigation(model, "relative"):
    ...     fused_path_refusal(model, model_info(model), 8)
    'a relative mitigation is active'
    """
    why = fused_refusal(model)
    if why is None and active_mitigations(model):
        why = f"a {active_mitigations(model)[-1]} mitigation is active"
    if why is None and not info.is_alibi:
        why = f"it has {info.shape.positional} positions, not ALiBi"
    if why is None:
        bias = applied_bias(model, n_pos, info)
        standard = -info.slopes.float()[:, None] * torch.arange(n_pos, dtype=torch.float32)
        # None for an ALiBi model: a standard Falcon's own bias of the key position, which the
        # fused attention takes from its mask, as the forward adds it (checked there).
        if bias is not None and not torch.equal(bias.cpu(), standard):
            why = "its ALiBi bias is not -m (t - j) (a trained bias variant)"
    return why
