"""Natural collapse, the 2x2 (issue 43): does ALiBi hold attention sinks back at organism scale?

Four arms of the recipe of ``analyses/train_organism.py --span-share`` (natural text with
context-free synthetic spans, BOS first), trained by ``analyses/natural_collapse_2x2.sh SEED``:
{ALiBi, no positional bias} x {weight decay 0.1, 0.5}, with the same seed (initialisation and
data order), step count and learning-rate schedule per arm. "No positional bias" is ALiBi
clamped to within 1e-6 of 0 (``--bias clamped --bias-c 1e-6``), so the two bias arms share
every line of code but the bias. For every arm this script reads the training log and the
exported model and reports:

1. Trajectories: every head's held-out BOS mass (query rows t >= 1: the census's ``bos_mass``)
   and Gu et al.'s sink score (every row, row 0 included: the census's ``sink_score``) at every
   evaluation, and the number of heads above eps = 0.3 (Gu's threshold) and 0.5 (the census's
   BOS-sink threshold) by each measure.
2. The final census on the training length (64 held-out windows of 256 tokens) and on Gu et al.'s
   protocol (100 windows of 64 tokens, sink rate at eps = 0.3), each head's layer and ALiBi
   slope, and its label.
3. BOS mass by query position (mean over the 64 windows of A[t, 0] for every t), for the heads
   above eps = 0.3.
4. Whether the sinks are dormant: mean- and zero-ablation importance of every head
   (``headsurgeon.head_importance``; dormant: |delta loss| <= 2 standard errors).

    analyses/natural_collapse_2x2.sh 0          # four arms, two at a time (~2 x 35 min CPU)
    python analyses/natural_collapse.py --seeds 0

Writes ``figures/natural_collapse/``: ``summary.md``, ``trajectories.csv`` / ``.png``,
``counts.csv`` / ``.png``, ``heads.csv``, ``bos_by_position.csv`` / ``.png``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from _common import ROOT, markdown, parser, start, style, write_topic
from plotly.subplots import make_subplots

from headsurgeon import classify_heads, head_importance, load_model, model_info, run_census
from headsurgeon.backend import Model
from headsurgeon.data import to_sequences
from headsurgeon.plots import OKABE_ITO

MODELS = ROOT / "analyses" / "natural_collapse_models"
ARMS = {  # arm folder prefix -> (bias, weight decay)
    "alibi-wd0.1": ("ALiBi", 0.1),
    "alibi-wd0.5": ("ALiBi", 0.5),
    "nobias-wd0.1": ("no bias", 0.1),
    "nobias-wd0.5": ("no bias", 0.5),
}
EPS = (0.3, 0.5)  # Gu et al.'s sink threshold; the census's BOS-sink threshold
MEASURES = {"bos_mass": "BOS mass (rows t >= 1)", "sink_score": "sink score (every row)"}
CENSUS = {"n_seqs": 64, "seq_len": 256}  # the training window
GU_PROTOCOL = {"n_seqs": 100, "seq_len": 64}  # Gu et al. 2025: 100 sequences of 64 tokens


def arm_name(arm: str, seed: int) -> str:
    bias, wd = ARMS[arm]
    return f"{bias}, wd {wd} (seed {seed})"


def trajectories(folder: Path, name: str) -> pd.DataFrame:
    """Every head's BOS mass and sink score at every evaluation (one row per head and step)."""
    log = pd.read_csv(folder / "training_log.csv")
    frames = []
    for measure, prefix in (("bos_mass", "bos_L"), ("sink_score", "sink_L")):
        columns = [c for c in log.columns if c.startswith(prefix)]
        long = log.melt(id_vars=["step", "tokens"], value_vars=columns, value_name=measure)
        long["head"] = long["variable"].str.split("_").str[1]
        frames.append(long.drop(columns="variable").set_index(["step", "tokens", "head"]))
    return frames[0].join(frames[1]).reset_index().assign(arm=name)


def counts(traj: pd.DataFrame) -> pd.DataFrame:
    """Heads above each eps by each measure, per arm and evaluation."""
    rows = []
    for (arm, step), sub in traj.groupby(["arm", "step"], sort=False):
        row = {"arm": arm, "step": step}
        for measure in MEASURES:
            for eps in EPS:
                row[f"{measure}>{eps}"] = int((sub[measure] > eps).sum())
        rows.append(row)
    return pd.DataFrame(rows)


def bos_by_position(model: Model, tokens: torch.Tensor) -> np.ndarray:
    """(n_layers, n_heads, seq_len): mean over windows of the attention on position 0 by query."""
    out = []

    def keep(pattern: torch.Tensor, hook) -> None:
        out.append(pattern[:, :, :, 0].double().mean(0))

    with torch.no_grad():
        model.run_with_hooks(
            tokens, return_type=None, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), keep)]
        )
    return torch.stack(out).numpy()


def head_table(model: Model, name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Census (training length and Gu's protocol), importance by mean and zero ablation of every
    head, and BOS mass by query position of the heads above eps = 0.3 (long format)."""
    seqs = to_sequences(model, **CENSUS)
    census = classify_heads(run_census(model, seqs, progress=False))
    gu = run_census(model, to_sequences(model, **GU_PROTOCOL), progress=False)
    table = census[["layer", "head", "slope", "bos_mass", "sink_score", "output_share", "label"]]
    table = table.assign(
        arm=name,
        gu_sink_score=gu["sink_score"].to_numpy(),
        gu_sink_share=gu["sink_share"].to_numpy(),  # its mean over heads is Gu's sink rate
    )
    for method in ("mean", "zero"):
        imp = head_importance(model, seqs, method=method, progress=False)
        table[f"dloss_{method}"] = imp["delta_loss"].to_numpy()
        table[f"dloss_{method}_se"] = imp["delta_loss_se"].to_numpy()
        table[f"dormant_{method}"] = (
            table[f"dloss_{method}"].abs() <= 2 * table[f"dloss_{method}_se"]
        )
    by_pos = bos_by_position(model, seqs.tokens)
    sinks = table[past_eps(table)]
    rows = [
        pd.DataFrame(
            {"arm": name, "head": f"L{r.layer}H{r.head}", "query_pos": np.arange(by_pos.shape[2])}
        ).assign(bos_weight=by_pos[r.layer, r.head])
        for r in sinks.itertuples()
    ]
    return table, pd.concat(rows) if rows else pd.DataFrame()


def past_eps(table: pd.DataFrame) -> pd.Series:
    """Heads past eps = 0.3 by any measure: BOS mass or sink score on the training windows, or
    the mean sink score under Gu's protocol (64-token windows)."""
    return (table[["bos_mass", "sink_score", "gu_sink_score"]] > EPS[0]).any(axis=1)


def late_growth(traj: pd.DataFrame, name: str) -> str:
    """How the arm's largest BOS mass moved over its last 1,000 and 500 steps, beside its
    value at step 1,000 and its peak. No extrapolation: a straight line through a curve that
    flattens as the cosine schedule decays says nothing about when, or whether, it reaches 0.5."""
    top = traj[traj["arm"] == name].groupby("step")["bos_mass"].max()
    end = int(top.index[-1])
    at = {s: top[top.index <= s].iloc[-1] for s in (1000, end - 1000, end - 500)}
    peak_step = int(top.idxmax())
    return (
        f"{name}: largest BOS mass {at[1000]:.3f} at step 1,000, {top[peak_step]:.3f} at its "
        f"peak (step {peak_step:,}), {top.iloc[-1]:.3f} at the end (step {end:,}); over the "
        f"last 1,000 steps it moved {top.iloc[-1] - at[end - 1000]:+.3f} (last 500: "
        f"{top.iloc[-1] - at[end - 500]:+.3f}), with the learning rate near the end of its decay"
    )


def panels(names: list[str]) -> go.Figure:
    """A 2 x 2 grid of panels, one per arm, sharing the y axis."""
    rows = 2 if len(names) > 2 else 1
    return make_subplots(
        rows=rows,
        cols=2,
        subplot_titles=names,
        shared_yaxes=True,
        vertical_spacing=0.14,
        horizontal_spacing=0.06,
    )


def trajectory_figure(traj: pd.DataFrame, names: list[str], measure: str) -> go.Figure:
    """One panel per arm: every head's ``measure`` over training; heads past 0.3 coloured."""
    fig = panels(names)
    colours = [OKABE_ITO[c] for c in ("vermillion", "blue", "green", "orange", "purple")]
    for i, name in enumerate(names):
        sub = traj[traj["arm"] == name]
        peak = sub.groupby("head")[measure].max()
        marked = sorted(peak[peak > EPS[0]].index)
        for head in sorted(peak.index, key=lambda h: h in marked):  # marked heads on top
            rows = sub[sub["head"] == head]
            is_marked = head in marked
            fig.add_trace(
                go.Scatter(
                    x=rows["step"],
                    y=rows[measure],
                    mode="lines",
                    name=f"{name.split(' (seed')[0]}: {head}",
                    legendgroup=name,
                    showlegend=is_marked,
                    line={
                        "color": colours[marked.index(head) % len(colours)]
                        if is_marked
                        else "#bbb",
                        "width": 2.5 if is_marked else 1,
                    },
                ),
                row=i // 2 + 1,
                col=i % 2 + 1,
            )
        for eps in EPS:
            fig.add_hline(
                y=eps, line={"dash": "dot", "color": "#555"}, row=i // 2 + 1, col=i % 2 + 1
            )
    fig.update_xaxes(title_text="training step (16 windows of 256 tokens each)")
    fig.update_yaxes(title_text=MEASURES[measure], range=[0, 1])
    style(
        fig,
        f"{MEASURES[measure]} of every head during training, per arm",
        "held-out text, 8 windows of 256 tokens per evaluation; dotted: eps = 0.3 and 0.5; "
        "coloured: heads that passed 0.3",
        1200,
        820,
    )
    return fig


def counts_figure(table: pd.DataFrame, names: list[str]) -> go.Figure:
    """Heads past eps over training, per arm, by both measures and thresholds."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=list(MEASURES.values()), shared_yaxes=True)
    colours = [OKABE_ITO[c] for c in ("vermillion", "orange", "blue", "sky")]
    for col, measure in enumerate(MEASURES, start=1):
        for colour, name in zip(colours, names, strict=False):
            sub = table[table["arm"] == name]
            for eps, dash in zip(EPS, ("solid", "dot"), strict=True):
                fig.add_trace(
                    go.Scatter(
                        x=sub["step"],
                        y=sub[f"{measure}>{eps}"],
                        mode="lines",
                        name=f"{name}, eps {eps}",
                        legendgroup=f"{name}{eps}",
                        showlegend=col == 1,
                        line={"color": colour, "dash": dash},
                    ),
                    row=1,
                    col=col,
                )
        fig.update_xaxes(title_text="training step", row=1, col=col)
    fig.update_yaxes(title_text="heads above eps (of 32)", row=1, col=1)
    style(
        fig,
        "Sink heads over training",
        "solid: eps = 0.3 (Gu et al.); dotted: eps = 0.5 (the census's BOS-sink threshold)",
        1200,
        520,
    )
    return fig


def position_figure(by_pos: pd.DataFrame, names: list[str]) -> go.Figure:
    """Attention on position 0 by query position, for every head past eps = 0.3."""
    fig = panels(names)
    colours = [OKABE_ITO[c] for c in ("vermillion", "blue", "green", "orange", "purple")]
    for i, name in enumerate(names):
        sub = by_pos[by_pos["arm"] == name] if len(by_pos) else by_pos
        for j, (head, rows) in enumerate(sub.groupby("head") if len(sub) else []):
            fig.add_trace(
                go.Scatter(
                    x=rows["query_pos"] + 1,
                    y=rows["bos_weight"],
                    mode="lines",
                    name=f"{name.split(' (seed')[0]}: {head}",
                    legendgroup=name,
                    line={"color": colours[j % len(colours)]},
                ),
                row=i // 2 + 1,
                col=i % 2 + 1,
            )
    fig.update_xaxes(title_text="query position t + 1 (log)", type="log")
    fig.update_yaxes(title_text="attention on position 0", range=[0, 1])
    style(
        fig,
        "Attention on position 0 by query position, heads past eps = 0.3",
        "mean over 64 held-out windows of 256 tokens; an empty panel: no head past 0.3",
        1200,
        820,
    )
    return fig


def summarise(
    names: list[str],
    models: dict[str, Model],
    heads: pd.DataFrame,
    traj: pd.DataFrame,
    count_table: pd.DataFrame,
) -> list[str]:
    """summary.md: the numbers per arm; the reading is in docs/organisms.md."""
    lines = [
        "# Natural collapse: {ALiBi, no positional bias} x {weight decay 0.1, 0.5}",
        "",
        "Every arm: the same seed (initialisation, data order), steps and schedule; see "
        "`analyses/natural_collapse_2x2.sh`. BOS mass: mean attention on position 0 over query "
        "rows t >= 1 (the census's `bos_mass`); sink score: the same over every row, row 0 "
        "included (Gu et al.'s alpha_1, the census's `sink_score`). Census: 64 held-out windows "
        "of 256 tokens; Gu's protocol: 100 x 64 tokens. Dormant: |delta loss| <= 2 SE under "
        "mean / zero ablation of the head's z on the census windows.",
        "",
        "| arm | steps | tokens | wall minutes (shared CPU) | held-out loss (Shakespeare / "
        "Python docs) | "
        "max BOS mass | max sink score | heads sink score > 0.3 / > 0.5 | Gu protocol: sink rate, "
        "heads with mean sink score > 0.3 | BOS-sink labels |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        training = model_info(models[name]).metadata["training"]
        mine = heads[heads["arm"] == name]
        loss = training["final_heldout_loss"]
        lines.append(
            f"| {name} | {training['steps']} | {training['tokens_seen']:,} | "
            f"{training['minutes']} | {loss['shakespeare']:.3f} / {loss['python-docs']:.3f} | "
            f"{mine['bos_mass'].max():.3f} ({top(mine, 'bos_mass')}) | "
            f"{mine['sink_score'].max():.3f} ({top(mine, 'sink_score')}) | "
            f"{int((mine['sink_score'] > 0.3).sum())} / {int((mine['sink_score'] > 0.5).sum())} | "
            f"{mine['gu_sink_share'].mean():.1%}, {int((mine['gu_sink_score'] > 0.3).sum())} | "
            f"{int((mine['label'] != 'healthy').sum())} |"
        )
    lines += ["", "## Heads past eps = 0.3 (any measure), final models", ""]
    columns = [
        "arm",
        "layer",
        "head",
        "slope",
        "bos_mass",
        "sink_score",
        "gu_sink_score",
        "gu_sink_share",
        "label",
        "dloss_mean",
        "dloss_mean_se",
        "dloss_zero",
        "dormant_mean",
        "dormant_zero",
    ]
    sinks = heads[past_eps(heads)]
    lines += [markdown(sinks[columns], 4) if len(sinks) else "None.", ""]
    healthy = heads[~heads.index.isin(sinks.index)]
    lines += [
        "Other heads, for scale: median mean-ablation cost "
        + ", ".join(
            f"{name}: {healthy[healthy['arm'] == name]['dloss_mean'].median():.4f}"
            for name in names
        )
        + " nats.",
        "",
        "## Trajectories",
        "",
        "Heads above eps over training (`counts.csv`), at the last evaluation and at their peak:",
        "",
    ]
    last = count_table.groupby("arm", sort=False).last().reset_index()
    peak = count_table.groupby("arm", sort=False).max().reset_index()
    lines += [markdown(last.drop(columns="step").assign(at="end"), 3), ""]
    lines += [markdown(peak.drop(columns="step").assign(at="peak"), 3), ""]
    lines += ["## Growth at the end of training (ALiBi arms)", ""]
    lines += [f"- {late_growth(traj, name)}." for name in names if name.startswith("ALiBi")]
    lines += [
        "",
        "The curves flattened as the learning rate decayed, so they give no estimate of the "
        "steps a sink past 0.5 would take, nor whether it would form at all: answering that "
        "needs a longer run (a longer or constant schedule), not a line through this one.",
    ]
    return lines


def top(table: pd.DataFrame, column: str) -> str:
    row = table.loc[table[column].idxmax()]
    return f"L{row['layer']}H{row['head']}"


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "whether BOS sinks grow by themselves in 4-layer organisms trained from scratch for 4,000"
        " steps under {ALiBi, no positional bias} x {weight decay 0.1, 0.5}, one seed per arm: "
        "BOS mass and Gu et al.'s sink score over training and at the end, and each head's "
        "ablation cost."
    ),
    (
        "whether sinks would grow with longer training or at scale (the ALiBi arms' largest BOS "
        "mass flattened while the learning rate decayed; no extrapolation is made), or how much "
        "differences between arms owe to the seed (one run per arm, no test across seeds)."
    ),
)


def main() -> None:
    p = parser(__doc__, "natural_collapse")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the 2x2 to read")
    p.add_argument("--models", type=Path, default=MODELS, help="folder of the exported arms")
    args = p.parse_args()
    started = start(args)

    folders = {
        arm_name(arm, seed): args.models / f"{arm}-s{seed}" for seed in args.seeds for arm in ARMS
    }
    names = [n for n, f in folders.items() if (f / "training_log.csv").exists()]
    missing = sorted(set(folders) - set(names))
    if missing:
        print(f"not trained (skipped): {', '.join(missing)}")
    traj = pd.concat([trajectories(folders[name], name) for name in names])
    count_table = counts(traj)
    figures = {  # drawn before the slow part: a figure's error costs seconds, not the census
        "trajectories": trajectory_figure(traj, names, "bos_mass"),
        "trajectories_sink_score": trajectory_figure(traj, names, "sink_score"),
        "counts": counts_figure(count_table, names),
    }
    models = {name: load_model(str(folders[name])) for name in names}
    tables = [head_table(models[name], name) for name in names]
    heads = pd.concat([t for t, _ in tables], ignore_index=True)
    by_pos = pd.concat([b for _, b in tables], ignore_index=True)
    figures["bos_by_position"] = position_figure(by_pos, names)
    write_topic(
        args.out,
        figures,
        {
            "trajectories.csv": traj,
            "counts.csv": count_table,
            "heads.csv": heads,
            "bos_by_position.csv": by_pos,
        },
        summarise(names, models, heads, traj, count_table),
        started,
        scope=SCOPE,
    )


if __name__ == "__main__":
    main()
