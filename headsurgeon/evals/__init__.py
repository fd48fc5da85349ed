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
    default_window(info, n_ctx)                          perplexity's default window

Every evaluation only runs the model forward, so it runs unchanged under any
``headsurgeon.blindness.mitigation(...)``. Long sequences run in blocks of query rows through the
model's key-value cache (:mod:`headsurgeon.long_context`): memory grows linearly with the length,
only one block's logits (``[batch, block, vocab]``) exist at a time, and the numbers equal the
dense pass's up to float32 rounding. ALiBi models take any length (their ``n_ctx`` is nominal);
models with learned or rotary positions keep their context
(:func:`headsurgeon.data.check_length`).

The evaluations live in :mod:`~headsurgeon.evals.loss` (perplexity, loss by position) and
:mod:`~headsurgeon.evals.retrieval` (passkey, needle, retrieval by distance); this package
gives their names.
"""

from headsurgeon.evals.loss import (
    default_window,
    loss_by_position,
    perplexity,
    position_edges,
    sliding_windows,
)
from headsurgeon.evals.retrieval import (
    DISTANCE_EDGES,
    Retrieval,
    distance_summary,
    distance_table,
    length_auc,
    needle,
    passkey,
    retrieval_by_distance,
    summarize,
    wilson_interval,
)

__all__ = [
    "default_window",
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
