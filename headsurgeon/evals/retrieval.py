"""Retrieval: passkey and needle in a haystack by context length and depth, and retrieval by the
needle's distance to the question with a chance baseline: the retrieval evaluations of
:mod:`headsurgeon.evals`.

The statistics of retrieval by distance (``distance_table``, ``distance_summary``,
``compare_retrieval``, ``wilson_interval``): :mod:`headsurgeon.evals.retrieval_stats`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headsurgeon.backend import Model
from headsurgeon.data import (
    CORPORA,
    MIN_SAMPLE_TOKENS,
    SAMPLE_FACTOR,
    Data,
    Sequences,
    bundled_text,
    check_length,
    iter_texts,
    resolve_bos,
    tokenize,
)
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.evals.retrieval_stats import METRICS, distance_summary, distance_table
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.long_context import continuation_logprobs
from headsurgeon.progress import tqdm
from headsurgeon.validation import MAX_SEED, check_choice, check_int, check_number

__all__ = [
    "DISTANCE_EDGES",
    "Retrieval",
    "length_auc",
    "needle",
    "passkey",
    "retrieval_by_distance",
    "summarize",
    "answer_scores",
]


# --- Retrieval: passkey and needle in a haystack ---------------------------------------------

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorise it. I will quiz you about it.\n"
)
PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
PASSKEY_DIGITS = 5  # digits of a passkey, unless asked otherwise
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
    info: ModelInfo, text: str, n_tokens: int, rng: np.random.Generator
) -> Int[Tensor, " pos"]:
    """``n_tokens`` consecutive tokens from a random place in ``text``.

    Only a stretch of a few characters per token is tokenised (doubled until it is enough), and
    its first token is dropped because it may be the end of a cut word.
    """
    span = 4 * n_tokens + 64
    while True:
        start = int(rng.integers(0, max(1, len(text) - span)))
        ids = tokenize(info, text[start : start + span])[1:]
        if len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens], dtype=torch.long)
        if span >= len(text):
            raise DataError(f"the filler text has fewer than {n_tokens} tokens; give more text")
        span *= 2


@torch.no_grad()
def answer_scores(
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
    """What a retrieval task puts in its prompts: the haystack (texts or files, read by
    :func:`_haystack_text`), the intro, needle and question templates (``parts``: keys ``i``,
    ``n``, ``q``) and how it draws its keys."""

    name: str
    haystack: Data
    parts: dict[str, str]
    draw: Callable[[np.random.Generator], list[str]]

    def __post_init__(self) -> None:
        # The needle goes between the haystack's words: token ids have none to put it between.
        if isinstance(self.haystack, Tensor | np.ndarray | Sequences):
            raise DataError(
                f"a haystack is text (texts or text files), got {type(self.haystack).__name__}; "
                "pass the texts themselves, not token ids"
            )


def _haystack_text(data: Data, n_tokens: int) -> str:
    """The texts of ``data`` joined by blank lines, read only as far as stretches of
    ``n_tokens`` tokens need: at most ``4 x max(8 x n_tokens, 2**23)`` characters (about four
    characters a token; :func:`headsurgeon.to_sequences`'s budget). Files are read piece by
    piece, with ``headsurgeon.data.read_texts``'s one-line errors; the rest of a huge one is
    never read."""
    budget = 4 * max(SAMPLE_FACTOR * n_tokens, MIN_SAMPLE_TOKENS)
    parts, n_chars = [], 0
    for pieces in iter_texts(data):
        if parts:
            parts.append("\n\n")
        for piece in pieces:
            parts.append(piece[: budget - n_chars])
            n_chars += len(parts[-1])
            if n_chars >= budget:
                return "".join(parts)
    return "".join(parts)


def _passkey_task(n_candidates: int, n_digits: int, filler: Data) -> _Task:
    check_int(n_candidates, "n_candidates", minimum=2)
    # Keys are drawn as int64 (numpy): 18 digits at most.
    check_int(n_digits, "n_digits", minimum=1, maximum=18)
    if n_candidates > 9 * 10 ** (n_digits - 1):
        raise InvalidArgumentError(f"{n_digits}-digit keys cannot give {n_candidates} candidates")
    text = (
        bundled_text(filler, "heldout") if isinstance(filler, str) and filler in CORPORA else filler
    )
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
    return _Task("needle", haystack_texts, parts, draw)


def _intro_and_question(
    info: ModelInfo, task: _Task
) -> tuple[Int[Tensor, " intro"], Int[Tensor, " question"]]:
    """The tokens every prompt of ``task`` starts and ends with (a BOS token first if that is
    the model's position-0 convention)."""
    intro, question = (torch.tensor(tokenize(info, task.parts[k]), dtype=torch.long) for k in "iq")
    if resolve_bos(info):
        intro = torch.cat([torch.tensor([info.bos_token_id]), intro])
    return intro, question


def _score(
    model: Model, info: ModelInfo, prompt: Int[Tensor, " pos"], keys: list[str], what: str
) -> dict[str, object]:
    """Greedy exact match, rank and log-likelihood of the true key (``keys[0]``) among ``keys``
    after ``prompt``; ``what`` names the prompt in the error of a model too short for it."""
    answers = [torch.tensor(tokenize(info, " " + k)) for k in keys]
    limit = info.max_length  # None: ALiBi, any length
    if limit is not None and len(prompt) + max(map(len, answers)) - 1 > limit:
        raise InvalidArgumentError(
            f"{what} leaves no room for the answer within the model's {limit} tokens; use a "
            "shorter one"
        )
    loglik, greedy = answer_scores(model, prompt, answers)
    return {
        "greedy_correct": bool(greedy[0]),
        "rank": 1 + int((loglik[1:] >= loglik[0]).sum()),  # ties count against
        "true_loglik": loglik[0].item(),
    }


def _retrieval(
    model: Model,
    info: ModelInfo,
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
    lengths = [check_length(info, length) for length in lengths]
    if not lengths:
        raise InvalidArgumentError("give at least one context length")
    intro, question = _intro_and_question(info, task)
    text = _haystack_text(task.haystack, max(lengths))
    rng = np.random.default_rng(check_int(seed, "seed", minimum=0, maximum=MAX_SEED))
    rows = []
    total = len(lengths) * len(depths) * n_trials
    progress = tqdm(total=total, desc=task.name, disable=total < 20)
    for length in lengths:
        for depth in depths:
            for trial in range(n_trials):
                keys = task.draw(rng)  # the true key first, then the distractors
                needle = torch.tensor(tokenize(info, task.parts["n"].format(key=keys[0])))
                n_filler = length - len(intro) - len(needle) - len(question)
                if n_filler < 0:
                    raise InvalidArgumentError(
                        f"context length {length} is too short for the {task.name} prompt; use "
                        f"at least {length - n_filler} tokens"
                    )
                filler = _filler(info, text, n_filler, rng)
                cut = round(depth * n_filler)
                prompt = torch.cat([intro, filler[:cut], needle, filler[cut:], question])
                rows.append(
                    {
                        "context_length": length,
                        "depth": depth,
                        "trial": trial,
                        "key": keys[0],
                        "needle_position": len(intro) + cut,
                        **_score(model, info, prompt, keys, f"context length {length}"),
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
    train_ctx = train_ctx or info.train_ctx or model.cfg.n_ctx
    table["in_context"] = table["context_length"] <= train_ctx
    for frame in (trials, table):
        frame.attrs.update(task=task.name, model=info.name, train_ctx=train_ctx)
    return Retrieval(task.name, trials, table, summarize(table, train_ctx), train_ctx)


@holds_model("passkey")
def passkey(
    model: Model,
    *,
    lengths: Sequence[int] = (64, 128, 256, 512, 1024),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    n_trials: int = 5,
    seed: int = 0,
    n_candidates: int = 10,
    n_digits: int = PASSKEY_DIGITS,
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
    info = model_info(model, "passkey")
    return _retrieval(
        model,
        info,
        _passkey_task(n_candidates, n_digits, filler),
        lengths=lengths,
        depths=depths,
        n_trials=n_trials,
        seed=seed,
        train_ctx=train_ctx,
    )


@holds_model("needle")
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
    info = model_info(model, "needle")
    return _retrieval(
        model,
        info,
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


def _check_distance_edges(edges: Sequence[int]) -> list[int]:
    edges = [check_int(e, "each of distances", minimum=0) for e in edges]
    if len(edges) < 2 or any(b <= a for a, b in pairwise(edges)):
        raise InvalidArgumentError(
            f"distances must be at least two increasing bin edges >= 0 (tokens), got {edges}"
        )
    return edges


@torch.no_grad()
@holds_model("retrieval_by_distance")
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
    keys: int | Sequence[str] | None = None,
    train_ctx: int | None = None,
    progress: bool = True,
) -> Retrieval:
    """Passkey or needle accuracy by the needle's distance to the question, beside a chance
    baseline measured on the same prompts with the needle taken out.

    ``r = retrieval_by_distance(model, "passkey")`` (40 prompts per bin, out to 8,192 tokens):
    ``r.table`` has per bin the accuracies, their Wilson intervals, the baseline's and the paired
    McNemar test; ``r.summary`` says up to where accuracy is above the baseline; ``r.trials`` holds
    every prompt. The prompts depend only on ``seed``, the tokenizer and the arguments, so two
    models compare prompt by prompt (:func:`compare_retrieval`).

    - ``model``: any model; one without ALiBi takes prompts of at most ``n_ctx`` tokens.
    - ``task``: ``"passkey"`` (a random key in filler text) or ``"needle"`` (a fact in real text).
    - ``haystack``: the filler text (default: Shakespeare; needle: both bundled corpora).
    - ``distances``: bin edges in tokens (default :data:`DISTANCE_EDGES`, 0 to 8,192).
    - ``n_trials``: prompts per bin, each at a distance drawn uniformly from the bin.
    - ``seed``: the seed of the prompts.
    - ``n_before``: haystack tokens before the needle.
    - ``n_candidates``: keys ranked by log-likelihood (chance ``1 / n_candidates``).
    - ``keys``: what keys are: passkey, a number of digits (5); needle, the words drawn from
      (:data:`NEEDLE_WORDS`).
    - ``train_ctx``: the training length that marks bins ``in_context`` (default: the model's).
    - ``progress``: show a progress bar.

    The prompt, the baseline, every column and the cost: [Blindness: retrieval by needle
    distance](../tools/blindness.md#retrieval-by-needle-distance).
    """
    info = model_info(model, "retrieval_by_distance")
    task = check_choice(task, "task", ("passkey", "needle"))
    if task == "needle":
        words = NEEDLE_WORDS if keys is None else keys
        if isinstance(words, str) or not isinstance(words, Sequence):
            raise InvalidArgumentError(
                f"keys for the needle task are words (a list of strings), not {keys!r}"
            )
        spec = _needle_task(haystack, n_candidates, words)
    else:  # a corpus name or one text as passkey's filler; texts or files joined like needle's
        if keys is not None and not isinstance(keys, int):
            raise InvalidArgumentError(
                f"keys for the passkey task is its number of digits (an int), not {keys!r}"
            )
        filler = "shakespeare" if haystack is None else haystack
        digits = (
            PASSKEY_DIGITS
            if keys is None
            else check_int(keys, "keys (a passkey's digits)", minimum=1)
        )
        spec = _passkey_task(n_candidates, digits, filler)
    edges = _check_distance_edges(distances)
    check_int(n_trials, "n_trials", minimum=1)
    check_int(n_before, "n_before", minimum=0)
    intro, question = _intro_and_question(info, spec)
    text = _haystack_text(spec.haystack, n_before + edges[-1])
    rng = np.random.default_rng(check_int(seed, "seed", minimum=0, maximum=MAX_SEED))
    rows = []
    total = (len(edges) - 1) * n_trials
    bar = tqdm(total=total, desc=f"{task} by distance", disable=not progress or total < 20)
    for lo, hi in pairwise(edges):
        for trial in range(n_trials):
            keys = spec.draw(rng)  # the true key first, then the distractors
            distance = int(rng.integers(lo, hi))
            needle = torch.tensor(tokenize(info, spec.parts["n"].format(key=keys[0])))
            haystack_tokens = _filler(info, text, n_before + distance, rng)
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
                **_score(model, info, prompt, keys, what),
            }
            baseline = torch.cat([intro, before, after, question])  # the needle taken out
            scored = _score(model, info, baseline, keys, what)
            row.update({f"baseline_{k}": v for k, v in scored.items()})
            rows.append(row)
            bar.update()
    bar.close()
    trials = pd.DataFrame(rows)
    for prefix in ("", "baseline_"):
        trials[f"{prefix}top1_correct"] = trials[f"{prefix}rank"] == 1
    train_ctx = train_ctx or info.train_ctx or model.cfg.n_ctx
    table = distance_table(trials, train_ctx)
    attrs = {
        "task": task,
        "model": info.name,
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
