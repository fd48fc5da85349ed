"""Evaluations: perplexity with a sliding window, passkey retrieval and needle in a haystack.

Exports:
    perplexity(model, data, window, stride, batch_size)   token-weighted perplexity (float)

Every evaluation only runs the model forward, so it runs unchanged under any
``headsurgeon.blindness.mitigation(...)``.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer

from headsurgeon.data import Data, _bos_id, _texts, batches, tokenize
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.models import model_info

logger = logging.getLogger(__name__)


def default_window(model: HookedTransformer) -> int:
    """The training length when known (in-context evaluation), else the model's context."""
    return min(model_info(model).train_ctx or model.cfg.n_ctx, model.cfg.n_ctx)


def check_length(model: HookedTransformer, length: int, what: str = "context length") -> int:
    """Return ``length`` if the model can take it, else raise a one-line error."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise InvalidArgumentError(f"{what} must be a positive integer, got {length!r}")
    if length > model.cfg.n_ctx:
        raise InvalidArgumentError(
            f"{what} {length} is beyond the model's context of {model.cfg.n_ctx} tokens; "
            "use a shorter one"
        )
    return length


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


def _token_streams(model: HookedTransformer, data: Data) -> list[Int[Tensor, "pos"]]:
    """Data as independent token streams: each text, or each row of a token tensor."""
    if isinstance(data, Tensor):
        if data.ndim not in (1, 2) or data.numel() == 0:
            raise DataError(f"token tensor must be [pos] or [n, pos] and non-empty, got {data.shape}")
        return list(data.long().reshape(-1, data.shape[-1]))
    return [torch.tensor(tokenize(model, text), dtype=torch.long) for text in _texts(data)]


@torch.no_grad()
def perplexity(
    model: HookedTransformer,
    data: Data = None,
    *,
    window: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    prepend_bos: bool | None = None,
) -> float:
    """Token-weighted perplexity ``exp(total NLL / scored tokens)`` over texts or token streams.

    ``data``: texts, text files, a token tensor (each row an independent stream; a 1-D tensor
    is one stream) or ``None`` for the bundled held-out corpora. Streams longer than ``window``
    (default: the training length when known, else the model's context) are scored with
    overlapping windows every ``stride`` tokens (default ``window // 2``); every token except
    a stream's first (which has no context unless a BOS token is prepended) is scored exactly
    once, by the window in which it has the most context. Log-probabilities are taken in float32
    and summed in float64.
    """
    window = check_length(model, default_window(model) if window is None else window, "window")
    stride = window // 2 if stride is None else stride
    if not isinstance(stride, int) or not 1 <= stride <= window - 1:
        raise InvalidArgumentError(f"stride must be between 1 and window - 1 = {window - 1}")
    if batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be positive, got {batch_size}")
    bos = model_info(model).prepend_bos if prepend_bos is None else prepend_bos
    prefix = torch.tensor([_bos_id(model)] if bos else [], dtype=torch.long)
    if window <= len(prefix):
        raise InvalidArgumentError("window must be at least 2 when a BOS token is prepended")

    by_length: dict[int, list[tuple[Tensor, int]]] = defaultdict(list)
    for stream in _token_streams(model, data):
        for begin, end, n_scored in sliding_windows(len(stream), window, stride, len(prefix)):
            tokens = torch.cat([prefix, stream[begin:end]])
            by_length[len(tokens)].append((tokens, n_scored))
    if not by_length:
        raise DataError("no token has context to be scored; give texts of at least two tokens")

    total_nll, total_tokens = 0.0, 0
    n_batches = sum(math.ceil(len(w) / batch_size) for w in by_length.values())
    progress = tqdm(total=n_batches, desc="perplexity", disable=n_batches < 20)
    for length, windows in by_length.items():
        tokens = torch.stack([t for t, _ in windows])
        n_scored = torch.tensor([n for _, n in windows])
        for start, batch in enumerate(batches(tokens, batch_size)):
            batch = batch.to(model.cfg.device)
            logits = model(batch, return_type="logits")[:, :-1].float()
            nll = -logits.log_softmax(-1).gather(-1, batch[:, 1:, None])[..., 0]
            counts = n_scored[start * batch_size : start * batch_size + len(batch)]
            scored = torch.arange(length - 1) >= (length - 1 - counts)[:, None]
            total_nll += nll.double()[scored.to(nll.device)].sum().item()
            total_tokens += int(counts.sum())
            progress.update()
    progress.close()
    return math.exp(total_nll / total_tokens)

