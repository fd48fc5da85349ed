"""Evaluations: perplexity with a sliding window, loss by position, passkey retrieval and needle
in a haystack.

Every evaluation only runs the model forward, so it runs unchanged under any
``headsurgeon.blindness.mitigation(...)``. Long sequences run in blocks of query rows through the
model's key-value cache (:mod:`headsurgeon.long_context`): memory grows linearly with the length,
only one block's logits (``[batch, block, vocab]``) exist at a time, and the numbers equal the
dense pass's up to float32 rounding. ALiBi models take any length (their ``n_ctx`` is nominal);
models with learned or rotary positions keep their context
(:func:`headsurgeon.data.check_length`).

The evaluations live in :mod:`~headsurgeon.evals.loss` (perplexity, loss by position) and
:mod:`~headsurgeon.evals.retrieval` (passkey, needle, retrieval by distance; its statistics in
:mod:`~headsurgeon.evals.retrieval_stats`); this package gives their names.
"""

from headsurgeon.evals.loss import loss_by_position, perplexity, sliding_windows
from headsurgeon.evals.retrieval import (
    DISTANCE_EDGES,
    Retrieval,
    length_auc,
    needle,
    passkey,
    retrieval_by_distance,
    summarize,
)
from headsurgeon.evals.retrieval_stats import (
    ALPHA,
    compare_retrieval,
    distance_summary,
    distance_table,
    wilson_interval,
)

__all__ = [
    "sliding_windows",
    "perplexity",
    "loss_by_position",
    "Retrieval",
    "length_auc",
    "summarize",
    "passkey",
    "needle",
    "DISTANCE_EDGES",
    "retrieval_by_distance",
    "distance_table",
    "distance_summary",
    "compare_retrieval",
    "ALPHA",
    "wilson_interval",
]
