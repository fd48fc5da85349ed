"""``index.html``: the one offline page every writer adds to its folder.

The page holds the run's summary, a grid of heads (click one), each head's metrics in each stage,
its attention on the run's own sequences (float16 lower triangles, base64), under each pattern a
strip of the received mass of its key positions where the writer has one
(:func:`headsurgeon.secondary_sinks`'s ``examples``), its curves, and the figures; plotly.js is
inlined once (its 1.5 MB cartesian bundle, which draws every figure of headsurgeon:
:func:`headsurgeon.plots.plotly_bundle`), and the markup, style and script come from
``headsurgeon/templates/index.html``. Its Content-Security-Policy lets it run only its own
inline script and style and show only ``data:`` images: whatever its text holds, an opened page
fetches nothing, off the machine or on it.
:func:`headsurgeon.reports.open_page` opens it in headless Chromium.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from headsurgeon import alibi
from headsurgeon.backend import Model
from headsurgeon.data import describe, token_strings
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.markup import local_link
from headsurgeon.outputs import atomic_write_text
from headsurgeon.pattern_samples import PatternSample
from headsurgeon.plots import COLUMN_LABELS, column_label, plotly_bundle
from headsurgeon.reports.records import json_safe
from headsurgeon.validation import check_choice

__all__ = [
    "PAGE",
]


PAGE = "index.html"
# Each head's attention on the page: the first positions of a few of the run's own sequences,
# stored as float16 (3 significant digits) lower triangles: 384 heads x 2 x 48 positions ~2.4 MB.
PAGE_SEQS = 2
PAGE_POSITIONS = 48
# A long sequence (blindness) is max-pooled to this many cells a side on the page.
PAGE_CELLS = 64
PAGE_SKIP = ("layer", "head")
# The page: markup, style and the small script that draws the grid, a head and its patterns.
PAGE_TEMPLATE = Path(__file__).parents[1] / "templates" / "index.html"
# The trace types the page's script draws itself (patterns, received-mass strips, curves), and
# the columns its own axes show.
PAGE_TRACES = ("heatmap", "scatter")
PAGE_AXES = ("query", "key", "distance", "zero_fraction")


def _packed(weights: np.ndarray) -> str:
    """The lower triangle (diagonal included) of a ``[n, n]`` matrix, row by row, as base64 of
    little-endian float16: what the page's ``unpack`` reads."""
    rows, cols = np.tril_indices(weights.shape[-1])
    return base64.b64encode(weights[rows, cols].astype("<f2").tobytes()).decode("ascii")


def _page_patterns(
    info: ModelInfo | None, samples: Sequence[PatternSample]
) -> tuple[list[dict[str, Any]], list[list[list[str]]]]:
    """The page's sequences (tokens as text, cell size) and, per stage and sequence, every head's
    packed weights (layer-major)."""
    if not samples:
        return [], []
    first = samples[0]
    sequences = [
        {
            "label": f"sequence {i + 1}: positions 0-{w.n_pos - 1}",
            "tokens": token_strings(info, tokens) if info is not None else [],
            "step": w.step,
            "n_pos": w.n_pos,
        }
        for i, (tokens, w) in enumerate(zip(first.tokens, first.weights, strict=True))
    ]
    packed = [[[_packed(m) for m in w.weights] for w in sample.weights] for sample in samples]
    return sequences, packed


def _page_received(
    examples: Sequence[np.ndarray | None], sequences: Sequence[dict[str, Any]]
) -> list[list[list[list[float | None]]]]:
    """Per stage, page sequence and head (layer-major): the received mass of the key positions
    its pattern shows, max-pooled into the pattern's cells, 3 significant digits (``None``: no
    later query). ``examples[j]`` is stage ``j``'s ``[seq, layer, head, position]`` array of the
    same sequences (``None``: no strip in that stage)."""
    stages = []
    for stage in examples:
        if stage is None:
            stages.append([])
            continue
        per_seq = []
        for seq, values in zip(sequences, stage, strict=False):
            n, step = seq["n_pos"], seq["step"]
            flat = values.reshape(-1, values.shape[-1])[:, :n].astype(np.float64)
            cells = -(-n // step)
            padded = np.full((len(flat), cells * step), np.nan)
            padded[:, :n] = flat
            pooled = np.fmax.reduce(padded.reshape(len(flat), cells, step), axis=-1)
            per_seq.append([[json_safe(float(f"{v:.3g}")) for v in head] for head in pooled])
        stages.append(per_seq)
    return stages


def _metrics(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Per head (layer-major), its row of ``df`` as ``{column: value}`` (numbers rounded)."""
    rows = df.sort_values(["layer", "head"]).to_dict(orient="records")
    return [
        {
            k: (float(f"{v:.5g}") if isinstance(v, float) and math.isfinite(v) else json_safe(v))
            for k, v in row.items()
            if k not in PAGE_SKIP
        }
        for row in rows
    ]


def _blind(
    info: ModelInfo | None, dtype: torch.dtype | None, n_layers: int, n_heads: int
) -> list[float | None]:
    """Each head's distance from which its weights are exactly 0 in ``dtype`` (the model's; None:
    never or no ALiBi), for the dashed line of the page's patterns."""
    if info is None or not info.is_alibi:
        return [None] * (n_layers * n_heads)
    distances = [alibi.blind_distance(m, dtype, "zero") for m in info.slopes.tolist()]
    return [json_safe(float(distances[h])) for _ in range(n_layers) for h in range(n_heads)]


def _figure_data(fig: go.Figure) -> dict[str, Any]:
    return json.loads(fig.to_json())


# Inside a <script> block "</script", "<!--" and "<script" change how the browser parses what
# follows (a folder named "<!--<script>" blanked the page): no "<", ">" or "&" reaches it raw. In
# JSON they occur only inside strings, where the \u escapes mean the same characters.
_SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})
_FIELD = re.compile(r"\{\{(\w+)\}\}")


def _script_json(value: Any) -> str:
    """``value`` as JSON text that can sit inside a ``<script>`` element whatever its strings
    hold: ``<``, ``>`` and ``&`` written as ``\\u`` escapes, and (``json.dumps``'s
    ``ensure_ascii``) every non-ASCII character too, U+2028 and U+2029 (line ends to older
    JavaScript) included; ``JSON.parse`` reads back the same strings.

    >>> print(_script_json({"name": "</script><!--\\u2028"}))
    {"name":"\\u003c/script\\u003e\\u003c!--\\u2028"}
    """
    return json.dumps(json_safe(value), separators=(",", ":")).translate(_SCRIPT_ESCAPES)


def _fill(template: str, **fields: str) -> str:
    """``template`` with each ``{{name}}`` replaced by ``fields[name]``, in one pass over the
    template: a field's text (a folder named ``{{data}}``) is never scanned for fields again."""
    return _FIELD.sub(lambda m: fields[m[1]], template)


def write_page(
    folder: Path,
    *,
    title: str,
    summary: str,
    summary_format: str = "text",
    grid: go.Figure,
    shape: tuple[int, int],
    stages: dict[str, pd.DataFrame],
    samples: Sequence[PatternSample] = (),
    model: Model | None = None,
    figures: dict[str, go.Figure] | None = None,
    curves: dict[str, Any] | None = None,
    note: str = "",
    pages: Sequence[str] = (),
    received: Sequence[np.ndarray | None] = (),
) -> None:
    """Write ``folder/index.html``: one offline page (plotly.js inlined once: the smallest bundle
    that draws every figure, :func:`headsurgeon.plots.plotly_bundle`) with the run's
    summary, ``grid`` (click a head), and per head its metrics in each of ``stages`` (name ->
    one row per head), its attention in each stage of ``samples`` (same order), under each
    pattern the received mass of ``received[j]`` (stage ``j``'s ``[seq, layer, head,
    position]`` array of the samples' sequences,
    :attr:`headsurgeon.received.SecondarySinks.examples`) and its ``curves``; ``figures``
    below, and links to the folder's other files and to ``pages`` (paths inside the folder, such
    as a subfolder's page)."""
    n_layers, n_heads = shape
    info = None if model is None else model_info(model, "write_page")
    sequences, packed = _page_patterns(info, samples)
    names = [f"L{layer}H{head}" for layer in range(n_layers) for head in range(n_heads)]
    metrics = {stage: _metrics(df) for stage, df in stages.items()}
    data = {
        "title": title,
        "note": note,
        "grid": _figure_data(grid),
        "n_heads": n_heads,
        "names": names,
        "stages": list(stages),
        "metrics": metrics,
        # Words and units for the head table's rows and the page's axes; a user's own column
        # shows as named.
        "labels": {
            c: column_label(c)
            for c in [*PAGE_AXES, *(c for df in stages.values() for c in df.columns)]
            if c in COLUMN_LABELS
        },
        "blind": _blind(info, None if model is None else model.cfg.dtype, n_layers, n_heads),
        "sequences": sequences,
        "patterns": packed,
        "received": _page_received(received, sequences),
        "curves": curves or {},
        "figures": [
            {"name": name, "figure": _figure_data(fig)} for name, fig in (figures or {}).items()
        ],
        "files": sorted(
            p.name
            for p in folder.iterdir()
            if p.name != PAGE and p.is_file() and not p.name.startswith(".")
        )
        + list(pages),
    }
    page = _fill(
        PAGE_TEMPLATE.read_text(encoding="utf-8"),
        title=html.escape(title),
        prompt=html.escape(
            "Click a head in the grid to see its metrics"
            + (" and its attention on the run's own sequences." if samples else "."),
            quote=False,
        ),
        summary=summary_html(summary, summary_format),
        plotly=plotly_bundle([grid, *(figures or {}).values()], traces=PAGE_TRACES)[1],
        data=_script_json(data),
    )
    atomic_write_text(folder / PAGE, page)


def summary_html(summary: str, summary_format: str = "text") -> str:
    r"""The page's summary as HTML: ``"markdown"`` (a report.md) rendered by markdown-it-py
    (CommonMark with tables; raw HTML in it is shown as text, never run, and a link or image
    whose address is not a path beside the page, :func:`headsurgeon.markup.local_link`, is
    shown as its Markdown text: an opened page loads nothing off the machine; its
    Content-Security-Policy shows only ``data:`` images, as ``file://host/`` is a network share
    on Windows), ``"text"`` (a tool's summary lines) escaped in a ``<pre>``.

    >>> "<td>&lt;i&gt;</td>" in summary_html("| a | b |\n|---|---|\n| <i> | 2 |", "markdown")
    True
    >>> summary_html("![t](http:evil.example) ![b](bos_mass_diff.png)", "markdown")
    '<p>![t](http:evil.example) <img src="bos_mass_diff.png" alt="b" /></p>\n'
    >>> summary_html("L0H1 <b>")
    '<pre>L0H1 &lt;b&gt;</pre>'
    """
    if summary_format == "markdown":
        from markdown_it import MarkdownIt

        md = MarkdownIt("commonmark", {"html": False}).enable("table")
        md.validateLink = local_link  # links, images, autolinks and references alike
        return md.render(summary)
    check_choice(summary_format, "summary_format", ("text", "markdown"))
    return f"<pre>{html.escape(summary)}</pre>"


def samples_note(
    samples: Sequence[PatternSample], data: object, where: str = "", *, received: bool = False
) -> str:
    """The page's line saying what its attention patterns show."""
    if not samples:
        return "This run read no attention patterns: the page shows each head's metrics."
    weights = samples[0].weights[0]
    shown = (
        f"the first {weights.n_pos} positions of the first {len(samples[0].weights)}"
        if weights.step == 1
        else f"{weights.n_pos} positions (max-pooled: each cell the "
        f"largest weight of {weights.step} x {weights.step}) of the first"
    )
    # The panel it describes is drawn only once a head is clicked: the line says so first.
    return (
        f"Click a head in the grid to see its attention{f' in {where}' if where else ''}: "
        f"{shown} of the run's sequences "
        f"({data or describe(None)}), from hook_pattern as the census reads it; weights rounded "
        "to float16 (3 significant digits: headsurgeon.plots.attention_pattern gives them "
        "exactly). Red box: position 0; dashed line: the blind distance (weights exactly 0 "
        "to its left)."
        + (
            " Strip under a pattern: the received mass of each key position, the mean weight "
            "it gets from the later queries of the whole sequence (headsurgeon.secondary_sinks)."
            if received
            else ""
        )
    )
