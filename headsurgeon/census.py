"""The head census: every attention head's metrics over many sequences, one row per head.

The census streams the data through the model with forward hooks (:mod:`headsurgeon.probes`): each
layer's attention pattern is reduced to per-head float64 sums as soon as it exists, no activation
is cached and the unembedding is never computed, so memory does not grow with the data.

A token tensor is used exactly as given, on every model. Texts follow the model's own position-0
convention (BLOOM prepends no BOS token, so "BOS mass" is the weight on the first text token, as
in the surgery paper); ``prepend_bos`` overrides it. ``df.attrs["prepend_bos"]`` records whether
position 0 holds the BOS token and ``df.attrs["bos_rule"]`` the rule that put it there
(:func:`headsurgeon.data.position_zero`). Per-query metrics average query rows
``t >= min_query_pos``: the default 1 drops row 0, which can only attend to position 0 and so adds
``1/seq_len`` of BOS mass to every head; ``min_query_pos=0`` reproduces the paper's metric.

Two columns follow other papers' definitions exactly (sources and differences in
``docs/tools/classify.md``, "Standard scores"): ``sink_score``/``sink_share`` (Gu et al., ICLR
2025, github.com/sail-sg/Attention-Sink) and ``ahon_ln`` (Sandoval-Segura et al., ICLR 2026,
github.com/psandovalsegura/inactive-heads).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from headsurgeon.alibi import content_free_reach
from headsurgeon.backend import Model, fused_attention
from headsurgeon.backend.forward import run_to_layer
from headsurgeon.backend.fused import BLOCK_ROWS, AttentionStats, attention_stats
from headsurgeon.blindness.analysis import applied_bias, fused_path_refusal
from headsurgeon.classify.labels import require_columns
from headsurgeon.data import Cut, Data, Sequences, batches, verb_sequences
from headsurgeon.defaults import CENSUS_N_SEQS, CENSUS_SEQ_LEN, GU_PROTOCOL
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.probes import HeadStats, check_batch_memory, stream
from headsurgeon.progress import tqdm
from headsurgeon.validation import check_int, check_number

__all__ = [
    "COLUMNS",
    "CENSUS_CUT",
    "run_census",
    "GU_PROTOCOL",
    "sink_rate",
]

logger = logging.getLogger(__name__)

COLUMNS: dict[str, str] = {
    "layer": "layer index (from 0)",
    "head": "head index within the layer (from 0)",
    "slope": "ALiBi slope m_h of the head (empty for models without ALiBi)",
    "bos_mass": "mean attention weight A[t, 0] on position 0, over query rows t >= min_query_pos",
    "bos_mass_std": "standard deviation across sequences of each sequence's BOS mass",
    "sink_score": "Gu et al.'s sink score alpha_0: mean of A[t, 0] over all query rows t >= 0",
    "sink_share": "share of sequences whose own sink_score exceeds sink_eps (Gu et al.'s sink "
    "indicator, per sequence; sink_rate is its mean over heads)",
    "entropy": "mean over query rows of the attention entropy -sum_k A ln A (nats)",
    "max_weight": "mean over query rows of the largest weight (Voita et al.'s confidence)",
    "mean_distance": "mean over query rows of the weighted distance sum_k A[t, k] (t - k), tokens",
    "self_mass": "mean attention weight A[t, t] on the query's own position",
    "prev_mass": "mean attention weight A[t, t - 1] on the previous token",
    "output_norm": "mean over positions of the norm of the head's write z_h W_O[h] (no bias)",
    "output_share": "output_norm over the mean norm of the whole attention layer's write (no b_O)",
    "ahon_ln": "Sandoval-Segura et al.'s AHON-LN: per sequence, the head's mean norm of z (its "
    "output before W_O) over every position, over the mean of that across the layer's heads; "
    "mean over sequences",
    # Only with reach=True (the default): the one column that needs every weight.
    "reach": "smallest distance d whose mean attention mass on keys at distance >= d (position 0 "
    "left out), over query rows t >= d + 1, is at most reach_eps; inf: none within the sequence",
    "reach_baseline": "the reach of a head with no preference for content: the same definition "
    "with the head's logits set to its positional bias alone (standard ALiBi: tends to "
    "ln(1/reach_eps)/slope on long sequences); exact, float64; empty without ALiBi and for a "
    "standard Falcon (its bias, rounded by key position, is not a function of distance alone)",
    "reach_ratio": "reach / reach_baseline: near 1, a head that only follows its slope; empty "
    "where either is unbounded within the sequence, except inf: a head that looks beyond the "
    "sequence while its slope alone would not",
}


CENSUS_CUT = Cut(seq_len=CENSUS_SEQ_LEN, n_seqs=CENSUS_N_SEQS)
"""How :func:`run_census` cuts texts: 64 sequences of 128 tokens spread over them."""

# The fused path's error bound per head, relative to each mean (absolute below 1): float32's
# worst-case bound (backend.fused.ENTROPY_ROUNDINGS) stays under it for the organism's heads at
# 128 ... 2,048 tokens (at most 1.6e-5); heads above it are computed in float64.
FUSED_TOLERANCE = 3e-5

# Per (batch, head, query, key) entry: the forward's scores, mask and pattern, plus the pattern
# statistics' temporaries (entropy terms, distance-weighted weights, the distance matrix).
CENSUS_BYTES_PER_ENTRY = 32


def _check_rows(n_pos: int, min_query_pos: int) -> None:
    if n_pos <= min_query_pos:
        raise DataError(
            f"sequences of {n_pos} tokens have no query rows at or after min_query_pos="
            f"{min_query_pos}; use a longer --seq-len or a smaller --min-query-pos"
        )


@holds_model("run_census")
def run_census(
    model: Model,
    data: Data | Sequences = None,
    *,
    batch_size: int = 8,
    min_query_pos: int = 1,
    block_size: int | None = None,
    reach: bool = True,
    reach_eps: float = 0.01,
    sink_eps: float = 0.3,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> pd.DataFrame:
    """Measure every head of ``model`` on ``data``: one row per head, columns :data:`COLUMNS`.

    ``census = hs.run_census(model, hs.to_sequences(model, n_seqs=16))``; each metric is the mean
    over sequences of a per-sequence mean, and ``census.attrs`` records the run.

    - ``model``: any TransformerLens model; an ALiBi model takes any length.
    - ``data``: texts, files, a token tensor or :class:`Sequences`; texts cut as :data:`CENSUS_CUT`.
    - ``batch_size``: sequences per forward pass.
    - ``min_query_pos``: the first query row measured (0: the surgery paper's exact BOS mass).
    - ``block_size``: query rows per block on long sequences (default: what memory allows).
    - ``reach``: ``False`` leaves out ``reach`` and its baseline, the columns that need every
      weight; the rest then comes from a fused attention where the model allows it (faster).
    - ``reach_eps``: the mean attention share left on keys at distance ``reach`` or more.
    - ``sink_eps``: the ``sink_score`` above which a sequence counts in ``sink_share`` (Gu: 0.3).
    - ``progress``: show a progress bar.
    - ``seq_len``, ``n_seqs``, ``prepend_bos``: deprecated (they warn): ``hs.to_sequences`` cuts.

    The columns, ``attrs``, ``reach``, the fused path and the standard scores: [Classify: the
    census](../tools/classify.md#the-census).

    >>> import torch
    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    >>> census = run_census(model, torch.randint(0, 64, (4, 12)), progress=False)
    >>> census[["layer", "head", "slope"]].head(2)
       layer  head   slope
    0      0     0  0.2500
    1      0     1  0.0625
    >>> census.attrs["n_seqs"], census.attrs["seq_len"], census.attrs["prepend_bos"]
    (4, 12, False)
    """
    info = model_info(model, "run_census")
    min_query_pos = check_int(min_query_pos, "min_query_pos", minimum=0)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    reach_eps = check_number(reach_eps, "reach_eps", low=0, high=1)
    sink_eps = check_number(sink_eps, "sink_eps", low=0, high=1)
    if seq_len is not None and not isinstance(data, Tensor | Sequences):  # before a corpus
        _check_rows(check_int(seq_len, "seq_len", minimum=1), min_query_pos)
    seqs = verb_sequences(info, data, "run_census", CENSUS_CUT, seq_len, n_seqs, prepend_bos)
    _check_rows(seqs.seq_len, min_query_pos)
    if info.train_ctx is not None and seqs.seq_len > info.train_ctx:
        logger.warning(
            "sequences of %d tokens are longer than the %d the model was trained on",
            seqs.seq_len,
            info.train_ctx,
        )

    stats = HeadStats(model, min_query_pos=min_query_pos, sink_eps=sink_eps)
    refusal = "reach needs every weight" if reach else fused_path_refusal(model, info, seqs.seq_len)
    if refusal is None:
        _fused_stream(model, info, seqs.tokens, stats, batch_size, progress)
    else:
        if not reach:  # the fused path was asked for: say why not
            logger.info("census: blocked attention, not fused: %s", refusal)
        stream(
            model,
            seqs.tokens,
            stats.hooks(),
            batch_size=batch_size,
            progress=progress,
            desc="census",
            block_size=block_size,
            bytes_per_entry=CENSUS_BYTES_PER_ENTRY,
        )
    stats.check_fired(seqs.n_seqs, "run_census")
    means, stds = stats.means(), stats.stds()

    cfg, shape = model.cfg, info.shape
    layer, head = np.divmod(np.arange(shape.n_layers * shape.n_heads), shape.n_heads)
    slopes = info.slopes.double().numpy()[head] if info.is_alibi else np.full(layer.shape, np.nan)
    columns = {
        "layer": layer,
        "head": head,
        "slope": slopes,
        "bos_mass": means["bos_mass"].ravel(),
        "bos_mass_std": stds["bos_mass"].ravel(),
    }
    if reach:
        means["reach"] = stats.reach(reach_eps)
        means["reach_baseline"], means["reach_ratio"] = _reach_baseline(
            model, info, seqs.seq_len, reach_eps, min_query_pos, means["reach"]
        )
    columns |= {name: means[name].ravel() for name in COLUMNS if name in means}
    df = pd.DataFrame(columns)
    df.attrs = {
        "model": info.name,
        "n_layers": shape.n_layers,
        "n_heads": shape.n_heads,
        "n_seqs": seqs.n_seqs,
        "seq_len": seqs.seq_len,
        "prepend_bos": seqs.holds_bos,
        "bos_rule": seqs.bos_rule,
        "min_query_pos": min_query_pos,
        "reach_eps": reach_eps if reach else None,
        "sink_eps": sink_eps,
        "attention": "blocked" if refusal else "fused",
        "blocked_because": refusal,
        "float64_heads": int(stats.refined.sum()),
        "data": seqs.source,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "device": str(cfg.device),
        "positional": shape.positional,
    }
    if seqs.dataset is not None:  # the data's dataset, field by field (heads.json's metadata)
        df.attrs["dataset"] = dict(seqs.dataset)
    return df


def _fused_stream(
    model: Model,
    info: ModelInfo,
    tokens: Tensor,
    stats: HeadStats,
    batch_size: int,
    progress: bool,
) -> None:
    """Whole sequences through ``model`` with its attention fused, feeding ``stats``."""
    n_pos = tokens.shape[1]
    check_batch_memory(model, len(tokens[:batch_size]), n_pos, BLOCK_ROWS, CENSUS_BYTES_PER_ENTRY)
    hooks = stats.hooks(pattern=False)
    with (
        torch.no_grad(),
        fused_attention(model, info.slopes, functools.partial(_fused_stats, stats.fused_sums)),
        model.hooks(fwd_hooks=hooks),
    ):
        for batch in tqdm(list(batches(tokens, batch_size)), desc="census", disable=not progress):
            run_to_layer(model, batch, model.cfg.n_layers)  # 4.x's own would unembed


def _fused_stats(
    consume: Callable[[int, AttentionStats], None],
    layer: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    **bias: Any,
) -> Tensor:
    """One layer's :func:`attention_stats`, handed to ``consume``; its head outputs."""
    stats = attention_stats(q, k, v, **bias, tolerance=FUSED_TOLERANCE)
    consume(layer, stats)
    return stats.z


def _reach_baseline(
    model: Model,
    info: ModelInfo,
    n_pos: int,
    eps: float,
    min_query_pos: int,
    reach: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``reach_baseline`` and ``reach_ratio``, ``[layer, head]``: the content-free reach of each
    head's bias (:func:`headsurgeon.alibi.content_free_reach`) and ``reach`` over it."""
    bias = applied_bias(model, n_pos, info)
    if bias is None:  # no bias on the logits: no slope for a head to follow
        baseline = np.full(reach.shape, math.nan)
    else:
        baseline = np.broadcast_to(content_free_reach(bias, eps, min_query_pos), reach.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = reach / baseline
    return baseline, np.where(np.isfinite(baseline) & (baseline > 0), ratio, math.nan)


def sink_rate(census: pd.DataFrame, eps: float | None = None) -> float:
    """Gu et al.'s sink rate of a census: the share of (sequence, head) pairs whose α_0 exceeds ε.

    ``sink_rate(hs.run_census(model, hs.to_sequences(model, seq_len=64, n_seqs=100)))``
    (:data:`GU_PROTOCOL`) is the number Gu et al. (ICLR 2025) report as Sink_1^ε, as a fraction:
    the mean over heads of the census's ``sink_share``. A head that is a sink in half the
    sequences counts one half; ``bos_mass`` is not used.

    - ``census``: a :func:`run_census` result (its ``sink_share`` column and ``attrs["sink_eps"]``).
    - ``eps``: the threshold, the one the census counted at (default: its ``sink_eps``).

    The definition, Gu's protocol and how the census differs from their script: [Classify:
    standard scores](../tools/classify.md#standard-scores-sink-rate-and-ahon-ln).

    >>> census = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1],
    ...                        "sink_share": [1.0, 0.5, 0.0, 0.0]})
    >>> census.attrs["sink_eps"] = 0.3
    >>> sink_rate(census)
    0.375
    >>> sink_rate(census, eps=0.5)
    Traceback (most recent call last):
    headsurgeon.errors.InvalidArgumentError: this census counted sinks at sink_eps=0.3, not 0.5; ...
    """
    require_columns(census, ["sink_share"])
    if eps is not None:
        eps = check_number(eps, "eps", low=0, high=1)
    counted = census.attrs.get("sink_eps")
    if counted is None:
        raise InvalidArgumentError(
            "the census does not record the sink_eps it counted sinks at (a table read back "
            "from a file has no attrs); set census.attrs['sink_eps'] from heads.json's metadata, "
            "or pass what run_census returns"
        )
    if eps is not None and not math.isclose(eps, counted, rel_tol=0, abs_tol=1e-12):
        raise InvalidArgumentError(
            f"this census counted sinks at sink_eps={counted:g}, not {eps:g}; the rate at "
            f"{eps:g} needs run_census(..., sink_eps={eps:g})"
        )
    shares = census["sink_share"].to_numpy(dtype=float)
    if not len(shares) or not np.isfinite(shares).all():
        raise InvalidArgumentError(
            "the census's sink_share column is empty or not finite; pass what run_census returns"
        )
    return float(shares.mean())
