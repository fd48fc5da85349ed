"""Models trained with an ALiBi variant: does log-distance ALiBi retrieve beyond its training
length?

The blindness paper's Table 3 at organism scale: models trained by ``analyses/train_organism.py``
with ``--bias standard`` and ``--bias log`` under identical budgets (same shape, steps, data
order, seed and retrieval mix) are loaded with ``headsurgeon.load_model``, which applies the
variant their ``headsurgeon.json`` records, and evaluated in context (lengths <= the training
length L) and out of context (2L-8L): passkey and needle-in-a-haystack accuracy (greedy and
top-1 of 10 candidates) by length and its AUC over log2 length, with 95% bootstrap intervals
(trials resampled within each length and depth; the same prompts for every model, so the
difference between two models is bootstrapped paired), and perplexity by window length.

Writes ``table.csv`` (the paper's layout: model x in/out-of-context AUC, perplexity at L),
``auc.csv`` (every AUC with its interval), ``differences.csv`` (each variant minus standard ALiBi
of the same training seed), ``curves.csv`` (accuracy by length), ``perplexity.csv``,
``models.csv``, ``trials_<model>_<task>.csv``, PNG figures and ``summary.md``.

    python analyses/mitigation_training.py \\
        --model standard=analyses/mitigation_models/standard \\
        --model log=analyses/mitigation_models/log \\
        --model standard-s1=analyses/mitigation_models/standard-s1 \\
        --model log-s1=analyses/mitigation_models/log-s1
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from _common import markdown, parser, start, style, write_topic

import headsurgeon as hs
from headsurgeon.evals import length_auc
from headsurgeon.exact_alibi import trained_bias
from headsurgeon.loading import model_info

TASKS = ("passkey", "needle")
METRIC = "top1_accuracy"  # chance 1/10; greedy_accuracy is reported too
SPLITS = ("in_context", "out_of_context")


def auc_by_split(trials: pd.DataFrame, train_ctx: int, column: str) -> dict[str, float]:
    """AUC over log2 length of the depth-averaged accuracy, in and out of context."""
    per_length = trials.groupby(["context_length", "depth"])[column].mean().groupby(level=0).mean()
    lengths = per_length.index.to_numpy()
    masks = {"in_context": lengths <= train_ctx, "out_of_context": lengths > train_ctx}
    return {s: length_auc(lengths[m], per_length.to_numpy()[m]) for s, m in masks.items()}


def bootstrap(
    trials: dict[str, pd.DataFrame], train_ctx: int, column: str, n: int, seed: int
) -> dict[str, np.ndarray]:
    """``n`` bootstrap AUCs per (variant, split): trial indices resampled within each length and
    depth, the same indices for every variant (paired: they saw the same prompts)."""
    rng = np.random.default_rng(seed)
    first = next(iter(trials.values()))
    cells = [g.index.to_numpy() for _, g in first.groupby(["context_length", "depth"])]
    out = {f"{v}/{s}": np.empty(n) for v in trials for s in SPLITS}
    for i in range(n):
        rows = np.concatenate([rng.choice(c, len(c)) for c in cells])
        for variant, frame in trials.items():
            for split, value in auc_by_split(frame.loc[rows], train_ctx, column).items():
                out[f"{variant}/{split}"][i] = value
    return out


def main() -> None:
    p = parser(__doc__, "mitigation_training")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="LABEL=FOLDER (repeat; the variant and seed come from headsurgeon.json)",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[96, 128, 256, 512, 1024])
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=20, help="prompts per length and depth")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    started = start(args)
    folders = dict(spec.split("=", 1) for spec in args.model)

    trials: dict[str, dict[str, pd.DataFrame]] = {t: {} for t in TASKS}
    models, ppl_rows, train_ctx = {}, [], None
    for label, folder in folders.items():
        model = hs.load_model(folder)
        info = model_info(model)
        training = info.metadata["training"]
        models[label] = {"variant": trained_bias(info.metadata)[0], "seed": training["seed"],
                         "steps": training["steps"], "tokens": training["tokens_seen"],
                         "minutes": training["minutes"], "folder": folder}  # fmt: skip
        train_ctx = train_ctx or info.train_ctx
        if info.train_ctx != train_ctx:
            raise SystemExit(f"{folder}: training length {info.train_ctx}, others {train_ctx}")
        common = {"lengths": args.lengths, "depths": args.depths, "n_trials": args.trials,
                  "seed": args.seed}  # fmt: skip
        trials["passkey"][label] = hs.passkey(model, **common).trials
        trials["needle"][label] = hs.needle(model, **common).trials
        for length in args.lengths:
            ppl = hs.perplexity(model, window=length, max_windows=32, progress=False)
            ppl_rows.append({"model": label, "window": length, "perplexity": ppl})

    auc, diffs, curves = evaluate(trials, models, train_ctx, args)
    ppl = pd.DataFrame(ppl_rows)
    table = paper_table(auc, ppl, models, train_ctx)
    figures = {f"curves_{task}": curve_figure(curves, task, train_ctx) for task in TASKS}
    figures["perplexity"] = ppl_figure(ppl, train_ctx)
    tables = {"table.csv": table, "auc.csv": auc, "differences.csv": diffs,
              "curves.csv": curves, "perplexity.csv": ppl,
              "models.csv": pd.DataFrame(models).T.rename_axis("model").reset_index()}  # fmt: skip
    for task in TASKS:
        for label, frame in trials[task].items():
            tables[f"trials_{label}_{task}.csv"] = frame
    summary = [
        "# Training with an ALiBi variant: retrieval in and out of context",
        "",
        f"Training length L = {train_ctx}. Models (variant, seed, budget from headsurgeon.json): "
        + "; ".join(
            f"{k}: {m['variant']}, seed {m['seed']}, {m['steps']} steps, "
            f"{m['tokens']:,} tokens, {m['minutes']} min"
            for k, m in models.items()
        ),
        f"Evaluation: lengths {args.lengths}, depths {args.depths}, {args.trials} prompts per "
        "length and depth (the same prompts for every model), 10 candidates (top-1 chance 0.1); "
        f"AUC over log2 length; 95% intervals from {args.bootstrap} bootstrap resamples of the "
        "prompts, paired across models (they cover prompt sampling, not training seeds: the seeds "
        "are separate rows).",
        "",
        *verdict(diffs),
        "",
        "## The paper's layout (top-1 AUC; perplexity at the training length)",
        "",
        markdown(table, 3),
        "",
        "## Log (or other variant) minus standard ALiBi, same training seed",
        "",
        markdown(diffs, 3),
    ]
    write_topic(args.out, figures, tables, summary, started)


def evaluate(
    trials: dict[str, dict[str, pd.DataFrame]], models: dict, train_ctx: int, args
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Every AUC with its interval, each variant minus standard (same seed), the curves."""
    auc_rows, diff_rows, curve_rows = [], [], []
    standard = {m["seed"]: k for k, m in models.items() if m["variant"] == "standard"}
    for task in TASKS:
        for column in ("top1_correct", "greedy_correct"):
            samples = bootstrap(trials[task], train_ctx, column, args.bootstrap, args.seed)
            points = {k: auc_by_split(f, train_ctx, column) for k, f in trials[task].items()}
            for label, point in points.items():
                base = standard.get(models[label]["seed"])
                for split in SPLITS:
                    low, high = np.nanpercentile(samples[f"{label}/{split}"], [2.5, 97.5])
                    auc_rows.append({"task": task, "metric": column, "model": label,
                                     "variant": models[label]["variant"], "split": split,
                                     "auc": point[split], "ci_low": low,
                                     "ci_high": high})  # fmt: skip
                    if base is None or base == label:
                        continue
                    delta = samples[f"{label}/{split}"] - samples[f"{base}/{split}"]
                    low, high = np.nanpercentile(delta, [2.5, 97.5])
                    diff_rows.append({"task": task, "metric": column, "model": label,
                                      "minus": base, "split": split,
                                      "difference": point[split] - points[base][split],
                                      "ci_low": low, "ci_high": high,
                                      "share_not_below": float(np.mean(delta >= 0))})  # fmt: skip
            for label, frame in trials[task].items():
                by_length = frame.groupby("context_length")[column].mean()
                curve_rows += [{"task": task, "metric": column, "model": label,
                                "context_length": n, "accuracy": a}
                               for n, a in by_length.items()]  # fmt: skip
    return pd.DataFrame(auc_rows), pd.DataFrame(diff_rows), pd.DataFrame(curve_rows)


def verdict(diffs: pd.DataFrame) -> list[str]:
    """The answer in words: out-of-context top-1 AUC of each variant minus standard, per seed."""
    rows = diffs[(diffs["metric"] == "top1_correct") & (diffs["split"] == "out_of_context")]
    if rows.empty:
        return ["No model to compare with standard ALiBi of the same seed."]
    lines = ["## Answer", ""]
    for task, frame in rows.groupby("task", sort=False):
        parts = [f"{r.model} {r.difference:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
                 for r in frame.itertuples()]  # fmt: skip
        above = (frame["ci_low"] > 0).all()
        below = (frame["ci_high"] < 0).all()
        word = "better" if above else "worse" if below else "not distinguishable from standard"
        status = f"{word} in every seed" if above or below else word
        lines.append(f"- {task}, out of context, variant minus standard ALiBi (top-1 AUC, 95% "
                     f"CI over prompts): {'; '.join(parts)}: {status}")  # fmt: skip
    worse = (rows["ci_high"] < 0).all()
    better = (rows["ci_low"] > 0).all()
    lines += ["", "The paper's direction (log-scaled distances retrieve better out of context "
              "than standard ALiBi) " + ("holds" if better else "is reversed" if worse
                                         else "is not shown") + " at this scale."]  # fmt: skip
    return lines


def paper_table(auc: pd.DataFrame, ppl: pd.DataFrame, models: dict, train_ctx: int) -> pd.DataFrame:
    """One row per model: passkey and needle top-1 AUC in/out of context, with intervals."""
    rows = []
    top1 = auc[auc["metric"] == "top1_correct"]
    for label, frame in top1.groupby("model", sort=False):
        row = {"model": label, "variant": models[label]["variant"], "seed": models[label]["seed"]}
        for r in frame.itertuples():
            row[f"{r.task}_{r.split}"] = r.auc
            row[f"{r.task}_{r.split}_ci"] = f"[{r.ci_low:.2f}, {r.ci_high:.2f}]"
        at = ppl[(ppl["model"] == label) & (ppl["window"] == train_ctx)]["perplexity"]
        row["perplexity_at_L"] = float(at.iloc[0]) if len(at) else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def _training_length(fig: go.Figure, train_ctx: int, low: float, high: float) -> None:
    """A dashed vertical line at the training length (a trace: shapes misplace on log axes)."""
    fig.add_trace(go.Scatter(
        x=[train_ctx, train_ctx], y=[low, high], mode="lines+text",
        line={"dash": "dash", "color": "#444"}, text=["training length", ""],
        textposition="top right", showlegend=False, hoverinfo="skip",
    ))  # fmt: skip


def curve_figure(curves: pd.DataFrame, task: str, train_ctx: int) -> go.Figure:
    fig = go.Figure()
    for (label, metric), frame in curves[curves["task"] == task].groupby(["model", "metric"]):
        fig.add_trace(go.Scatter(
            x=frame["context_length"], y=frame["accuracy"], mode="lines+markers",
            name=f"{label}, {metric.removesuffix('_correct')}",
            line={"dash": "solid" if metric == "top1_correct" else "dot"},
        ))  # fmt: skip
    _training_length(fig, train_ctx, 0, 1)
    fig.add_hline(y=0.1, line_dash="dot", annotation_text="top-1 chance")
    fig.update_xaxes(type="log", title="context length (tokens)")
    fig.update_yaxes(title="accuracy", range=[0, 1.02])
    style(fig, f"{task}: accuracy by context length",
          "models trained with each ALiBi variant; beyond the dashed line is out of context",
          760, 460)  # fmt: skip
    return fig


def ppl_figure(ppl: pd.DataFrame, train_ctx: int) -> go.Figure:
    fig = go.Figure()
    for label, frame in ppl.groupby("model", sort=False):
        fig.add_trace(go.Scatter(x=frame["window"], y=frame["perplexity"], mode="lines+markers",
                                 name=label))  # fmt: skip
    _training_length(fig, train_ctx, ppl["perplexity"].min(), ppl["perplexity"].max())
    fig.update_xaxes(type="log", title="window (tokens)")
    fig.update_yaxes(type="log", title="held-out perplexity")
    style(fig, "Perplexity by window length", "bundled held-out corpora, 32 windows each",
          760, 460)  # fmt: skip
    return fig


if __name__ == "__main__":
    main()
