"""The sink-cache figure: perplexity with a StreamingLLM cache of sinks plus recent tokens.

>>> import pandas as pd
>>> table = pd.DataFrame({"sinks": [0, 0, 4, 4], "window": [64, 256, 64, 256],
...                       "ppl": [90.0, 60.0, 48.0, 47.0], "dnll": [0.7, 0.3, 0.05, 0.03],
...                       "dnll_se": [0.02, 0.01, 0.004, 0.003], "full_ppl": 46.0})
>>> [t.name for t in sink_cache_figure(table).data]
['0 sinks', '4 sinks', 'full context']
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from headsurgeon.plots.evaluation import sequential_colours
from headsurgeon.plots.layout import OKABE_ITO, check_columns, column_label, style, wrap_text

__all__ = ["sink_cache_figure"]


def sink_cache_figure(by_cache: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Perplexity against the window ``y`` (log axis), one line per number of sinks ``x``.

    Takes ``sink_cache_effect(...).by_cache`` (:mod:`headsurgeon.sink_cache`). Error bars are
    one standard error of the ΔNLL against the full context (batch means), carried to the
    perplexity (``ppl x se``); the dashed line is the full-context perplexity. A line of 0 sinks
    far above the others is StreamingLLM's finding: the model needs its first tokens.
    """
    columns = ["sinks", "window", "ppl", "dnll", "dnll_se", "full_ppl"]
    check_columns(by_cache, columns, "sink-cache table", "sink_cache_effect(...).by_cache")
    windows = sorted(by_cache["window"].unique())
    x = [str(y) for y in windows]
    sinks = sorted(by_cache["sinks"].unique())
    fig = go.Figure()
    for n, colour in zip(sinks, sequential_colours(len(sinks)), strict=True):
        part = by_cache[by_cache["sinks"] == n].set_index("window").reindex(windows)
        name = f"{n} sink{'' if n == 1 else 's'}"
        fig.add_trace(
            go.Scatter(
                x=x,
                y=part["ppl"],
                error_y={
                    "type": "data",
                    "array": part["ppl"] * part["dnll_se"].fillna(0),
                    "thickness": 1,
                    "width": 3,
                },
                customdata=np.stack([part["dnll"], part["dnll_se"]], axis=-1),
                mode="lines+markers",
                line={"color": colour, "width": 2},
                marker={"size": 7},
                name=name,
                hovertemplate=f"{name} + window %{{x}}: perplexity %{{y:.4g}}, ΔNLL "
                "%{customdata[0]:.4f} ± %{customdata[1]:.4f}<extra></extra>",
            )
        )
    full = float(by_cache["full_ppl"].iloc[0])
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[full] * len(x),
            mode="lines",
            line={"color": OKABE_ITO["black"], "width": 2, "dash": "dash"},
            name="full context",
            hovertemplate=f"full context: perplexity {full:.4g}<extra></extra>",
        )
    )
    fig.update_xaxes(title_text=column_label("window"), type="category")
    fig.update_yaxes(title_text=column_label("perplexity"), type="log")
    a = by_cache.attrs
    subtitle = (
        f"{a.get('model', '')} · {a.get('n_seqs', '')} × {a.get('seq_len', '')} tokens · "
        f"ALiBi distances: {a.get('positions', 'cache')} · trained on "
        f"{a.get('train_ctx') or '?'} tokens · error bars: one standard error"
    )
    width = round(480 + 60 * len(x))
    lines = wrap_text(subtitle, width - 100)
    style(
        fig,
        title=title or "Perplexity with a cache of sinks plus recent tokens",
        subtitle=lines,
        width=width,
        height=450 + 18 * len(lines),
        margin={"l": 80, "r": 160, "t": 70 + 18 * len(lines), "b": 70},
        subtitle_size=12,
    )
    fig.update_layout(legend={"x": 1.02, "y": 1, "font": {"size": 12}})
    return fig
