"""The house style every figure shares: fonts, the colour-blind-safe palette, titles and sizes.

>>> import plotly.graph_objects as go
>>> fig = style(go.Figure(), title="BOS mass", subtitle="organism · 64 seqs", width=600)
>>> fig.layout.width, fig.layout.title.x
(600, 0.0)

Every figure of :mod:`headsurgeon.plots`, of :mod:`headsurgeon.reports` and of ``analyses/``
goes through :func:`style` (the plotly_white template, paper fonts, a left-aligned title and a
grey subtitle). The figures here lay themselves out in pixels around their plot area
(:func:`base_layout`: the subtitle wrapped to the figure's width, the legend under the x axis, the
margins grown to fit both), so a cell is the same size whatever the figure holds. The
DataFrame check and the short number format the figure modules share live here too.

:data:`COLUMN_LABELS` is the one place a column becomes words: every axis, colour bar and hover
label of a figure, and the head table of ``index.html``, name a column through
:func:`column_label`, so a reader sees ``BOS mass (fraction of attention)``, never
``bos_mass``.
"""

from __future__ import annotations

import html
import textwrap
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from headsurgeon.errors import InvalidArgumentError, shown

__all__ = [
    "OKABE_ITO",
    "style",
    "column_label",
]

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
# Each column a figure or page shows: (words, unit or ""). Attention weights are fractions of a
# query's attention (each row sums to 1); distances count tokens; losses are in nats.
COLUMN_LABELS: dict[str, tuple[str, str]] = {
    "layer": ("layer", ""),
    "head": ("head", ""),
    "slope": ("ALiBi slope m", "per token"),
    "bos_mass": ("BOS mass", "fraction of attention"),
    "bos_mass_std": ("BOS mass std across sequences", "fraction of attention"),
    "sink_score": ("sink score α₀", "fraction of attention"),
    "sink_share": ("sink share", "fraction of sequences with α₀ > ε"),
    "entropy": ("entropy", "nats"),
    "max_weight": ("largest weight", "fraction of attention"),
    "mean_distance": ("mean distance", "tokens"),
    "self_mass": ("self mass", "fraction of attention"),
    "prev_mass": ("previous-token mass", "fraction of attention"),
    "output_norm": ("output norm", "residual-stream units"),
    "output_share": ("output share", "fraction of the layer's attention output"),
    "ahon_ln": ("AHON-LN", "|z| over the layer's mean"),
    "reach": ("reach", "tokens"),
    "reach_baseline": ("reach of its slope alone (no content)", "tokens"),
    "reach_ratio": ("reach / reach of its slope alone", "≈ 1: follows its slope"),
    "delta_loss": ("Δ loss when removed", "nats"),
    "delta_loss_se": ("standard error of Δ loss", "nats"),
    "clean_loss": ("loss of the unchanged model", "nats"),
    "label": ("label", ""),
    "reason": ("why", ""),
    "blind_distance": ("analytic blind distance", "tokens"),
    "first_zero_distance": ("measured first zero", "tokens"),
    "zero_fraction": ("weights exactly 0", "fraction of weights"),
    "log10_distance": ("blind distance", "log₁₀ tokens"),
    "distance": ("distance i − j", "tokens"),
    "context_length": ("context length", "tokens"),
    "depth": ("needle depth", "fraction of the context before it"),
    "position": ("position", "tokens from the start"),
    "query": ("query position", ""),
    "key": ("key position", ""),
    "weight": ("attention weight", "fraction of attention"),
    "step": ("training step", ""),
    "perplexity": ("perplexity", ""),
    "delta_nll": ("ΔNLL", "nats per token"),
    "mean_dnll": ("mean ΔNLL against float64", "nats per token"),
    "window": ("window y: recent tokens kept", "tokens"),
    "band": ("layer band", "each model's layers in thirds"),
    "sick_share": ("sick heads, BOS-sink + dead", "share of the band's heads"),
    "heads": ("number of heads", ""),
}


def style(
    fig: go.Figure,
    *,
    title: str,
    subtitle: str | Sequence[str] = "",
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
    ``"container"`` with the figure's edge. Title and subtitle are plain text, shown as written
    (:func:`literal`: a model named ``<b>x</b>`` is not bold); a subtitle given as lines is
    shown one per line. Returns ``fig``, restyled in place.
    """
    lines = [subtitle] if isinstance(subtitle, str) else list(subtitle)
    title_layout: dict = {
        "text": literal(title),
        "subtitle": {
            "text": "<br>".join(literal(line) for line in lines if line),
            "font": {"size": subtitle_size, "color": "#555555"},
        },
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


def literal(text: object) -> str:
    r"""``text`` for a figure's title, subtitle, panel title or hover label, shown as written:
    plotly reads tags (``<b>``, ``<br>``, ``<a href>``) and entities in these, and a control
    character stops a static export, so ``<``, ``>``, ``&`` become entities and control
    characters their Python escapes (:func:`headsurgeon.errors.shown`).

    >>> literal("<b>x</b> & <!--\x1b[31m")
    '&lt;b&gt;x&lt;/b&gt; &amp; &lt;!--\\x1b[31m'
    """
    return html.escape(shown(text, keep=""), quote=False)


def column_label(column: str) -> str:
    """``column`` in words with its unit (:data:`COLUMN_LABELS`); a column not there (a user's
    own) with its underscores as spaces.

    >>> column_label("entropy"), column_label("head"), column_label("my_score")
    ('entropy (nats)', 'head', 'my score')
    """
    words, unit = COLUMN_LABELS.get(column, (str(column).replace("_", " "), ""))
    return f"{words} ({unit})" if unit else words


def colorbar_title(text: str) -> dict:
    """A colour bar's title: ``text`` (a :func:`column_label`) above the bar in lines of at most
    18 characters, its unit in parentheses from a line of its own, so a long label fits beside
    a small grid.

    >>> colorbar_title("output share (fraction of the layer's attention output)")["text"]
    "output share<br>(fraction of the<br>layer's attention<br>output)"
    """
    words, paren, unit = text.partition(" (")
    lines = textwrap.wrap(words, 18) + (textwrap.wrap(f"({unit}", 18) if paren else [])
    text = "<br>".join(literal(line) for line in lines)
    return {"text": text, "side": "top", "font": {"size": 12}}


def base_layout(
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
    margin = {"l": 75, "r": 150 if colorbar else 20}  # room for a colour bar's title
    width = margin["l"] + plot_w + margin["r"]
    lines = wrap_text(subtitle, width - margin["l"] - 10)
    margin["t"] = 58 + (20 * len(lines) + 12 if lines else 0) + (28 if panel_titles else 0)
    names = [t.name for t in fig.data if t.type == "scatter" and t.showlegend is not False]
    rows = _legend_rows([n for n in names if n], width - 20)
    below = 62 if axis_title else 38  # tick labels (and the x axis title)
    margin["b"] = below + (28 * rows + 12 if rows else 0)
    height = margin["t"] + plot_h + margin["b"]
    style(
        fig,
        title=title,
        subtitle=lines,
        width=width,
        height=height,
        margin=margin,
        title_size=19,
    )
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


def wrap_text(text: str, width: float) -> list[str]:
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


def check_columns(
    df: pd.DataFrame, columns: Sequence[str], what: str = "df", source: str | None = None
) -> None:
    """One line unless ``df`` is a DataFrame with ``columns`` and at least one row; the message
    says to pass ``source`` (default: a census or classification)."""
    if not isinstance(df, pd.DataFrame):
        raise InvalidArgumentError(f"{what} must be a DataFrame, got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        source_ = source or "a census (run_census) or classification (classify_heads)"
        raise InvalidArgumentError(f"{what} lacks column(s) {', '.join(missing)}; pass {source_}")
    if df.empty:
        raise InvalidArgumentError(
            f"{what} has no rows; pass {source or 'a census with at least one head'}"
        )


def compact_number(x: float) -> str:
    """Short cell text for a distance: ``124``, ``2.2k``, ``4.4e53``, ``∞``.

    >>> [compact_number(x) for x in (124.0, 22359.0, 4.37e53, float("inf"))]
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
