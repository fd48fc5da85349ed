"""Perplexity with a sliding window and loss by position: the language-modelling evaluations of
:mod:`headsurgeon.evals`, and the length checks its retrieval tasks share.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon import long_context
from headsurgeon.backend import Model, fused_attention
from headsurgeon.backend.forward import run_layers, run_to_layer
from headsurgeon.backend.fused import BLOCK_ROWS
from headsurgeon.data import (
    MIN_SAMPLE_TOKENS,
    SAMPLE_FACTOR,
    Data,
    Sequences,
    as_sequences,
    batches,
    check_data,
    check_length,
    iter_token_ids,
    resolve_bos,
)
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.long_context import run_in_blocks
from headsurgeon.probes import check_batch_memory, unfired
from headsurgeon.progress import tqdm
from headsurgeon.validation import check_int

__all__ = [
    "loss_by_position",
    "perplexity",
    "sliding_windows",
]

logger = logging.getLogger(__name__)


def default_window(info: ModelInfo, n_ctx: int) -> int:
    """The training length when known (in-context evaluation), else the model's context.

    The context is the checkpoint's own ``seq_length`` when it has one (``info.shape``), at most
    TransformerLens's ``n_ctx`` (it gives every BLOOM ``n_ctx = 2048``).
    """
    return min(info.train_ctx or info.shape.n_ctx, n_ctx)


def sliding_windows(
    n_tokens: int, window: int, stride: int, n_prefix: int = 0
) -> list[tuple[int, int, int]]:
    """Windows ``(begin, end, n_scored)`` that score every predictable token exactly once.

    A window feeds ``n_prefix`` prefix tokens (a BOS token) and tokens ``begin:end`` of the stream
    and scores its last ``n_scored`` predictions: the tokens no earlier window scored. Windows
    start every ``stride`` tokens, so after the first one each scored token sees at least
    ``window - n_prefix - stride`` tokens of context.

    >>> sliding_windows(10, window=4, stride=2)
    [(0, 4, 3), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    >>> sliding_windows(3, window=4, stride=2, n_prefix=1)
    [(0, 3, 3)]
    """
    span = window - n_prefix
    out, begin, done = [], 0, 0
    while True:
        end = min(begin + span, n_tokens)
        first = max(done, begin + 1 - n_prefix)  # a target needs a logit before it
        if end > first:
            out.append((begin, end, end - first))
        done = end
        if end == n_tokens:
            return out
        begin += stride


def _token_streams(
    info: ModelInfo, data: Data | Sequences, budget: int | None
) -> list[Int[Tensor, " pos"]]:
    """Data as independent token streams: each text, or each row of a token tensor. Texts and
    files are read and tokenised piece by piece, and only up to ``budget`` tokens in all (None:
    all of them)."""
    if isinstance(data, Sequences | Tensor):  # checked at the door (check_data)
        return list(data.tokens if isinstance(data, Sequences) else data)
    streams, n_tokens = [], 0
    for pieces in iter_token_ids(info, data):
        ids = []
        for piece in pieces:
            ids.append(piece)
            n_tokens += len(piece)
            if budget is not None and n_tokens >= budget:
                break
        streams.append(torch.cat(ids))
        if budget is not None and n_tokens >= budget:
            break
    return streams


def _windows_by_length(
    streams: Iterable[Int[Tensor, " pos"]],
    prefix: Int[Tensor, " prefix"],
    window: int,
    stride: int,
    max_windows: int | None,
) -> dict[int, list[tuple[Int[Tensor, " pos"], int]]]:
    """The windows :func:`perplexity` scores, grouped by length: ``(tokens, n_scored)`` each."""
    spans = []  # (stream, begin, end, tokens scored) of every window
    for stream in streams:
        if len(prefix) and len(stream) > 1 and stream[0] == prefix[0]:
            stream = stream[1:]  # e.g. from to_sequences: already BOS-first; never score BOS twice
        spans += [
            (stream, *span) for span in sliding_windows(len(stream), window, stride, len(prefix))
        ]
    if not spans:
        raise DataError("no token has context to be scored; give texts of at least two tokens")
    if max_windows is not None and len(spans) > max_windows:
        logger.info(
            "perplexity on %d of %d windows (max_windows=None: all)", max_windows, len(spans)
        )
        picks = torch.linspace(0, len(spans) - 1, max_windows).round().long().tolist()
        spans = [spans[i] for i in picks]
    by_length: dict[int, list[tuple[Tensor, int]]] = defaultdict(list)
    for stream, begin, end, n_scored in spans:
        tokens = torch.cat([prefix, stream[begin:end]])
        by_length[len(tokens)].append((tokens, n_scored))
    return by_length


def next_token_nll(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    block_size: int,
    first: int = 0,
    keys: long_context.KeyChooser | None = None,
    start: tuple[int, Callable[[int], Tensor]] | None = None,
) -> Iterator[tuple[int, Float[Tensor, "batch n"]]]:
    """``(position, nll)`` block by block: ``nll[:, i]`` (float64, on the model's device) is the
    negative log-probability of token ``position + i + 1`` given the tokens up to ``position + i``,
    for the positions from ``first`` to the second last.

    The tokens run in blocks of ``block_size`` rows (:func:`long_context.run_in_blocks`) and
    only a block's rows from ``first`` on are unembedded, so one block's logits
    (``[batch, block, vocab]``, log-softmaxed in float32) are the largest tensor. ``keys``: each
    block attends to those earlier positions only (:func:`long_context.run_in_blocks`);
    ``start``: ``(layer, resid_pre)``, the blocks from that layer on run from
    ``resid_pre(offset)`` (``run_in_blocks``'s ``start_at_layer``, ``resid_pre``).
    """
    last = tokens.shape[1] - 1  # the last position predicts nothing
    layer, resid_pre = start or (0, None)
    blocks = run_in_blocks(
        model, tokens, block_size=block_size, keys=keys, start_at_layer=layer, resid_pre=resid_pre
    )
    for offset, resid in blocks:
        lo, hi = max(first, offset), min(offset + resid.shape[1], last)
        if hi > lo:
            yield (
                lo,
                resid_nll(model, resid[:, lo - offset : hi - offset], tokens[:, lo + 1 : hi + 1]),
            )


class LayerInputs:
    """The residual stream entering each of ``layers`` (above 0: layer 0 runs from the tokens),
    per batch and block of query rows (offset 0: whole sequences), as a base pass computed it:
    a pass whose earlier layers are the base pass's starts there, bit for bit."""

    def __init__(self, layers: Iterable[int]) -> None:
        self.layers = {layer for layer in layers if layer > 0}
        self.kept: dict[tuple[int, int, int], Tensor] = {}

    def writer(self, layer: int, batch: int, offset: Callable[[], int]):  # -> a TL hook
        def write(resid: Tensor, hook: object) -> None:
            self.kept[layer, batch, offset()] = resid.clone()

        return write

    def read(self, layer: int, batch: int, offset: int) -> Tensor:
        return self.kept[layer, batch, offset]


def fused_token_nll(
    model: Model,
    tokens: Int[Tensor, "seq pos"],
    slopes: Tensor,
    attend: Callable[..., Tensor],
    *,
    analysis: str,
    batch_size: int,
    block_size: int | None,
    keep: LayerInputs | None = None,
    start: tuple[int, LayerInputs] | None = None,
) -> Float[Tensor, "seq position"]:
    """Next-token NLL at every position (float64, CPU) of whole sequences, each layer's
    attention ``attend`` (:func:`headsurgeon.backend.fused_attention`, ``slopes`` its bias):
    ``keep`` records what enters its layers; ``start`` (``(layer, inputs)``) runs only the
    layers from ``layer`` on, from what ``inputs`` recorded. A layer (from there) whose
    attention never ran is refused in one line, naming ``analysis``."""
    n_seqs, n_pos = tokens.shape
    n_layers = model.cfg.n_layers
    out = torch.empty(n_seqs, n_pos - 1, dtype=torch.float64)
    first, inputs = start or (0, None)
    fired = [0] * n_layers

    def counted(layer: int, *args: Tensor, **kwargs: Any) -> Tensor:
        fired[layer] += 1
        return attend(layer, *args, **kwargs)

    record = [] if keep is None else sorted(keep.layers)
    with torch.no_grad(), fused_attention(model, slopes, counted):
        for i, batch in enumerate(batches(tokens, batch_size)):
            check_batch_memory(model, len(batch), n_pos, BLOCK_ROWS)
            hooks = [
                (f"blocks.{layer}.hook_resid_pre", keep.writer(layer, i, int)) for layer in record
            ]
            with model.hooks(fwd_hooks=hooks):
                if inputs is None:
                    resid = run_to_layer(model, batch, n_layers)
                else:
                    resid = run_layers(model, inputs.read(first, i, 0), first, n_layers)
            block = block_size or long_context.block_size(model, n_pos, batch=len(batch))
            rows = slice(i * batch_size, i * batch_size + len(batch))
            out[rows] = sequence_nll(model, batch, resid, block)
    silent = [layer for layer in range(first, n_layers) if not fired[layer]]
    if silent:
        raise unfired(model, analysis, f"blocks.{silent[0]}.attn", silent)
    return out


def sequence_nll(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    resid: Float[Tensor, "batch pos d_model"],
    block_size: int,
) -> Float[Tensor, "batch pos_minus_1"]:
    """Next-token NLL of every position but the last (float64, CPU) from the whole sequences'
    residual stream before the final LayerNorm, unembedded ``block_size`` rows at a time."""
    n_pos = tokens.shape[1]
    out = torch.empty(len(tokens), n_pos - 1, dtype=torch.float64)
    for lo in range(0, n_pos - 1, block_size):
        hi = min(lo + block_size, n_pos - 1)
        out[:, lo:hi] = resid_nll(model, resid[:, lo:hi], tokens[:, lo + 1 : hi + 1]).cpu()
    return out


def resid_nll(
    model: Model, resid: Float[Tensor, "batch n d_model"], targets: Int[Tensor, "batch n"]
) -> Float[Tensor, "batch n"]:
    """The negative log-probability of ``targets`` from the residual stream before the final
    LayerNorm: logits log-softmaxed in float32, the result float64 on the model's device."""
    logits = model.unembed(model.ln_final(resid)).float()
    picked = logits.log_softmax(-1).gather(-1, targets[..., None].to(logits.device))
    return -picked[..., 0].double()


@torch.no_grad()
@holds_model("perplexity")
def perplexity(
    model: Model,
    data: Data | Sequences = None,
    *,
    window: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    prepend_bos: bool | None = None,
    max_windows: int | None = 64,
    block_size: int | None = None,
    progress: bool = True,
) -> float:
    """Token-weighted perplexity ``exp(total NLL / scored tokens)`` over texts or token streams.

    ``perplexity(model)`` scores windows of the training length; ``perplexity(model,
    window=16384, batch_size=1, max_windows=4)`` four 16k-token windows of an ALiBi model, beyond
    it. Every token but a stream's first is scored once, by the window in which it has the most
    context; log-probabilities in float32, summed in float64.

    - ``model``: any model; ALiBi models take windows of any length, others at most ``n_ctx``.
    - ``data``: texts, text files or token streams (tensor rows; 1-D: one), default held-out text.
    - ``window``: tokens per window (default: the training length when known, else ``n_ctx``).
    - ``stride``: tokens between window starts (default ``window // 2``).
    - ``batch_size``: windows per forward pass.
    - ``prepend_bos``: a BOS token first in each window (default: the convention, for texts).
    - ``max_windows``: windows scored, evenly spaced (``None``: every token of the data).
    - ``block_size``: query rows per block (default: by memory for ALiBi, else the window).
    - ``progress``: show a progress bar.

    Windows, BOS tokens, how much of a file is read, memory: [Evaluation:
    perplexity](evals.md#perplexity).
    """
    info = model_info(model, "perplexity")
    if isinstance(data, Tensor | np.ndarray) and data.ndim == 1:  # one stream
        data = data[None]
    data = check_data(info, data)  # the door every verb shares, before anything runs
    window = default_window(info, model.cfg.n_ctx) if window is None else window
    window = check_length(info, window, "window")
    # A stride of window or more would skip tokens.
    stride = check_int(
        window // 2 if stride is None else stride, "stride", minimum=1, maximum=window - 1
    )
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if block_size is not None:
        check_int(block_size, "block_size", minimum=1)
    given = isinstance(data, Tensor | Sequences)  # tokens: a BOS token only when asked for
    bos = resolve_bos(info, prepend_bos) and (prepend_bos or not given)
    prefix = torch.tensor([info.bos_token_id] if bos else [], dtype=torch.long)
    if window <= len(prefix):
        raise InvalidArgumentError("window must be at least 2 when a BOS token is prepended")
    if max_windows is not None:
        check_int(max_windows, "max_windows", minimum=1)

    budget = (
        None
        if max_windows is None
        else max(SAMPLE_FACTOR * max_windows * window, MIN_SAMPLE_TOKENS)
    )
    streams = _token_streams(info, data, budget)
    by_length = _windows_by_length(streams, prefix, window, stride, max_windows)
    total_nll, total_tokens = 0.0, 0
    n_batches = sum(math.ceil(len(w) / batch_size) for w in by_length.values())
    bar = tqdm(total=n_batches, desc="perplexity", disable=not progress or n_batches < 2)
    for length, windows in by_length.items():
        tokens = torch.stack([t for t, _ in windows])
        n_scored = torch.tensor([n for _, n in windows])
        for start, batch in enumerate(batches(tokens, batch_size)):
            counts = n_scored[start * batch_size : start * batch_size + len(batch)]
            first = length - 1 - counts  # each window's first scored position
            block = block_size or long_context.block_size(model, length, batch=len(batch))
            for position, nll in next_token_nll(model, batch, block, int(first.min())):
                scored = position + torch.arange(nll.shape[1]) >= first[:, None]
                total_nll += nll[scored.to(nll.device)].sum().item()
            total_tokens += int(counts.sum())
            bar.update()
    bar.close()
    return math.exp(total_nll / total_tokens)


def position_edges(length: int) -> list[int]:
    """The default buckets of :func:`loss_by_position`: ``0, 1, 2, 4, ...`` (powers of two), then
    ``length - 1``, the number of positions that predict a token.

    >>> position_edges(20)
    [0, 1, 2, 4, 8, 16, 19]
    """
    last = check_int(length, "length", minimum=2) - 1
    return [0] + [2**k for k in range(last.bit_length()) if 2**k < last] + [last]


def check_edges(edges: Sequence[int], length: int) -> list[int]:
    edges = [check_int(e, "each of edges", minimum=0, maximum=length - 1) for e in edges]
    if len(edges) < 2 or any(b <= a for a, b in pairwise(edges)):
        raise InvalidArgumentError(
            f"edges must be at least two increasing positions between 0 and {length - 1} (the "
            f"last position that predicts a token), got {edges}"
        )
    return edges


def _position_table(
    edges: list[int],
    sums: Float[Tensor, "seq bucket"],
    squares: Float[Tensor, " bucket"],
) -> pd.DataFrame:
    """:func:`loss_by_position`'s table from each sequence's summed loss per bucket and the
    summed squares (every sequence has ``edges[i + 1] - edges[i]`` predictions in bucket ``i``)."""
    n = len(sums)
    per_seq = torch.tensor(edges).diff().double()
    total = n * per_seq
    mean = sums.sum(0) / total
    unbiased = total / (total - 1).clamp(min=1)
    std = ((squares / total - mean**2).clamp(min=0) * unbiased).sqrt()
    # Tokens of one sequence are not independent: the interval comes from the sequences' means.
    ci95 = (
        1.96 * (sums / per_seq).std(0) / math.sqrt(n) if n > 1 else torch.full_like(mean, math.nan)
    )
    return pd.DataFrame(
        {
            "position_lo": edges[:-1],
            "position_hi": edges[1:],
            "tokens": total.long().numpy(),
            "mean_nll": mean.numpy(),
            "std": std.numpy(),
            "ci95": ci95.numpy(),
            "perplexity": mean.exp().numpy(),
        }
    )


@torch.no_grad()
@holds_model("loss_by_position")
def loss_by_position(
    model: Model,
    data: Data | Sequences = None,
    *,
    length: int = 4096,
    n_seqs: int = 4,
    edges: Sequence[int] | None = None,
    prepend_bos: bool | None = None,
    batch_size: int = 1,
    block_size: int | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Mean next-token loss by position: ALiBi's length-extrapolation curve.

    ``curve = loss_by_position(model, length=16384, n_seqs=4)``; under ``with mitigation(model,
    "log"):`` the same call gives the mitigated model's curve. One row per bucket of predicting
    positions ``p`` (the prediction of token ``p + 1``): ``position_lo``, ``position_hi``,
    ``tokens``, ``mean_nll`` (nats), ``std``, ``ci95`` (from the sequences' own means: NaN with
    one), ``perplexity`` and ``in_context`` (``position_hi <= train_ctx``).

    - ``model``: any model; ALiBi models take any ``length``, others at most ``n_ctx``.
    - ``data``: texts, text files (default: held-out text) or a token tensor (rows used as given).
    - ``length``: tokens per sequence.
    - ``n_seqs``: sequences, evenly spaced over the texts (fewer texts give fewer, logged).
    - ``edges``: bucket edges (default :func:`position_edges`: 0, 1, 2, 4, ... ``length - 1``).
    - ``prepend_bos``: a BOS token first in each text's sequences (default: the model's convention).
    - ``batch_size``: sequences per forward pass.
    - ``block_size``: query rows per block (default: what memory allows).
    - ``progress``: show a progress bar.

    How texts are cut, the bundled corpora's lengths and the cost: [Evaluation: loss by
    position](evals.md#loss-by-position).
    """
    info = model_info(model, "loss_by_position")
    length = check_length(info, check_int(length, "length", minimum=2), "length")
    n_seqs = check_int(n_seqs, "n_seqs", minimum=1)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if block_size is not None:
        check_int(block_size, "block_size", minimum=1)
    edges = check_edges(position_edges(length) if edges is None else edges, length)
    seqs = as_sequences(info, data, seq_len=length, n_seqs=n_seqs, prepend_bos=prepend_bos)
    tokens = seqs.tokens
    if tokens.shape[1] < length:
        raise DataError(f"the token rows hold {tokens.shape[1]} tokens, fewer than length {length}")
    tokens = tokens[:n_seqs, :length]
    if len(tokens) < n_seqs:
        logger.info(
            "loss_by_position on %d sequences of %d tokens: the data hold no more",
            len(tokens),
            length,
        )

    # Positions from edges[-1] on are in no bucket: the tokens after edges[-1] never run.
    tokens = tokens[:, : edges[-1] + 1]
    bounds = torch.tensor(edges)
    sums = torch.zeros(len(tokens), len(edges) - 1, dtype=torch.float64)  # per sequence
    squares = torch.zeros(len(edges) - 1, dtype=torch.float64)
    bar = tqdm(
        total=len(tokens) * (edges[-1] - edges[0]),
        desc="loss by position",
        unit="token",
        unit_scale=True,
        disable=not progress,
    )
    for start, batch in enumerate(batches(tokens, batch_size)):
        block = block_size or long_context.block_size(model, tokens.shape[1], batch=len(batch))
        rows = sums[start * batch_size : start * batch_size + len(batch)]  # a view
        for position, nll in next_token_nll(model, batch, block, first=edges[0]):
            nll = nll.cpu()
            bucket = torch.bucketize(position + torch.arange(nll.shape[1]), bounds, right=True) - 1
            rows.index_add_(1, bucket, nll)
            squares.index_add_(0, bucket, (nll**2).sum(0))
            bar.update(nll.numel())
    bar.close()
    frame = _position_table(edges, sums, squares)
    train_ctx = info.train_ctx or model.cfg.n_ctx
    frame["in_context"] = frame["position_hi"] <= train_ctx
    frame.attrs.update(
        model=info.name,
        data=seqs.source,
        length=length,
        n_seqs=len(tokens),
        prepend_bos=seqs.holds_bos,
        train_ctx=train_ctx,
    )
    return frame
