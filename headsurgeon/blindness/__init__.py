"""Underflow blindness of ALiBi heads: predicted, measured, and mitigated through hooks.

ALiBi adds ``-m_h (i - j)`` to the attention logits; far enough back, a key's softmax weight is
below what a float format can hold and becomes exactly 0: the head is blind there.

Command line: ``python -m headsurgeon blindness [MODEL] [options]`` (the tool itself is
:mod:`headsurgeon.cli.blindness`).
"""

from __future__ import annotations

from headsurgeon.blindness.analysis import (
    ANALYSED_DTYPES,
    CONVENTIONS,
    BlindnessMeasurement,
    analytic_blindness,
    measure_blindness,
    mitigation,
)
from headsurgeon.blindness.rounding import RoundingAnalysis, analytic_rounding

__all__ = [
    "ANALYSED_DTYPES",
    "CONVENTIONS",
    "BlindnessMeasurement",
    "analytic_blindness",
    "analytic_rounding",
    "RoundingAnalysis",
    "measure_blindness",
    "mitigation",
]
