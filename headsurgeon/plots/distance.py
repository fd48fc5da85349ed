"""Distance figures: how far each head looks, and which distances the model's loss needs.

>>> import pandas as pd
>>> census = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "slope": [0.5, 0.25],
...                        "reach": [12.0, float("inf")], "reach_baseline": [10.0, 19.0]})
>>> by_head = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "dtype": "float32",
...                         "first_zero_distance": [180.0, None], "analytic_distance": [207, 414]})
>>> census.attrs["seq_len"] = 256
>>> fig = reach_figure(census, by_head)
>>> [t.name for t in fig.data]
['reach', 'reach > 256 (not bounded within the sequence)', 'reach of its slope alone (no \
content)', 'first exact zero (float32)', 'no exact zero within the sequence', 'analytic blind \
distance (float32)']

``reach_figure`` takes the census (:func:`headsurgeon.run_census`: its ``reach`` and
``reach_baseline`` columns) and the ``by_head`` table of :func:`headsurgeon.measure_blindness`
(``first_zero_distance``, ``analytic_distance``, one row per layer, head and dtype), joined on
layer and head for one dtype. The three distances answer different questions: where a head's
weights are negligible (reach: mass beyond it at most ``reach_eps``; beside it, the reach its
slope alone gives a head with no preference for content, so a head whose two marks coincide
only follows its slope), where they are exactly 0 in a float format (which changes nothing the
model computes: a row loses less than ``T`` times the smallest float), and where the slope alone
predicts zeros. ``window_figure`` takes ``window_effect(...).by_distance``
(:mod:`headsurgeon.window`): what the loss loses when every head is cut to a window.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from headsurgeon.errors import InvalidArgumentError
from headsurgeon.plots.evaluation import sequential_colours
from headsurgeon.plots.layout import OKABE_ITO, check_columns, column_label, style, wrap_text
from headsurgeon.plots.notebook import notebook_figure

__all__ = ["reach_figure", "window_figure"]

# Pixels per head row of reach_figure.
_ROW = 13
# The baseline's bar: a line symbol draws only its outline.
_BAR = {"width": 2, "color": OKABE_ITO["blue"]}


def _one_dtype(by_head: pd.DataFrame, dtype: str | None) -> tuple[pd.DataFrame, str]:
    """``by_head``'s rows of ``dtype`` (default: float32 if measured, else the first)."""
    measured = list(dict.fromkeys(by_head["dtype"]))
    if dtype is None:
        dtype = "float32" if "float32" in measured else measured[0]
    if dtype not in measured:
        raise InvalidArgumentError(
            f"by_head holds no rows of dtype {dtype!r}; use one of {', '.join(measured)}"
        )
    return by_head[by_head["dtype"] == dtype], dtype


def _marker(symbol: str, colour: str, open_: bool = False) -> dict:
    return {
        "symbol": f"{symbol}-open" if open_ else symbol,
        "color": colour,
        "size": 9,
        "line": {"width": 1.5 if open_ else 0.5, "color": colour if open_ else "white"},
    }


@notebook_figure
def reach_figure(
    census: pd.DataFrame,
    by_head: pd.DataFrame,
    *,
    dtype: str | None = None,
    title: str | None = None,
) -> go.Figure:
    """Every head's reach (beside its slope's), first exact zero and analytic blind distance on
    one log axis.

    One row per head, grouped by layer (layer 0 at the top) and, within a layer, ordered by
    ALiBi slope, steepest first (by head without ALiBi). Markers: ``reach`` (filled circle;
    open at the sequence length when ``inf``: more than ``reach_eps`` at the farthest
    distance measured), ``reach_baseline`` (a vertical bar in the same colour: the reach of a
    head whose logits are its bias alone; a reach on its bar only follows its slope; hovering a
    reach shows their ratio), ``first_zero_distance`` (diamond; open at the measured length
    when no weight underflowed) and ``analytic_distance`` (grey triangle; left out where
    infinite). ``census`` is :func:`headsurgeon.run_census`'s (``layer``, ``head``, ``reach``;
    ``slope`` orders the heads; ``reach_baseline``, where present, adds the bars), ``by_head``
    is ``measure_blindness(...).by_head``, of which the rows of
    ``dtype`` are used (default: float32 when measured, else its first dtype). A head missing
    from ``by_head`` has no zero markers.

    Usage::

        seqs = hs.to_sequences(model, seq_len=4096, n_seqs=4)
        census, zeros = hs.run_census(model, seqs), hs.measure_blindness(model, seqs)
        reach_figure(census, zeros.by_head, dtype="bfloat16")
    """
    check_columns(census, ["layer", "head", "reach"], "census")
    check_columns(
        by_head,
        ["layer", "head", "dtype", "first_zero_distance", "analytic_distance"],
        "by_head table",
        "measure_blindness(...).by_head",
    )
    rows, dtype = _one_dtype(by_head, dtype)
    zeros = rows[["layer", "head", "first_zero_distance", "analytic_distance"]]
    optional = [c for c in ("slope", "reach_baseline") if c in census]
    heads = census[["layer", "head", "reach", *optional]]
    df = heads.merge(zeros, on=["layer", "head"], how="left", indicator=True)
    if "slope" in df and df["slope"].notna().all():
        df = df.sort_values(["layer", "slope", "head"], ascending=[True, False, True])
    else:
        df = df.sort_values(["layer", "head"])
    df = df.reset_index(drop=True)
    labels = [f"L{layer}H{head}" for layer, head in zip(df["layer"], df["head"], strict=True)]
    seq_len = census.attrs.get("seq_len") or _largest(df["reach"])
    zero_len = by_head.attrs.get("seq_len") or seq_len
    reach, first, analytic = (
        df[c].to_numpy(dtype=float) for c in ("reach", "first_zero_distance", "analytic_distance")
    )
    baseline = df.get("reach_baseline", pd.Series(np.nan, index=df.index)).to_numpy(dtype=float)
    measured = (df["_merge"] == "both").to_numpy()
    fig = go.Figure()
    traces = [
        (reach, np.isfinite(reach), "reach", _marker("circle", OKABE_ITO["blue"])),
        (
            np.full(len(df), float(seq_len)),
            np.isinf(reach),
            f"reach > {seq_len} (not bounded within the sequence)",
            _marker("circle", OKABE_ITO["blue"], open_=True),
        ),
        (
            baseline,
            np.isfinite(baseline),
            column_label("reach_baseline").removesuffix(" (tokens)"),
            {"symbol": "line-ns", "color": OKABE_ITO["blue"], "size": 12, "line": _BAR},
        ),
        (
            first,
            np.isfinite(first),
            f"first exact zero ({dtype})",
            _marker("diamond", OKABE_ITO["vermillion"]),
        ),
        (
            np.full(len(df), float(zero_len)),
            np.isnan(first) & measured,
            "no exact zero within the sequence",
            _marker("diamond", OKABE_ITO["vermillion"], open_=True),
        ),
        (
            analytic,
            np.isfinite(analytic),
            f"analytic blind distance ({dtype})",
            _marker("triangle-left", "#888888"),
        ),
    ]
    # Each point's hover: its distance; a reach also its ratio to its slope's.
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.char.add(" · ", np.char.mod("%.2g× its slope's", reach / baseline))
    ratio = np.where(np.isfinite(reach) & np.isfinite(baseline) & (baseline > 0), ratio, "")
    for x, shown, name, marker in traces:
        if not shown.any():
            continue
        extra = ratio[shown] if name == "reach" else np.full(shown.sum(), "")
        fig.add_trace(
            go.Scatter(
                x=x[shown],
                y=np.asarray(labels)[shown],
                mode="markers",
                marker=marker,
                name=name,
                customdata=extra,
                hovertemplate=f"%{{y}} · {name}: %{{x:.0f}} tokens%{{customdata}}<extra></extra>",
            )
        )
    for boundary in np.flatnonzero(np.diff(df["layer"].to_numpy())) + 0.5:
        fig.add_hline(y=boundary, line={"color": "#CCCCCC", "width": 1})
    fig.add_vline(x=seq_len, line={"color": "#BBBBBB", "width": 1, "dash": "dot"})
    finite = np.concatenate(
        [v[np.isfinite(v) & (v > 0)] for v in (reach, baseline, first, analytic)] + [[seq_len]]
    )
    lo, hi = max(0.5, finite.min() / 1.5), finite.max() * 1.5
    fig.update_xaxes(
        title_text=column_label("distance"),
        type="log",
        range=np.log10([lo, hi]),
        dtick=1,
        ticks="outside",
        showgrid=True,
    )
    fig.update_yaxes(
        type="category",
        categoryorder="array",
        categoryarray=labels,
        autorange="reversed",
        tickfont={"size": 10},
        dtick=1,
        title_text="",
    )
    a = census.attrs
    eps = a.get("reach_eps", 0.01)
    subtitle = (
        f"{a.get('model', '')} · {a.get('n_seqs', '')} × {seq_len} tokens · reach: mean mass at "
        f"that distance or more ≤ {eps:g} (position 0 left out; bar: the same for its slope "
        f"alone, no content) · zeros: {dtype}, "
        f"{by_head.attrs.get('n_seqs', '')} × {zero_len} tokens · heads by layer, steepest first"
    )
    lines = wrap_text(subtitle, 900 - 100)
    style(
        fig,
        title=title or "How far each head looks",
        subtitle=lines,
        width=900,
        height=round(160 + 18 * len(lines) + _ROW * len(df)),
        margin={"l": 70, "r": 30, "t": 70 + 18 * len(lines), "b": 120},
        subtitle_size=12,
    )
    fig.update_layout(legend={"orientation": "h", "x": 0, "y": -60 / (_ROW * len(df) + 1)})
    return fig


def _largest(values: pd.Series) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max()) if len(finite) else 1.0


@notebook_figure
def window_figure(table: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """ΔNLL against the window ``d`` every head was cut to, one line per position bucket.

    Takes ``window_effect(...).by_distance``: error bars are one standard error (from the
    sequences' spread; none with one sequence), and a black line pools every bucket (token
    weighted). Distances are evenly spaced categories (usually powers of two; 0 allowed). A
    bucket whose positions all lie within ``d`` of position 0 is unchanged by construction: its
    ΔNLL is exactly 0.
    """
    columns = ["distance", "position_lo", "position_hi", "tokens", "dnll", "dnll_se"]
    check_columns(table, columns, "window table", "window_effect(...).by_distance")
    distances = sorted(table["distance"].unique())
    x = [str(d) for d in distances]
    buckets = list(dict.fromkeys(zip(table["position_lo"], table["position_hi"], strict=True)))
    colours = sequential_colours(len(buckets))
    fig = go.Figure()
    for (lo, hi), colour in zip(buckets, colours, strict=True):
        part = table[(table["position_lo"] == lo) & (table["position_hi"] == hi)]
        name = f"position {lo}" if hi == lo + 1 else f"positions {lo}–{hi - 1}"
        part = part.set_index("distance").reindex(distances)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=part["dnll"],
                error_y={"type": "data", "array": part["dnll_se"], "thickness": 1, "width": 3},
                mode="lines+markers",
                line={"color": colour, "width": 1.5},
                marker={"size": 6},
                name=name,
                hovertemplate=f"{name}, d = %{{x}}: ΔNLL %{{y:.4f}}<extra></extra>",
            )
        )
    weighted = (
        table.assign(w=table["dnll"] * table["tokens"]).groupby("distance")[["w", "tokens"]].sum()
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=(weighted["w"] / weighted["tokens"]).reindex(distances),
            mode="lines+markers",
            line={"color": OKABE_ITO["black"], "width": 3},
            marker={"size": 8},
            name="all positions",
            hovertemplate="all positions, d = %{x}: ΔNLL %{y:.4f}<extra></extra>",
        )
    )
    fig.add_hline(y=0, line={"color": "#888888", "width": 1})
    fig.update_xaxes(
        title_text="window d: keys within d tokens kept (and position 0)", type="category"
    )
    fig.update_yaxes(title_text=column_label("delta_nll"))
    a = table.attrs
    subtitle = (
        f"{a.get('model', '')} · {a.get('n_seqs', '')} × {a.get('seq_len', '')} tokens · every "
        "head cut at once, masked before the softmax · error bars: one standard error"
    )
    width = round(260 + 70 * len(x) + 220)
    lines = wrap_text(subtitle, width - 100)
    style(
        fig,
        title=title or "Loss when attention is cut to a window",
        subtitle=lines,
        width=width,
        height=450 + 18 * len(lines),
        margin={"l": 80, "r": 220, "t": 70 + 18 * len(lines), "b": 70},
        subtitle_size=12,
    )
    fig.update_layout(legend={"x": 1.02, "y": 1, "font": {"size": 12}})
    return fig
