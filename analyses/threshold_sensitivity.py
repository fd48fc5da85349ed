"""Threshold sensitivity of the head labels, and the surgery paper's metric against ours.

The surgery paper calls its BOS-mass distribution bimodal, so that the sink threshold would not
matter. This script shows how the label counts of each organism really move: ``threshold_sweep``
moves each threshold while the others stay put. It also compares three ways to measure BOS mass:

* ours: 64 held-out sequences x 128 tokens, query rows t >= 1 (``min_query_pos=1``);
* the paper's metric on the same data: rows t >= 0 (row 0 can only attend to position 0, so every
  head gains ``(1 - mass) / seq_len``);
* the paper's protocol: the paper's metric on ONE prompt of about 50 tokens; repeated on
  ``--prompts`` different prompts to show how much the count depends on which prompt it is.

    python analyses/threshold_sensitivity.py
    python analyses/threshold_sensitivity.py --models DIR --prompts 8

Writes ``figures/thresholds/``: ``sweep_<model>.png`` (every threshold, our metric),
``sink_threshold.png`` (sick count against the sink threshold, both metrics, all models),
``bos_histogram.png``, ``sweep_<model>_<metric>.csv``, ``prompts.csv`` and ``summary.md``.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from _common import markdown, parser, start, style, write_topic
from plotly.subplots import make_subplots

from headsurgeon import classify_heads, load_model, model_info, run_census, threshold_sweep
from headsurgeon.classify import Thresholds
from headsurgeon.classify.labels import NEAR
from headsurgeon.data import to_sequences
from headsurgeon.plots import OKABE_ITO, sweep_plot

METRICS = {"ours": 1, "paper": 0}  # name -> min_query_pos
COLOURS = [OKABE_ITO[c] for c in ("blue", "vermillion", "green", "purple")]


def sink_figure(sweeps: dict[tuple[str, str], pd.DataFrame], chosen: float) -> go.Figure:
    """Sick heads against the sink threshold: one colour per model, solid ours, dashed paper's."""
    fig = go.Figure()
    models = list(dict.fromkeys(model for model, _ in sweeps))
    for (model, metric), sweep in sweeps.items():
        rows = sweep[sweep["threshold"] == "sink"]
        fig.add_trace(
            go.Scatter(
                x=rows["value"],
                y=rows["sick"],
                mode="lines",
                name=f"{model}, {metric} (rows t ≥ {METRICS[metric]})",
                line={
                    "color": COLOURS[models.index(model) % len(COLOURS)],
                    "dash": "solid" if metric == "ours" else "dash",
                    "width": 3 if metric == "ours" else 2,
                },
                hovertemplate="sink > %{x:.2f}: %{y} sick<extra></extra>",
            )
        )
    fig.add_vline(x=chosen, line={"dash": "dot", "color": "#666666"})
    fig.update_xaxes(title_text="sink threshold (BOS mass >)", showgrid=True, range=[0, 0.95])
    fig.update_yaxes(title_text="sick heads (BOS-sink + dead)", rangemode="tozero", showgrid=True)
    style(
        fig,
        "Sick heads against the sink threshold",
        "dead threshold 0.95 and min output share 0.01 held fixed; dotted: the default 0.5",
        900,
        480,
    )
    fig.update_layout(legend={"x": 0.99, "xanchor": "right", "y": 0.99, "bgcolor": "white"})
    return fig


def histogram(classified: dict[str, pd.DataFrame]) -> go.Figure:
    """The paper's BOS-mass histogram (bins of 0.02), one panel per model, log counts."""
    fig = make_subplots(
        rows=1, cols=len(classified), shared_yaxes=True, subplot_titles=list(classified)
    )
    for col, df in enumerate(classified.values(), start=1):
        fig.add_trace(
            go.Histogram(
                x=df["bos_mass"],
                xbins={"start": 0, "end": 1.0001, "size": 0.02},
                marker={"color": OKABE_ITO["blue"], "line": {"width": 0.5, "color": "white"}},
                showlegend=False,
                hovertemplate="BOS mass %{x}: %{y} heads<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.add_vline(x=0.5, line={"dash": "dash", "color": "#888888"}, row=1, col=col)
        fig.add_vline(x=0.95, line={"dash": "dot", "color": "#888888"}, row=1, col=col)
    fig.update_xaxes(title_text="BOS mass (rows t ≥ 1)", range=[0, 1])
    fig.update_yaxes(title_text="heads", row=1, col=1)
    style(
        fig,
        "Distribution of BOS mass",
        "bins of 0.02, as the paper's histogram; dashed: sink threshold, dotted: dead threshold",
        100 + 420 * len(classified),
        430,
    )
    return fig


def stable_range(sweep: pd.DataFrame, chosen: float) -> str:
    """The sink thresholds (steps of 0.01) around ``chosen`` that give its sick count."""
    rows = sweep[sweep["threshold"] == "sink"].sort_values("value").reset_index(drop=True)
    at = int((rows["value"] - chosen).abs().idxmin())
    same = rows["sick"] == rows.loc[at, "sick"]
    lo, hi = at, at
    while lo > 0 and same[lo - 1]:
        lo -= 1
    while hi < len(rows) - 1 and same[hi + 1]:
        hi += 1
    return f"{rows.loc[lo, 'value']:.2f}-{rows.loc[hi, 'value']:.2f}"


def sick_range(sweep: pd.DataFrame, low: float, high: float) -> str:
    rows = sweep[(sweep["threshold"] == "sink") & sweep["value"].between(low - 1e-9, high + 1e-9)]
    return f"{rows['sick'].min()}-{rows['sick'].max()}"


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "how the classifier's labels of organism and organism-injured move with its thresholds, "
        "and how the surgery paper's BOS-mass metric and protocol differ from ours on them."
    ),
    ("which thresholds suit other models, or labels on other text; one model each, one seed."),
)


def main() -> None:
    p = parser(__doc__, "thresholds")
    p.add_argument("--models", nargs="+", default=["organism", "organism-injured"])
    p.add_argument("--n-seqs", type=int, default=64, help="census sequences")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per census sequence")
    p.add_argument("--prompts", type=int, default=16, help="single prompts (paper's protocol)")
    p.add_argument("--prompt-len", type=int, default=50, help="tokens of each single prompt")
    args = p.parse_args()
    started = start(args)
    default = Thresholds()

    sweeps: dict[tuple[str, str], pd.DataFrame] = {}
    ours: dict[str, pd.DataFrame] = {}
    figures: dict[str, go.Figure] = {}
    tables: dict[str, pd.DataFrame | str] = {}
    rows, prompt_rows, shifts = [], [], []
    for source in args.models:
        model = load_model(source)
        name = model_info(model).name
        classified = {}
        seqs = to_sequences(model, seq_len=args.seq_len, n_seqs=args.n_seqs)
        for metric, min_query_pos in METRICS.items():  # the same sequences both times
            census = run_census(model, seqs, min_query_pos=min_query_pos, progress=False)
            classified[metric] = classify_heads(census, default)
            sweep = threshold_sweep(classified[metric], default)
            sweeps[(name, metric)] = sweep
            tables[f"sweep_{name}_{metric}.csv"] = sweep
            counts = classified[metric]["label"].value_counts()
            bos = classified[metric]["bos_mass"]
            rows.append(
                {
                    "model": name,
                    "metric": f"{metric} (t ≥ {min_query_pos}, {args.n_seqs} x {args.seq_len})",
                    "healthy": int(counts.get("healthy", 0)),
                    "BOS-sink": int(counts.get("BOS-sink", 0)),
                    "dead": int(counts.get("dead", 0)),
                    f"within ±{NEAR} of 0.5": int(((bos - default.sink).abs() <= NEAR).sum()),
                    "sick, sink 0.45-0.55": sick_range(sweep, 0.45, 0.55),
                    "sick, sink 0.3-0.7": sick_range(sweep, 0.3, 0.7),
                    "same count for sink in": stable_range(sweep, default.sink),
                }
            )
        ours[name] = classified["ours"]
        figures[f"sweep_{name}"] = sweep_plot(
            sweeps[(name, "ours")], title=f"{name}: label counts against each threshold"
        )
        shift = classified["paper"]["bos_mass"] - classified["ours"]["bos_mass"]
        shifts.append(f"{name}: mean {shift.mean():+.4f}, max {shift.max():+.4f}")
        changed = (classified["paper"]["label"] != classified["ours"]["label"]).sum()
        shifts[-1] += f", labels changed: {changed}"

        # The paper's protocol: one short prompt, rows t >= 0; repeated over prompts. The prompts
        # are built in the model's own position-0 convention (a token tensor is used as given).
        prompts = to_sequences(model, seq_len=args.prompt_len, n_seqs=args.prompts).tokens
        for i in range(len(prompts)):
            census = run_census(model, prompts[i : i + 1], min_query_pos=0, progress=False)
            labels = classify_heads(census, default)["label"].value_counts()
            prompt_rows.append(
                {
                    "model": name,
                    "prompt": i,
                    "sick": int(len(census) - labels.get("healthy", 0)),
                    "BOS-sink": int(labels.get("BOS-sink", 0)),
                    "dead": int(labels.get("dead", 0)),
                    "max_bos_mass": float(census["bos_mass"].max()),
                }
            )
    figures["sink_threshold"] = sink_figure(sweeps, default.sink)
    figures["bos_histogram"] = histogram(ours)
    prompt_table = pd.DataFrame(prompt_rows)
    tables["prompts.csv"] = prompt_table

    per_prompt = prompt_table.groupby("model", sort=False).agg(
        sick_min=("sick", "min"),
        sick_median=("sick", "median"),
        sick_max=("sick", "max"),
        max_bos_mass_min=("max_bos_mass", "min"),
        max_bos_mass_max=("max_bos_mass", "max"),
    )
    lines = [
        "# Threshold sensitivity",
        "",
        f"Default thresholds: BOS-sink if BOS mass > {default.sink}, dead if > {default.dead} or "
        f"output share < {default.min_output_share}. Data: bundled held-out corpora, position 0 "
        "in each model's own convention (organism: first text token; organism-injured: a BOS "
        "token).",
        "",
        markdown(pd.DataFrame(rows)),
        "",
        f"Paper's metric minus ours (row 0 included, {args.seq_len}-token sequences; expected "
        f"(1 - mass)/{args.seq_len} <= {1 / args.seq_len:.4f}): " + "; ".join(shifts) + ".",
        "",
        f"The paper's protocol, one {args.prompt_len}-token prompt with rows t >= 0, over "
        f"{args.prompts} different prompts (floor 1/{args.prompt_len} = "
        f"{1 / args.prompt_len:.3f} on every head):",
        "",
        markdown(per_prompt.reset_index()),
    ]
    write_topic(args.out, figures, tables, lines, started, scope=SCOPE)


if __name__ == "__main__":
    main()
