"""Head grids: one cell per head, layers down and heads across, for a census or a classification.

>>> import pandas as pd
>>> df = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1],
...                    "bos_mass": [0.1, 0.7, 0.2, 0.97]})
>>> head_grid(df).data[0].z.tolist()
[[0.1, 0.7], [0.2, 0.97]]

Every function takes DataFrames (one row per head, as :func:`headsurgeon.run_census` and
:func:`headsurgeon.classify_heads` return) and returns a :class:`~headsurgeon.plots.Figure`.
Colour scales are colour-blind safe (viridis, a blue-red diverging scale), labels are drawn as
symbols as well as colours (BOS-sink ○, dead ×: they survive greyscale print), cells are sized
so that the heads fill a paper column at 2x export, and hovering a cell shows every metric of
the head. Metrics that are weights in [0, 1] keep that colour range, so that figures of
different models compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from headsurgeon.errors import InvalidArgumentError
from headsurgeon.plots.layout import (
    OKABE_ITO,
    base_layout,
    check_columns,
    colorbar_title,
    column_label,
    literal,
)
from headsurgeon.plots.notebook import notebook_figure

__all__ = [
    "diff_grid",
    "head_grid",
    "label_grid",
    "models_grid",
]

LABEL_COLOURS = {"healthy": "#DDDDDD", "BOS-sink": OKABE_ITO["orange"], "dead": "#1A1A1A"}
# Marker styles that stay visible on both ends of viridis: white core with a dark rim, or the
# reverse.
LABEL_MARKERS = {
    "BOS-sink": {"symbol": "circle", "color": "white", "line": {"color": "black", "width": 1.5}},
    "dead": {"symbol": "x", "color": "black", "line": {"color": "white", "width": 1.5}},
}
# The fixed colour range of the census metrics that are weights in [0, 1]; others use their data
# range. (Their words and units: layout.COLUMN_LABELS.)
METRIC_RANGES = {
    metric: (0.0, 1.0)
    for metric in ("bos_mass", "sink_score", "sink_share", "max_weight", "self_mass", "prev_mass")
}
HOVER_SKIP = ("layer", "head", "label", "reason")


def grid_shape(df: pd.DataFrame) -> tuple[int, int]:
    return int(df["layer"].max()) + 1, int(df["head"].max()) + 1


def _matrix(df: pd.DataFrame, column: str) -> np.ndarray:
    """``[layer, head]`` array of a column; cells without a row are NaN (or None)."""
    n_layers, n_heads = grid_shape(df)
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
            lines.append(f"{literal(column_label(field))} = %{{customdata[{i}]:.4g}}")
    return data, "<br>".join(lines) + "<extra></extra>"


def cell_size(n_heads: int, width: float = 480) -> float:
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
        title_text=column_label("head"),
        tickvals=_ticks(n_heads, cell),
        range=[-0.5, n_heads - 0.5],
        **common,
        **where,
    )
    fig.update_yaxes(
        title_text=column_label("layer"),
        tickvals=_ticks(n_layers, cell),
        range=[n_layers - 0.5, -0.5],  # layer 0 on top
        **common,
        **where,
    )


def census_subtitle(df: pd.DataFrame) -> str:
    a = df.attrs
    if "n_seqs" not in a:
        return ""
    position0 = "BOS token" if a.get("prepend_bos") else "first text token"
    return (
        f"{a.get('model', '')} · {a['n_seqs']} seqs × {a.get('seq_len')} tokens · "
        f"position 0: {position0} · rows t ≥ {a.get('min_query_pos')}"
    )


def grid_plot_size(n_layers: int, n_heads: int, cell: float) -> tuple[float, float]:
    return max(n_heads * cell, 240), max(n_layers * cell, 160)


@notebook_figure
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
    check_columns(df, ["layer", "head", metric])
    n_layers, n_heads = grid_shape(df)
    cell = cell_size(n_heads)
    custom, template = _hover(df)
    zrange = zrange or METRIC_RANGES.get(metric)
    z = _matrix(df, metric)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            colorscale=colorscale,
            zmin=zrange[0] if zrange else None,
            zmax=zrange[1] if zrange else None,
            colorbar={"title": colorbar_title(column_label(metric)), "thickness": 16},
            customdata=custom,
            hovertemplate=template,
            xgap=1,
            ygap=1,
        )
    )
    for trace in _label_markers(df, cell):
        fig.add_trace(trace)
    _axes(fig, n_layers, n_heads, cell)
    plot_size = grid_plot_size(n_layers, n_heads, cell)
    default = column_label(metric)[0].upper() + column_label(metric)[1:]
    base_layout(fig, title or default, census_subtitle(df), plot_size)
    return fig


@notebook_figure
def label_grid(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """The label of every head: healthy (light grey), BOS-sink (orange ○), dead (black ×)."""
    check_columns(df, ["layer", "head", "label"])
    n_layers, n_heads = grid_shape(df)
    cell = cell_size(n_heads)
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
    plot_size = grid_plot_size(n_layers, n_heads, cell)
    base_layout(fig, title or default, census_subtitle(df), plot_size)  # same size as a head_grid
    return fig


@notebook_figure
def diff_grid(
    before: pd.DataFrame,
    after: pd.DataFrame,
    metric: str = "bos_mass",
    *,
    title: str | None = None,
    bound: float | None = None,
) -> go.Figure:
    """Heatmap of ``after - before`` for ``metric``; heads whose label changed are outlined.

    Both frames must cover the same heads (matched on ``layer`` and ``head``). Blue is a fall,
    red a rise, white no change; hover shows both values and both labels. The colour scale runs
    from ``-bound`` to ``+bound`` (default: the largest change), which the subtitle states; give
    grids shown together one ``bound`` (:func:`diff_bound`) so equal colours are equal changes.
    """
    check_columns(before, ["layer", "head", metric], "before")
    check_columns(after, ["layer", "head", metric], "after")
    keys = ["layer", "head"]
    if set(map(tuple, before[keys].to_numpy())) != set(map(tuple, after[keys].to_numpy())):
        raise InvalidArgumentError("before and after cover different heads; compare one model")
    has_labels = "label" in before.columns and "label" in after.columns
    extra = ["label"] if has_labels else []
    merged = before[keys + [metric] + extra].merge(
        after[keys + [metric] + extra], on=keys, suffixes=("_before", "_after")
    )
    merged["change"] = merged[f"{metric}_after"] - merged[f"{metric}_before"]
    n_layers, n_heads = grid_shape(merged)
    cell = cell_size(n_heads)
    if bound is None:
        bound, scale = diff_bound([(before, after)], metric), "the largest change"
    elif bound > 0:
        scale = "fixed: grids shown together share it"
    else:
        raise InvalidArgumentError(f"bound must be a change above 0 (±bound); got {bound!r}")
    fields = [f"{metric}_before", f"{metric}_after", "change"]
    lines = ["<b>layer %{y}, head %{x}</b>"]
    words = literal(column_label(metric))
    names = [f"{words}, before", f"{words}, after", "change (after − before)"]
    lines += [f"{name} = %{{customdata[{i}]:.4g}}" for i, name in enumerate(names)]
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
            colorbar={
                "title": colorbar_title(f"Δ {column_label(metric)}"),
                "thickness": 16,
            },
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
    default = f"Change in {column_label(metric)}, after − before"
    plot_size = grid_plot_size(n_layers, n_heads, cell)
    scale = f"colour scale ±{bound:.3g} ({scale})"
    subtitle = " · ".join(part for part in (census_subtitle(after), scale) if part)
    base_layout(fig, title or default, subtitle, plot_size)
    return fig


def diff_bound(
    pairs: Sequence[tuple[pd.DataFrame, pd.DataFrame]], metric: str = "bos_mass"
) -> float:
    """The largest ``|after - before|`` of ``metric`` over ``(before, after)`` pairs (heads
    matched on ``layer`` and ``head``): one :func:`diff_grid` ``bound`` for grids shown together.
    """
    largest = 0.0
    for before, after in pairs:
        merged = before[["layer", "head", metric]].merge(
            after[["layer", "head", metric]], on=["layer", "head"]
        )
        change = np.abs(merged[f"{metric}_y"] - merged[f"{metric}_x"]).to_numpy(dtype=float)
        if np.isfinite(change).any():
            largest = max(largest, float(np.nanmax(change)))
    return max(largest, 1e-9)


# models_grid's panels per row: more wrap onto further rows (plotly cannot space dozens of panels
# in one row, and they would be too thin to read), ROW_GAP pixels apart (the x axis title and
# ticks of one row, the panel titles of the next).
PANELS_PER_ROW = 6
ROW_GAP = 90


@notebook_figure
def models_grid(
    dfs: Mapping[str, pd.DataFrame], metric: str = "bos_mass", *, title: str | None = None
) -> go.Figure:
    """Several models' head grids side by side on one colour scale (the paper's cross-scale view).

    Panel widths follow the head counts, so a cell is the same width in every panel. More than
    :data:`PANELS_PER_ROW` panels wrap onto further rows, so that any number fits.
    """
    if not dfs:
        raise InvalidArgumentError("models_grid needs at least one {name: DataFrame} entry")
    for name, df in dfs.items():
        check_columns(df, ["layer", "head", metric], f"the DataFrame of {name}")
    shapes = {name: grid_shape(df) for name, df in dfs.items()}
    names = list(dfs)
    n_cols = min(len(names), PANELS_PER_ROW)
    n_rows = -(-len(names) // n_cols)
    col_heads = [max(shapes[n][1] for n in names[c::n_cols]) for c in range(n_cols)]
    row_layers = [
        max(shapes[n][0] for n in names[r * n_cols : (r + 1) * n_cols]) for r in range(n_rows)
    ]
    cell = cell_size(sum(col_heads), 800)
    rows_h = sum(row_layers) * cell
    fixed = METRIC_RANGES.get(metric)
    values = np.concatenate([df[metric].to_numpy(float) for df in dfs.values()])
    zmin, zmax = fixed or (float(np.nanmin(values)), float(np.nanmax(values)))
    rows = {}
    if n_rows > 1:  # the gap in pixels, as plotly's fraction of the height (always below 1/rows)
        rows = {
            "row_heights": row_layers,
            "vertical_spacing": ROW_GAP / (rows_h + ROW_GAP * (n_rows - 1)),
        }
    fig = make_subplots(
        rows=n_rows,
        cols=n_cols,
        specs=[
            [{} if r * n_cols + c < len(names) else None for c in range(n_cols)]
            for r in range(n_rows)
        ],
        column_widths=col_heads,
        horizontal_spacing=0.05,
        **rows,
        subplot_titles=[
            literal(name) + (f" ({(df['label'] != 'healthy').mean():.0%} sick)")
            if "label" in df.columns
            else literal(name)
            for name, df in dfs.items()
        ],
    )
    legend_shown = False
    for i, (name, df) in enumerate(dfs.items()):
        row, col = i // n_cols + 1, i % n_cols + 1
        n_layers, n_heads = shapes[name]
        custom, template = _hover(df)
        fig.add_trace(
            go.Heatmap(
                z=_matrix(df, metric),
                x=list(range(n_heads)),
                y=list(range(n_layers)),
                coloraxis="coloraxis",
                customdata=custom,
                hovertemplate=f"{literal(name)}<br>" + template,
                xgap=1,
                ygap=1,
            ),
            row=row,
            col=col,
        )
        # One legend entry per label, from the first panel that has labels.
        for trace in _label_markers(df, cell, showlegend=not legend_shown):
            trace.name = trace.legendgroup  # counts differ between the panels
            fig.add_trace(trace, row=row, col=col)
            legend_shown = True
        _axes(fig, n_layers, n_heads, cell, row=row, col=col)
        # Equal cells: a shallower model's panel is shorter (aligned at its row's top), one with
        # fewer heads than its column's widest narrower (aligned left).
        panel = fig.get_subplot(row, col)
        low, high = panel.yaxis.domain
        depth = (high - low) * n_layers / row_layers[row - 1]
        fig.update_yaxes(domain=[high - depth, high], row=row, col=col)
        left, right = panel.xaxis.domain
        width = (right - left) * n_heads / col_heads[col - 1]
        fig.update_xaxes(domain=[left, left + width], row=row, col=col)
        if col > 1:
            fig.update_yaxes(title_text=None, row=row, col=col)
    fig.update_layout(
        coloraxis={
            "colorscale": "Viridis",
            "cmin": zmin,
            "cmax": zmax,
            "colorbar": {"title": colorbar_title(column_label(metric)), "thickness": 16},
        }
    )
    plot_w = sum(col_heads) * cell * (1 + 0.05 * (n_cols - 1))
    plot_size = (plot_w, rows_h + ROW_GAP * (n_rows - 1))
    base_layout(
        fig, title or f"{column_label(metric)} across models", "", plot_size, panel_titles=True
    )
    return fig
