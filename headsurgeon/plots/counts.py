"""Label counts: how many heads are sick as each threshold moves, and per layer band and model.

>>> from headsurgeon.classify import threshold_sweep
>>> census = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0],
...                        "bos_mass": [0.1, 0.48, 0.97], "output_share": [0.3] * 3})
>>> [panel.text for panel in sweep_plot(threshold_sweep(census)).layout.annotations]
['sink threshold (BOS mass >)', 'dead threshold (BOS mass >)', 'min output share (log)']

:func:`sweep_plot` shows whether a classification's counts are robust to its thresholds (a flat
``sick`` curve around the threshold in use) or depend on them (a steep one);
:func:`sick_share_plot` compares models, the surgery paper's cross-scale view. Lines are told
apart by dash and width as well as by colour.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from headsurgeon.plots.grids import census_subtitle
from headsurgeon.plots.layout import OKABE_ITO, base_layout, check_columns, column_label, literal
from headsurgeon.plots.notebook import notebook_figure

__all__ = ["sick_share_plot", "sweep_plot"]

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


@notebook_figure
def sweep_plot(sweep: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Head counts per label (and sick = BOS-sink + dead) as each threshold moves.

    One panel per threshold of :func:`headsurgeon.threshold_sweep`; a dashed vertical line marks
    the threshold in use. A flat ``sick`` curve around it means the count is robust; a steep one
    means it depends on the choice.
    """
    check_columns(sweep, ["threshold", "value", "sick"], "sweep")
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
                    hovertemplate=f"{SWEEP_PANELS[panel]} = %{{x:.4g}}<br>{name}: %{{y}} heads"
                    "<extra></extra>",
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
    fig.update_yaxes(title_text=column_label("heads"), row=1, col=1, rangemode="tozero")
    fig.update_xaxes(showgrid=True, gridcolor="#EEEEEE", ticks="outside")
    fig.update_annotations(font={"size": 14})
    default = "Label counts against each threshold"
    base_layout(
        fig,
        title or default,
        census_subtitle(sweep),
        (300 * len(panels), 300),
        colorbar=False,
        axis_title=False,
        panel_titles=True,
    )
    return fig


@notebook_figure
def sick_share_plot(shares: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Share of sick heads (BOS-sink + dead) per layer band, one line per model: the surgery
    paper's cross-scale comparison, from :func:`headsurgeon.classify.sick_shares`. Each model's
    share over all its heads is in its legend entry."""
    check_columns(shares, ["model", "band", "sick_share", "sick", "n_heads"], "shares")
    fig = go.Figure()
    palette = list(OKABE_ITO.values())
    for i, (model, rows) in enumerate(shares.groupby("model", sort=False)):
        total = rows[rows["band"] == "all"]
        bands = rows[rows["band"] != "all"]
        overall = f" (all: {total['sick_share'].iloc[0]:.0%})" if len(total) else ""
        fig.add_trace(
            go.Scatter(
                x=bands["band"],
                y=bands["sick_share"],
                mode="lines+markers",
                name=f"{literal(model)}{overall}",
                line={"color": palette[i % len(palette)], "width": 2.5},
                marker={"size": 9},
                customdata=bands[["sick", "n_heads", "layers"]].to_numpy(),
                hovertemplate=f"{literal(model)}<br>%{{x}} layers (%{{customdata[2]}})<br>"
                "sick share %{y:.1%} (%{customdata[0]} of %{customdata[1]} heads)<extra></extra>",
            )
        )
    fig.update_yaxes(title_text=column_label("sick_share"), tickformat=".0%", rangemode="tozero")
    fig.update_xaxes(title_text=column_label("band"))
    subtitle = "share of each band's heads labelled BOS-sink or dead"
    base_layout(fig, title or "Sick heads across models", subtitle, (560, 340), colorbar=False)
    return fig
