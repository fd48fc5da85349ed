"""Blindness and evaluation figures: where ALiBi heads stop seeing, and what retrieval finds.

>>> from headsurgeon.blindness import analytic_blindness
>>> table = analytic_blindness("bloom-560m", dtypes=["float32"], limits=["normal"])
>>> fig = blind_distance_grid(table)  # head 0 is blind beyond 124 tokens, in bold: < 2048
>>> fig.data[1].y, fig.data[1].text[0][:3].tolist()
(('float32 · normal',), ['<b>124</b>', '<b>175</b>', '<b>248</b>'])

The blindness figures take :mod:`headsurgeon.blindness` tables: the analytic blind distance of
every head (:func:`~headsurgeon.blindness.analytic_blindness`), and the weights that really
underflow to exactly 0 (:func:`~headsurgeon.blindness.measure_blindness`). The retrieval heat
map takes a passkey or needle result of :mod:`headsurgeon.evals`. Distances span dozens of
orders of magnitude: colours and axes are logarithmic, cells print them short (``2.2k``,
``4.4e53``, ``∞``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from headsurgeon.errors import InvalidArgumentError
from headsurgeon.plots.layout import (
    OKABE_ITO,
    check_columns,
    colorbar_title,
    column_label,
    compact_number,
    style,
)
from headsurgeon.plots.notebook import notebook_figure

__all__ = [
    "analytic_vs_measured",
    "blind_distance_grid",
    "precision_figure",
    "retrieval_distance_plot",
    "retrieval_heatmap",
    "zero_fraction_plot",
]


def _mark_train_length(
    fig: go.Figure, x: float, label_x: float, text: str, *, width: int, y: float, xanchor: str
) -> None:
    """A dashed vertical line at the training length, labelled above the plot (``label_x``: the
    same place in the axis' own units, log10 on a log axis)."""
    fig.add_vline(x=x, line={"color": "black", "dash": "dash", "width": width})
    fig.add_annotation(
        x=label_x,
        y=y,
        yref="paper",
        text=text,
        showarrow=False,
        xanchor=xanchor,
        yanchor="bottom",
        font={"size": 12},
    )


def _eval_layout(fig: go.Figure, title: str, subtitle: str, width: int, height: int) -> None:
    margin = {"l": 80, "r": 30, "t": 95 if subtitle else 65, "b": 70}
    style(
        fig,
        title=title,
        subtitle=subtitle,
        width=width,
        height=height,
        margin=margin,
        subtitle_size=12,
    )


@notebook_figure
def blind_distance_grid(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Blind distance of every head (columns) per dtype and underflow limit (rows), log colours.

    Takes :func:`headsurgeon.blindness.analytic_blindness` output; ALiBi slopes are the same in
    every layer, so layer 0 stands for all. Cells show the distance in tokens (``∞``: never
    blind); bold cells are blind within the table's context.
    """
    check_columns(df, ["layer", "head", "dtype", "limit", "blind_distance"], "blindness table")
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
            text[i, head] = f"<b>{compact_number(d)}</b>" if label == "blind" else compact_number(d)
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
                    "title": colorbar_title(column_label("log10_distance")),
                    "thickness": 16,
                },
                hovertemplate="head %{x}, %{y}: %{text} tokens<extra></extra>",
            ),
        ]
    )
    fig.update_xaxes(
        title_text=column_label("head"), tickmode="linear", dtick=1 if n_heads <= 16 else 4
    )
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


def sequential_colours(n: int) -> list[str]:
    """``n`` colours along viridis (colour-blind safe and monotone in lightness)."""
    from plotly.colors import sample_colorscale

    return sample_colorscale("Viridis", [0.9 * i / max(n - 1, 1) for i in range(n)])


@notebook_figure
def zero_fraction_plot(by_distance: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Share of weights that underflow to exactly 0 against distance, one line per head.

    Takes ``measure_blindness(...).by_distance``; one panel per dtype, layers pooled (entries
    weighted). Heads with no underflow in any dtype are left out (named in the subtitle).
    """
    cols = ["head", "dtype", "distance_lo", "distance_hi", "entries", "zero_entries"]
    check_columns(by_distance, cols, "by_distance table")
    pooled = by_distance.groupby(["dtype", "head", "distance_lo", "distance_hi"], sort=False)[
        ["entries", "zero_entries"]
    ].sum()
    pooled = pooled.reset_index()
    pooled["fraction"] = pooled["zero_entries"] / pooled["entries"]
    pooled["distance"] = (pooled["distance_lo"] + pooled["distance_hi"] - 1) / 2
    dtypes = list(dict.fromkeys(pooled["dtype"]))
    heads = sorted(pooled["head"].unique())
    blind = sorted(pooled.loc[pooled["zero_entries"] > 0, "head"].unique())
    colours = dict(zip(heads, sequential_colours(len(heads)), strict=True))
    fig = make_subplots(  # the gap shrinks for many dtypes: plotly allows 1 / (cols - 1) at most
        rows=1,
        cols=len(dtypes),
        subplot_titles=dtypes,
        shared_yaxes=True,
        horizontal_spacing=min(0.04, 0.5 / len(dtypes)),
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
    fig.update_xaxes(title_text=column_label("distance"), rangemode="tozero")
    fig.update_yaxes(range=[-0.02, 1.02])
    fig.update_yaxes(title_text=column_label("zero_fraction"), row=1, col=1)
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


@notebook_figure
def analytic_vs_measured(by_head: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Measured first zero distance against the analytic blind distance, per head and dtype.

    Takes ``measure_blindness(...).by_head``. Filled markers: the head's smallest distance with an
    exact zero in any layer; open markers at the top: no zero within the measured length. The
    analytic distance (``zero`` limit, equal content logits) bounds the measured one from
    above; the softmax normaliser and content logits pull real zeros closer.
    """
    check_columns(
        by_head, ["head", "dtype", "analytic_distance", "first_zero_distance"], "by_head table"
    )
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
        title_text=column_label("blind_distance"), range=np.log10([lo, x_hi]), **log_axis
    )
    fig.update_yaxes(
        title_text=column_label("first_zero_distance"), range=np.log10([lo, y_hi]), **log_axis
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


# What a per-head frame may hold, how the strip names it and the marker it gets.
HEAD_MARKS = {
    "reach": ("reach", "triangle-up"),
    "first_zero_distance": ("first exact zero", "line-ns"),
}
SERIES_COLOURS = [OKABE_ITO[c] for c in ("blue", "vermillion", "green", "orange", "purple", "sky")]


@notebook_figure
def retrieval_distance_plot(
    table: pd.DataFrame,
    heads: pd.DataFrame | None = None,
    *,
    metric: str = "top1_accuracy",
    title: str | None = None,
) -> go.Figure:
    """Retrieval accuracy against the needle's distance to the question (log axis), with its 95%
    interval and the chance baseline, and every head's reach and first exact zero on that axis.

    ``table``: ``retrieval_by_distance(...).table`` (:mod:`headsurgeon.evals`), or several
    concatenated with a ``model`` and/or ``task`` column: one colour per series. A point sits at
    its bin's mean distance, its bar spans the Wilson interval; the dashed line of the same
    colour (open markers) is the baseline: the same prompts with the needle deleted, scored
    against the same candidates. For ``top1_accuracy`` a grey dotted line is
    ``1 / n_candidates``. A vertical line marks the training length (a ``train_ctx`` column,
    else ``table.attrs["train_ctx"]``).

    ``heads``: one row per head with ``layer``, ``head`` and any of ``reach`` and
    ``first_zero_distance`` (e.g. ``measure_blindness(...).by_head``), optionally ``model``:
    a strip under the axis, one row per quantity (and model), one marker per head at its
    distance. Heads with none (NaN: no zero within the measured length) or at distance 0 (no
    place on a log axis) are left out and counted in the row's name. The strip shows where
    heads stop attending or underflow, the curve where the model stops retrieving; that one
    causes the other the figure does not show.
    """
    columns = ["distance_lo", "distance_hi", "mean_distance", "n_trials"]
    columns += [f"{p}{metric}{s}" for p in ("", "baseline_") for s in ("", "_low", "_high")]
    check_columns(table, columns, "retrieval-by-distance table (retrieval_by_distance(...).table)")
    marks = _head_marks(heads)
    fig = make_subplots(
        rows=2 if marks else 1,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.72, 0.28] if marks else None,
        vertical_spacing=0.05,
    )
    for i, (label, part) in enumerate(_retrieval_series(table)):
        _distance_series(fig, label, part, metric, SERIES_COLOURS[i % len(SERIES_COLOURS)])
    if metric == "top1_accuracy" and "chance" in table.columns:
        _mark_chance(fig, table["chance"].unique())
    _mark_each_train_length(fig, table)
    strip = [_head_strip(fig, heads, column) for column in marks]
    x = np.concatenate([table["mean_distance"].to_numpy(dtype=float), *(d for _, d in strip)])
    x = x[np.isfinite(x) & (x > 0)]
    x_range = np.log10([max(0.5, float(x.min()) / 1.5), float(x.max()) * 1.5])
    fig.update_xaxes(type="log", dtick=1, ticks="outside", showgrid=True, range=x_range)
    x_title = "needle distance to the question (tokens)"
    fig.update_xaxes(title_text=x_title, row=2 if marks else 1, col=1)
    names = RETRIEVAL_METRICS.get(metric, (metric, metric))
    fig.update_yaxes(title_text=names[1], range=[-0.03, 1.03], row=1, col=1)
    if marks:
        fig.update_yaxes(type="category", autorange="reversed", row=2, col=1)
    n_rows = sum(len(names) for names, _ in strip)
    _eval_layout(
        fig,
        title or f"Retrieval by needle distance: {names[0]}",
        _retrieval_subtitle(table),
        width=980,
        height=500 + (60 + 30 * n_rows if marks else 0),
    )
    fig.update_layout(legend={"x": 1.02, "y": 1, "font": {"size": 13}})
    return fig


def _retrieval_series(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Each series' ``(label, rows)``: one per model and/or task, else the table's task."""
    keys = [c for c in ("model", "task") if c in table.columns]
    if not keys:
        return [(str(table.attrs.get("task", "retrieval")), table)]
    return [(" · ".join(map(str, k)), t) for k, t in table.groupby(keys, sort=False)]


def _mark_chance(fig: go.Figure, chances: np.ndarray) -> None:
    """A grey dotted line at each chance level ``1 / n_candidates``, on the curves' panel."""
    for chance in chances:
        fig.add_hline(
            y=chance,
            line={"color": "#888888", "dash": "dot", "width": 1.5},
            annotation={"text": f"1 / candidates = {chance:.2f}", "font": {"size": 12}},
            annotation_position="top right",
            row=1,
            col=1,
        )


def _mark_each_train_length(fig: go.Figure, table: pd.DataFrame) -> None:
    """A vertical line at each training length (a ``train_ctx`` column, else the attrs')."""
    lengths = (
        table["train_ctx"].unique() if "train_ctx" in table else [table.attrs.get("train_ctx")]
    )
    for i, length in enumerate(float(n) for n in lengths if n):
        # Labels alternate sides of their lines, so that close training lengths keep apart.
        side = "right" if i % 2 == 0 and len(lengths) > 1 else "left"
        label = f"train length {length:.0f}"
        _mark_train_length(fig, length, np.log10(length), label, width=2, y=1.0, xanchor=side)


def _retrieval_subtitle(table: pd.DataFrame) -> str:
    """The figure's subtitle: the model (one, unless a column names several), prompts per bin."""
    n, model = table["n_trials"], table.attrs.get("model")
    per_bin = f"{n.min()}" if n.min() == n.max() else f"{n.min()}–{n.max()}"
    return (f"{model} · " if model and "model" not in table else "") + (
        f"{per_bin} prompts per bin · 95% Wilson intervals · dashed: the same prompts without "
        "the needle"
    )


def _head_marks(heads: pd.DataFrame | None) -> list[str]:
    """The columns of ``heads`` the strip draws (none without ``heads``)."""
    if heads is None:
        return []
    check_columns(heads, ["layer", "head"], "per-head table")
    marks = [c for c in HEAD_MARKS if c in heads.columns]
    if not marks:
        raise InvalidArgumentError(
            f"the per-head table has none of {', '.join(HEAD_MARKS)}; pass a census with reach "
            "or measure_blindness(...).by_head"
        )
    return marks


def _distance_series(
    fig: go.Figure, label: str, part: pd.DataFrame, metric: str, colour: str
) -> None:
    """One series: the metric with the needle (solid) and without it (dashed, open markers)."""
    for prefix, name, dash, symbol in (
        ("", label, "solid", "circle"),
        ("baseline_", f"{label} · no needle", "dash", "circle-open"),
    ):
        y = part[f"{prefix}{metric}"]
        fig.add_trace(
            go.Scatter(
                x=part["mean_distance"],
                y=y,
                mode="lines+markers",
                line={"color": colour, "dash": dash, "width": 1.5 if prefix else 2},
                marker={"symbol": symbol, "size": 8, "color": colour},
                error_y={
                    "type": "data",
                    "array": part[f"{prefix}{metric}_high"] - y,
                    "arrayminus": y - part[f"{prefix}{metric}_low"],
                    "color": colour,
                    "thickness": 1.2,
                    "width": 3,
                },
                name=name,
                customdata=np.stack(
                    [part["distance_lo"], part["distance_hi"], part["n_trials"]], axis=-1
                ),
                hovertemplate=f"{name}<br>distance %{{customdata[0]}}–%{{customdata[1]}}: "
                "%{y:.2f} of %{customdata[2]}<extra></extra>",
            ),
            row=1,
            col=1,
        )


def _head_strip(fig: go.Figure, heads: pd.DataFrame, column: str) -> tuple[list[str], np.ndarray]:
    """One strip row per model of ``column``'s heads; returns the rows' names and distances."""
    name, symbol = HEAD_MARKS[column]
    groups = heads.groupby("model", sort=False) if "model" in heads else [("", heads)]
    names, distances = [], []
    for model, sub in groups:
        values = sub[column].to_numpy(dtype=float)
        seen = np.isfinite(values) & (values > 0)  # a log axis has no 0
        none, zero = int(np.isnan(values).sum()), int((values == 0).sum())
        notes = [f"{none} of {len(values)} none"] * bool(none) + [f"{zero} at 0"] * bool(zero)
        row_name = (f"{model} · {name}" if model else name) + (
            f" ({', '.join(notes)})" if notes else ""
        )
        names.append(row_name)
        distances.append(values[seen])
        fig.add_trace(
            go.Scatter(
                x=values[seen],
                y=[row_name] * int(seen.sum()),
                mode="markers",
                marker={
                    "symbol": symbol,
                    "size": 12,
                    "color": OKABE_ITO["black"],
                    "opacity": 0.7,
                    "line": {"width": 1.5, "color": OKABE_ITO["black"]},
                },
                customdata=np.stack([sub["layer"][seen], sub["head"][seen]], axis=-1),
                hovertemplate=f"L%{{customdata[0]}}H%{{customdata[1]}}: {name} %{{x:.0f}}"
                "<extra></extra>",
                showlegend=False,
            ),
            row=2,
            col=1,
        )
    return names, np.concatenate(distances)


@notebook_figure
def retrieval_heatmap(
    table: pd.DataFrame, metric: str = "top1_accuracy", *, title: str | None = None
) -> go.Figure:
    """Depth x context-length heat map of a retrieval metric (``passkey``/``needle`` ``.table``).

    A dashed line separates lengths within the training length from those beyond it.
    """
    check_columns(table, ["context_length", "depth", metric], "retrieval table")
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
        x = sum(inside) - 0.5
        _mark_train_length(
            fig, x, x, f"train length {train_ctx}", width=3, y=1.02, xanchor="center"
        )
    fig.update_xaxes(title_text=column_label("context_length"), type="category")
    fig.update_yaxes(title_text=column_label("depth"), autorange="reversed", type="category")
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


PART_DASHES = {"model": "solid", "scores": "dash", "softmax": "dot", "attention": "dashdot"}


@notebook_figure
def precision_figure(by_position: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Mean loss change against position: one line per dtype (colour) and part (dash).

    Takes ``precision_effect(...).by_position``: ``mean_dnll`` (nats, the dtype's next-token
    loss minus float64's; above 0 is worse) per bucket of positions, drawn at the bucket's
    middle on a log axis; solid: the whole model in the dtype, dashed: only the attention
    scores rounded, dotted: only the weights. The hover gives the bucket's top-1 agreement with
    float64. The subtitle names the bias form (``attrs``).

    >>> table = pd.DataFrame({"dtype": ["bfloat16"] * 2, "part": ["model"] * 2,
    ...     "position_lo": [0, 8], "position_hi": [8, 15], "mean_dnll": [0.0, 0.2],
    ...     "top1_agreement": [1.0, 0.9]})
    >>> [round(float(x), 1) for x in precision_figure(table).data[0].x]
    [4.0, 11.5]
    """
    cols = ["dtype", "part", "position_lo", "position_hi", "mean_dnll", "top1_agreement"]
    check_columns(by_position, cols, "by_position table")
    fig = go.Figure()
    # A reference or bias form that varies names its traces (reference="training" runs).
    keys = [k for k in ("reference", "bias") if k in by_position and by_position[k].nunique() > 1]
    for group, sub in by_position.groupby([*keys, "dtype", "part"], sort=False):
        *named, dtype, part = group
        _, colour = DTYPE_MARKERS.get(dtype, ("circle", "#555555"))
        middle = (sub["position_lo"] + sub["position_hi"]) / 2
        words = [
            f"vs {v}" if k == "reference" else f"{v} bias" for k, v in zip(keys, named, strict=True)
        ]
        name = " · ".join([*words, dtype, part])
        fig.add_trace(
            go.Scatter(
                x=middle,
                y=sub["mean_dnll"],
                mode="lines+markers",
                line={"color": colour, "width": 2, "dash": PART_DASHES.get(part, "solid")},
                marker={"size": 6},
                name=name,
                customdata=np.stack(
                    [sub["position_lo"], sub["position_hi"], sub["top1_agreement"]], -1
                ),
                hovertemplate=(
                    f"{name}<br>positions %{{customdata[0]}}–%{{customdata[1]}}: "
                    "ΔNLL %{y:.4f} nats, top-1 agreement %{customdata[2]:.3f}<extra></extra>"
                ),
            )
        )
    fig.add_hline(y=0, line={"color": "#999999", "width": 1})
    fig.update_xaxes(title_text=column_label("position"), type="log")
    fig.update_yaxes(title_text=column_label("mean_dnll"))
    attrs = by_position.attrs
    subtitle = " · ".join(
        str(x)
        for x in (
            attrs.get("model"),
            f"ALiBi bias {attrs['bias']}" if "bias" in attrs else None,
            f"{attrs['n_seqs']} × {attrs['seq_len']} tokens" if "seq_len" in attrs else None,
            "solid: whole model · dashed: scores only · dotted: weights only"
            + (" · dash-dot: the attention" if "attention" in set(by_position["part"]) else ""),
        )
        if x
    )
    if attrs.get("train_ctx"):
        fig.add_vline(x=attrs["train_ctx"], line={"color": "#999999", "dash": "dot", "width": 1})
    _eval_layout(fig, title or "What rounding costs, by position", subtitle, width=820, height=470)
    fig.update_layout(legend={"title": {"text": ""}, "x": 1.01, "y": 1})
    return fig
