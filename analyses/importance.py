"""Causal importance of every head of the bundled organisms, and whether the planted sinks work.

For each organism: a census (labels), exact mean and zero ablation of every head
(``headsurgeon.head_importance``) and attribution patching of both, all on the same held-out
sequences. Then: how well attribution ranks heads like exact ablation (Spearman, Pearson, top-k
overlap, and the time each took), and, for ``organism-injured``, whether each planted injury of
its ``truth.json`` is dormant by ablation (removing the head costs nothing) or still doing work,
next to what the same head cost in the uninjured ``organism``.

    python analyses/importance.py
    python analyses/importance.py --n-seqs 16 --seq-len 64 --models organism-injured

Writes ``figures/importance/``: ``importance_<model>.png`` (delta_loss per head),
``bos_vs_importance_<model>.png``, ``attribution_vs_exact.png``, ``importance_<model>.csv`` (one
row per head: census, labels, every importance column), ``agreement.csv``, ``planted.csv`` and
``summary.md``, which also sets pruning against repairing ``organism-injured``'s sick heads, from
the repair report of ``analyses/repair_organism.py`` (run that first).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from _common import FIGURES, ROOT, fmt_heads, markdown, parser, start, style, write_topic
from plotly.subplots import make_subplots

from headsurgeon import classify_heads, head_importance, load_model, model_info, run_census
from headsurgeon.data import to_sequences
from headsurgeon.importance import DORMANT_SE, compare_importance, is_dormant
from headsurgeon.plots import OKABE_ITO, bos_vs_importance, importance_grid

# (column prefix, method, ablation): exact mean and zero ablation, and attribution of each.
RUNS = (
    ("mean", "mean", "mean"),
    ("zero", "zero", "zero"),
    ("attr_mean", "attribution", "mean"),
    ("attr_zero", "attribution", "zero"),
)
SOURCE = "organism"  # the uninjured model the injured one was planted from


def importance_table(model, tokens, census: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """The classified census with every run's ``delta_loss`` and SE, and each run's CPU seconds
    (with one thread, unlike wall-clock time, they do not count waiting for a shared core)."""
    table, seconds = census.copy(), {}
    for prefix, method, ablation in RUNS:
        began = time.process_time()
        df = head_importance(model, tokens, method=method, ablation=ablation, progress=False)
        seconds[prefix] = time.process_time() - began
        columns = {"delta_loss": f"{prefix}_delta_loss", "delta_loss_se": f"{prefix}_se"}
        table = table.merge(
            df[["layer", "head", *columns]].rename(columns=columns), on=["layer", "head"]
        )
        table["clean_loss"] = df["clean_loss"]
    table.attrs = census.attrs
    return table, seconds


def as_importance(table: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """One run's columns under head_importance's names (for plots and compare_importance)."""
    method, ablation = next((m, a) for p, m, a in RUNS if p == prefix)
    out = table.rename(
        columns={f"{prefix}_delta_loss": "delta_loss", f"{prefix}_se": "delta_loss_se"}
    )
    out = out.assign(method=method, ablation=ablation)
    out.attrs = dict(table.attrs) | {"importance_method": method, "importance_ablation": ablation}
    return out


def scatter_figure(tables: dict[str, pd.DataFrame], agreement: pd.DataFrame) -> go.Figure:
    """Attribution estimate against exact ablation, one panel per organism, mean and zero."""
    names = list(tables)
    titles = []
    for name in names:
        row = agreement[(agreement["model"] == name) & (agreement["ablation"] == "mean")].iloc[0]
        titles.append(f"{name}<br>mean: ρ = {row['spearman']:.2f}")
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=titles, horizontal_spacing=0.07)
    colours = {"mean": OKABE_ITO["blue"], "zero": OKABE_ITO["vermillion"]}
    for col, name in enumerate(names, start=1):
        t = tables[name]
        for ablation, colour in colours.items():
            fig.add_trace(
                go.Scatter(
                    x=t[f"{ablation}_delta_loss"],
                    y=t[f"attr_{ablation}_delta_loss"],
                    mode="markers",
                    name=f"{ablation} ablation",
                    legendgroup=ablation,
                    showlegend=col == 1,
                    marker={
                        "color": colour,
                        "size": 7,
                        "opacity": 0.75,
                        "symbol": "circle" if ablation == "mean" else "diamond",
                    },
                    text=[f"L{r.layer}H{r.head} ({r.label})" for r in t.itertuples()],
                    hovertemplate="%{text}: exact %{x:.4g}, attribution %{y:.4g}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        values = t[[f"{a}_delta_loss" for a in colours] + [f"attr_{a}_delta_loss" for a in colours]]
        lo, hi = float(np.nanmin(values.to_numpy())), float(np.nanmax(values.to_numpy()))
        fig.add_trace(
            go.Scatter(
                x=[lo, hi],
                y=[lo, hi],
                mode="lines",
                name="attribution = exact",
                showlegend=col == 1,
                line={"color": "#888888", "dash": "dot", "width": 1},
                hoverinfo="skip",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="exact Δ loss (nats)", row=1, col=col)
    fig.update_yaxes(title_text="attribution estimate (nats)", row=1, col=1)
    fig.update_xaxes(showgrid=True, gridcolor="#EEEEEE", zeroline=False)
    fig.update_yaxes(showgrid=True, gridcolor="#EEEEEE", zeroline=False)
    fig.update_annotations(font={"size": 13})
    style(
        fig,
        "Attribution patching against exact ablation",
        "one marker per head; dotted: equal; ρ: Spearman rank correlation",
        80 + 360 * len(names) + 170,
        500,
    )
    fig.update_layout(margin={"l": 80, "r": 170, "t": 130, "b": 70})
    return fig


def planted_table(tables: dict[str, pd.DataFrame], truth: list[dict], name: str) -> pd.DataFrame:
    """Each planted injury: its label, BOS mass, cost under mean and zero ablation, and verdict.

    Dormant: the mean-ablation change is within DORMANT_SE standard errors of 0. The same head's
    cost in the uninjured source organism (when it was measured) says what the injury took away.
    """
    injured, source = tables[name], tables.get(SOURCE)
    ranks = injured["mean_delta_loss"].rank(ascending=False)
    rows = []
    for injury in truth:
        layer, head = (int(x) for x in injury["head"][1:].split("H"))
        i = injured.index[(injured["layer"] == layer) & (injured["head"] == head)][0]
        r = injured.loc[i]
        row = {
            "head": injury["head"],
            "kind": injury["kind"],
            "label": r["label"],
            "bos_mass": r["bos_mass"],
            "mean_delta_loss": r["mean_delta_loss"],
            "mean_se": r["mean_se"],
            "zero_delta_loss": r["zero_delta_loss"],
            "rank (of 64, mean)": int(ranks[i]),
            "dormant": bool(is_dormant(r["mean_delta_loss"], r["mean_se"])),
        }
        if source is not None:
            s = source[(source["layer"] == layer) & (source["head"] == head)].iloc[0]
            row["uninjured_mean_delta_loss"] = s["mean_delta_loss"]
        rows.append(row)
    return pd.DataFrame(rows)


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "the causal cost of removing each head of the organisms (exact mean and zero ablation of "
        "its `z`, 32 x 128 held-out tokens), how well first-order attribution estimates it, and "
        "whether organism-injured's planted heads are dormant."
    ),
    (
        "what a head computes, its importance on other text or lengths (`figures/sinks/corpora/` "
        "compares two corpora), or in combination with other heads (one head at a time); standard"
        " errors are across sequences of one model and one seed."
    ),
)


def main() -> None:
    p = parser(__doc__, "importance")
    p.add_argument(
        "--models",
        nargs="+",
        default=["organism", "organism-deep", "organism-injured"],
        help="bundled organisms or checkpoint folders",
    )
    p.add_argument("--n-seqs", type=int, default=32, help="held-out sequences per model")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    args = p.parse_args()
    started = start(args)

    tables: dict[str, pd.DataFrame] = {}
    agreement_rows, truth, injured_name = [], None, None
    for source in args.models:
        model = load_model(source)
        name = model_info(model).name
        tokens = to_sequences(model, seq_len=args.seq_len, n_seqs=args.n_seqs).tokens
        census = classify_heads(run_census(model, tokens, progress=False))
        tables[name], seconds = importance_table(model, tokens, census)
        for ablation in ("mean", "zero"):
            exact = as_importance(tables[name], ablation)
            estimate = as_importance(tables[name], f"attr_{ablation}")
            agreement_rows.append(
                {
                    "model": name,
                    "ablation": ablation,
                    **compare_importance(exact, estimate),
                    "exact_cpu_s": seconds[ablation],
                    "attribution_cpu_s": seconds[f"attr_{ablation}"],
                    "speed-up": seconds[ablation] / seconds[f"attr_{ablation}"],
                }
            )
        truth_path = Path(model_info(model).source or "") / "truth.json"
        if model_info(model).source is not None and truth_path.exists():
            truth, injured_name = json.loads(truth_path.read_text())["injuries"], name
        print(f"{name}: {seconds}", flush=True)
    agreement = pd.DataFrame(agreement_rows)

    figures: dict[str, go.Figure] = {}
    for name, table in tables.items():
        figures[f"importance_{name}"] = importance_grid(as_importance(table, "mean"))
        figures[f"bos_vs_importance_{name}"] = bos_vs_importance(as_importance(table, "mean"))
    figures["attribution_vs_exact"] = scatter_figure(tables, agreement)
    csvs: dict[str, pd.DataFrame | str] = {f"importance_{n}.csv": t for n, t in tables.items()}
    csvs["agreement.csv"] = agreement

    a = next(iter(tables.values())).attrs
    lines = [
        "# Causal head importance of the organisms",
        "",
        f"Data: {a['n_seqs']} held-out sequences x {a['seq_len']} tokens per model (bundled "
        "corpora, each model's position-0 convention). `delta_loss`: increase of the mean "
        "next-token cross-entropy (nats) when one head's `z` is replaced, everywhere, by its "
        "mean over the data (`mean`) or by 0 (`zero`); attribution: the first-order estimate "
        "of the same ablation from one forward and one backward pass. Times: CPU seconds, 1 torch "
        "thread; exact and attribution both include the same first pass for the means.",
        "",
        "## Per model (exact mean ablation)",
        "",
    ]
    rows = []
    for name, t in tables.items():
        top = t.nlargest(3, "mean_delta_loss")
        sick = t[t["label"] != "healthy"]
        rows.append(
            {
                "model": name,
                "heads": len(t),
                "clean loss": round(float(t["clean_loss"].iloc[0]), 4),
                "median Δ (mean)": t["mean_delta_loss"].median(),
                "max Δ (mean)": t["mean_delta_loss"].max(),
                "top heads": fmt_heads([f"L{r.layer}H{r.head}" for r in top.itertuples()]),
                "dormant (mean)": int(is_dormant(t["mean_delta_loss"], t["mean_se"]).sum()),
                "max Δ (zero)": t["zero_delta_loss"].max(),
                "sick heads": len(sick),
            }
        )
    lines += [markdown(pd.DataFrame(rows)), "", "## Attribution against exact ablation", ""]
    lines += [markdown(agreement, digits=3), ""]
    if truth is not None and injured_name is not None:
        planted = planted_table(tables, truth, injured_name)
        csvs["planted.csv"] = planted
        dormant = planted[planted["dormant"]]["head"].tolist()
        lines += [
            f"## Planted injuries of {injured_name}: dormant by ablation?",
            "",
            f"Dormant: the mean-ablation change is within {DORMANT_SE:g} standard errors of 0 "
            "(either way; `headsurgeon.importance.is_dormant`). "
            f"`uninjured_mean_delta_loss`: the same head in `{SOURCE}` before the injury.",
            "",
            markdown(planted.drop(columns=["kind"]), digits=3),
            "",
            f"Dormant: {fmt_heads(dormant)}; still working: "
            f"{fmt_heads(planted[~planted['dormant']]['head'].tolist())}.",
        ]

    lines += prune_vs_repair_lines(FIGURES / "repair" / "report" / "report.json")
    write_topic(args.out, figures, csvs, lines, started, scope=SCOPE)


def prune_vs_repair_lines(report_file: Path) -> list[str]:
    """Prune against repair on organism-injured, from the repair report that
    ``analyses/repair_organism.py`` writes (the same run as ``python -m headsurgeon repair``)."""
    if not report_file.exists():
        return ["", f"(No repair report at {report_file}: run analyses/repair_organism.py.)"]
    comparison = json.loads(report_file.read_text()).get("prune_vs_repair")
    if comparison is None:
        return ["", f"({report_file} predates prune versus repair: rerun repair_organism.py.)"]
    rows = [
        ("before repair", comparison["injured"]),
        ("pruned: the targets mean-ablated", comparison["pruned_mean"]),
        ("pruned: the targets zero-ablated", comparison["pruned_zero"]),
        ("repaired", comparison["repaired"]),
    ]
    table = pd.DataFrame(
        [
            {"model": name, "train PPL": p["train"], "held-out PPL": p["heldout"]}
            for name, p in rows
            if p is not None
        ]
    )
    return [
        "",
        "## Prune versus repair",
        "",
        f"The repair's targets ({fmt_heads(comparison['heads'])}) pruned instead of repaired, "
        f"from `{report_file.relative_to(ROOT)}` (`analyses/repair_organism.py`):",
        "",
        markdown(table, digits=5),
    ]


if __name__ == "__main__":
    main()
