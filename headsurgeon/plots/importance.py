"""Head importance: what removing each head costs, and which attention sinks are dormant.

>>> import pandas as pd
>>> df = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "delta_loss": [0.3, -0.1]})
>>> importance_grid(df).data[0].zmin
-0.3

Both take :func:`headsurgeon.head_importance` output (``delta_loss``, in nats), or a classified
census merged with it on ``layer`` and ``head``: then the labels are drawn too. A sink whose
removal costs nothing is dormant; one whose removal raises the loss works.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from headsurgeon.plots.grids import cell_size, grid_plot_size, grid_shape, head_grid
from headsurgeon.plots.layout import OKABE_ITO, base_layout, check_columns, column_label
from headsurgeon.plots.notebook import notebook_figure

__all__ = ["bos_vs_importance", "importance_grid"]


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
        parts.append(
            f"{method} of {ablation} ablation" if method == "attribution" else f"{method} ablation"
        )
    if "n_seqs" in a:
        parts.append(f"{a['n_seqs']} seqs × {a.get('seq_len')} tokens")
    if "clean_loss" in df.columns:
        parts.append(f"clean loss {float(df['clean_loss'].iloc[0]):.3f} nats")
    return " · ".join(p for p in parts if p)


@notebook_figure
def importance_grid(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Layers x heads heatmap of ``delta_loss``: what removing each head costs (nats).

    Takes :func:`headsurgeon.head_importance` output, or a classified census merged with it
    (then BOS-sink ○ and dead × heads are marked as in :func:`head_grid`). The diverging colour
    scale is centred on 0: red heads raise the loss when removed, blue ones lower it.
    """
    check_columns(df, ["layer", "head", "delta_loss"], "importance table")
    bound = max(float(np.nanmax(np.abs(df["delta_loss"].to_numpy()))), 1e-9)
    fig = head_grid(df, "delta_loss", colorscale="RdBu_r", zrange=(-bound, bound))
    n_layers, n_heads = grid_shape(df)
    default = "Head importance: loss increase when the head is removed"
    base_layout(
        fig,
        title or default,
        _importance_subtitle(df),
        grid_plot_size(n_layers, n_heads, cell_size(n_heads)),
    )
    return fig


IMPORTANCE_MARKERS = {  # label -> marker; healthy darker than in label_grid, for a white plot
    "healthy": {"symbol": "circle", "color": "#999999", "line": {"color": "white", "width": 0.5}},
    "BOS-sink": {"symbol": "circle", "color": OKABE_ITO["orange"], "line": {"color": "black"}},
    "dead": {"symbol": "x", "color": OKABE_ITO["black"], "line": {"color": "white", "width": 0.5}},
}


@notebook_figure
def bos_vs_importance(df: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """BOS mass against ``delta_loss`` per head, coloured by label: which sinks are dormant.

    Takes a classified census merged with :func:`headsurgeon.head_importance` on ``layer`` and
    ``head`` (columns ``bos_mass``, ``label``, ``delta_loss``; ``delta_loss_se`` draws error
    bars). A sink near the zero line is dormant (removing it costs nothing); one above it works.
    """
    check_columns(df, ["layer", "head", "bos_mass", "label", "delta_loss"], "merged table")
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
    fig.update_xaxes(
        title_text=column_label("bos_mass"),
        range=[-0.02, 1.02],
        ticks="outside",
        showgrid=True,
        gridcolor="#EEEEEE",
        zeroline=False,
    )
    fig.update_yaxes(
        title_text=column_label("delta_loss"),
        ticks="outside",
        showgrid=True,
        gridcolor="#EEEEEE",
        zeroline=False,
    )
    default = "Attention sinks against causal importance"
    base_layout(fig, title or default, _importance_subtitle(df), (520, 380), colorbar=False)
    return fig
