"""Underflow blindness of ALiBi heads: predicted, measured, and mitigated through hooks.

ALiBi adds ``-m_h (i - j)`` to the attention logits; far enough back, a key's softmax weight is
below what a float format can hold and becomes exactly 0: the head is blind there.

Exports:
    ANALYSED_DTYPES                    the float formats analysed: float32, bfloat16, float16
    analytic_blindness(model)  DataFrame: blind distance per layer, head, dtype, limit
                                       (from the slopes: no weights needed)
    measure_blindness(model, data)     BlindnessMeasurement: exact zeros per head, distance and
                                       context length, streamed over batches and query blocks
    BlindnessMeasurement               its tables: by_head, by_distance, by_length
    mitigation(model, kind, **params)  context manager: a mitigated ALiBi through hooks
    active_mitigations(model)          the kinds of the mitigation blocks a model runs in
    dtype_name(dtype)                  canonical dtype name
    CONVENTIONS                        how a softmax is rounded: hf or tl
    require_scores(name, scores, ...)  one line unless hook_attn_scores holds pre-softmax scores

Command line: ``python -m headsurgeon.blindness [MODEL] [options]`` (the tool itself is
:mod:`headsurgeon.cli.blindness`).

The package itself imports nothing heavy: each name comes from
:mod:`headsurgeon.blindness.analysis` on first use, so ``python -m headsurgeon.blindness`` (which
imports this package first) answers ``--help`` without torch's import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headsurgeon.blindness.analysis import (
        ANALYSED_DTYPES,
        CONVENTIONS,
        BlindnessMeasurement,
        active_mitigations,
        analytic_blindness,
        dtype_name,
        measure_blindness,
        mitigation,
        require_scores,
    )

__all__ = [
    "ANALYSED_DTYPES",
    "CONVENTIONS",
    "active_mitigations",
    "BlindnessMeasurement",
    "analytic_blindness",
    "require_scores",
    "dtype_name",
    "measure_blindness",
    "mitigation",
]


def __getattr__(name: str) -> Any:
    """The names of :mod:`headsurgeon.blindness.analysis`, imported on first use."""
    return getattr(importlib.import_module("headsurgeon.blindness.analysis"), name)
