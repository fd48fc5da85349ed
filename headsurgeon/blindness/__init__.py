"""Underflow blindness of ALiBi heads: predicted, measured, and mitigated through hooks.

ALiBi adds ``-m_h (i - j)`` to the attention logits; far enough back, a key's softmax weight is
below what a float format can hold and becomes exactly 0: the head is blind there.

Exports:
    ANALYSED_DTYPES                    the float formats analysed: float32, bfloat16, float16
    analytic_blindness(model)  DataFrame: blind distance per layer, head, dtype, limit
                                       (from the slopes: no weights needed)
    analytic_rounding(model)           RoundingAnalysis: per head and dtype, the rounding step
                                       of the ALiBi bias by position, and the first positions
                                       where it exceeds 0.1 and 1 logit (no weights needed)
    RoundingAnalysis                   its tables: by_head, by_position
    measure_blindness(model, data)     BlindnessMeasurement: exact zeros per head, distance and
                                       context length, streamed over batches and query blocks
    BlindnessMeasurement               its tables: by_head, by_distance, by_length
    mitigation(model, kind, **params)  context manager: a mitigated ALiBi through hooks
    active_mitigations(model)          the kinds of the mitigation blocks a model runs in
    applied_bias(model, n_pos)         the positional bias its heads add now, by distance
    dtype_name(dtype)                  canonical dtype name
    CONVENTIONS                        how a softmax is rounded: hf or tl
    require_scores(name, scores, ...)  one line unless hook_attn_scores holds pre-softmax scores

Command line: ``python -m headsurgeon blindness [MODEL] [options]`` (the tool itself is
:mod:`headsurgeon.cli.blindness`).
"""

from __future__ import annotations

from headsurgeon.blindness.analysis import (
    ANALYSED_DTYPES,
    CONVENTIONS,
    BlindnessMeasurement,
    active_mitigations,
    analytic_blindness,
    applied_bias,
    dtype_name,
    measure_blindness,
    mitigation,
    require_scores,
)
from headsurgeon.blindness.rounding import RoundingAnalysis, analytic_rounding

__all__ = [
    "ANALYSED_DTYPES",
    "CONVENTIONS",
    "active_mitigations",
    "applied_bias",
    "BlindnessMeasurement",
    "analytic_blindness",
    "analytic_rounding",
    "RoundingAnalysis",
    "require_scores",
    "dtype_name",
    "measure_blindness",
    "mitigation",
]
