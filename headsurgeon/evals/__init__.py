"""Evaluations: perplexity with a sliding window, loss by position, passkey retrieval and needle
in a haystack.

Exports:
    perplexity(model, data, window, stride, batch_size)  token-weighted perplexity (float)
    loss_by_position(model, data, length, n_seqs, ...)   mean loss per position bucket (DataFrame)
    position_edges(length)                               its default buckets (powers of two)
    passkey(model, lengths, depths, n_trials, seed)      Retrieval: the passkey task
    needle(model, haystack_texts, lengths, depths, ...)  Retrieval: needle in a haystack
    retrieval_by_distance(model, task, haystack, distances, n_trials, ...)
                                                         Retrieval by the needle's distance to the
                                                         question, with a chance baseline per bin
    DISTANCE_EDGES                                       its default bins: 0, 16, 32, ... 8192
    distance_table(trials, train_ctx)                    its table per bin from its trials
    distance_summary(table)                              where accuracy falls to that baseline
    wilson_interval(k, n)                                95% Wilson interval of a proportion
    Retrieval                                            trials, table (length x depth or distance
                                                         bin), summary
    length_auc(lengths, values), summarize(table, ...)   AUC over context lengths, in/out of context
    sliding_windows(n_tokens, window, stride)            the windows perplexity scores
    default_window(model), check_length(model, length)

Every evaluation only runs the model forward, so it runs unchanged under any
``headsurgeon.blindness.mitigation(...)``. Long sequences run in blocks of query rows through the
model's key-value cache (:mod:`headsurgeon.long_context`): memory grows linearly with the length,
only one block's logits (``[batch, block, vocab]``) exist at a time, and the numbers equal the
dense pass's up to float32 rounding. ALiBi models take any length (their ``n_ctx`` is nominal);
models with learned or rotary positions keep their context (:func:`check_length`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import pairwise

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headsurgeon import long_context
from headsurgeon.backend import Model, check_model
from headsurgeon.data import (
    CORPORA,
    Data,
    _texts,
    batches,
    bos_token_id,
    bundled_text,
    describe,
    position_zero,
    resolve_bos,
    to_sequences,
    tokenize,
)
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.loading import model_info, model_shape
from headsurgeon.long_context import continuation_logprobs, run_in_blocks
from headsurgeon.progress import tqdm
from headsurgeon.validation import check_choice, check_int, check_number

__all__ = [
    "default_window",
    "check_length",
    "sliding_windows",
    "perplexity",
    "loss_by_position",
    "position_edges",
    "Retrieval",
    "length_auc",
    "summarize",
    "passkey",
    "needle",
    "DISTANCE_EDGES",
    "retrieval_by_distance",
    "distance_table",
    "distance_summary",
    "wilson_interval",
]

logger = logging.getLogger(__name__)


def default_window(model: Model) -> int:
    """The training length when known (in-context evaluation), else the model's context.

    The context is the checkpoint's own ``seq_length`` when it has one (:func:`model_shape`):
    TransformerLens gives every BLOOM ``n_ctx = 2048``.
    """
    return min(model_info(model).train_ctx or model_shape(model).n_ctx, model.cfg.n_ctx)


def check_length(model: Model, length: int, what: str = "context length") -> int:
    """Return ``length`` if the model can take it, else raise a one-line error: any length for
    ALiBi models, at most ``cfg.n_ctx`` for models with positions
    (:func:`headsurgeon.long_context.check_length`)."""
    return long_context.check_length(model, length, what)


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


def _token_streams(model: Model, data: Data) -> list[Int[Tensor, " pos"]]:
    """Data as independent token streams: each text, or each row of a token tensor."""
    if isinstance(data, Tensor):
        if data.ndim not in (1, 2) or data.numel() == 0:
            raise DataError(
                f"token tensor must be [pos] or [n, pos] and non-empty, got {data.shape}"
            )
        return list(data.long().reshape(-1, data.shape[-1]))
    return [torch.tensor(tokenize(model, text), dtype=torch.long) for text in _texts(data)]


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


def _next_token_nll(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    block_size: int,
    first: int = 0,
    keys: long_context.KeyChooser | None = None,
) -> Iterator[tuple[int, Float[Tensor, "batch n"]]]:
    """``(position, nll)`` block by block: ``nll[:, i]`` (float64, on the model's device) is the
    negative log-probability of token ``position + i + 1`` given the tokens up to ``position + i``,
    for the positions from ``first`` to the second last.

    The tokens run in blocks of ``block_size`` rows (:func:`long_context.run_in_blocks`) and
    only a block's rows from ``first`` on are unembedded, so one block's logits
    (``[batch, block, vocab]``, log-softmaxed in float32) are the largest tensor. ``keys``: each
    block attends to those earlier positions only (:func:`long_context.run_in_blocks`).
    """
    last = tokens.shape[1] - 1  # the last position predicts nothing
    for offset, resid in run_in_blocks(model, tokens, block_size=block_size, keys=keys):
        lo, hi = max(first, offset), min(offset + resid.shape[1], last)
        if hi <= lo:
            continue
        logits = model.unembed(model.ln_final(resid[:, lo - offset : hi - offset])).float()
        targets = tokens[:, lo + 1 : hi + 1, None].to(logits.device)
        yield lo, -logits.log_softmax(-1).gather(-1, targets)[..., 0].double()


@torch.no_grad()
def perplexity(
    model: Model,
    data: Data = None,
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

    ``data``: texts, text files, a token tensor (each row an independent stream; a 1-D tensor
    is one stream) or ``None`` for the bundled held-out corpora. Streams longer than ``window``
    (default: the training length when known, else the model's context) are scored with
    overlapping windows every ``stride`` tokens (default ``window // 2``); every token except
    a stream's first (which has no context unless a BOS token is prepended) is scored exactly
    once, by the window in which it has the most context. With a BOS token (``prepend_bos``, by
    default the model's convention for texts) every window starts with it; a token stream that
    already starts with it (as :func:`headsurgeon.data.to_sequences` makes them) is not given a
    second one. A token tensor is used as given: its windows get a BOS token only when
    ``prepend_bos=True`` asks for one explicitly, never by convention. Log-probabilities are
    taken in float32 and summed in float64.

    At most ``max_windows`` windows are scored (default 64, like the census's 64 sequences),
    evenly spaced over all of them, so the default call on the bundled corpora takes seconds, not
    minutes; ``max_windows=None`` scores every token of the data.

    ALiBi models take windows of any length (beyond ``n_ctx``: length extrapolation); others at
    most ``n_ctx`` tokens. A batch of windows runs in blocks of ``block_size`` query rows
    (default: for ALiBi models chosen by memory, :func:`headsurgeon.long_context.block_size`; for
    others the whole window), so memory is linear in the window: ``batch_size`` key-value caches,
    one block's attention and one block's logits. A window of at most ``block_size`` tokens is
    one dense pass.

    Usage::

        perplexity(model)  # in context: windows of the training length
        # Beyond it (an ALiBi model): four 16k-token windows, one at a time.
        perplexity(model, window=16384, batch_size=1, max_windows=4)
    """
    check_model(model, "perplexity")
    window = check_length(model, default_window(model) if window is None else window, "window")
    # A stride of window or more would skip tokens.
    stride = check_int(
        window // 2 if stride is None else stride, "stride", minimum=1, maximum=window - 1
    )
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if block_size is not None:
        check_int(block_size, "block_size", minimum=1)
    bos = resolve_bos(model, prepend_bos) and (prepend_bos or not isinstance(data, Tensor))
    prefix = torch.tensor([bos_token_id(model)] if bos else [], dtype=torch.long)
    if window <= len(prefix):
        raise InvalidArgumentError("window must be at least 2 when a BOS token is prepended")
    if max_windows is not None:
        check_int(max_windows, "max_windows", minimum=1)

    by_length = _windows_by_length(_token_streams(model, data), prefix, window, stride, max_windows)
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
            for position, nll in _next_token_nll(model, batch, block, int(first.min())):
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


def _check_edges(edges: Sequence[int], length: int) -> list[int]:
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
def loss_by_position(
    model: Model,
    data: Data = None,
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

    ``n_seqs`` sequences of ``length`` tokens each run in one pass, ``batch_size`` at a time, in
    blocks of ``block_size`` query rows (as in :func:`perplexity`; memory is linear in
    ``length``: one 16k-token sequence of the 4-layer organism took 16 s and 0.9 GiB above the
    model on one CPU thread under TransformerLens 4.x, 50 s under 3.x), and every
    prediction is put in the bucket of its position ``p`` (the prediction of token ``p + 1``
    from tokens ``0 ... p``). Buckets are ``edges[i] <= p < edges[i + 1]``; the default
    (:func:`position_edges`) doubles: ``[0, 1), [1, 2), [2, 4), ... [2^k, length - 1)``.

    ``data``: texts, text files (``None``: the bundled held-out corpora) or a ``[n, pos]`` token
    tensor. Texts are cut as :func:`headsurgeon.data.to_sequences` cuts them: each text on its
    own into non-overlapping sequences (a BOS token first when ``prepend_bos``, by default the
    model's convention), ``n_seqs`` of them evenly spaced over all texts. Fewer texts give fewer
    sequences (logged, and in ``attrs["n_seqs"]``); a text shorter than ``length`` gives none, and
    if every text is, that is a one-line :class:`~headsurgeon.errors.DataError`. The bundled
    held-out corpora hold about 290k (Shakespeare) and 210k (Python docs) tokens for the
    organisms' tokenizer: seven sequences of 64k tokens, none of 300k. A token tensor's rows
    are used as given (no BOS token added, :func:`~headsurgeon.data.to_sequences`), cut to
    ``length``.

    Returns one row per bucket: ``position_lo``, ``position_hi`` (its positions), ``tokens``
    (predictions in it, over all sequences), ``mean_nll`` (nats), ``std`` (of the per-token loss),
    ``ci95`` (half-width of a 95% interval for ``mean_nll`` from the spread of the sequences' own
    means: NaN with one sequence), ``perplexity`` (``exp(mean_nll)``) and ``in_context``
    (``position_hi <= train_ctx``: positions the model was trained at). ``attrs``: model, data,
    length, n_seqs, prepend_bos, train_ctx. Under a ``headsurgeon.blindness.mitigation(...)``
    the curve is the mitigated model's.

    Usage::

        curve = loss_by_position(model, length=16384, n_seqs=4)
        with mitigation(model, "log"):
            logged = loss_by_position(model, length=16384, n_seqs=4)
    """
    check_model(model, "loss_by_position")
    length = check_length(model, check_int(length, "length", minimum=2), "length")
    n_seqs = check_int(n_seqs, "n_seqs", minimum=1)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if block_size is not None:
        check_int(block_size, "block_size", minimum=1)
    edges = _check_edges(position_edges(length) if edges is None else edges, length)
    tokens = to_sequences(model, data, seq_len=length, n_seqs=n_seqs, prepend_bos=prepend_bos)
    bos = position_zero(model, data, tokens, prepend_bos)[0]
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
        for position, nll in _next_token_nll(model, batch, block, first=edges[0]):
            nll = nll.cpu()
            bucket = torch.bucketize(position + torch.arange(nll.shape[1]), bounds, right=True) - 1
            rows.index_add_(1, bucket, nll)
            squares.index_add_(0, bucket, (nll**2).sum(0))
            bar.update(nll.numel())
    bar.close()
    frame = _position_table(edges, sums, squares)
    train_ctx = model_info(model).train_ctx or model.cfg.n_ctx
    frame["in_context"] = frame["position_hi"] <= train_ctx
    frame.attrs.update(
        model=model_info(model).name,
        data=describe(data),
        length=length,
        n_seqs=len(tokens),
        prepend_bos=bos,
        train_ctx=train_ctx,
    )
    return frame


# --- Retrieval: passkey and needle in a haystack ---------------------------------------------

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorise it. I will quiz you about it.\n"
)
PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
NEEDLE_SENTENCE = " The special magic word is {key}. "
NEEDLE_QUESTION = "\nWhat is the special magic word? The special magic word is"
# Common, single-word values of the needle; distractors are drawn from the same list.
NEEDLE_WORDS = (
    "apple",
    "river",
    "lantern",
    "violin",
    "tiger",
    "marble",
    "garden",
    "rocket",
    "pepper",
    "castle",
    "falcon",
    "mirror",
    "velvet",
    "thunder",
    "orchid",
    "copper",
    "island",
    "candle",
    "dragon",
    "meadow",
    "anchor",
    "harbor",
    "silver",
    "winter",
)
METRICS = ("greedy_accuracy", "top1_accuracy")


@dataclasses.dataclass
class Retrieval:
    """Result of :func:`passkey`, :func:`needle` or :func:`retrieval_by_distance`.

    ``trials``: one row per prompt. From :func:`passkey` and :func:`needle`: ``table``, one row
    per (context_length, depth) with the mean of each metric; ``summary``, the AUC over context
    lengths of each metric, per split (``in_context``: lengths up to ``train_ctx``;
    ``out_of_context``; ``all``), with the chance level (see :func:`length_auc`). From
    :func:`retrieval_by_distance`: ``table``, one row per needle-distance bin with each metric,
    its chance baseline and their intervals; ``summary``, where accuracy falls to the baseline
    (:func:`distance_summary`).
    """

    task: str
    trials: pd.DataFrame
    table: pd.DataFrame
    summary: pd.DataFrame
    train_ctx: int


def length_auc(lengths: Sequence[float], values: Sequence[float]) -> float:
    """Normalised area under ``values`` against ``log2(length)``: the mean height of the curve.

    Trapezoids over the sorted log lengths, divided by their span, so a constant curve ``a`` has
    AUC ``a`` whatever the lengths; a single length gives its value; none gives NaN.

    >>> length_auc([64, 128, 256], [1.0, 1.0, 0.0])
    0.75
    >>> length_auc([512], [0.25]), length_auc([], [])
    (0.25, nan)
    """
    if len(lengths) == 0:
        return math.nan
    order = np.argsort(lengths)
    x = np.log2(np.asarray(lengths, dtype=float)[order])
    y = np.asarray(values, dtype=float)[order]
    if len(x) == 1:
        return float(y[0])
    return float(np.trapezoid(y, x) / (x[-1] - x[0]))


def summarize(table: pd.DataFrame, train_ctx: int) -> pd.DataFrame:
    """AUC over context lengths of each metric (depth-averaged), in and out of context."""
    per_length = table.groupby("context_length")[list(METRICS)].mean()
    lengths = per_length.index.to_numpy()
    splits = {
        "in_context": lengths <= train_ctx,
        "out_of_context": lengths > train_ctx,
        "all": np.ones(len(lengths), bool),
    }
    chance = {"greedy_accuracy": 0.0, "top1_accuracy": float(table["chance"].iloc[0])}
    rows = [
        {
            "metric": metric,
            "split": split,
            "auc": length_auc(lengths[mask], per_length[metric].to_numpy()[mask]),
            "n_lengths": int(mask.sum()),
            "lengths": " ".join(map(str, lengths[mask])),
            "chance": chance[metric],
        }
        for metric in METRICS
        for split, mask in splits.items()
    ]
    return pd.DataFrame(rows)


def _check_depths(depths: Sequence[float]) -> list[float]:
    depths = list(depths) if isinstance(depths, Iterable) else [depths]
    if not depths:
        raise InvalidArgumentError("depths must hold at least one fraction between 0 and 1")
    return [check_number(d, "each of depths", low=0, high=1) for d in depths]


def _filler(
    model: Model, text: str, n_tokens: int, rng: np.random.Generator
) -> Int[Tensor, " pos"]:
    """``n_tokens`` consecutive tokens from a random place in ``text``.

    Only a stretch of a few characters per token is tokenised (doubled until it is enough), and
    its first token is dropped because it may be the end of a cut word.
    """
    span = 4 * n_tokens + 64
    while True:
        start = int(rng.integers(0, max(1, len(text) - span)))
        ids = tokenize(model, text[start : start + span])[1:]
        if len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens], dtype=torch.long)
        if span >= len(text):
            raise DataError(f"the filler text has fewer than {n_tokens} tokens; give more text")
        span *= 2


@torch.no_grad()
def _answer_scores(
    model: Model, prompt: Int[Tensor, " pos"], candidates: list[Int[Tensor, " pos"]]
) -> tuple[Float[Tensor, " candidate"], Bool[Tensor, " candidate"]]:
    """Log-likelihood of each candidate after ``prompt`` and whether greedy decoding gives it.

    All candidates run as right-padded rows after the prompt
    (:func:`headsurgeon.long_context.continuation_logprobs`: from one key-value cache of the prompt,
    filled in blocks, so the cost is one prompt, not one per candidate, and memory is linear in
    its length). Only the answer positions are unembedded. Greedy decoding produces a candidate
    exactly when every one of its tokens is the argmax given the tokens before it.
    """
    width = max(len(c) for c in candidates)
    batch = torch.zeros(len(candidates), width - 1, dtype=torch.long)
    for i, c in enumerate(candidates):
        batch[i, : len(c) - 1] = c[:-1]
    rows = continuation_logprobs(model, prompt, batch)
    loglik, greedy = torch.zeros(len(candidates)), torch.zeros(len(candidates), dtype=torch.bool)
    for i, c in enumerate(candidates):
        answer = rows[i, : len(c)]
        loglik[i] = answer.gather(-1, c[:, None]).sum()
        greedy[i] = bool((answer.argmax(-1) == c).all())
    return loglik, greedy


@dataclasses.dataclass(frozen=True)
class _Task:
    """What a retrieval task puts in its prompts: the haystack text, the intro, needle and
    question templates (``parts``: keys ``i``, ``n``, ``q``) and how it draws its keys."""

    name: str
    text: str
    parts: dict[str, str]
    draw: Callable[[np.random.Generator], list[str]]


def _passkey_task(n_candidates: int, n_digits: int, filler: str) -> _Task:
    check_int(n_candidates, "n_candidates", minimum=2)
    check_int(n_digits, "n_digits", minimum=1)
    if n_candidates > 9 * 10 ** (n_digits - 1):
        raise InvalidArgumentError(f"{n_digits}-digit keys cannot give {n_candidates} candidates")
    text = bundled_text(filler, "heldout") if filler in CORPORA else filler
    low, high = 10 ** (n_digits - 1), 10**n_digits

    def draw(rng: np.random.Generator) -> list[str]:
        return [str(k) for k in rng.choice(np.arange(low, high), n_candidates, replace=False)]

    parts = {"i": PASSKEY_INTRO, "n": PASSKEY_NEEDLE, "q": PASSKEY_QUESTION}
    return _Task("passkey", text, parts, draw)


def _needle_task(haystack_texts: Data, n_candidates: int, words: Sequence[str]) -> _Task:
    check_int(n_candidates, "n_candidates", minimum=2)
    words = list(words)
    if len(set(words)) < n_candidates:
        raise InvalidArgumentError(f"need at least {n_candidates} distinct words, got {len(words)}")

    def draw(rng: np.random.Generator) -> list[str]:
        return [str(w) for w in rng.choice(sorted(set(words)), n_candidates, replace=False)]

    parts = {"i": "", "n": NEEDLE_SENTENCE, "q": NEEDLE_QUESTION}
    return _Task("needle", "\n\n".join(_texts(haystack_texts)), parts, draw)


def _intro_and_question(
    model: Model, task: _Task
) -> tuple[Int[Tensor, " intro"], Int[Tensor, " question"]]:
    """The tokens every prompt of ``task`` starts and ends with (a BOS token first if that is
    the model's position-0 convention)."""
    intro, question = (torch.tensor(tokenize(model, task.parts[k]), dtype=torch.long) for k in "iq")
    if resolve_bos(model):
        intro = torch.cat([torch.tensor([bos_token_id(model)]), intro])
    return intro, question


def _score(
    model: Model, prompt: Int[Tensor, " pos"], keys: list[str], what: str
) -> dict[str, object]:
    """Greedy exact match, rank and log-likelihood of the true key (``keys[0]``) among ``keys``
    after ``prompt``; ``what`` names the prompt in the error of a model too short for it."""
    answers = [torch.tensor(tokenize(model, " " + k)) for k in keys]
    limit = long_context.max_length(model)  # None: ALiBi, any length
    if limit is not None and len(prompt) + max(map(len, answers)) - 1 > limit:
        raise InvalidArgumentError(
            f"{what} leaves no room for the answer within the model's {limit} tokens; use a "
            "shorter one"
        )
    loglik, greedy = _answer_scores(model, prompt, answers)
    return {
        "greedy_correct": bool(greedy[0]),
        "rank": 1 + int((loglik[1:] >= loglik[0]).sum()),  # ties count against
        "true_loglik": loglik[0].item(),
    }


def _retrieval(
    model: Model,
    task: _Task,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    n_trials: int,
    seed: int,
    train_ctx: int | None,
) -> Retrieval:
    """Shared engine: build each prompt by token counts, score its candidates, tabulate."""
    depths = _check_depths(depths)
    check_int(n_trials, "n_trials", minimum=1)
    lengths = [lengths] if not isinstance(lengths, Iterable) else lengths  # one length: 256
    lengths = [check_length(model, length) for length in lengths]
    if not lengths:
        raise InvalidArgumentError("give at least one context length")
    intro, question = _intro_and_question(model, task)
    rng = np.random.default_rng(seed)
    rows = []
    total = len(lengths) * len(depths) * n_trials
    progress = tqdm(total=total, desc=task.name, disable=total < 20)
    for length in lengths:
        for depth in depths:
            for trial in range(n_trials):
                keys = task.draw(rng)  # the true key first, then the distractors
                needle = torch.tensor(tokenize(model, task.parts["n"].format(key=keys[0])))
                n_filler = length - len(intro) - len(needle) - len(question)
                if n_filler < 0:
                    raise InvalidArgumentError(
                        f"context length {length} is too short for the {task.name} prompt; use "
                        f"at least {length - n_filler} tokens"
                    )
                filler = _filler(model, task.text, n_filler, rng)
                cut = round(depth * n_filler)
                prompt = torch.cat([intro, filler[:cut], needle, filler[cut:], question])
                rows.append(
                    {
                        "context_length": length,
                        "depth": depth,
                        "trial": trial,
                        "key": keys[0],
                        "needle_position": len(intro) + cut,
                        **_score(model, prompt, keys, f"context length {length}"),
                        "n_candidates": len(keys),
                    }
                )
                progress.update()
    progress.close()
    trials = pd.DataFrame(rows)
    trials["top1_correct"] = trials["rank"] == 1
    table = (
        trials.groupby(["context_length", "depth"], as_index=False)
        .agg(
            n_trials=("trial", "size"),
            greedy_accuracy=("greedy_correct", "mean"),
            top1_accuracy=("top1_correct", "mean"),
            mean_rank=("rank", "mean"),
            mean_true_loglik=("true_loglik", "mean"),
            n_candidates=("n_candidates", "first"),
        )
        .assign(chance=lambda t: 1 / t["n_candidates"])
    )
    train_ctx = train_ctx or model_info(model).train_ctx or model.cfg.n_ctx
    table["in_context"] = table["context_length"] <= train_ctx
    for frame in (trials, table):
        frame.attrs.update(task=task.name, model=model_info(model).name, train_ctx=train_ctx)
    return Retrieval(task.name, trials, table, summarize(table, train_ctx), train_ctx)


def passkey(
    model: Model,
    *,
    lengths: Sequence[int] = (64, 128, 256, 512, 1024),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    n_trials: int = 5,
    seed: int = 0,
    n_candidates: int = 10,
    n_digits: int = 5,
    filler: str = "shakespeare",
    train_ctx: int | None = None,
) -> Retrieval:
    """The passkey task: a random number hidden in filler text, asked for at the end.

    Each prompt is :data:`PASSKEY_INTRO` (after a BOS token if that is the model's convention),
    filler tokens with :data:`PASSKEY_NEEDLE` after a ``depth`` fraction of them (0: first,
    1: last), then :data:`PASSKEY_QUESTION`; the filler fills the prompt to exactly ``length``
    tokens and is a random stretch of a bundled held-out corpus (``filler``: ``shakespeare`` or
    ``python-docs``) or of the text given. The key is a random ``n_digits``-digit number; it is
    scored by exact greedy completion and by the rank of its log-likelihood among
    ``n_candidates`` distinct random numbers (itself included; ties count against it), so
    ``top1_accuracy`` has chance level ``1 / n_candidates``. ``in_context``:
    ``length <= train_ctx`` (default: the model's training length, else its context).

    ALiBi models take lengths beyond their nominal ``n_ctx`` (4k to 64k tokens: each prompt runs
    once, in blocks, into a key-value cache its candidates share; memory linear in the length);
    models with positions take at most ``n_ctx``. By the needle's distance to the question
    rather than the prompt's length: :func:`retrieval_by_distance`.
    """
    check_model(model, "passkey")
    return _retrieval(
        model,
        _passkey_task(n_candidates, n_digits, filler),
        lengths=lengths,
        depths=depths,
        n_trials=n_trials,
        seed=seed,
        train_ctx=train_ctx,
    )


def needle(
    model: Model,
    haystack_texts: Data = None,
    *,
    lengths: Sequence[int] = (64, 128, 256, 512, 1024),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    n_trials: int = 5,
    seed: int = 0,
    n_candidates: int = 10,
    words: Sequence[str] = NEEDLE_WORDS,
    train_ctx: int | None = None,
) -> Retrieval:
    """Needle in a haystack: a fact sentence hidden in real text, retrieved by a question.

    The haystack (after a BOS token if that is the model's convention) is a random stretch of
    ``haystack_texts`` (texts or files; default: both bundled held-out corpora) of exactly the
    tokens needed; :data:`NEEDLE_SENTENCE` with a random word from ``words`` goes in after a
    ``depth`` fraction of it, and :data:`NEEDLE_QUESTION` follows. Scored like :func:`passkey`,
    the other candidates being other words of the list.
    """
    check_model(model, "needle")
    return _retrieval(
        model,
        _needle_task(haystack_texts, n_candidates, words),
        lengths=lengths,
        depths=depths,
        n_trials=n_trials,
        seed=seed,
        train_ctx=train_ctx,
    )


# --- Retrieval by the needle's distance to the question, with a chance baseline ---------------

# Needle distances of retrieval_by_distance: bins [0, 16), [16, 32), ... [4096, 8192).
DISTANCE_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def wilson_interval(k: int | np.ndarray, n: int | np.ndarray, z: float = 1.96) -> tuple:
    """The Wilson score interval ``(low, high)`` of a proportion of ``k`` successes in ``n``
    (elementwise for arrays): the 95% interval of an accuracy over ``n`` independent prompts.

    >>> [round(float(x), 3) for x in wilson_interval(15, 15)]
    [0.796, 1.0]
    >>> [round(float(x), 3) for x in wilson_interval(0, 40)]
    [0.0, 0.088]
    """
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    p, z2 = k / n, z * z
    centre = p + z2 / (2 * n)
    half = z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # Clipped: rounding would otherwise give -0.0 at k = 0 and 1.0000000000000002 at k = n.
    low = np.clip((centre - half) / (1 + z2 / n), 0.0, 1.0)
    high = np.clip((centre + half) / (1 + z2 / n), 0.0, 1.0)
    return (float(low), float(high)) if low.ndim == 0 else (low, high)


def _check_distance_edges(edges: Sequence[int]) -> list[int]:
    edges = [check_int(e, "each of distances", minimum=0) for e in edges]
    if len(edges) < 2 or any(b <= a for a, b in pairwise(edges)):
        raise InvalidArgumentError(
            f"distances must be at least two increasing bin edges >= 0 (tokens), got {edges}"
        )
    return edges


@torch.no_grad()
def retrieval_by_distance(
    model: Model,
    task: str = "passkey",
    haystack: Data = None,
    *,
    distances: Sequence[int] = DISTANCE_EDGES,
    n_trials: int = 40,
    seed: int = 0,
    n_before: int = 32,
    n_candidates: int = 10,
    n_digits: int = 5,
    words: Sequence[str] = NEEDLE_WORDS,
    train_ctx: int | None = None,
    progress: bool = True,
) -> Retrieval:
    """Passkey or needle accuracy by the needle's distance to the question, beside a chance
    baseline measured on the same prompts with the needle taken out.

    Usage::

        r = retrieval_by_distance(model, "passkey")  # 40 prompts per bin, out to 8,192 tokens
        r.table[["distance_lo", "distance_hi", "top1_accuracy", "baseline_top1_accuracy"]]
        r.summary  # per metric: up to where accuracy is above the baseline, from where it is not

    ALiBi's penalty depends on the distance between query and key, not on the prompt's length,
    so this draws prompts by distance. For each bin ``[lo, hi)`` of ``distances`` (edges;
    default :data:`DISTANCE_EDGES`, ``[0, 16)`` to ``[4096, 8192)``) and each of ``n_trials``
    prompts, a distance ``d`` is drawn uniformly from the bin and the prompt is: the task's
    intro (after a BOS token if that is the model's convention), ``n_before`` haystack tokens,
    the needle, ``d`` haystack tokens, the question, the haystack one random stretch of held-out
    text as in :func:`passkey` (``task="passkey"``; ``haystack``: a corpus name, a text, texts or
    files, default Shakespeare) or :func:`needle` (``task="needle"``; texts or files, default
    both bundled corpora). Every prompt is just as long as its distance needs (``n_before + d``
    plus the fixed parts), not padded to the longest: a prompt's cost grows with the square of
    its length. The **distance** is exactly ``d``: the number of tokens strictly between the
    needle's last token and the question's first (the answer is predicted ``d`` plus the
    question's length tokens after the needle).

    Each prompt's **baseline** is the same token sequence with the needle's tokens deleted
    (``n_before + d`` haystack tokens between intro and question), scored against the same
    candidates the same way: what the model guesses without the information, which can differ
    from ``1 / n_candidates`` (a model may prefer some keys). Scored like :func:`passkey`: greedy
    exact match and top-1 rank of the log-likelihood among ``n_candidates`` keys.

    Returns a :class:`Retrieval`: ``trials`` (one row per prompt: ``distance_lo``,
    ``distance_hi``, ``trial``, ``key``, ``distance``, ``needle_start``, ``needle_end``
    (exclusive), ``question_start`` (``= needle_end + distance``), ``prompt_length`` (the needle
    prompt's; the baseline's is ``needle_end - needle_start`` shorter), ``n_candidates``, and per
    prompt kind (no prefix: with the needle; ``baseline_``: without) ``greedy_correct``,
    ``rank``, ``true_loglik``, ``top1_correct``); ``table`` (one row per bin: ``n_trials``,
    ``mean_distance``, ``max_length``, and for ``greedy_accuracy`` and ``top1_accuracy`` the
    value, its 95% Wilson interval ``<metric>_low``/``<metric>_high``, and the baseline's
    ``baseline_<metric>``, ``baseline_<metric>_low``, ``baseline_<metric>_high``; ``mean_rank``,
    ``baseline_mean_rank``, ``chance`` ``= 1 / n_candidates``, ``in_context``: every prompt of
    the bin at most ``train_ctx`` tokens long); ``summary`` (:func:`distance_summary`).

    The prompts depend only on ``seed``, the tokenizer and the arguments, never on the model's
    outputs: every model with the same tokenizer gets the same prompts. The intervals treat the
    prompts of a bin as independent draws; they cover prompt sampling, not training seeds.
    ALiBi models take any distance (each prompt runs once, in blocks, into a key-value cache
    its candidates share: memory linear in the length); models with positions at most
    ``n_ctx`` tokens per prompt (else one-line error). Cost: a 4-layer, 128-wide organism scores
    one 8,192-token prompt in 5 s under TransformerLens 4.x and 9 s under 3.x (one CPU thread
    on busy shared cores, measured); the default bins and baselines take about 15 min a task.
    """
    check_model(model, "retrieval_by_distance")
    task = check_choice(task, "task", ("passkey", "needle"))
    if task == "needle":
        spec = _needle_task(haystack, n_candidates, words)
    else:  # a corpus name or one text as passkey's filler; texts or files joined like needle's
        filler = haystack if isinstance(haystack, str) else "\n\n".join(_texts(haystack))
        spec = _passkey_task(n_candidates, n_digits, "shakespeare" if haystack is None else filler)
    edges = _check_distance_edges(distances)
    check_int(n_trials, "n_trials", minimum=1)
    check_int(n_before, "n_before", minimum=0)
    intro, question = _intro_and_question(model, spec)
    rng = np.random.default_rng(seed)
    rows = []
    total = (len(edges) - 1) * n_trials
    bar = tqdm(total=total, desc=f"{task} by distance", disable=not progress or total < 20)
    for lo, hi in pairwise(edges):
        for trial in range(n_trials):
            keys = spec.draw(rng)  # the true key first, then the distractors
            distance = int(rng.integers(lo, hi))
            needle = torch.tensor(tokenize(model, spec.parts["n"].format(key=keys[0])))
            haystack_tokens = _filler(model, spec.text, n_before + distance, rng)
            before, after = haystack_tokens[:n_before], haystack_tokens[n_before:]
            prompt = torch.cat([intro, before, needle, after, question])
            start = len(intro) + n_before
            what = f"needle distance {distance}"
            row = {
                "distance_lo": lo,
                "distance_hi": hi,
                "trial": trial,
                "key": keys[0],
                "distance": distance,
                "needle_start": start,
                "needle_end": start + len(needle),
                "question_start": start + len(needle) + distance,
                "prompt_length": len(prompt),
                "n_candidates": len(keys),
                **_score(model, prompt, keys, what),
            }
            baseline = torch.cat([intro, before, after, question])  # the needle taken out
            row.update({f"baseline_{k}": v for k, v in _score(model, baseline, keys, what).items()})
            rows.append(row)
            bar.update()
    bar.close()
    trials = pd.DataFrame(rows)
    for prefix in ("", "baseline_"):
        trials[f"{prefix}top1_correct"] = trials[f"{prefix}rank"] == 1
    train_ctx = train_ctx or model_info(model).train_ctx or model.cfg.n_ctx
    table = distance_table(trials, train_ctx)
    attrs = {
        "task": task,
        "model": model_info(model).name,
        "train_ctx": train_ctx,
        "seed": seed,
        "n_before": n_before,
        "distances": edges,
    }
    for frame in (trials, table):
        frame.attrs.update(attrs)
    summary = distance_summary(table)
    summary.attrs.update(attrs)
    return Retrieval(task, trials, table, summary, train_ctx)


def distance_table(trials: pd.DataFrame, train_ctx: int) -> pd.DataFrame:
    """:func:`retrieval_by_distance`'s table from its trials (e.g. read back from a CSV): per
    bin, each metric with and without the needle, with Wilson intervals; ``in_context`` when
    every prompt of the bin is at most ``train_ctx`` tokens long."""
    groups = trials.groupby(["distance_lo", "distance_hi"], sort=True)
    table = groups.agg(
        n_trials=("trial", "size"),
        mean_distance=("distance", "mean"),
        max_length=("prompt_length", "max"),
        n_candidates=("n_candidates", "first"),
    ).reset_index()
    n = table["n_trials"].to_numpy()
    for metric in METRICS:
        for prefix in ("", "baseline_"):
            k = groups[prefix + metric.replace("_accuracy", "_correct")].sum().to_numpy()
            low, high = wilson_interval(k, n)
            table[f"{prefix}{metric}"] = k / n
            table[f"{prefix}{metric}_low"] = low
            table[f"{prefix}{metric}_high"] = high
    table["mean_rank"] = groups["rank"].mean().to_numpy()
    table["baseline_mean_rank"] = groups["baseline_rank"].mean().to_numpy()
    table["chance"] = 1 / table["n_candidates"]
    table["in_context"] = table["max_length"] <= train_ctx
    return table


def distance_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Where accuracy falls to the chance baseline, per metric, from a
    :func:`retrieval_by_distance` table.

    A bin is **above the baseline** when the accuracy's Wilson interval lies entirely above the
    baseline's (``<metric>_low > baseline_<metric>_high``: a conservative test; intervals that
    touch count as not above). One row per metric: ``above_up_to``, the upper edge of the
    farthest bin above the baseline (NaN if none), ``at_baseline_from``, the lower edge of the
    first bin from which no bin is above it (NaN if the farthest bin still is), and that bin's
    accuracy and baseline with their intervals (``n_trials`` prompts each). "At the baseline"
    means not distinguishable from it with these prompts, not equal to it.

    >>> t = pd.DataFrame({"distance_lo": [0, 16], "distance_hi": [16, 32], "n_trials": [40, 40],
    ...     "top1_accuracy": [1.0, 0.1], "baseline_top1_accuracy": [0.1, 0.15]})
    >>> for m in ("", "baseline_"):  # the Wilson intervals of 40 prompts
    ...     t[f"{m}top1_accuracy_low"], t[f"{m}top1_accuracy_high"] = wilson_interval(
    ...         t[f"{m}top1_accuracy"] * 40, 40)
    >>> s = distance_summary(t)
    >>> s[["metric", "above_up_to", "at_baseline_from", "accuracy"]].to_dict("records")
    [{'metric': 'top1_accuracy', 'above_up_to': 16.0, 'at_baseline_from': 16.0, 'accuracy': 0.1}]
    """
    rows = []
    for metric in (m for m in METRICS if m in table):
        above = (table[f"{metric}_low"] > table[f"baseline_{metric}_high"]).to_numpy()
        hits = np.flatnonzero(above)
        last = int(hits[-1]) if len(hits) else -1
        row: dict[str, object] = {
            "metric": metric,
            "above_up_to": float(table["distance_hi"].iloc[last]) if last >= 0 else math.nan,
            "at_baseline_from": math.nan,
        }
        if last + 1 < len(table):
            at = table.iloc[last + 1]
            row["at_baseline_from"] = float(at["distance_lo"])
            row.update(
                n_trials=int(at["n_trials"]),
                accuracy=at[metric],
                accuracy_low=at[f"{metric}_low"],
                accuracy_high=at[f"{metric}_high"],
                baseline=at[f"baseline_{metric}"],
                baseline_low=at[f"baseline_{metric}_low"],
                baseline_high=at[f"baseline_{metric}_high"],
            )
        rows.append(row)
    return pd.DataFrame(rows)
