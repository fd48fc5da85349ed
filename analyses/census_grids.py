"""Census grids across the organisms: BOS mass and labels per head, side by side, and the slopes.

The surgery paper's cross-scale figure puts BLOOM-560m ... 7b1 side by side as layer x head grids
of BOS mass; here the same layout holds the bundled organisms: the uninjured ``organism``, the
deeper ``organism-deep`` (8 x 24 heads, trained on BOS-first 512-token windows), the
``organism-injured`` copy with planted sinks and a silenced head, and the repaired copy written by
``analyses/repair_organism.py`` when it exists. Each model gets a label grid and a BOS mass
against ALiBi slope panel (the paper: sick heads sit at the shallowest slopes); a planted
organism's labels are checked against its ``truth.json``. Organisms that ship their training log
also get training curves (held-out loss and the largest BOS mass of any head).

    python analyses/census_grids.py
    python analyses/census_grids.py --models organism DIR --repaired runs/organism-repaired

Writes ``figures/census/``: ``models_bos_mass.png``, ``labels_<model>.png``,
``bos_mass_vs_slope.png``, ``training.png``, ``census_<model>.csv`` and ``summary.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from _common import ROOT, fmt_heads, markdown, parser, start, style, write_topic
from plotly.subplots import make_subplots

from headsurgeon import classify_heads, load_model, model_info, plots, run_census, to_sequences
from headsurgeon.plots import OKABE_ITO, label_grid, models_grid

REPAIRED = ROOT / "runs" / "organism-repaired"
TRAINING_LOG = "training_log.csv"  # analyses/train_organism.py's log, exported with the model
# Healthy heads in blue: the grids' light grey would vanish on a white scatter background.
SCATTER = {
    "healthy": ("circle", OKABE_ITO["blue"]),
    "BOS-sink": ("diamond", OKABE_ITO["orange"]),
    "dead": ("x", OKABE_ITO["black"]),
}


def truth_of(model) -> dict[str, str] | None:
    """The planted labels shipped beside an injured organism (``truth.json``), if any."""
    source = model_info(model).source
    path = source / "truth.json" if source is not None else None
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())["labels"]


def slope_figure(censuses: dict[str, pd.DataFrame], sink: float, dead: float) -> go.Figure:
    """BOS mass against ALiBi slope, one panel per model, markers by label."""
    fig = make_subplots(
        rows=1,
        cols=len(censuses),
        shared_yaxes=True,
        horizontal_spacing=0.03,
        subplot_titles=list(censuses),
    )
    shown: set[str] = set()  # one legend entry per label, from the first panel that has it
    for col, df in enumerate(censuses.values(), start=1):
        for label, (symbol, colour) in SCATTER.items():
            rows = df[df["label"] == label]
            first = len(rows) > 0 and label not in shown
            shown |= {label} if first else set()
            fig.add_trace(
                go.Scatter(
                    x=rows["slope"],
                    y=rows["bos_mass"],
                    mode="markers",
                    name=label,
                    legendgroup=label,
                    showlegend=first,
                    marker={"symbol": symbol, "color": colour, "size": 9, "opacity": 0.85},
                    text=[f"L{r.layer}H{r.head}" for r in rows.itertuples()],
                    hovertemplate="%{text}: slope %{x:.4f}, BOS mass %{y:.3f}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        for value, name in ((sink, "sink"), (dead, "dead")):
            fig.add_hline(
                y=value, line={"dash": "dash", "color": "#888888", "width": 1}, row=1, col=col
            )
            if col == 1:
                fig.add_annotation(
                    x=0,
                    xref="x domain",
                    y=value,
                    text=f"{name} {value:g}",
                    showarrow=False,
                    xanchor="left",
                    yanchor="bottom",
                    font={"size": 11, "color": "#555555"},
                )
    fig.update_xaxes(type="log", title_text="ALiBi slope m_h (log)", dtick=1, showgrid=True)
    fig.update_yaxes(range=[-0.03, 1.03], showgrid=True, gridcolor="#EEEEEE")
    fig.update_yaxes(title_text="BOS mass", row=1, col=1)
    return plots.style(
        fig,
        title="BOS mass against ALiBi slope",
        subtitle="one marker per head (all layers); left: shallow slopes, right: steep",
        width=80 + 380 * len(censuses) + 130,
        height=470,
        margin={"l": 80, "r": 130, "t": 110, "b": 70},
        title_xref="container",
    )


def by_slope(censuses: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per ALiBi slope: mean and max BOS mass over layers, per model (blank: slope not in it).

    Models with different head counts share slopes: 24 heads have the 16-head slopes and 8 more.
    """
    tables = [
        df.groupby("slope")["bos_mass"].agg(["mean", "max"]).add_prefix(f"{name} ")
        for name, df in censuses.items()
    ]
    table = pd.concat(tables, axis=1).sort_index(ascending=False).reset_index()
    return table.round({"slope": 4})


def training_figure(logs: dict[str, pd.DataFrame]) -> go.Figure:
    """Training curves per organism against tokens seen: held-out loss and the largest BOS mass."""
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        subplot_titles=["held-out loss (solid: Shakespeare, dotted: Python docs)", "max BOS mass"],
    )
    colours = list(OKABE_ITO.values())
    for i, (name, log) in enumerate(logs.items()):
        colour = colours[i % len(colours)]
        tokens = log["tokens"] / 1e6
        for column, dash in (("heldout_shakespeare", "solid"), ("heldout_python_docs", "dot")):
            fig.add_trace(
                go.Scatter(
                    x=tokens,
                    y=log[column],
                    mode="lines",
                    name=name,
                    legendgroup=name,
                    showlegend=dash == "solid",
                    line={"color": colour, "dash": dash},
                    hovertemplate=f"{name} {column}: " + "%{y:.3f} at %{x:.2f}M<extra></extra>",
                ),
                row=1,
                col=1,
            )
        fig.add_trace(
            go.Scatter(
                x=tokens,
                y=log["max_bos_mass"],
                mode="lines+markers",
                name=name,
                legendgroup=name,
                showlegend=False,
                line={"color": colour},
                marker={"size": 5},
                text=log["max_bos_head"],
                hovertemplate="%{x:.2f}M tokens: %{y:.3f} (%{text})<extra></extra>",
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text="training tokens (millions)", showgrid=True, gridcolor="#EEEEEE")
    fig.update_yaxes(showgrid=True, gridcolor="#EEEEEE")
    fig.update_yaxes(title_text="loss (nats/token)", range=[3, 6], row=1, col=1)
    fig.update_yaxes(title_text="BOS mass", range=[0, 0.55], row=1, col=2)
    fig.add_hline(y=0.5, line={"dash": "dash", "color": "#888888", "width": 1}, row=1, col=2)
    style(
        fig,
        "Training of the organisms",
        "fixed held-out windows; BOS mass: the largest of any head, query rows t >= 1; "
        "dashed: the BOS-sink threshold",
        1100,
        460,
    )
    fig.update_layout(
        margin={"l": 80, "r": 30, "t": 110, "b": 110},
        title_xref="paper",
        legend={"orientation": "h", "y": -0.22},
    )
    return fig


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "which heads of the bundled organisms put their attention on position 0 (BOS mass) or "
        "write almost nothing (output share), on 64 x 128-token windows of the bundled held-out "
        "text, labelled by fixed thresholds, and how BOS mass follows the ALiBi slope."
    ),
    (
        "whether a head matters to the loss (`figures/importance/`), whether the labels hold on "
        "other text or lengths, or anything about large models (4.2M-parameter organisms, one "
        "training seed each); the Spearman correlations describe 64 heads that share 16 slopes "
        "and carry no test."
    ),
)


def main() -> None:
    p = parser(__doc__, "census")
    p.add_argument(
        "--models",
        nargs="+",
        default=["organism", "organism-deep", "organism-injured"],
        help="bundled organisms or checkpoint folders",
    )
    p.add_argument(
        "--repaired",
        type=Path,
        default=REPAIRED,
        help="repaired organism folder (analyses/repair_organism.py); added if it exists",
    )
    p.add_argument("--n-seqs", type=int, default=64, help="census sequences per model")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per census sequence")
    args = p.parse_args()
    started = start(args)

    sources = list(args.models) + ([args.repaired] if args.repaired.is_dir() else [])
    censuses: dict[str, pd.DataFrame] = {}
    truths: dict[str, dict[str, str]] = {}
    logs: dict[str, pd.DataFrame] = {}  # training logs shipped with trained organisms
    for source in sources:
        model = load_model(source)
        name = model_info(model).name
        seqs = to_sequences(model, seq_len=args.seq_len, n_seqs=args.n_seqs)
        census = run_census(model, seqs, progress=False)
        censuses[name] = classify_heads(census)
        truth = truth_of(model)
        if truth is not None:
            truths[name] = truth
        source = model_info(model).source
        if source is not None and (source / TRAINING_LOG).exists():
            logs[name] = pd.read_csv(source / TRAINING_LOG)

    thresholds = next(iter(censuses.values())).attrs["thresholds"]
    figures = {"models_bos_mass": models_grid(censuses, "bos_mass", title="BOS mass per head")}
    figures |= {f"labels_{name}": label_grid(df) for name, df in censuses.items()}
    figures["bos_mass_vs_slope"] = slope_figure(censuses, thresholds["sink"], thresholds["dead"])
    if logs:
        figures["training"] = training_figure(logs)
    tables: dict[str, pd.DataFrame | str] = {
        f"census_{name}.csv": df for name, df in censuses.items()
    }

    a = next(iter(censuses.values())).attrs
    lines = [
        "# Census of the organisms",
        "",
        f"Census: {a['n_seqs']} sequences x {a['seq_len']} tokens of the bundled held-out corpora "
        f"per model, query rows t >= {a['min_query_pos']}, position 0 in each model's own "
        "convention (column `position 0`); thresholds: BOS-sink if BOS mass > "
        f"{thresholds['sink']}, dead if > {thresholds['dead']} or output share < "
        f"{thresholds['min_output_share']}.",
        "",
    ]
    rows = []
    for name, df in censuses.items():
        counts = df["label"].value_counts()
        top = df.loc[df["bos_mass"].idxmax()]
        sick = df[df["label"] != "healthy"]
        row = {
            "model": name,
            "position 0": "BOS token" if df.attrs["prepend_bos"] else "first text token",
            "heads": len(df),
            "healthy": int(counts.get("healthy", 0)),
            "BOS-sink": int(counts.get("BOS-sink", 0)),
            "dead": int(counts.get("dead", 0)),
            "sick %": f"{len(sick) / len(df):.1%}",
            "max BOS mass": f"{top['bos_mass']:.3f} (L{top['layer']}H{top['head']}, "
            f"m={top['slope']:.4f})",
            "median BOS mass": f"{df['bos_mass'].median():.3f}",
        }
        if name in truths:
            predicted = {f"L{r.layer}H{r.head}": r.label for r in df.itertuples()}
            wrong = [h for h, t in truths[name].items() if predicted.get(h) != t]
            row["vs truth.json"] = f"{len(df) - len(wrong)}/{len(df)} right" + (
                f" (wrong: {fmt_heads(wrong)})" if wrong else ""
            )
        rows.append(row)
    lines += [markdown(pd.DataFrame(rows).fillna("")), ""]
    for name, df in censuses.items():
        sick = df[df["label"] != "healthy"]
        # Rank correlation (Spearman) without scipy: Pearson on the ranks.
        rho = df["slope"].rank().corr(df["bos_mass"].rank())
        lines.append(
            f"- {name}: sick heads {fmt_heads([f'L{r.layer}H{r.head}' for r in sick.itertuples()])}"
            f"; Spearman rank correlation of BOS mass with slope {rho:+.2f}."
        )
    for name, log in logs.items():
        top = log.loc[log["max_bos_mass"].idxmax()]
        last = log.iloc[-1]
        lines.append(
            f"- {name} during training ({len(log)} evaluations, {last['tokens'] / 1e6:.1f}M "
            f"tokens, {last['minutes']:.0f} min): largest BOS mass of any head "
            f"{top['max_bos_mass']:.3f} ({top['max_bos_head']}, step {top['step']}); at the end "
            f"{last['max_bos_mass']:.3f} ({last['max_bos_head']})."
        )
    lines += [
        "",
        "Per ALiBi slope (the same in every layer): mean and max BOS mass over layers.",
        "",
        markdown(by_slope(censuses)),
    ]
    write_topic(args.out, figures, tables, lines, started, scope=SCOPE)


if __name__ == "__main__":
    main()
