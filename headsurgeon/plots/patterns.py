"""One head's attention on a text: query x key weights, and their change after a repair.

>>> from headsurgeon.loading import ModelShape, random_model
>>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
>>> fig = pattern_diff(model, model, [5, 9, 3, 7], "L1H2")  # before | after | change
>>> len(fig.data), float(np.nanmax(np.abs(fig.data[2].z)))
(3, 0.0)

The weights are those of the census's hook, read block by block through the long-context path
(:func:`headsurgeon.pattern_samples.attention_weights`), exact at any length; beyond ``MAX_CELLS``
positions a side they are max-pooled for display, each cell the largest weight of its square,
whose exact value and positions hover shows. Tokens label the axes of a short text; a red box
marks position 0 (the BOS sink's key), a dashed line each head's blind distance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from torch import Tensor

from headsurgeon.alibi import blind_distance
from headsurgeon.backend import Model
from headsurgeon.data import Sequences, check_token_ids, encode, resolve_bos, token_strings
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.pattern_samples import AttentionWeights, attention_weights
from headsurgeon.plots.layout import (
    OKABE_ITO,
    check_columns,
    colorbar_title,
    column_label,
    compact_number,
    style,
    wrap_text,
)
from headsurgeon.plots.notebook import notebook_figure

__all__ = [
    "attention_pattern",
    "pattern_diff",
]

# Cells a side above which a pattern is max-pooled for display (hover still shows exact weights).
MAX_CELLS = 256


def _one_sequence(info: ModelInfo, text_or_tokens: str | Tensor | Sequence[int]) -> Tensor:
    """``[1, pos]`` tokens: a text by the model's BOS convention, token ids as given."""
    if isinstance(text_or_tokens, str):
        return encode(info, text_or_tokens)
    if isinstance(text_or_tokens, Sequences | np.ndarray):  # checked as every verb checks them
        return check_token_ids(info, text_or_tokens)
    if isinstance(text_or_tokens, Tensor):
        return text_or_tokens if text_or_tokens.dim() != 1 else text_or_tokens[None]
    if isinstance(text_or_tokens, Sequence) and all(isinstance(t, int) for t in text_or_tokens):
        return torch.tensor([list(text_or_tokens)], dtype=torch.long)
    raise InvalidArgumentError(
        f"give a text (str) or one sequence of token ids, got {type(text_or_tokens).__name__}"
    )


def _shown_tokens(info: ModelInfo, tokens: Tensor) -> list[str]:
    """``"<position> <token>"`` per position (unique, so they can name a category axis), escaped
    as plotly shows text (it reads tags: ``<s>`` would strike the rest through)."""
    return [f"{i} {escape(t, quote=False)}" for i, t in enumerate(token_strings(info, tokens[0]))]


def _head_facts(
    info: ModelInfo, dtype: torch.dtype, census: pd.DataFrame | None
) -> Callable[[int, int], str]:
    """``(layer, head) -> "L1H7 · BOS-sink · slope 0.0039 · 0 beyond 2,231"``: the head's label
    (from ``census``), ALiBi slope and blind distance (exact zeros in the model's dtype)."""
    labels = {}
    if census is not None:
        check_columns(census, ["layer", "head", "label"], "census")
        labels = {(int(r.layer), int(r.head)): r.label for r in census.itertuples()}
    slopes = info.slopes.tolist() if info.is_alibi else []

    def facts(layer: int, head: int) -> str:
        parts = [f"L{layer}H{head}"] + ([labels[layer, head]] if (layer, head) in labels else [])
        if slopes:
            blind = blind_distance(slopes[head], dtype, "zero")
            parts += [f"slope {slopes[head]:.3g}", f"0 beyond {compact_number(blind)}"]
        return " · ".join(parts)

    return facts


def _blind_distances(
    info: ModelInfo, dtype: torch.dtype, heads: Sequence[tuple[int, int]]
) -> list[float]:
    """Each head's distance from which its weights are exactly 0 in ``dtype`` (the model's; inf:
    never or no ALiBi)."""
    if not info.is_alibi:
        return [float("inf")] * len(heads)
    slopes = info.slopes.tolist()
    return [float(blind_distance(slopes[h], dtype, "zero")) for _, h in heads]


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
        lines = [
            f"largest weight of a {w.step}×{w.step} cell: query %{{customdata[0]}} → key "
            "%{customdata[1]}"
        ]
    if before is None:
        lines.append("weight %{z:.6g}")  # z holds the weight itself
    else:
        j = len(columns)
        columns += [before.weights[i], w.weights[i]]
        lines.append(f"%{{customdata[{j}]:.6g}} → %{{customdata[{j + 1}]:.6g}} (%{{z:+.6g}})")
    custom = np.stack(columns, axis=-1).astype(np.float64) if columns else None
    axis = labels if w.step == 1 else None
    return go.Heatmap(
        z=shown,
        x=axis,
        y=axis,
        customdata=custom,
        hoverongaps=False,
        hovertemplate="<br>".join(lines) + "<extra></extra>",
        **heatmap,
    )


def _pattern_axes(fig: go.Figure, w: AttentionWeights, row: int, col: int) -> None:
    """Category axes of ``"<position> <token>"`` for a short sequence, positions for a pooled
    one; query 0 on top."""
    n = w.weights.shape[-1]
    ticks: dict = {}
    if w.step > 1:
        vals = list(range(0, n, max(1, n // 8)))
        ticks = {"tickmode": "array", "tickvals": vals, "ticktext": [str(v * w.step) for v in vals]}
    fig.update_xaxes(
        range=[-0.5, n - 0.5],
        tickangle=-60,
        tickfont={"size": 11},
        showgrid=False,
        zeroline=False,
        row=row,
        col=col,
        **ticks,
    )
    fig.update_yaxes(
        range=[n - 0.5, -0.5],
        tickfont={"size": 11},
        showgrid=False,
        zeroline=False,
        row=row,
        col=col,
        **ticks,
    )


def _pattern_marks(fig: go.Figure, w: AttentionWeights, blind: float, row: int, col: int) -> None:
    """Position 0 (a box around column 0) and, where the sequence reaches it, the blind
    distance: the diagonal key = query − δ, left of which every weight is exactly 0."""
    n = w.weights.shape[-1]
    box = {"color": OKABE_ITO["vermillion"], "width": 2}
    fig.add_shape(type="rect", x0=-0.5, x1=0.5, y0=-0.5, y1=n - 0.5, line=box, row=row, col=col)
    if blind < w.n_pos:
        s = w.step
        fig.add_shape(
            type="line",
            x0=-0.5,
            y0=blind / s - 0.5,
            x1=(w.n_pos - blind) / s - 0.5,
            y1=n - 0.5,
            line={"color": OKABE_ITO["sky"], "width": 2, "dash": "dash"},
            row=row,
            col=col,
        )


def _pattern_title(info: ModelInfo, tokens: Tensor, w: AttentionWeights, what: str) -> tuple:
    # Plain text, escaped by style(): a token such as BLOOM's "<s>" would strike the rest out.
    text = "".join(token_strings(info, tokens[0, :24])).replace("·", " ")
    position0 = (
        "BOS token"
        if resolve_bos(info) and w.n_pos and tokens[0, 0] == info.bos_token_id
        else "first token"
    )
    parts = [
        info.name,
        f"{w.n_pos} tokens",
        f"red box: position 0 ({position0})",
        "dashed: weights exactly 0 left of it (blind distance)",
    ]
    if w.step > 1:
        parts.append(f"max-pooled: each cell is the largest of {w.step}×{w.step} weights")
    return f"{what} on “{text}{'…' if w.n_pos > 24 else ''}”", " · ".join(parts)


@notebook_figure
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
    (:func:`headsurgeon.pattern_samples.attention_weights`): beyond ``max_cells`` positions they are
    max-pooled for display, each cell the largest weight of its square, with that weight's exact
    value and (query, key) positions on hover. Nothing is kept on the model.
    """
    info = model_info(model, "attention_pattern")
    tokens = _one_sequence(info, text_or_tokens)
    w = attention_weights(model, tokens, heads, max_cells=max_cells, block_size=block_size)
    names = _shown_tokens(info, tokens)
    dtype = model.cfg.dtype
    facts, blind = _head_facts(info, dtype, census), _blind_distances(info, dtype, w.heads)
    cols = min(len(w.heads), 3)
    n_rows = -(-len(w.heads) // cols)
    fig = make_subplots(
        rows=n_rows,
        cols=cols,
        subplot_titles=[facts(*h) for h in w.heads],
        horizontal_spacing=0.1,
        vertical_spacing=0.16 / n_rows,
    )
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
            "colorbar": {"title": colorbar_title(column_label("weight"))},
        }
    )
    fig.update_annotations(font={"size": 13})
    default, subtitle = _pattern_title(info, tokens, w, "Attention")
    side = 380
    style(
        fig,
        title=title or default,
        subtitle=wrap_text(subtitle, side * cols),
        width=110 + side * cols + 110,
        height=150 + (side + 60) * n_rows,
        margin={"l": 90, "r": 40, "t": 140, "b": 70},
    )
    return fig


@notebook_figure
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
    info = model_info(model_before, "pattern_diff", argument="model_before")
    info_after = model_info(model_after, "pattern_diff", argument="model_after")
    tokens = _one_sequence(info, text_or_tokens)
    read = {"max_cells": max_cells, "block_size": block_size}
    before = attention_weights(model_before, tokens, heads, **read)
    after = attention_weights(model_after, tokens, heads, **read)
    names = _shown_tokens(info, tokens)
    blind = _blind_distances(info_after, model_after.cfg.dtype, after.heads)
    titles = [
        f"{name} {label}"
        for name in HeadSet(before.heads).names()
        for label in ("before", "after", "after − before")
    ]
    n = len(before.heads)
    fig = make_subplots(
        rows=n, cols=3, subplot_titles=titles, horizontal_spacing=0.08, vertical_spacing=0.16 / n
    )
    change = after.weights - before.weights
    bound = max(float(np.abs(change).max()), 1e-9)
    for i in range(n):
        panels = (
            (before, None, "coloraxis"),
            (after, None, "coloraxis"),
            (after, before, "coloraxis2"),
        )
        for col, (w, base, axis) in enumerate(panels, start=1):
            trace = _pattern_trace(w, i, names, base, coloraxis=axis)
            fig.add_trace(trace, row=i + 1, col=col)
            _pattern_axes(fig, w, i + 1, col)
            _pattern_marks(fig, w, blind[i], i + 1, col)
    fig.update_layout(
        coloraxis={
            "colorscale": "Viridis",
            "cmin": 0,
            "cmax": 1,
            "colorbar": {
                "title": colorbar_title(column_label("weight")),
                "x": 1.02,
                "len": 0.45,
                "y": 0.75,
            },
        },
        coloraxis2={
            "colorscale": "RdBu_r",
            "cmin": -bound,
            "cmax": bound,
            "colorbar": {
                "title": colorbar_title(f"Δ {column_label('weight')}"),
                "x": 1.02,
                "len": 0.45,
                "y": 0.2,
            },
        },
    )
    fig.update_annotations(font={"size": 13})
    default, subtitle = _pattern_title(info, tokens, after, "Attention before and after")
    side = 330
    style(
        fig,
        title=title or default,
        subtitle=wrap_text(subtitle, side * 3),
        width=110 + side * 3 + 120,
        height=150 + (side + 60) * n,
        margin={"l": 90, "r": 40, "t": 140, "b": 70},
    )
    return fig
