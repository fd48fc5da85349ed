"""Heads across corpora: the per-head difference between two corpora, and each corpus side by side.

Both take :func:`headsurgeon.compare_corpora`'s long table (a ``corpus`` column, one row per head
per corpus). Corpus names are user text (file names): they reach a figure's titles escaped, so a
name that looks like markup shows as written.

>>> import pandas as pd
>>> rows = dict(layer=[0, 0], head=[0, 1], label=["healthy", "healthy"])
>>> df = pd.concat([pd.DataFrame(rows | {"corpus": "a", "bos_mass": [0.1, 0.7]}),
...                 pd.DataFrame(rows | {"corpus": "b", "bos_mass": [0.2, 0.3]})])
>>> corpus_diff_grid(df).data[0].z.round(2).tolist()
[[0.1, -0.4]]
"""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go

from headsurgeon.domains import corpus_changes, split_corpora
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.plots.grids import cell_size, diff_grid, models_grid
from headsurgeon.plots.layout import OKABE_ITO, check_columns, column_label
from headsurgeon.plots.notebook import notebook_figure

__all__ = ["corpora_grid", "corpus_diff_grid"]


def _corpora(compared: pd.DataFrame) -> list[str]:
    check_columns(compared, ["corpus", "layer", "head"], "compared")
    return list(dict.fromkeys(compared["corpus"]))


def _pick(names: list[str], name: str | None, default: int, what: str) -> str:
    if name is None:
        return names[default]
    if name not in names:
        raise InvalidArgumentError(f"{what}={name!r} is not a corpus of the table ({names})")
    return name


@notebook_figure
def corpus_diff_grid(
    compared: pd.DataFrame,
    metric: str = "bos_mass",
    *,
    a: str | None = None,
    b: str | None = None,
    title: str | None = None,
) -> go.Figure:
    """Heatmap of ``metric`` on corpus ``b`` minus on corpus ``a`` (default: the second and the
    first corpus), one cell per head (:func:`headsurgeon.plots.diff_grid`: blue a fall, red a
    rise; heads whose label changed outlined). With importance columns, the heads whose
    dormancy changed (:func:`headsurgeon.domains.corpus_changes`' ``importance_changed``) are
    marked with a diamond. Hover shows both values and both labels.
    """
    names = _corpora(compared)
    if len(names) < 2:
        raise InvalidArgumentError(f"corpus_diff_grid needs two corpora; the table holds {names}")
    a = _pick(names, a, 0, "a")
    b = _pick(names, b, 1, "b")
    tables = split_corpora(compared)
    before, after = tables[a], tables[b]
    fig = diff_grid(
        before,
        after,
        metric,
        title=title or f"{column_label(metric)}: {b} − {a}",  # style() escapes names
    )
    if {"delta_loss", "delta_loss_se", "label"} <= set(compared.columns):
        changes = corpus_changes(compared[compared["corpus"].isin([a, b])], reference=a)
        moved = changes[changes["importance_changed"]]
        n_heads = int(compared["head"].max()) + 1
        fig.add_trace(
            go.Scatter(
                x=moved["head"],
                y=moved["layer"],
                mode="markers",
                name=f"dormancy changed ({len(moved)})",
                marker={
                    "symbol": "diamond",
                    "size": 0.35 * cell_size(n_heads),
                    "color": OKABE_ITO["green"],
                    "line": {"color": "black", "width": 1},
                },
                hovertext=[html.escape(w) for w in moved["change"]],
                hoverinfo="text",
            )
        )
    return fig


@notebook_figure
def corpora_grid(
    compared: pd.DataFrame, metric: str = "bos_mass", *, title: str | None = None
) -> go.Figure:
    """Each corpus's head grid of ``metric`` side by side on one colour scale
    (:func:`headsurgeon.plots.models_grid`, one panel per corpus, BOS-sink and dead heads
    marked)."""
    _corpora(compared)
    panels = split_corpora(compared)  # models_grid escapes the names
    return models_grid(panels, metric, title=title or f"{column_label(metric)} per corpus")
