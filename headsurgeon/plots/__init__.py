"""Figures: head grids (layers x heads), label maps, repair diffs, threshold sweeps; and export.

Every function takes DataFrames (one row per head, as :func:`headsurgeon.run_census` and
:func:`headsurgeon.classify_heads` return) and returns a :class:`Figure` (a
``plotly.graph_objects.Figure``) that renders inline in Jupyter; :func:`save_figure` writes it.
Colour scales are colour-blind safe (viridis, a blue-red diverging scale, Okabe-Ito colours),
labels are drawn as symbols as well as colours (so they survive greyscale print), fonts are sized
for a paper figure at 2x scale, and hovering a cell shows every metric of the head.

Modules (their figures are importable from ``headsurgeon.plots`` itself):
    grids        head_grid, label_grid, diff_grid, models_grid: one cell per head
    counts       sweep_plot, sick_share_plot: how many heads are sick, by threshold, band, model
    importance   importance_grid, bos_vs_importance: what removing a head costs
    corpora      corpus_diff_grid, corpora_grid: heads across corpora
    evaluation   blind_distance_grid, zero_fraction_plot, analytic_vs_measured,
                 retrieval_heatmap, retrieval_distance_plot, precision_figure: blindness,
                 retrieval and rounding
    distance     reach_figure, window_figure: how far heads look, which distances the loss uses
    patterns     attention_pattern, pattern_diff: one head's attention on a text
    sink_cache   sink_cache_figure: perplexity with a StreamingLLM cache
    layout       style, FONT, OKABE_ITO: the house style, and the helpers the figures share
    notebook     Figure: the notebook output; its settings NOTEBOOK_OUTPUTS, NOTEBOOK_SCALE
    export       save_figure, save_figures, split_formats, the browser: the files

Static formats (png, svg, pdf) go through kaleido and a Chromium browser; html needs nothing.
Writers that take ``formats`` (:func:`save_figures`, ``reports.write_classification``,
``reports.write_report``) follow one rule: ``formats=None`` (the default) writes png when a
browser is found and no HTML figure (each writer's ``index.html`` holds every figure
interactively); without a browser the PNGs are skipped and one warning names them and the
fix. ``html`` given explicitly writes each figure as HTML, all sharing one plotly.js in the
folder. Formats given explicitly are all required: a static one without a browser raises
:class:`~headsurgeon.errors.FigureExportError` before anything is written. A browser that does
not start within ``HEADSURGEON_BROWSER_TIMEOUT`` seconds (30 by default) counts as none.

In Jupyter a :class:`Figure` shows through the user's plotly renderer as usual (interactive,
``application/vnd.plotly.v1+json``) and its output also carries ``text/html`` (plotly.js from
the CDN, with the PNG inside as a fallback) and ``image/png`` (when a browser is found), so it
still shows where the notebook is viewed as a file: GitHub, nbviewer, an HTML export.
``notebook.NOTEBOOK_OUTPUTS`` chooses these extra representations (``from headsurgeon.plots import
notebook; notebook.NOTEBOOK_OUTPUTS = ()`` for plotly's own output only); plotly's settings
(``plotly.io.renderers``) are never changed.
"""

from __future__ import annotations

# Each module's exports; the names imported ``as`` themselves are not in ``__all__`` but stay
# importable from here as they were before the split (the figures' constants, helpers the tests
# call).
from headsurgeon.plots.corpora import corpora_grid, corpus_diff_grid
from headsurgeon.plots.counts import (
    SWEEP_PANELS as SWEEP_PANELS,
    SWEEP_STYLE as SWEEP_STYLE,
    sick_share_plot,
    sweep_plot,
)
from headsurgeon.plots.distance import reach_figure, window_figure
from headsurgeon.plots.evaluation import (
    DTYPE_MARKERS as DTYPE_MARKERS,
    PART_DASHES as PART_DASHES,
    RETRIEVAL_METRICS as RETRIEVAL_METRICS,
    analytic_vs_measured,
    blind_distance_grid,
    precision_figure,
    retrieval_distance_plot,
    retrieval_heatmap,
    zero_fraction_plot,
)
from headsurgeon.plots.export import (
    CARTESIAN_TRACES as CARTESIAN_TRACES,
    DEFAULT_FORMATS as DEFAULT_FORMATS,
    FORMATS as FORMATS,
    INSTALL_BROWSER as INSTALL_BROWSER,
    STATIC_FORMATS as STATIC_FORMATS,
    has_browser as has_browser,
    plotly_bundle as plotly_bundle,
    require_browser as require_browser,
    save_figure,
    save_figures,
    split_formats as split_formats,
    start_browser as start_browser,
    start_timeout as start_timeout,
    warn_skipped as warn_skipped,
)
from headsurgeon.plots.grids import (
    HOVER_SKIP as HOVER_SKIP,
    LABEL_COLOURS as LABEL_COLOURS,
    LABEL_MARKERS as LABEL_MARKERS,
    METRIC_RANGES as METRIC_RANGES,
    diff_bound as diff_bound,
    diff_grid,
    head_grid,
    label_grid,
    models_grid,
)
from headsurgeon.plots.importance import (
    IMPORTANCE_MARKERS as IMPORTANCE_MARKERS,
    bos_vs_importance,
    importance_grid,
)
from headsurgeon.plots.layout import (
    COLUMN_LABELS as COLUMN_LABELS,
    FONT as FONT,
    OKABE_ITO,
    column_label,
    style,
)
from headsurgeon.plots.notebook import Figure
from headsurgeon.plots.patterns import MAX_CELLS as MAX_CELLS, attention_pattern, pattern_diff
from headsurgeon.plots.sink_cache import sink_cache_figure

__all__ = [
    "OKABE_ITO",
    "Figure",
    "analytic_vs_measured",
    "attention_pattern",
    "blind_distance_grid",
    "bos_vs_importance",
    "column_label",
    "corpora_grid",
    "corpus_diff_grid",
    "diff_grid",
    "head_grid",
    "importance_grid",
    "label_grid",
    "models_grid",
    "pattern_diff",
    "precision_figure",
    "reach_figure",
    "retrieval_distance_plot",
    "retrieval_heatmap",
    "save_figure",
    "save_figures",
    "sick_share_plot",
    "sink_cache_figure",
    "style",
    "sweep_plot",
    "window_figure",
    "zero_fraction_plot",
]
