"""Head classification: healthy, BOS-sink or dead, with the reason; and how the counts move.

Exports:
    LABELS                                   ("healthy", "BOS-sink", "dead"), from headsurgeon.heads
    Thresholds                               the classification thresholds (validated dataclass)
    with_thresholds(t, sink_threshold=, dead_threshold=, min_output_share=)
                                             Thresholds with fields given by the CLI's names,
                                             keywords every verb that takes thresholds takes
    label_heads(bos_mass, output_share, t)   the label rule on arrays
    classify_heads(census, thresholds)       census + ``label`` and ``reason`` columns
    threshold_sweep(census, thresholds)      label counts as each threshold moves
    thresholds_of(df)                        the thresholds a classified table records
    sick_shares(classified_by_model, bands)  per model and layer band: label counts, sick share
    require_columns(df, columns)             InvalidArgumentError unless df is a census with them

The summary and files the CLI writes are in :mod:`headsurgeon.reports` (``format_summary``,
``write_classification``). Command line: ``python -m headsurgeon classify [MODEL] [options]``
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
    label_heads,
    require_columns,
    sick_shares,
    threshold_sweep,
    thresholds_of,
    with_thresholds,
)

__all__ = [
    "LABELS",
    "Thresholds",
    "with_thresholds",
    "label_heads",
    "require_columns",
    "classify_heads",
    "threshold_sweep",
    "thresholds_of",
    "sick_shares",
]
