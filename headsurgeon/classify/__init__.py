"""Head classification: healthy, BOS-sink or dead, with the reason; and how the counts move.

The summary and files the CLI writes are in :mod:`headsurgeon.reports`
(``write_classification``). Command line: ``python -m headsurgeon classify [MODEL] [options]``
(``--help`` lists them; the tool itself is :mod:`headsurgeon.cli.classify`).

The rule follows the surgery paper: a head is ``dead`` when its BOS mass exceeds ``dead`` (0.95),
a ``BOS-sink`` when it exceeds ``sink`` (0.5). A head whose write into the residual stream is
(almost) nothing, ``output_share < min_output_share`` (1% of its layer's attention write), is
also ``dead``, whatever its pattern. The paper calls the count threshold-insensitive;
:func:`threshold_sweep` shows how it really moves for the model at hand.
"""

from __future__ import annotations

from headsurgeon.classify.labels import (
    LABELS,
    Thresholds,
    classify_heads,
    sick_shares,
    threshold_sweep,
)

__all__ = [
    "LABELS",
    "Thresholds",
    "classify_heads",
    "threshold_sweep",
    "sick_shares",
]
