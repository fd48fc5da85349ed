"""Figures: head grids (layers x heads), label maps, repair diffs, threshold sweeps; and export.

Every function takes DataFrames (one row per head, as :func:`headsurgeon.run_census` and
:func:`headsurgeon.classify_heads` return) and returns a :class:`Figure` (a
``plotly.graph_objects.Figure``) that renders inline in Jupyter; :func:`save_figure` writes it.
Colour scales are colour-blind safe (viridis, a blue-red diverging scale, Okabe-Ito colours),
labels are drawn as symbols as well as colours (so they survive greyscale print), fonts are sized
for a paper figure at 2x scale, and hovering a cell shows every metric of the head.

Exports:
    head_grid(df, metric)              heatmap of one metric; BOS-sink / dead heads marked
    label_grid(df)                     the label of every head
    diff_grid(before, after, metric)   after - before, heads whose label changed outlined
    sweep_plot(sweep)                  label counts against each threshold
    models_grid({name: df}, metric)    several models side by side, one colour scale
    sick_share_plot(shares)            sick share per layer band, one line per model
    blind_distance_grid(df)            blind distance per head, dtype and underflow limit
    zero_fraction_plot(by_distance)    share of exact-zero weights against distance, per head
    analytic_vs_measured(by_head)      measured first zero against the analytic blind distance
    retrieval_heatmap(table, metric)   depth x context length of a passkey/needle metric
    importance_grid(df)                delta_loss per head (head_importance), diverging colour
    bos_vs_importance(df)              BOS mass against delta_loss, by label: dormant sinks
    attention_pattern(model, text, heads)
                                       query x key weights of heads on a text (exact, from the
                                       census's hook; max-pooled beyond MAX_CELLS positions)
    pattern_diff(before, after, text, heads)
                                       those weights before, after and the change, per head
    style(fig, title=..., ...)         the house layout (template, fonts, title, size) every
                                       figure here, in reports and in analyses/ goes through
    save_figure(fig, path)             .html, .png, .svg or .pdf, written atomically
    save_figures(figs, folder, fmts)   every figure in every format; static ones skipped
                                       without a browser (see split_formats)
    split_formats(formats)             the formats to write and the static ones to skip
    require_browser(what)              FigureExportError (one line, the fix) without Chromium
    has_browser()                      whether static figures can be written here
    warn_skipped(names, folder)        the one warning line about skipped static figures
    Figure                             go.Figure that also shows as HTML and PNG in notebooks
    FORMATS, STATIC_FORMATS            the formats save_figure writes; those needing Chromium
    MAX_CELLS                          positions a side above which patterns are max-pooled
    FONT, OKABE_ITO                    the house font and the colour-blind-safe palette

Static formats (png, svg, pdf) go through kaleido and a Chromium browser; html needs nothing.
Writers that take ``formats`` (:func:`save_figures`, ``reports.write_classification``,
``reports.write_report``) follow one rule: ``formats=None`` (the default) writes html, and png
when a browser is found; without one the PNGs are skipped and one warning names them and the
fix. Formats given explicitly are all required: a static one without a browser raises
:class:`~headsurgeon.errors.FigureExportError` before anything is written.

In Jupyter a :class:`Figure` shows through the user's plotly renderer as usual (interactive,
``application/vnd.plotly.v1+json``) and its output also carries ``text/html`` (plotly.js from
the CDN, with the PNG inside as a fallback) and ``image/png`` (when a browser is found), so it
still shows where the notebook is viewed as a file: GitHub, nbviewer, an HTML export.
``NOTEBOOK_OUTPUTS`` chooses these extra representations (``()`` for plotly's own output only);
plotly's settings (``plotly.io.renderers``) are never changed.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from html import escape
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from torch import Tensor

from headsurgeon.alibi import blind_distance
from headsurgeon.backend import Model, check_model
from headsurgeon.data import bos_token_id, encode, resolve_bos, token_strings
from headsurgeon.errors import FigureExportError, InvalidArgumentError
from headsurgeon.exact_alibi import alibi_slopes
from headsurgeon.loading import model_info
from headsurgeon.outputs import atomic_write_bytes, atomic_write_text
from headsurgeon.probes import AttentionWeights, attention_weights
from headsurgeon.surgery import Heads, HeadSet

logger = logging.getLogger(__name__)

__all__ = [
    "FONT",
    "FORMATS",
    "OKABE_ITO",
    "STATIC_FORMATS",
    "Figure",
    "MAX_CELLS",
    "analytic_vs_measured",
    "attention_pattern",
    "blind_distance_grid",
    "bos_vs_importance",
    "diff_grid",
    "has_browser",
    "head_grid",
    "importance_grid",
    "label_grid",
    "models_grid",
    "pattern_diff",
    "require_browser",
    "retrieval_heatmap",
    "save_figure",
    "save_figures",
    "sick_share_plot",
    "split_formats",
    "style",
    "sweep_plot",
    "warn_skipped",
    "zero_fraction_plot",
]

FORMATS = ("html", "png", "svg", "pdf")
STATIC_FORMATS = ("png", "svg", "pdf")  # written through kaleido and a Chromium browser
# Written by default: html always, png when a browser is found (see split_formats).
DEFAULT_FORMATS = ("html", "png")
# What a Figure's notebook output carries besides the plotly renderer's own representation.
NOTEBOOK_OUTPUTS = ("text/html", "image/png")
NOTEBOOK_SCALE = 1.0  # pixel scale of the notebook PNG (1: the figure's own size, small files)
FONT = {"family": "Helvetica, Arial, sans-serif", "size": 15, "color": "#222222"}
# Okabe & Ito (2008) colours: distinguishable with every common colour-vision deficiency.
OKABE_ITO = {
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "green": "#009E73",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "purple": "#CC79A7",
    "black": "#000000",
}
LABEL_COLOURS = {"healthy": "#DDDDDD", "BOS-sink": OKABE_ITO["orange"], "dead": "#1A1A1A"}
# Marker styles that stay visible on both ends of viridis: white core with a dark rim, or the
# reverse.
LABEL_MARKERS = {
    "BOS-sink": {"symbol": "circle", "color": "white", "line": {"color": "black", "width": 1.5}},
    "dead": {"symbol": "x", "color": "black", "line": {"color": "white", "width": 1.5}},
}
# Display name and fixed colour range of the census metrics; others use their data range.
METRICS = {
    "bos_mass": ("BOS mass", (0.0, 1.0)),
    "bos_mass_std": ("BOS mass std", None),
    "sink_score": ("sink score α₀", (0.0, 1.0)),
    "entropy": ("entropy (nats)", None),
    "max_weight": ("max weight", (0.0, 1.0)),
    "mean_distance": ("mean distance (tokens)", None),
    "self_mass": ("self mass", (0.0, 1.0)),
    "prev_mass": ("previous-token mass", (0.0, 1.0)),
    "output_norm": ("output norm", None),
    "output_share": ("output share", None),
    "slope": ("ALiBi slope", None),
}
HOVER_SKIP = ("layer", "head", "label", "reason")


class Figure(go.Figure):
    """A plotly figure whose notebook output also shows where no plotly.js runs.

    Plotly's Jupyter output is its JSON mime type only, which GitHub, nbviewer and HTML exports
    do not draw. Shown in Jupyter (as a cell's value or with :meth:`show`), this figure's output
    keeps whatever the user's plotly renderer produces and adds the representations named in
    :data:`NOTEBOOK_OUTPUTS`: ``text/html`` (the interactive figure, plotly.js from the CDN, with
    the PNG inside until it draws) and ``image/png`` (when a Chromium browser is found; rendered
    through kaleido, ~0.3 s a figure). An explicit ``show(renderer=...)``, an external renderer
    (a browser window) and code outside Jupyter get plotly's behaviour unchanged.
    """

    def _repr_mimebundle_(self, include=None, exclude=None, validate=True, **kwargs):
        bundle = super()._repr_mimebundle_(include, exclude, validate, **kwargs)
        return _with_static_outputs(self, bundle) if bundle else bundle

    def _ipython_display_(self):
        import plotly.io as pio

        if pio.renderers.render_on_display and pio.renderers.default:
            self.show()
        else:
            print(repr(self))

    def show(self, *args, **kwargs):
        """Display the figure (see :meth:`plotly.graph_objects.Figure.show`)."""
        bundle = None
        if not args and kwargs.get("renderer") is None and _mimetype_renderers_in_ipython():
            kwargs.pop("renderer", None)
            bundle = self._repr_mimebundle_(**kwargs)
        if not bundle:
            return super().show(*args, **kwargs)
        from IPython.display import display

        display(bundle, raw=True)
        return None


def _mimetype_renderers_in_ipython() -> bool:
    """Whether plotly's default renderers all produce notebook output, inside IPython."""
    import plotly.io as pio
    from plotly.io.base_renderers import MimetypeRenderer

    try:
        from IPython import get_ipython
    except ImportError:
        return False
    names = [name for name in (pio.renderers.default or "").split("+") if name]
    return (
        get_ipython() is not None
        and bool(names)
        and all(isinstance(pio.renderers[name], MimetypeRenderer) for name in names)
    )


def _with_static_outputs(fig: go.Figure, bundle: dict) -> dict:
    """``bundle`` plus the ``text/html`` and ``image/png`` of :data:`NOTEBOOK_OUTPUTS`."""
    bundle = dict(bundle)
    png = bundle.get("image/png")
    if png is None and "image/png" in NOTEBOOK_OUTPUTS and has_browser():
        try:
            png = base64.b64encode(_image(fig, "png", NOTEBOOK_SCALE)).decode("ascii")
        except FigureExportError as e:
            logger.debug("no notebook PNG: %s", e)
        else:
            bundle["image/png"] = png
    if "text/html" not in bundle and "text/html" in NOTEBOOK_OUTPUTS:
        bundle["text/html"] = _notebook_html(fig, png)
    return bundle


def _notebook_html(fig: go.Figure, png: str | None) -> str:
    """The interactive figure (plotly.js from the CDN) as an HTML fragment.

    Where scripts do not run (GitHub) or the CDN cannot be reached, ``png`` (base64) shows in
    the figure's place; plotly.js removes it once the figure is drawn.
    """
    div_id = f"headsurgeon-{uuid.uuid4().hex[:16]}"
    drawn = "var i = document.getElementById('{plot_id}-png'); if (i) { i.remove(); }"
    html = fig.to_html(
        full_html=False,
        include_plotlyjs="cdn",
        div_id=div_id,
        config={"displaylogo": False},
        post_script=drawn,
    )
    if png is not None:
        width, height = fig.layout.width, fig.layout.height
        size = f' width="{width}" height="{height}"' if width and height else ""
        alt = escape(re.sub(r"<[^>]+>", "", fig.layout.title.text or "figure"))
        image = f'<img id="{div_id}-png" src="data:image/png;base64,{png}" alt="{alt}"{size}>'
        empty_div = re.compile(rf'(<div id="{div_id}"[^>]*>)(</div>)')
        html = empty_div.sub(lambda m: m[1] + image + m[2], html, count=1)
    return html


def _notebook_figure(make: Callable[..., go.Figure]) -> Callable[..., Figure]:
    """Decorator: the figure ``make`` returns, as a :class:`Figure`."""

    @functools.wraps(make)
    def wrapper(*args, **kwargs) -> Figure:
        fig = make(*args, **kwargs)
        if type(fig) is go.Figure:
            # A fresh figure of ours: retype it in place (Figure adds methods, no state), which
            # costs nothing, where Figure(fig) would copy and validate every trace again.
            fig.__class__ = Figure
        return fig

    return wrapper


def _title(metric: str) -> str:
    return METRICS.get(metric, (metric, None))[0]


def _check(df: pd.DataFrame, columns: Sequence[str], what: str = "df") -> None:
    if not isinstance(df, pd.DataFrame):
        raise InvalidArgumentError(f"{what} must be a DataFrame, got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise InvalidArgumentError(
            f"{what} lacks column(s) {', '.join(missing)}; pass a census (run_census) "
            "or classification (classify_heads)"
        )
    if df.empty:
        raise InvalidArgumentError(f"{what} has no rows; pass a census with at least one head")


def _shape(df: pd.DataFrame) -> tuple[int, int]:
    return int(df["layer"].max()) + 1, int(df["head"].max()) + 1


def _matrix(df: pd.DataFrame, column: str) -> np.ndarray:
    """``[layer, head]`` array of a column; cells without a row are NaN (or None)."""
    n_layers, n_heads = _shape(df)
    values = df[column].to_numpy()
    out = np.full((n_layers, n_heads), np.nan if values.dtype.kind in "fiub" else None, object)
    out[df["layer"].to_numpy(), df["head"].to_numpy()] = values
    return out.astype(float) if values.dtype.kind in "fiub" else out


def _hover(df: pd.DataFrame) -> tuple[np.ndarray, str]:
    """Custom data ``[layer, head, field]`` and the hover template that shows every metric."""
    fields = [c for c in ("label", "reason") if c in df.columns]
    fields += [c for c in df.columns if c not in HOVER_SKIP and df[c].dtype.kind in "fiu"]
    data = np.stack([_matrix(df, c).astype(object) for c in fields], axis=-1)
    lines = ["<b>layer %{y}, head %{x}</b>"]
    for i, field in enumerate(fields):
        if field == "label":
            lines[0] += f": %{{customdata[{i}]}}"
        elif field == "reason":
            lines.append(f"%{{customdata[{i}]}}")
        else:
            lines.append(f"{field} = %{{customdata[{i}]:.4g}}")
    return data, "<br>".join(lines) + "<extra></extra>"


def _cell(n_heads: int, width: float = 480) -> float:
    """Cell size in pixels: the heads fill about ``width`` px (a paper column at 2x export)."""
    return float(np.clip(width / n_heads, 8, 48))


def _label_markers(df: pd.DataFrame, cell: float, *, showlegend: bool = True) -> list[go.Scatter]:
    """One scatter trace per sick label, a symbol at the centre of each of its cells."""
    if "label" not in df.columns:
        return []
    traces = []
    for label, style in LABEL_MARKERS.items():
        rows = df[df["label"] == label]
        traces.append(
            go.Scatter(
                x=rows["head"],
                y=rows["layer"],
                mode="markers",
                name=f"{label} ({len(rows)})",
                legendgroup=label,
                showlegend=showlegend,
                marker={**style, "size": max(7.0, 0.48 * cell)},
                hoverinfo="skip",
            )
        )
    return traces


def _ticks(n: int, cell: float) -> list[int]:
    """Every 1st, 2nd, 4th... index, whichever keeps tick labels at least 24 px apart."""
    step = next(s for s in (1, 2, 4, 8, 16, 32, 64) if s * cell >= 24 or s == 64)
    return list(range(0, n, step))


def _axes(fig: go.Figure, n_layers: int, n_heads: int, cell: float, **where) -> None:
    common = {"tickmode": "array", "showgrid": False, "zeroline": False, "ticks": "outside"}
    fig.update_xaxes(
        title_text="head",
        tickvals=_ticks(n_heads, cell),
        range=[-0.5, n_heads - 0.5],
        **common,
        **where,
    )
    fig.update_yaxes(
        title_text="layer",
        tickvals=_ticks(n_layers, cell),
        range=[n_layers - 0.5, -0.5],  # layer 0 on top
        **common,
        **where,
    )


def _subtitle(df: pd.DataFrame) -> str:
    a = df.attrs
    if "n_seqs" not in a:
        return ""
    position0 = "BOS token" if a.get("prepend_bos") else "first text token"
    return (
        f"{a.get('model', '')} · {a['n_seqs']} seqs × {a.get('seq_len')} tokens · "
        f"position 0: {position0} · rows t ≥ {a.get('min_query_pos')}"
    )


def _wrap(text: str, width: float) -> list[str]:
    """Break ``text`` at its " · " separators into lines about ``width`` px wide (13 px font)."""
    lines: list[str] = []
    for part in text.split(" · ") if text else []:
        if lines and 7.0 * (len(lines[-1]) + 3 + len(part)) <= width:
            lines[-1] += " · " + part
        else:
            lines.append(part)
    return lines


def _legend_rows(names: Sequence[str], width: float) -> int:
    """Rows a horizontal legend of ``names`` wraps into at ``width`` px (15 px font)."""
    rows, used = 0, width
    for name in names:
        entry = 45 + 8.5 * len(name)
        if used + entry > width:
            rows, used = rows + 1, 0.0
        used += entry
    return rows


def style(
    fig: go.Figure,
    *,
    title: str,
    subtitle: str = "",
    width: float | None = None,
    height: float | None = None,
    margin: Mapping[str, float] | None = None,
    template: str = "plotly_white",
    title_size: float | None = None,
    subtitle_size: float = 13,
    title_xref: str = "paper",
) -> go.Figure:
    """The house layout of every figure: template, paper fonts, a left-aligned title and subtitle.

    ``width`` and ``height`` in pixels (rounded), ``margin`` as plotly's ``{"l", "r", "t", "b"}``;
    ``None`` leaves plotly's default. ``title_xref="paper"`` aligns the title with the plot area,
    ``"container"`` with the figure's edge. Returns ``fig``, restyled in place.
    """
    title_layout: dict = {
        "text": title,
        "subtitle": {"text": subtitle, "font": {"size": subtitle_size, "color": "#555555"}},
        "x": 0.0,
        "xanchor": "left",
        "xref": title_xref,
    }
    if title_size is not None:
        title_layout["font"] = {"size": title_size}
    layout: dict = {"template": template, "font": FONT, "title": title_layout}
    if width is not None:
        layout["width"] = round(width)
    if height is not None:
        layout["height"] = round(height)
    if margin is not None:
        layout["margin"] = dict(margin)
    fig.update_layout(**layout, plot_bgcolor="white")
    return fig


def _layout(
    fig: go.Figure,
    title: str,
    subtitle: str,
    plot_size: tuple[float, float],
    *,
    colorbar: bool = True,
    axis_title: bool = True,
    panel_titles: bool = False,
) -> None:
    """Title, fonts and a pixel layout around a plot area of ``plot_size``.

    The subtitle wraps to the figure's width and the legend (the named scatter traces) sits
    under the x axis, with the margins grown to fit both.
    """
    plot_w, plot_h = plot_size
    margin = {"l": 75, "r": 105 if colorbar else 20}
    width = margin["l"] + plot_w + margin["r"]
    lines = _wrap(subtitle, width - margin["l"] - 10)
    margin["t"] = 58 + (20 * len(lines) + 12 if lines else 0) + (28 if panel_titles else 0)
    names = [t.name for t in fig.data if t.type == "scatter" and t.showlegend is not False]
    rows = _legend_rows([n for n in names if n], width - 20)
    below = 62 if axis_title else 38  # tick labels (and the x axis title)
    margin["b"] = below + (28 * rows + 12 if rows else 0)
    height = margin["t"] + plot_h + margin["b"]
    style(fig, title=title, subtitle="<br>".join(lines), width=width, height=height,
          margin=margin, title_size=19)  # fmt: skip
    fig.update_layout(
        showlegend=rows > 0,
        legend={
            "orientation": "h",
            "x": 0,
            "xanchor": "left",
            "y": -below / plot_h,
            "yanchor": "top",
        },
    )


def _plot_size(n_layers: int, n_heads: int, cell: float) -> tuple[float, float]:
    return max(n_heads * cell, 240), max(n_layers * cell, 160)


@_notebook_figure
def head_grid(
    df: pd.DataFrame,
    metric: str = "bos_mass",
    *,
    title: str | None = None,
    colorscale: str = "Viridis",
    zrange: tuple[float, float] | None = None,
) -> go.Figure:
    """Layers x heads heatmap of ``metric``; BOS-sink (○) and dead (×) heads marked.

    The colour range is fixed for weights in [0, 1] (``bos_mass``, ``max_weight``, ...) so
    figures of different models compare; other metrics use their data range unless ``zrange``.
    Hovering a cell shows the head's label, reason and every metric.
    """
    _check(df, ["layer", "head", metric])
    n_layers, n_heads = _shape(df)
    cell = _cell(n_heads)
    custom, template = _hover(df)
    zrange = zrange or METRICS.get(metric, (None, None))[1]
    z = _matrix(df, metric)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            colorscale=colorscale,
            zmin=zrange[0] if zrange else None,
            zmax=zrange[1] if zrange else None,
            colorbar={"title": {"text": _title(metric), "side": "right"}, "thickness": 16},
            customdata=custom,
            hovertemplate=template,
            xgap=1,
            ygap=1,
        )
    )
    for trace in _label_markers(df, cell):
        fig.add_trace(trace)
    _axes(fig, n_layers, n_heads, cell)
    plot_size = _plot_size(n_layers, n_heads, cell)
    default = _title(metric)[0].upper() + _title(metric)[1:]
    _layout(fig, title or default, _subtitle(df), plot_size)
    return fig


@_notebook_figure
def label_grid(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """The label of every head: healthy (light grey), BOS-sink (orange ○), dead (black ×)."""
    _check(df, ["layer", "head", "label"])
    n_layers, n_heads = _shape(df)
    cell = _cell(n_heads)
    labels = list(LABEL_COLOURS)
    codes = df["label"].map({label: i for i, label in enumerate(labels)})
    if codes.isna().any():
        raise InvalidArgumentError(f"labels must be one of {', '.join(labels)}")
    z = _matrix(df.assign(code=codes.astype(float)), "code")
    bounds = np.linspace(0, 1, len(labels) + 1)
    colorscale = [
        [edge, colour]
        for i, colour in enumerate(LABEL_COLOURS.values())
        for edge in (bounds[i], bounds[i + 1])
    ]
    custom, template = _hover(df)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            zmin=-0.5,
            zmax=len(labels) - 0.5,
            colorscale=colorscale,
            showscale=False,
            customdata=custom,
            hovertemplate=template,
            xgap=1,
            ygap=1,
        )
    )
    counts = df["label"].value_counts()
    # Legend entries for the cell colours (symbols named); the cells' symbols need no entry.
    symbols = {"healthy": "", "BOS-sink": " ○", "dead": " ×"}
    for label, colour in LABEL_COLOURS.items():
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"{label}{symbols[label]} ({counts.get(label, 0)})",
                marker={"symbol": "square", "size": 15, "color": colour, "line": {"width": 1}},
            )
        )
    for trace in _label_markers(df, cell, showlegend=False):
        fig.add_trace(trace)
    _axes(fig, n_layers, n_heads, cell)
    total = len(df)
    sick = total - counts.get("healthy", 0)
    default = f"Head labels: {sick}/{total} sick ({sick / total:.1%})"
    plot_size = _plot_size(n_layers, n_heads, cell)
    _layout(fig, title or default, _subtitle(df), plot_size)  # same size as a head_grid
    return fig


@_notebook_figure
def diff_grid(
    before: pd.DataFrame,
    after: pd.DataFrame,
    metric: str = "bos_mass",
    *,
    title: str | None = None,
) -> go.Figure:
    """Heatmap of ``after - before`` for ``metric``; heads whose label changed are outlined.

    Both frames must cover the same heads (matched on ``layer`` and ``head``). Blue is a fall,
    red a rise, white no change; hover shows both values and both labels.
    """
    _check(before, ["layer", "head", metric], "before")
    _check(after, ["layer", "head", metric], "after")
    keys = ["layer", "head"]
    if set(map(tuple, before[keys].to_numpy())) != set(map(tuple, after[keys].to_numpy())):
        raise InvalidArgumentError("before and after cover different heads; compare one model")
    has_labels = "label" in before.columns and "label" in after.columns
    extra = ["label"] if has_labels else []
    merged = before[keys + [metric] + extra].merge(
        after[keys + [metric] + extra], on=keys, suffixes=("_before", "_after")
    )
    merged["change"] = merged[f"{metric}_after"] - merged[f"{metric}_before"]
    n_layers, n_heads = _shape(merged)
    cell = _cell(n_heads)
    bound = max(float(np.nanmax(np.abs(merged["change"]))), 1e-9)
    fields = [f"{metric}_before", f"{metric}_after", "change"]
    lines = ["<b>layer %{y}, head %{x}</b>"]
    lines += [f"{field} = %{{customdata[{i}]:.4g}}" for i, field in enumerate(fields)]
    if has_labels:
        fields += ["label_before", "label_after"]
        lines.append("label: %{customdata[3]} → %{customdata[4]}")
    custom = np.stack([_matrix(merged, c).astype(object) for c in fields], axis=-1)
    fig = go.Figure(
        go.Heatmap(
            z=_matrix(merged, "change"),
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            colorscale="RdBu_r",
            zmid=0,
            zmin=-bound,
            zmax=bound,
            colorbar={"title": {"text": f"Δ {_title(metric)}", "side": "right"}, "thickness": 16},
            customdata=custom,
            hovertemplate="<br>".join(lines) + "<extra></extra>",
            xgap=1,
            ygap=1,
        )
    )
    if has_labels:
        changed = merged[merged["label_before"] != merged["label_after"]]
        fig.add_trace(
            go.Scatter(
                x=changed["head"],
                y=changed["layer"],
                mode="markers",
                name=f"label changed ({len(changed)})",
                marker={
                    "symbol": "square-open",
                    "size": 0.8 * cell,
                    "color": "black",
                    "line": {"width": 2},
                },
                hoverinfo="skip",
            )
        )
    _axes(fig, n_layers, n_heads, cell)
    default = f"Change in {_title(metric)} (after − before)"
    plot_size = _plot_size(n_layers, n_heads, cell)
    _layout(fig, title or default, _subtitle(after), plot_size)
    return fig


SWEEP_STYLE = {
    "healthy": {"color": OKABE_ITO["blue"], "dash": "solid", "width": 2},
    "BOS-sink": {"color": OKABE_ITO["orange"], "dash": "dash", "width": 2},
    "dead": {"color": OKABE_ITO["black"], "dash": "dot", "width": 2},
    "sick": {"color": OKABE_ITO["vermillion"], "dash": "solid", "width": 3.5},
}
SWEEP_PANELS = {
    "sink": "sink threshold (BOS mass >)",
    "dead": "dead threshold (BOS mass >)",
    "min_output_share": "min output share (log)",
}


@_notebook_figure
def sweep_plot(sweep: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Head counts per label (and sick = BOS-sink + dead) as each threshold moves.

    One panel per threshold of :func:`headsurgeon.threshold_sweep`; a dashed vertical line marks
    the threshold in use. A flat ``sick`` curve around it means the count is robust; a steep one
    means it depends on the choice.
    """
    _check(sweep, ["threshold", "value", "sick"], "sweep")
    panels = [p for p in SWEEP_PANELS if p in set(sweep["threshold"])]
    fig = make_subplots(
        rows=1,
        cols=len(panels),
        shared_yaxes=True,
        horizontal_spacing=0.05,
        subplot_titles=[SWEEP_PANELS[p] for p in panels],
    )
    chosen = sweep.attrs.get("thresholds", {})
    for col, panel in enumerate(panels, start=1):
        rows = sweep[sweep["threshold"] == panel].sort_values("value")
        if panel == "min_output_share":
            rows = rows[rows["value"] > 0]  # a log axis cannot show 0
        for name, style in SWEEP_STYLE.items():
            if name not in rows.columns:
                continue
            fig.add_trace(
                go.Scatter(
                    x=rows["value"],
                    y=rows[name],
                    mode="lines",
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    line=style,
                    hovertemplate=f"{panel} = %{{x:.4g}}<br>{name}: %{{y}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        if panel in chosen:
            fig.add_vline(
                x=chosen[panel],
                line={"dash": "dash", "color": "#666666", "width": 1.5},
                row=1,
                col=col,
            )
        if panel == "min_output_share":
            fig.update_xaxes(type="log", exponentformat="power", row=1, col=col)
    fig.update_yaxes(title_text="heads", row=1, col=1, rangemode="tozero")
    fig.update_xaxes(showgrid=True, gridcolor="#EEEEEE", ticks="outside")
    fig.update_annotations(font={"size": 14})
    default = "Label counts against each threshold"
    _layout(
        fig,
        title or default,
        _subtitle(sweep),
        (300 * len(panels), 300),
        colorbar=False,
        axis_title=False,
        panel_titles=True,
    )
    return fig


@_notebook_figure
def models_grid(
    dfs: Mapping[str, pd.DataFrame], metric: str = "bos_mass", *, title: str | None = None
) -> go.Figure:
    """Several models' head grids side by side on one colour scale (the paper's cross-scale view).

    Panel widths follow the head counts, so a cell is the same width in every panel.
    """
    if not dfs:
        raise InvalidArgumentError("models_grid needs at least one {name: DataFrame} entry")
    for name, df in dfs.items():
        _check(df, ["layer", "head", metric], f"the DataFrame of {name}")
    shapes = {name: _shape(df) for name, df in dfs.items()}
    max_layers = max(s[0] for s in shapes.values())
    total_heads = sum(s[1] for s in shapes.values())
    cell = _cell(total_heads, 800)
    fixed = METRICS.get(metric, (None, None))[1]
    values = np.concatenate([df[metric].to_numpy(float) for df in dfs.values()])
    zmin, zmax = fixed or (float(np.nanmin(values)), float(np.nanmax(values)))
    fig = make_subplots(
        rows=1,
        cols=len(dfs),
        column_widths=[shapes[n][1] for n in dfs],
        horizontal_spacing=0.05,
        subplot_titles=[
            f"{name} ({(df['label'] != 'healthy').mean():.0%} sick)"
            if "label" in df.columns
            else name
            for name, df in dfs.items()
        ],
    )
    legend_shown = False
    for col, (name, df) in enumerate(dfs.items(), start=1):
        n_layers, n_heads = shapes[name]
        custom, template = _hover(df)
        fig.add_trace(
            go.Heatmap(
                z=_matrix(df, metric),
                x=list(range(n_heads)),
                y=list(range(n_layers)),
                coloraxis="coloraxis",
                customdata=custom,
                hovertemplate=f"{name}<br>" + template,
                xgap=1,
                ygap=1,
            ),
            row=1,
            col=col,
        )
        # One legend entry per label, from the first panel that has labels.
        for trace in _label_markers(df, cell, showlegend=not legend_shown):
            trace.name = trace.legendgroup  # counts differ between the panels
            fig.add_trace(trace, row=1, col=col)
            legend_shown = True
        _axes(fig, n_layers, n_heads, cell, row=1, col=col)
        # Equal cell heights: a shallower model's panel is shorter, aligned at the top.
        fig.update_yaxes(domain=[1 - n_layers / max_layers, 1], row=1, col=col)
        if col > 1:
            fig.update_yaxes(title_text=None, row=1, col=col)
    fig.update_layout(
        coloraxis={
            "colorscale": "Viridis",
            "cmin": zmin,
            "cmax": zmax,
            "colorbar": {"title": {"text": _title(metric), "side": "right"}, "thickness": 16},
        }
    )
    plot_w = total_heads * cell * (1 + 0.05 * (len(dfs) - 1))
    plot_size = (plot_w, max_layers * cell)
    _layout(fig, title or f"{_title(metric)} across models", "", plot_size, panel_titles=True)
    return fig


INSTALL_BROWSER = "install Chromium (apt-get install -y chromium) or set BROWSER_PATH"


@_notebook_figure
def sick_share_plot(shares: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Share of sick heads (BOS-sink + dead) per layer band, one line per model: the surgery
    paper's cross-scale comparison, from :func:`headsurgeon.classify.sick_shares`. Each model's
    share over all its heads is in its legend entry."""
    _check(shares, ["model", "band", "sick_share", "sick", "n_heads"], "shares")
    fig = go.Figure()
    palette = list(OKABE_ITO.values())
    for i, (model, rows) in enumerate(shares.groupby("model", sort=False)):
        total = rows[rows["band"] == "all"]
        bands = rows[rows["band"] != "all"]
        overall = f" (all: {total['sick_share'].iloc[0]:.0%})" if len(total) else ""
        fig.add_trace(go.Scatter(
            x=bands["band"], y=bands["sick_share"],
            mode="lines+markers", name=f"{model}{overall}",
            line={"color": palette[i % len(palette)], "width": 2.5}, marker={"size": 9},
            customdata=bands[["sick", "n_heads", "layers"]].to_numpy(),
            hovertemplate=f"{model}<br>%{{x}} layers (%{{customdata[2]}})<br>sick share "
                          "%{y:.1%} (%{customdata[0]} of %{customdata[1]} heads)<extra></extra>",
        ))  # fmt: skip
    fig.update_yaxes(
        title_text="sick heads (BOS-sink + dead)", tickformat=".0%", rangemode="tozero"
    )
    fig.update_xaxes(title_text="layer band (each model's layers in thirds)")
    subtitle = "share of each band's heads labelled BOS-sink or dead"
    _layout(fig, title or "Sick heads across models", subtitle, (560, 340), colorbar=False)
    return fig


def _browser() -> tuple[str | None, str]:
    """``(path, "")`` of the Chromium kaleido will use, or ``(None, "none found")`` (or why
    ``BROWSER_PATH`` cannot be used).

    ``BROWSER_PATH`` wins (as in choreographer); else choreographer's search: a browser it
    downloaded, the Chrome/Chromium/Edge/Brave/Vivaldi names on ``PATH``, their usual paths.
    """
    configured = os.environ.get("BROWSER_PATH")
    if configured:
        if not os.access(configured, os.X_OK):
            return None, f"BROWSER_PATH={configured} is not an executable"
        return configured, ""
    from choreographer.browsers.chromium import Chromium

    found = Chromium.find_browser(skip_local=False)
    if found is None:
        return None, "none found"
    return found, ""


def has_browser() -> bool:
    """Whether static figures (png, svg, pdf) can be written here: a Chromium was found."""
    return _browser()[0] is not None


def require_browser(what: str = "static figure export", *, instead: str = "save as .html") -> str:
    """The browser's path; without one, :class:`FigureExportError` in one line with the fix.

    ``what`` names what needs it (``"--format pdf"``); ``instead`` is the way around it.
    """
    path, why = _browser()
    if path is None:
        raise FigureExportError(
            f"{what} needs a Chromium browser, {why}; {INSTALL_BROWSER}, or {instead}"
        )
    return path


def _find_browser() -> str:
    return require_browser()


_server = {"running": False}


class _ByeFilter(logging.Filter):
    """Drop choreographer's traceback about the ``{bye}`` its Chromium wrapper sends on exit.

    When a browser closes, choreographer's wrapper process writes ``{bye}`` to the pipe as an
    end marker. If Chromium's last event and that marker arrive in one read (the reader thread
    lagging a little, as on a busy machine), the reader waits for a message end that never
    comes until the channel is closed, then parses the marker as JSON and logs
    ``JSONError decoding message. Ignoring`` with a ``simplejson`` traceback, at interpreter
    exit. The events are delivered; only the marker is misread. Every other record, and every
    other JSON error, passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        document = getattr(getattr(error, "__cause__", None), "doc", None)
        return not (
            record.getMessage().startswith("JSONError decoding message")
            and isinstance(document, str)
            and document.strip() == "{bye}"
        )


def _quiet_browser_exit() -> None:
    """Install :class:`_ByeFilter` on choreographer's pipe logger (once)."""
    pipe_logger = logging.getLogger("choreographer.channels.pipe")
    if not any(isinstance(f, _ByeFilter) for f in pipe_logger.filters):
        pipe_logger.addFilter(_ByeFilter())


def _image(fig: go.Figure, fmt: str, scale: float) -> bytes:
    """Static image bytes through kaleido; one Chromium is kept running for later exports."""
    import kaleido

    require_browser(f"saving a figure as {fmt}")  # fail with the fix, not deep inside kaleido
    if not _server["running"]:
        _quiet_browser_exit()
        kaleido.start_sync_server(silence_warnings=True)  # ~0.3 s per image after the first
        _server["running"] = True
    layout = fig.layout
    opts = {"format": fmt, "width": layout.width or 700, "height": layout.height or 500}
    try:
        return kaleido.calc_fig_sync(fig, opts=opts | {"scale": scale})
    except Exception as e:  # kaleido and choreographer raise many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FigureExportError(f"kaleido could not export the figure as {fmt} ({first})") from e


def save_figure(
    fig: go.Figure,
    path: str | os.PathLike,
    *,
    scale: float = 2.0,
    include_plotlyjs: bool | str = True,
) -> Path:
    """Write ``fig`` to ``path``, the format given by its suffix; return the path.

    ``.html`` is interactive (self-contained by default; ``include_plotlyjs="directory"`` writes
    one shared ``plotly.min.js`` beside it instead). ``.png`` (at ``scale`` times the figure's
    pixel size), ``.svg`` and ``.pdf`` go through kaleido and a Chromium browser (the system one,
    or ``BROWSER_PATH``). The file appears whole or not at all.
    """
    if not isinstance(fig, go.Figure):
        raise InvalidArgumentError(
            f"save_figure takes a plotly Figure (what the plot functions return), got "
            f"{type(fig).__name__}"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"save_figure needs a file path, got {type(path).__name__}")
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise InvalidArgumentError(
            f"cannot save a figure as {path.name!r}; use a suffix of {', '.join(FORMATS)}"
        )
    if fmt == "html":
        html = fig.to_html(
            include_plotlyjs=include_plotlyjs, full_html=True, config={"displaylogo": False}
        )
        if include_plotlyjs == "directory" and not (path.parent / "plotly.min.js").exists():
            from plotly.offline import get_plotlyjs

            atomic_write_text(path.parent / "plotly.min.js", get_plotlyjs())
        atomic_write_text(path, html)
    else:
        atomic_write_bytes(path, _image(fig, fmt, scale))
    logger.debug("wrote %s", path)
    return path


def split_formats(formats: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """The figure formats to write and the static ones to skip: ``(write, skipped)``.

    ``None`` asks for :data:`DEFAULT_FORMATS`: html always, png when a Chromium browser is
    found, else png is skipped. Formats given explicitly are all written: an unknown one raises
    :class:`InvalidArgumentError`, a static one without a browser :class:`FigureExportError`
    (one line with the fix). Call it before writing anything, so that either fails first.

    >>> split_formats(["html"])
    (['html'], [])
    """
    if formats is None:
        if has_browser():
            return list(DEFAULT_FORMATS), []
        return [f for f in DEFAULT_FORMATS if f not in STATIC_FORMATS], ["png"]
    if isinstance(formats, str):
        formats = [formats]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown figure format(s) {', '.join(unknown)}; use {', '.join(FORMATS)}"
        )
    write = list(dict.fromkeys(formats))
    static = [f for f in write if f in STATIC_FORMATS]
    if static:
        require_browser(
            f"figure format(s) {', '.join(static)}",
            instead="leave formats at their default (html, and png when a browser is found)",
        )
    return write, []


def save_figures(
    figures: Mapping[str, go.Figure],
    folder: str | os.PathLike,
    formats: Sequence[str] | None = None,
    *,
    scale: float = 2.0,
    include_plotlyjs: bool | str = "directory",
) -> list[str]:
    """Write each figure as ``folder/<name>.<format>``; return the file names skipped.

    ``formats`` follows :func:`split_formats`: by default html, and png when a browser is found
    (the PNGs are skipped, and returned, when none is). The writers of this package then log
    :func:`warn_skipped` once the folder is complete.
    """
    write, skipped = split_formats(formats)
    folder = Path(folder)
    for name, figure in figures.items():
        for fmt in write:
            save_figure(
                figure, folder / f"{name}.{fmt}", scale=scale, include_plotlyjs=include_plotlyjs
            )
    return [f"{name}.{fmt}" for fmt in skipped for name in figures]


def _file_list(names: Sequence[str], most: int = 6) -> str:
    """``a.png, b.png`` for a few names, ``*.png`` patterns with counts for many.

    >>> _file_list(["a.png", "b.png"]), _file_list([f"{i}.png" for i in range(9)])
    ('a.png, b.png', '*.png')
    """
    if len(names) <= most:
        return ", ".join(names)
    suffixes = dict.fromkeys(Path(n).suffix for n in names)
    return ", ".join(f"*{suffix}" for suffix in suffixes)


def warn_skipped(names: Sequence[str], folder: str | os.PathLike) -> str | None:
    """Log one warning line naming the static figures skipped in ``folder``, and the fix.

    Returns the line (``None`` when nothing was skipped).
    """
    if not names:
        return None
    why = _browser()[1] or "the browser could not be used"
    plural, them = ("s", "them") if len(names) > 1 else ("", "it")
    message = (
        f"warning: skipped {len(names)} static figure{plural} in {Path(folder)}/ "
        f"({_file_list(names)}): no Chromium browser for kaleido ({why}); to write {them}, "
        f"{INSTALL_BROWSER} and run again, or export {them} from the .html figure{plural} "
        "(camera button)"
    )
    logger.warning(message)
    return message


# --- Blindness and evaluation figures ---
def _compact(x: float) -> str:
    """Short cell text for a distance: ``124``, ``2.2k``, ``4.4e53``, ``∞``.

    >>> [_compact(x) for x in (124.0, 22359.0, 4.37e53, float("inf"))]
    ['124', '22k', '4.4e53', '∞']
    """
    if not np.isfinite(x):
        return "∞"
    if x < 1e4:
        return f"{x:.0f}"
    if x < 1e6:
        return f"{x / 1e3:.0f}k"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _eval_layout(fig: go.Figure, title: str, subtitle: str, width: int, height: int) -> None:
    margin = {"l": 80, "r": 30, "t": 95 if subtitle else 65, "b": 70}
    style(fig, title=title, subtitle=subtitle, width=width, height=height, margin=margin,
          subtitle_size=12)  # fmt: skip


@_notebook_figure
def blind_distance_grid(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Blind distance of every head (columns) per dtype and underflow limit (rows), log colours.

    Takes :func:`headsurgeon.blindness.analytic_blindness` output; ALiBi slopes are the same in
    every layer, so layer 0 stands for all. Cells show the distance in tokens (``∞``: never
    blind); bold cells are blind within the table's context.
    """
    _check(df, ["layer", "head", "dtype", "limit", "blind_distance"], "blindness table")
    rows = df[df["layer"] == df["layer"].min()]
    keys = list(dict.fromkeys(zip(rows["dtype"], rows["limit"], strict=True)))
    n_heads = int(rows["head"].max()) + 1
    z = np.full((len(keys), n_heads), np.nan)
    text = np.full((len(keys), n_heads), "", dtype=object)
    for i, key in enumerate(keys):
        sub = rows[(rows["dtype"] == key[0]) & (rows["limit"] == key[1])]
        for head, d, label in zip(
            sub["head"], sub["blind_distance"], sub.get("label", ""), strict=False
        ):
            z[i, head] = np.log10(d) if np.isfinite(d) else np.nan
            text[i, head] = f"<b>{_compact(d)}</b>" if label == "blind" else _compact(d)
    finite = z[np.isfinite(z)]
    top = float(finite.max()) if finite.size else 1.0
    never = np.where(np.isnan(z), top, np.nan)  # never-blind cells: drawn in grey
    cell_w = float(np.clip(900 / n_heads, 22, 64))
    fig = go.Figure(
        [
            go.Heatmap(
                z=never,
                x=list(range(n_heads)),
                y=[f"{d} · {t}" for d, t in keys],
                colorscale=[[0, "#E5E5E5"], [1, "#E5E5E5"]],
                showscale=False,
                hoverinfo="skip",
            ),
            go.Heatmap(
                z=z,
                x=list(range(n_heads)),
                y=[f"{d} · {t}" for d, t in keys],
                text=text,
                texttemplate="%{text}",
                textfont={"size": 11 if n_heads <= 16 else 8},
                colorscale="Cividis",
                zmin=float(finite.min()) if finite.size else 0.0,
                zmax=top,
                xgap=1,
                ygap=1,
                colorbar={
                    "title": {"text": "log₁₀ tokens", "side": "right"},
                    "thickness": 16,
                },
                hovertemplate="head %{x}, %{y}: %{text} tokens<extra></extra>",
            ),
        ]
    )
    fig.update_xaxes(title_text="head", tickmode="linear", dtick=1 if n_heads <= 16 else 4)
    fig.update_yaxes(autorange="reversed", title_text="")
    a = df.attrs
    subtitle = (
        f"{a.get('model', '')} · {a.get('bias', 'standard')} ALiBi · same in every layer · "
        f"bold: blind within {a.get('context_length', '')} tokens"
    )
    _eval_layout(
        fig,
        title or "Blind distance per head (tokens)",
        subtitle,
        width=round(190 + n_heads * cell_w + 110),
        height=round(165 + 34 * len(keys)),
    )
    return fig


def _sequential(n: int) -> list[str]:
    """``n`` colours along viridis (colour-blind safe and monotone in lightness)."""
    from plotly.colors import sample_colorscale

    return sample_colorscale("Viridis", [0.9 * i / max(n - 1, 1) for i in range(n)])


@_notebook_figure
def zero_fraction_plot(by_distance: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Share of weights that underflow to exactly 0 against distance, one line per head.

    Takes ``measure_blindness(...).by_distance``; one panel per dtype, layers pooled (entries
    weighted). Heads with no underflow in any dtype are left out (named in the subtitle).
    """
    cols = ["head", "dtype", "distance_lo", "distance_hi", "entries", "zero_entries"]
    _check(by_distance, cols, "by_distance table")
    pooled = by_distance.groupby(["dtype", "head", "distance_lo", "distance_hi"], sort=False)[
        ["entries", "zero_entries"]
    ].sum()
    pooled = pooled.reset_index()
    pooled["fraction"] = pooled["zero_entries"] / pooled["entries"]
    pooled["distance"] = (pooled["distance_lo"] + pooled["distance_hi"] - 1) / 2
    dtypes = list(dict.fromkeys(pooled["dtype"]))
    heads = sorted(pooled["head"].unique())
    blind = sorted(pooled.loc[pooled["zero_entries"] > 0, "head"].unique())
    colours = dict(zip(heads, _sequential(len(heads)), strict=True))
    fig = make_subplots(
        rows=1, cols=len(dtypes), subplot_titles=dtypes, shared_yaxes=True, horizontal_spacing=0.04
    )
    for col, dtype in enumerate(dtypes, start=1):
        for head in blind:
            sub = pooled[(pooled["dtype"] == dtype) & (pooled["head"] == head)]
            fig.add_trace(
                go.Scatter(
                    x=sub["distance"],
                    y=sub["fraction"],
                    mode="lines",
                    line={"color": colours[head], "width": 2},
                    name=f"head {head}",
                    legendgroup=str(head),
                    showlegend=col == 1,
                    hovertemplate=f"head {head}, distance %{{x:.0f}}: %{{y:.3f}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(title_text="distance i − j (tokens)", rangemode="tozero")
    fig.update_yaxes(range=[-0.02, 1.02])
    fig.update_yaxes(title_text="share of weights = 0", row=1, col=1)
    fig.update_annotations(font={"size": 14})
    sighted = [h for h in heads if h not in blind]
    subtitle = "layers pooled" + (
        f" · no underflow: heads {', '.join(map(str, sighted))}" if sighted else ""
    )
    _eval_layout(
        fig,
        title or "Attention weights that underflow to exactly 0",
        subtitle,
        width=120 + 330 * len(dtypes) + 110,
        height=430,
    )
    fig.update_layout(legend={"title": {"text": ""}, "x": 1.01, "y": 1})
    return fig


DTYPE_MARKERS = {
    "float32": ("circle", OKABE_ITO["blue"]),
    "bfloat16": ("square", OKABE_ITO["orange"]),
    "float16": ("diamond", OKABE_ITO["green"]),
}


@_notebook_figure
def analytic_vs_measured(by_head: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Measured first zero distance against the analytic blind distance, per head and dtype.

    Takes ``measure_blindness(...).by_head``. Filled markers: the head's smallest distance with an
    exact zero in any layer; open markers at the top: no zero within the measured length. The
    analytic distance (``zero`` limit, equal content logits) bounds the measured one from
    above; the softmax normaliser and content logits pull real zeros closer.
    """
    _check(by_head, ["head", "dtype", "analytic_distance", "first_zero_distance"], "by_head table")
    seq_len = by_head.attrs.get("seq_len") or float(by_head["first_zero_distance"].max())
    per_head = by_head.groupby(["dtype", "head"], sort=False).agg(
        analytic=("analytic_distance", "first"), measured=("first_zero_distance", "min")
    )
    per_head = per_head.reset_index()
    fig = go.Figure()
    for dtype, sub in per_head.groupby("dtype", sort=False):
        symbol, colour = DTYPE_MARKERS.get(dtype, ("circle", OKABE_ITO["black"]))
        for seen, part in sub.groupby(sub["measured"].notna()):
            fig.add_trace(
                go.Scatter(
                    x=part["analytic"],
                    y=part["measured"] if seen else np.full(len(part), seq_len),
                    mode="markers",
                    marker={
                        "symbol": symbol if seen else f"{symbol}-open",
                        "color": colour,
                        "size": 10,
                        "line": {"width": 1, "color": "white" if seen else colour},
                    },
                    name=dtype if seen else f"{dtype}: no zero ≤ {seq_len}",
                    customdata=part["head"],
                    hovertemplate="head %{customdata}: analytic %{x:.0f}, measured %{y:.0f}"
                    "<extra></extra>",
                )
            )
    finite = per_head["analytic"][np.isfinite(per_head["analytic"])]
    measured = per_head["measured"].dropna()
    lo = max(1.0, min(finite.min(), measured.min() if len(measured) else seq_len) / 1.5)
    x_hi, y_hi = float(finite.max()) * 1.5, seq_len * 1.6
    diagonal = min(x_hi, y_hi)
    fig.add_trace(
        go.Scatter(
            x=[lo, diagonal],
            y=[lo, diagonal],
            mode="lines",
            line={"color": "#888888", "dash": "dot", "width": 1.5},
            name="measured = analytic",
            hoverinfo="skip",
        )
    )
    fig.add_hline(
        y=seq_len,
        line={"color": "#BBBBBB", "width": 1},
        annotation={"text": f"measured length {seq_len}", "font": {"size": 12}},
        annotation_position="bottom left",
    )
    log_axis = {"type": "log", "dtick": 1, "ticks": "outside", "showgrid": True}
    fig.update_xaxes(
        title_text="analytic blind distance (tokens)", range=np.log10([lo, x_hi]), **log_axis
    )
    fig.update_yaxes(
        title_text="measured first zero (tokens)", range=np.log10([lo, y_hi]), **log_axis
    )
    a = by_head.attrs
    subtitle = f"{a.get('model', '')} · {a.get('n_seqs', '')} × {seq_len} tokens · zero limit"
    _eval_layout(fig, title or "Analytic versus measured blindness", subtitle, 860, 520)
    fig.update_layout(legend={"x": 1.02, "y": 1, "font": {"size": 13}})
    return fig


RETRIEVAL_METRICS = {  # title, colour-bar title
    "top1_accuracy": ("top-1 accuracy (log-likelihood rank)", "top-1"),
    "greedy_accuracy": ("greedy exact match", "exact match"),
    "mean_rank": ("mean rank of the true key", "mean rank"),
}


@_notebook_figure
def retrieval_heatmap(
    table: pd.DataFrame, metric: str = "top1_accuracy", *, title: str | None = None
) -> go.Figure:
    """Depth x context-length heat map of a retrieval metric (``passkey``/``needle`` ``.table``).

    A dashed line separates lengths within the training length from those beyond it.
    """
    _check(table, ["context_length", "depth", metric], "retrieval table")
    grid = table.pivot_table(index="depth", columns="context_length", values=metric)
    names = RETRIEVAL_METRICS.get(metric, (metric, metric))
    lengths = [str(x) for x in grid.columns]
    accuracy = metric != "mean_rank"
    text = [[f"{v:.0%}" if accuracy else f"{v:.1f}" for v in row] for row in grid.to_numpy()]
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(),
            x=lengths,
            y=[f"{d:.0%}" for d in grid.index],
            text=text,
            texttemplate="%{text}",
            colorscale="Cividis" if accuracy else "Cividis_r",
            zmin=0 if accuracy else 1,
            zmax=1 if accuracy else float(table.get("n_candidates", pd.Series([10])).max()),
            xgap=2,
            ygap=2,
            colorbar={"title": {"text": names[1], "side": "right"}, "thickness": 16},
            hovertemplate="length %{x}, depth %{y}: %{text}<extra></extra>",
        )
    )
    a = table.attrs
    train_ctx = a.get("train_ctx")
    inside = [int(x) <= train_ctx for x in grid.columns] if train_ctx else []
    if any(inside) and not all(inside):
        fig.add_vline(x=sum(inside) - 0.5, line={"color": "black", "dash": "dash", "width": 3})
        fig.add_annotation(
            x=sum(inside) - 0.5, y=1.02, yref="paper", text=f"train length {train_ctx}",
            showarrow=False, xanchor="center", yanchor="bottom", font={"size": 12},
        )  # fmt: skip
    fig.update_xaxes(title_text="context length (tokens)", type="category")
    fig.update_yaxes(title_text="needle depth", autorange="reversed", type="category")
    chance = table["chance"].iloc[0] if "chance" in table and metric == "top1_accuracy" else None
    subtitle = f"{a.get('model', '')} · {int(table['n_trials'].iloc[0])} trials per cell" + (
        f" · chance {chance:.0%}" if chance is not None else ""
    )
    task = a.get("task", "retrieval")
    _eval_layout(
        fig,
        title or f"{task}: {names[0]}",
        subtitle,
        width=round(180 + 80 * len(lengths) + 150),
        height=round(200 + 50 * len(grid.index)),
    )
    return fig


# --- Head importance figures ---
def _importance_subtitle(df: pd.DataFrame) -> str:
    """Model, method and data of a :func:`headsurgeon.head_importance` result (or a merge)."""
    a = df.attrs
    method = a.get("importance_method", a.get("method"))
    if method is None and "method" in df.columns:
        method = df["method"].iloc[0]
    ablation = a.get("importance_ablation", a.get("ablation"))
    if ablation is None and "ablation" in df.columns:
        ablation = df["ablation"].iloc[0]
    parts = [str(a.get("model", ""))]
    if method:
        parts.append(f"{method} of {ablation} ablation" if method == "attribution"
                     else f"{method} ablation")  # fmt: skip
    if "n_seqs" in a:
        parts.append(f"{a['n_seqs']} seqs × {a.get('seq_len')} tokens")
    if "clean_loss" in df.columns:
        parts.append(f"clean loss {float(df['clean_loss'].iloc[0]):.3f} nats")
    return " · ".join(p for p in parts if p)


@_notebook_figure
def importance_grid(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Layers x heads heatmap of ``delta_loss``: what removing each head costs (nats).

    Takes :func:`headsurgeon.head_importance` output, or a classified census merged with it
    (then BOS-sink ○ and dead × heads are marked as in :func:`head_grid`). The diverging colour
    scale is centred on 0: red heads raise the loss when removed, blue ones lower it.
    """
    _check(df, ["layer", "head", "delta_loss"], "importance table")
    bound = max(float(np.nanmax(np.abs(df["delta_loss"].to_numpy()))), 1e-9)
    fig = head_grid(df, "delta_loss", colorscale="RdBu_r", zrange=(-bound, bound))
    fig.update_traces(colorbar_title_text="Δ loss (nats)", selector={"type": "heatmap"})
    n_layers, n_heads = _shape(df)
    default = "Head importance: loss increase when the head is removed"
    _layout(fig, title or default, _importance_subtitle(df),
            _plot_size(n_layers, n_heads, _cell(n_heads)))  # fmt: skip
    return fig


IMPORTANCE_MARKERS = {  # label -> marker; healthy darker than in label_grid, for a white plot
    "healthy": {"symbol": "circle", "color": "#999999", "line": {"color": "white", "width": 0.5}},
    "BOS-sink": {"symbol": "circle", "color": OKABE_ITO["orange"], "line": {"color": "black"}},
    "dead": {"symbol": "x", "color": OKABE_ITO["black"], "line": {"color": "white", "width": 0.5}},
}


@_notebook_figure
def bos_vs_importance(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """BOS mass against ``delta_loss`` per head, coloured by label: which sinks are dormant.

    Takes a classified census merged with :func:`headsurgeon.head_importance` on ``layer`` and
    ``head`` (columns ``bos_mass``, ``label``, ``delta_loss``; ``delta_loss_se`` draws error
    bars). A sink near the zero line is dormant (removing it costs nothing); one above it works.
    """
    _check(df, ["layer", "head", "bos_mass", "label", "delta_loss"], "merged table")
    fig = go.Figure()
    for label, marker in IMPORTANCE_MARKERS.items():
        rows = df[df["label"] == label]
        if rows.empty:
            continue
        bars = {"thickness": 1, "width": 0, "color": "#BBBBBB"}
        if "delta_loss_se" in rows.columns:
            bars["array"] = rows["delta_loss_se"]
        fig.add_trace(
            go.Scatter(
                x=rows["bos_mass"],
                y=rows["delta_loss"],
                mode="markers",
                name=f"{label} ({len(rows)})",
                marker={**marker, "size": 10 if label == "healthy" else 12},
                error_y=bars if "array" in bars else None,
                customdata=np.stack([rows["layer"], rows["head"]], axis=-1),
                hovertemplate="<b>L%{customdata[0]}H%{customdata[1]}</b><br>BOS mass %{x:.3f}"
                "<br>Δ loss %{y:.4g} nats<extra>" + label + "</extra>",
            )
        )
    fig.add_hline(y=0, line={"color": "#666666", "width": 1, "dash": "dot"})
    fig.update_xaxes(title_text="BOS mass", range=[-0.02, 1.02], ticks="outside",
                     showgrid=True, gridcolor="#EEEEEE", zeroline=False)  # fmt: skip
    fig.update_yaxes(title_text="Δ loss when removed (nats)", ticks="outside", showgrid=True,
                     gridcolor="#EEEEEE", zeroline=False)  # fmt: skip
    default = "Attention sinks against causal importance"
    _layout(fig, title or default, _importance_subtitle(df), (520, 380), colorbar=False)
    return fig


# --- One head's attention on a text ---
# Cells a side above which a pattern is max-pooled for display (hover still shows exact weights).
MAX_CELLS = 256


def _one_sequence(model: Model, text_or_tokens: str | Tensor | Sequence[int]) -> Tensor:
    """``[1, pos]`` tokens: a text by the model's BOS convention, token ids as given."""
    if isinstance(text_or_tokens, str):
        return encode(model, text_or_tokens)
    if isinstance(text_or_tokens, Tensor):
        return text_or_tokens if text_or_tokens.dim() != 1 else text_or_tokens[None]
    if isinstance(text_or_tokens, Sequence) and all(isinstance(t, int) for t in text_or_tokens):
        return torch.tensor([list(text_or_tokens)], dtype=torch.long)
    raise InvalidArgumentError(
        f"give a text (str) or one sequence of token ids, got {type(text_or_tokens).__name__}"
    )


def _shown_tokens(model: Model, tokens: Tensor) -> list[str]:
    """``"<position> <token>"`` per position (unique, so they can name a category axis), escaped
    as plotly shows text (it reads tags: ``<s>`` would strike the rest through)."""
    return [f"{i} {escape(t, quote=False)}" for i, t in enumerate(token_strings(model, tokens[0]))]


def _head_facts(model: Model, census: pd.DataFrame | None) -> Callable[[int, int], str]:
    """``(layer, head) -> "L1H7 · BOS-sink · slope 0.0039 · 0 beyond 2,231"``: the head's label
    (from ``census``), ALiBi slope and blind distance (exact zeros in the model's dtype)."""
    labels = {}
    if census is not None:
        _check(census, ["layer", "head", "label"], "census")
        labels = {(int(r.layer), int(r.head)): r.label for r in census.itertuples()}
    slopes = alibi_slopes(model).tolist() if model.cfg.positional_embedding_type == "alibi" else []

    def facts(layer: int, head: int) -> str:
        parts = [f"L{layer}H{head}"] + ([labels[layer, head]] if (layer, head) in labels else [])
        if slopes:
            blind = blind_distance(slopes[head], model.cfg.dtype, "zero")
            parts += [f"slope {slopes[head]:.3g}", f"0 beyond {_compact(blind)}"]
        return " · ".join(parts)

    return facts


def _blind_distances(model: Model, heads: Sequence[tuple[int, int]]) -> list[float]:
    """Each head's distance from which its weights are exactly 0 in the model's dtype (inf: never
    or no ALiBi)."""
    if model.cfg.positional_embedding_type != "alibi":
        return [float("inf")] * len(heads)
    slopes = alibi_slopes(model).tolist()
    return [float(blind_distance(slopes[h], model.cfg.dtype, "zero")) for _, h in heads]


def _pattern_trace(
    w: AttentionWeights,
    i: int,
    labels: list[str],
    before: AttentionWeights | None = None,
    **heatmap,
) -> go.Heatmap:
    """Heatmap of head ``i`` of ``w`` (with ``before``: of the change from it), future cells
    blank. Hover gives the exact weight(s) and where: the (query, key) tokens for a short
    sequence, whose axes are labelled ``"<position> <token>"``; for a pooled one the positions
    of each cell's largest weight (numbers only: the figure stays small)."""
    n = w.weights.shape[-1]
    values = w.weights[i] if before is None else w.weights[i] - before.weights[i]
    shown = np.where(np.tri(n, dtype=bool), values, np.nan)
    columns: list[np.ndarray] = []
    if w.step == 1:
        lines = ["query %{y} → key %{x}"]
    else:
        columns += [w.query[i], w.key[i]]
        lines = [f"largest weight of a {w.step}×{w.step} cell: query %{{customdata[0]}} → key "
                 "%{customdata[1]}"]  # fmt: skip
    if before is None:
        lines.append("weight %{z:.6g}")  # z holds the weight itself
    else:
        j = len(columns)
        columns += [before.weights[i], w.weights[i]]
        lines.append(f"%{{customdata[{j}]:.6g}} → %{{customdata[{j + 1}]:.6g}} (%{{z:+.6g}})")
    custom = np.stack(columns, axis=-1).astype(np.float64) if columns else None
    axis = labels if w.step == 1 else None
    return go.Heatmap(z=shown, x=axis, y=axis, customdata=custom, hoverongaps=False,
                      hovertemplate="<br>".join(lines) + "<extra></extra>", **heatmap)  # fmt: skip


def _pattern_axes(fig: go.Figure, w: AttentionWeights, row: int, col: int) -> None:
    """Category axes of ``"<position> <token>"`` for a short sequence, positions for a pooled
    one; query 0 on top."""
    n = w.weights.shape[-1]
    ticks: dict = {}
    if w.step > 1:
        vals = list(range(0, n, max(1, n // 8)))
        ticks = {"tickmode": "array", "tickvals": vals, "ticktext": [str(v * w.step) for v in vals]}
    fig.update_xaxes(range=[-0.5, n - 0.5], tickangle=-60, tickfont={"size": 11}, showgrid=False,
                     zeroline=False, row=row, col=col, **ticks)  # fmt: skip
    fig.update_yaxes(range=[n - 0.5, -0.5], tickfont={"size": 11}, showgrid=False, zeroline=False,
                     row=row, col=col, **ticks)  # fmt: skip


def _pattern_marks(fig: go.Figure, w: AttentionWeights, blind: float, row: int, col: int) -> None:
    """Position 0 (a box around column 0) and, where the sequence reaches it, the blind
    distance: the diagonal key = query − δ, left of which every weight is exactly 0."""
    n = w.weights.shape[-1]
    box = {"color": OKABE_ITO["vermillion"], "width": 2}
    fig.add_shape(type="rect", x0=-0.5, x1=0.5, y0=-0.5, y1=n - 0.5, line=box, row=row, col=col)
    if blind < w.n_pos:
        s = w.step
        fig.add_shape(type="line", x0=-0.5, y0=blind / s - 0.5, x1=(w.n_pos - blind) / s - 0.5,
                      y1=n - 0.5, line={"color": OKABE_ITO["sky"], "width": 2, "dash": "dash"},
                      row=row, col=col)  # fmt: skip


def _pattern_title(model: Model, tokens: Tensor, w: AttentionWeights, what: str) -> tuple:
    info = model_info(model)
    text = "".join(token_strings(model, tokens[0, :24])).replace("·", " ")
    position0 = "BOS token" if resolve_bos(model) and w.n_pos and tokens[0, 0] == bos_token_id(
        model) else "first token"  # fmt: skip
    parts = [info.name, f"{w.n_pos} tokens", f"red box: position 0 ({position0})",
             "dashed: weights exactly 0 left of it (blind distance)"]  # fmt: skip
    if w.step > 1:
        parts.append(f"max-pooled: each cell is the largest of {w.step}×{w.step} weights")
    return f"{what} on “{text}{'…' if w.n_pos > 24 else ''}”", " · ".join(parts)


@_notebook_figure
def attention_pattern(
    model: Model,
    text_or_tokens: str | Tensor | Sequence[int],
    heads: Heads,
    *,
    census: pd.DataFrame | None = None,
    max_cells: int = MAX_CELLS,
    block_size: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """Query x key attention weights of one or several heads on a text, one panel per head.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    >>> fig = attention_pattern(model, [5, 9, 3, 7], "L1H2")
    >>> fig.data[0].z.shape
    (4, 4)

    ``text_or_tokens`` is a text (tokenised with the model's BOS convention) or one sequence of
    token ids (used as given); ``heads`` any head form: ``"L1H7"``, ``(1, 7)``, ``[(1, 7), (2,
    3)]``, ``"L1H0-3"``, a :class:`~headsurgeon.HeadSet`. Tokens label the axes; hovering a cell
    shows the (query, key) token pair and its weight. A red box marks position 0, a dashed line
    the head's blind distance (weights exactly 0 to its left), and each panel's title the head's
    slope, blind distance and, given ``census`` (a classified census), its label.

    The weights are those of the census's hook (``hook_pattern``, the exact ALiBi
    :func:`headsurgeon.load_model` installs), read block by block through the long-context path
    (:func:`headsurgeon.probes.attention_weights`): beyond ``max_cells`` positions they are
    max-pooled for display, each cell the largest weight of its square, with that weight's exact
    value and (query, key) positions on hover. Nothing is kept on the model.
    """
    check_model(model, "attention_pattern")
    tokens = _one_sequence(model, text_or_tokens)
    w = attention_weights(model, tokens, heads, max_cells=max_cells, block_size=block_size)
    names = _shown_tokens(model, tokens)
    facts, blind = _head_facts(model, census), _blind_distances(model, w.heads)
    cols = min(len(w.heads), 3)
    n_rows = -(-len(w.heads) // cols)
    fig = make_subplots(rows=n_rows, cols=cols, subplot_titles=[facts(*h) for h in w.heads],
                        horizontal_spacing=0.1, vertical_spacing=0.16 / n_rows)  # fmt: skip
    for i in range(len(w.heads)):
        row, col = i // cols + 1, i % cols + 1
        fig.add_trace(_pattern_trace(w, i, names, coloraxis="coloraxis"), row=row, col=col)
        _pattern_axes(fig, w, row, col)
        _pattern_marks(fig, w, blind[i], row, col)
    fig.update_layout(
        coloraxis={
            "colorscale": "Viridis",
            "cmin": 0,
            "cmax": 1,
            "colorbar": {"title": {"text": "weight", "side": "right"}},
        }
    )
    fig.update_annotations(font={"size": 13})
    default, subtitle = _pattern_title(model, tokens, w, "Attention")
    side = 380
    style(fig, title=title or default, subtitle="<br>".join(_wrap(subtitle, side * cols)),
          width=110 + side * cols + 110, height=150 + (side + 60) * n_rows,
          margin={"l": 90, "r": 40, "t": 140, "b": 70})  # fmt: skip
    return fig


@_notebook_figure
def pattern_diff(
    model_before: Model,
    model_after: Model,
    text_or_tokens: str | Tensor | Sequence[int],
    heads: Heads,
    *,
    max_cells: int = MAX_CELLS,
    block_size: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """One row per head: its attention before, after (a repair, a mitigation...) and the change.

    Both models must have the same shape and tokenizer (a model and its repaired copy; for a
    repair done in place, ``copy.deepcopy`` the model first). Weights as in
    :func:`attention_pattern` (pooled beyond ``max_cells`` positions: then the change is that of
    each cell's largest weight); the change is drawn blue (fell) to red (rose), and hovering
    shows both exact weights.
    """
    check_model(model_before, "pattern_diff", argument="model_before")
    check_model(model_after, "pattern_diff", argument="model_after")
    tokens = _one_sequence(model_before, text_or_tokens)
    read = {"max_cells": max_cells, "block_size": block_size}
    before = attention_weights(model_before, tokens, heads, **read)
    after = attention_weights(model_after, tokens, heads, **read)
    names = _shown_tokens(model_before, tokens)
    blind = _blind_distances(model_after, after.heads)
    titles = [f"{name} {label}" for name in HeadSet(before.heads).names()
              for label in ("before", "after", "after − before")]  # fmt: skip
    n = len(before.heads)
    fig = make_subplots(rows=n, cols=3, subplot_titles=titles, horizontal_spacing=0.08,
                        vertical_spacing=0.16 / n)  # fmt: skip
    change = after.weights - before.weights
    bound = max(float(np.abs(change).max()), 1e-9)
    for i in range(n):
        panels = ((before, None, "coloraxis"), (after, None, "coloraxis"),
                  (after, before, "coloraxis2"))  # fmt: skip
        for col, (w, base, axis) in enumerate(panels, start=1):
            trace = _pattern_trace(w, i, names, base, coloraxis=axis)
            fig.add_trace(trace, row=i + 1, col=col)
            _pattern_axes(fig, w, i + 1, col)
            _pattern_marks(fig, w, blind[i], i + 1, col)
    fig.update_layout(
        coloraxis={"colorscale": "Viridis", "cmin": 0, "cmax": 1,
                   "colorbar": {"title": {"text": "weight"}, "x": 1.02, "len": 0.45, "y": 0.75}},
        coloraxis2={"colorscale": "RdBu_r", "cmin": -bound, "cmax": bound,
                    "colorbar": {"title": {"text": "change"}, "x": 1.02, "len": 0.45, "y": 0.2}},
    )  # fmt: skip
    fig.update_annotations(font={"size": 13})
    default, subtitle = _pattern_title(model_before, tokens, after, "Attention before and after")
    side = 330
    style(fig, title=title or default, subtitle="<br>".join(_wrap(subtitle, side * 3)),
          width=110 + side * 3 + 120, height=150 + (side + 60) * n,
          margin={"l": 90, "r": 40, "t": 140, "b": 70})  # fmt: skip
    return fig
