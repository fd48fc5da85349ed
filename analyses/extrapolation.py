"""ALiBi's length-extrapolation curve: loss by token position far beyond the training length,
with each mitigation.

One long pass per sequence (``headsurgeon.evals.loss_by_position``, the long-context path: memory
linear in the length) of a model trained at L tokens (default: the Table 3 model
``analyses/mitigation_models/standard``, L = 128), bare and under every mitigation applied
through hooks (``headsurgeon.mitigation``: clamped and softcap with ``--c``, log, robust for the
evaluated length in float32), and optionally other trained models beside it (``--model
LABEL=FOLDER``, e.g. the one trained with log distances). Beside each curve, the analytic
float32 blind distance of every head (``headsurgeon.analytic_blindness``), so a reader sees
where the bare model's heads stop seeing.

Writes ``loss_by_position.csv`` (one row per curve and position bucket), ``blind_heads.csv``,
``loss_by_position.png`` and ``summary.md``.

    python analyses/extrapolation.py                 # 16,384 tokens (128L), ~8 min, one thread
    python analyses/extrapolation.py --length 65536  # 512L: 34 min (the committed figures)
    python analyses/extrapolation.py --length 65536 --n-seqs 2 \\
        --model log-trained=analyses/mitigation_models/log   # ~7 min per curve and sequence
"""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from _common import markdown, parser, start, style, write_topic

import headsurgeon as hs
from headsurgeon.evals import loss_by_position
from headsurgeon.loading import model_info
from headsurgeon.progress import tqdm


def mitigations(c: float, length: int) -> dict[str, dict]:
    """Label -> ``hs.mitigation`` arguments (``{}``: the bare model)."""
    return {
        "none": {},
        f"clamped c={c:g}": {"kind": "clamped", "c": c},
        "log": {"kind": "log"},
        f"softcap c={c:g}": {"kind": "softcap", "c": c},
        "robust": {"kind": "robust", "context": length, "dtype": "float32", "limit": "normal"},
    }


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "the loss by token position of one L = 128 model (`analyses/mitigation_models/standard`, "
        "one seed) on one 65,536-token held-out sequence, bare and under each mitigation applied "
        "as a hook at inference (no retraining), beside its heads' analytic float32 blind "
        "distances."
    ),
    (
        "which distances the model uses (`window_effect` does), what a mitigation does to a model"
        " trained with it (`figures/mitigation_training/`), or the spread over sequences and "
        "seeds (one sequence, one model); the blind distances are analytic, and the figure sets "
        "them beside the loss without showing that one causes the other."
    ),
)


def main() -> None:
    p = parser(__doc__, "extrapolation")
    p.add_argument(
        "--base",
        default="analyses/mitigation_models/standard",
        help="the model the mitigations are applied to",
    )
    p.add_argument("--model", action="append", default=[], help="LABEL=FOLDER, also evaluated")
    p.add_argument("--length", type=int, default=16384, help="tokens per sequence")
    p.add_argument("--n-seqs", type=int, default=1, help="sequences (one pass each)")
    p.add_argument("--c", type=float, default=20.0, help="cap of clamped and softcap")
    args = p.parse_args()
    started = start(args)
    base = hs.load_model(args.base)
    runs = [(name, base, spec) for name, spec in mitigations(args.c, args.length).items()]
    for spec in args.model:
        label, folder = spec.split("=", 1)
        runs.append((label, hs.load_model(folder), {}))
    curves = []
    for label, model, spec in tqdm(runs, desc="curves"):
        kwargs = dict(spec)
        context = hs.mitigation(model, kwargs.pop("kind"), **kwargs) if spec else None
        with context or contextlib.nullcontext():
            curve = loss_by_position(model, length=args.length, n_seqs=args.n_seqs)
        curves.append(curve.assign(curve=label))
    curves = pd.concat(curves, ignore_index=True)
    blind = hs.analytic_blindness(base, dtypes=["float32"], limits=["normal"])
    train_ctx = model_info(base).train_ctx or base.cfg.n_ctx
    summary = [
        "# Length extrapolation: loss by token position, with each mitigation",
        "",
        f"Model {args.base} (trained at L = {train_ctx} tokens), {args.n_seqs} held-out "
        f"sequence(s) of {args.length:,} tokens, one pass each (exact, in query blocks); "
        "mitigations through hooks, no weight change.",
        "",
        *findings(curves, blind, train_ctx),
        "",
        markdown(
            curves.pivot_table(
                index=["position_lo", "position_hi"], columns="curve", values="mean_nll", sort=False
            ).reset_index(),
            3,
        ),
    ]
    write_topic(
        args.out,
        {"loss_by_position": figure(curves, blind, train_ctx)},
        {"loss_by_position.csv": curves, "blind_heads.csv": blind},
        summary,
        started,
        scope=SCOPE,
    )


def findings(curves: pd.DataFrame, blind: pd.DataFrame, train_ctx: int) -> list[str]:
    """Each curve's loss in context, at the far end, and the change between them."""
    lines = [
        "| curve | loss in context (nats) | loss in the last bucket | change |",
        "|---|---:|---:|---:|",
    ]
    for label, frame in curves.groupby("curve", sort=False):
        inside = frame[frame["position_hi"] <= train_ctx]
        near = np.average(inside["mean_nll"], weights=inside["tokens"])
        far = frame.iloc[-1]
        spread = f" ± {far.ci95:.3f}" if np.isfinite(far.ci95) else ""  # NaN: one sequence
        lines.append(
            f"| {label} | {near:.3f} | {far.mean_nll:.3f}{spread} "
            f"(positions {int(far.position_lo):,}-{int(far.position_hi):,}) | "
            f"{far.mean_nll - near:+.3f} |"
        )
    distances = np.sort(blind["blind_distance"].dropna().unique())
    lines += [
        "",
        "Analytic float32 blind distances of the bare model's heads ('normal' "
        "limit, tokens): " + ", ".join(f"{d:,.0f}" for d in distances),
    ]
    return lines


def figure(curves: pd.DataFrame, blind: pd.DataFrame, train_ctx: int) -> go.Figure:
    fig = go.Figure()
    for label, frame in curves.groupby("curve", sort=False):
        centre = np.sqrt(frame["position_lo"].clip(lower=1) * frame["position_hi"])
        fig.add_trace(
            go.Scatter(
                x=centre,
                y=frame["mean_nll"],
                mode="lines+markers",
                name=label,
                error_y={"type": "data", "array": frame["ci95"]},
            )
        )
    for distance in np.sort(blind["blind_distance"].dropna().unique()):
        fig.add_vline(x=np.log10(distance), line_dash="dot", line_color="#bbb")
    fig.add_vline(x=np.log10(train_ctx), line_dash="dash", line_color="#444")
    fig.update_xaxes(type="log", title="token position")
    fig.update_yaxes(title="mean next-token loss (nats)")
    style(
        fig,
        "Loss by token position, with each mitigation",
        "dashed: training length; dotted: analytic float32 blind distance of each head",
        820,
        480,
    )
    return fig


if __name__ == "__main__":
    main()
