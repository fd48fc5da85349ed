"""Models trained with an ALiBi variant: does log-distance ALiBi retrieve beyond its training
length?

The blindness paper's Table 3 at organism scale: models trained by ``analyses/train_organism.py``
with ``--bias standard`` and ``--bias log`` under identical budgets (same shape, steps, data
order, seed and retrieval mix) are loaded with ``headsurgeon.load_model``, which applies the
variant their ``headsurgeon.json`` records, and evaluated in context (lengths <= the training
length L) and out of context (beyond L): passkey and needle-in-a-haystack accuracy (greedy and
top-1 of 10 candidates) by length and its AUC over log2 length, with 95% bootstrap intervals
(trials resampled within each length and depth; the same prompts for every model, so the
difference between two models is bootstrapped paired), and perplexity by window length.

Out to the paper's regime: retrieval from L to 128L (``--long-trials`` prompts per length and
depth beyond ``--long-from`` tokens; one prompt of one CPU thread costs 66 s at 16,384 tokens and
245-298 s at 32,768, measured), and for every model its measured underflow blindness on one
``--blindness-length`` sequence (default 256L: exact zero counts per head,
:func:`headsurgeon.measure_blindness` on the long-context path) and its loss by token position
out to the same length (:func:`headsurgeon.evals.loss_by_position`, one pass per sequence), so that
retrieval by length stands beside the number of heads that are blind at that distance.

Writes ``table.csv`` (the paper's layout: model x in/out-of-context AUC, perplexity at L),
``auc.csv`` (every AUC with its interval), ``differences.csv`` (each variant minus standard ALiBi
of the same training seed), ``curves.csv`` (accuracy by length), ``perplexity.csv``,
``blindness.csv`` (measured, per head), ``regime.csv`` (per model and length: top-1 accuracy
with its interval beside the heads blind within that distance), ``by_distance.csv`` (top-1
accuracy by the needle's distance to the end), ``distance_pairs.csv`` (each variant against
standard ALiBi of the same seed by that distance, on the same prompts: discordant prompts and
exact McNemar p), ``loss_by_position.csv``, ``models.csv``, ``trials_<model>_<task>.csv``, PNG
figures and ``summary.md``.

    python analyses/mitigation_training.py \\
        --model standard=analyses/mitigation_models/standard \\
        --model log=analyses/mitigation_models/log \\
        --model standard-s1=analyses/mitigation_models/standard-s1 \\
        --model log-s1=analyses/mitigation_models/log-s1
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from _common import markdown, parser, start, style, write_topic
from plotly.subplots import make_subplots

import headsurgeon as hs
from headsurgeon.evals import length_auc, loss_by_position, wilson_interval
from headsurgeon.exact_alibi import trained_bias
from headsurgeon.loading import model_info
from headsurgeon.plots import save_figure
from headsurgeon.progress import tqdm
from headsurgeon.stats import discordant, mcnemar_p

TASKS = ("passkey", "needle")
METRIC = "top1_accuracy"  # chance 1/10; greedy_accuracy is reported too
SPLITS = ("in_context", "out_of_context")
# One colour per model, the same in every figure (plotly's default cycle gives a model's
# passkey and another model's needle the same blue).
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")


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


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "retrieval (passkey, needle; top-1 of 10 candidates) and perplexity of models trained at "
        "L = 128 with standard or log ALiBi, two training seeds each, by prompt length beyond L "
        "(averaged over needle depths, so most out-of-context prompts hold their needle far "
        "from the question) and by needle distance, variants compared on the same prompts "
        "(paired bootstrap of the AUC; exact McNemar by distance)."
    ),
    (
        "the paper's claim, which concerns heads that are blind inside the training window: these "
        "models were trained below every head's first exact zero (see below), so no head was "
        "blind in training; nor retrieval against a no-needle baseline "
        "(`figures/retrieval_distance/`), nor models of real size."
    ),
)


def main() -> None:
    p = parser(__doc__, "mitigation_training")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="LABEL=FOLDER (repeat; the variant and seed come from headsurgeon.json)",
    )
    lengths = [96, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    p.add_argument("--lengths", type=int, nargs="+", default=lengths)
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=20, help="prompts per length and depth")
    p.add_argument("--long-from", type=int, default=1024, help="lengths above take --long-trials")
    p.add_argument("--long-trials", type=int, default=3, help="prompts per long length, depth")
    p.add_argument("--ppl-max", type=int, default=1024, help="perplexity windows up to this")
    p.add_argument(
        "--blindness-length",
        type=int,
        default=32768,
        help="sequence length of measured blindness and loss by position",
    )
    p.add_argument("--loss-seqs", type=int, default=2, help="sequences for loss by position")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--replot", action="store_true", help="only redraw a finished run's figures from its CSVs"
    )
    p.add_argument(
        "--resummarize",
        action="store_true",
        help="rewrite a finished run's folder (tables, figures, summary.md) from its CSVs, with "
        "the options it was run with",
    )
    args = p.parse_args()
    folders = dict(spec.split("=", 1) for spec in args.model)
    if args.replot:
        return replot(Path(args.out), folders)
    if args.resummarize:
        return resummarize(args, folders)
    started = start(args)

    trials: dict[str, dict[str, pd.DataFrame]] = {t: {} for t in TASKS}
    models, ppl_rows, train_ctx, blind, losses = {}, [], None, [], []
    groups = [
        ([n for n in args.lengths if n <= args.long_from], args.trials),
        ([n for n in args.lengths if n > args.long_from], args.long_trials),
    ]
    for label, folder in tqdm(folders.items(), desc="models"):
        model = hs.load_model(folder)
        info = model_info(model)
        training = info.metadata["training"]
        models[label] = {
            "variant": trained_bias(info.metadata)[0],
            "seed": training["seed"],
            "steps": training["steps"],
            "tokens": training["tokens_seen"],
            "minutes": training["minutes"],
            "folder": folder,
        }
        train_ctx = train_ctx or info.train_ctx
        if info.train_ctx != train_ctx:
            raise SystemExit(f"{folder}: training length {info.train_ctx}, others {train_ctx}")
        for task, run in (("passkey", hs.passkey), ("needle", hs.needle)):
            frames = [
                run(model, lengths=group, depths=args.depths, n_trials=n, seed=args.seed).trials
                for group, n in groups
                if group
            ]
            trials[task][label] = pd.concat(frames, ignore_index=True)
        for length in [n for n in args.lengths if n <= args.ppl_max]:
            ppl = hs.perplexity(model, window=length, max_windows=32, progress=False)
            ppl_rows.append({"model": label, "window": length, "perplexity": ppl})
        one = hs.to_sequences(model, seq_len=args.blindness_length, n_seqs=1)
        measured = hs.measure_blindness(model, one, dtypes=["float32"], progress=False).by_head
        blind.append(measured.assign(model=label))
        curve = loss_by_position(
            model, length=args.blindness_length, n_seqs=args.loss_seqs, progress=False
        )
        losses.append(curve.assign(model=label))

    auc, diffs, curves = evaluate(trials, models, train_ctx, args)
    ppl = pd.DataFrame(ppl_rows)
    blind, losses = pd.concat(blind, ignore_index=True), pd.concat(losses, ignore_index=True)
    regime = regime_table(trials, blind, args)
    lengths = blind_lengths(regime, models, train_ctx)
    long_diff = long_range_difference(trials, models, lengths, args.bootstrap, args.seed)
    table = paper_table(auc, ppl, models, train_ctx)
    figures = all_figures(curves, ppl, regime, losses, train_ctx)
    tables = {
        "table.csv": table,
        "auc.csv": auc,
        "differences.csv": diffs,
        "curves.csv": curves,
        "perplexity.csv": ppl,
        "regime.csv": regime,
        "long_range_differences.csv": long_diff,
        "blindness.csv": blind,
        "loss_by_position.csv": losses,
        "models.csv": pd.DataFrame(models).T.rename_axis("model").reset_index(),
    }
    for task in TASKS:
        for label, frame in trials[task].items():
            tables[f"trials_{label}_{task}.csv"] = frame
    by_distance = distance_table(trials)
    pairs = distance_pairs(trials, models)
    tables["by_distance.csv"], tables["distance_pairs.csv"] = by_distance, pairs
    summary = summary_lines(
        models, train_ctx, args, diffs, by_distance, pairs, regime, blind, losses, long_diff, table
    )
    write_topic(args.out, figures, tables, summary, started, scope=SCOPE)


def summary_lines(
    models: dict,
    train_ctx: int,
    args,
    diffs: pd.DataFrame,
    by_distance: pd.DataFrame,
    pairs: pd.DataFrame,
    regime: pd.DataFrame,
    blind: pd.DataFrame,
    losses: pd.DataFrame,
    long_diff: pd.DataFrame,
    table: pd.DataFrame,
) -> list[str]:
    """summary.md, from the run's tables (so ``--resummarize`` rewrites it from the CSVs)."""
    lengths = blind_lengths(regime, models, train_ctx)
    return [
        "# Training with an ALiBi variant: retrieval in and out of context",
        "",
        f"Training length L = {train_ctx}. Models (variant, seed, budget from headsurgeon.json): "
        + "; ".join(
            f"{k}: {m['variant']}, seed {m['seed']}, {m['steps']} steps, "
            f"{m['tokens']:,} tokens, {m['minutes']} min"
            for k, m in models.items()
        ),
        f"Evaluation: lengths {args.lengths}, depths {args.depths}, {args.trials} prompts per "
        f"length and depth up to {args.long_from} tokens, {args.long_trials} beyond (the same "
        "prompts for every model), 10 candidates (top-1 chance 0.1); "
        f"AUC over log2 length; 95% intervals from {args.bootstrap} bootstrap resamples of the "
        "prompts, paired across models (they cover prompt sampling, not training seeds: the seeds "
        "are separate rows).",
        "",
        *verdict(diffs),
        "",
        *distance_lines(by_distance, pairs, blind, train_ctx),
        "",
        *regime_lines(regime, blind, losses, long_diff, lengths, args),
        "",
        "## The paper's layout (top-1 AUC; perplexity at the training length)",
        "",
        markdown(table, 3),
        "",
        "## Log (or other variant) minus standard ALiBi, same training seed",
        "",
        markdown(diffs, 3),
    ]


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
                    auc_rows.append(
                        {
                            "task": task,
                            "metric": column,
                            "model": label,
                            "variant": models[label]["variant"],
                            "split": split,
                            "auc": point[split],
                            "ci_low": low,
                            "ci_high": high,
                        }
                    )
                    if base is None or base == label:
                        continue
                    delta = samples[f"{label}/{split}"] - samples[f"{base}/{split}"]
                    low, high = np.nanpercentile(delta, [2.5, 97.5])
                    diff_rows.append(
                        {
                            "task": task,
                            "metric": column,
                            "model": label,
                            "minus": base,
                            "split": split,
                            "difference": point[split] - points[base][split],
                            "ci_low": low,
                            "ci_high": high,
                            "share_not_below": float(np.mean(delta >= 0)),
                        }
                    )
            for label, frame in trials[task].items():
                by_length = frame.groupby("context_length")[column].mean()
                curve_rows += [
                    {
                        "task": task,
                        "metric": column,
                        "model": label,
                        "context_length": n,
                        "accuracy": a,
                    }
                    for n, a in by_length.items()
                ]
    return pd.DataFrame(auc_rows), pd.DataFrame(diff_rows), pd.DataFrame(curve_rows)


def verdict(diffs: pd.DataFrame) -> list[str]:
    """The answer in words: out-of-context top-1 AUC of each variant minus standard, per seed."""
    rows = diffs[(diffs["metric"] == "top1_correct") & (diffs["split"] == "out_of_context")]
    if rows.empty:
        return ["No model to compare with standard ALiBi of the same seed."]
    lines = ["## Out-of-context AUC over prompt length", ""]
    for task, frame in rows.groupby("task", sort=False):
        parts = [
            f"{r.model} {r.difference:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
            for r in frame.itertuples()
        ]
        above = (frame["ci_low"] > 0).all()
        below = (frame["ci_high"] < 0).all()
        word = "better" if above else "worse" if below else "not distinguishable from standard"
        status = f"{word} in every seed" if above or below else word
        lines.append(
            f"- {task}, out of context, variant minus standard ALiBi (top-1 AUC, 95% "
            f"CI over prompts): {'; '.join(parts)}: {status}"
        )
    lines += [
        "",
    ]
    return lines


def regime_table(
    trials: dict[str, dict[str, pd.DataFrame]], blind: pd.DataFrame, args
) -> pd.DataFrame:
    """Per model and length: each task's top-1 accuracy with its Wilson interval, and how many
    heads are blind (measured, float32) within that distance, beside the analytic count."""
    rows = []
    for label, by_model in blind.groupby("model", sort=False):
        first_zero = by_model["first_zero_distance"].to_numpy()
        analytic = by_model["analytic_distance"].to_numpy()
        for length in args.lengths:
            row = {
                "model": label,
                "context_length": length,
                "n_heads": len(by_model),
                "blind_heads": int(np.sum(first_zero < length)),
                "blind_heads_analytic": int(np.sum(analytic < length)),
            }
            for task in TASKS:
                frame = trials[task][label]
                correct = frame.loc[frame["context_length"] == length, "top1_correct"]
                low, high = wilson_interval(int(correct.sum()), len(correct))
                row |= {
                    task: correct.mean(),
                    f"{task}_ci_low": low,
                    f"{task}_ci_high": high,
                    f"{task}_n": len(correct),
                }
            rows.append(row)
    return pd.DataFrame(rows)


def long_range_difference(
    trials: dict[str, dict[str, pd.DataFrame]], models: dict, lengths: list[int], n: int, seed: int
) -> pd.DataFrame:
    """Each variant minus standard ALiBi of the same seed: top-1 accuracy over ``lengths``
    (the mean of the length x depth cells), with a paired bootstrap interval over prompts."""
    rng = np.random.default_rng(seed)
    standard = {m["seed"]: k for k, m in models.items() if m["variant"] == "standard"}
    rows = []
    for task in TASKS if lengths else ():
        first = next(iter(trials[task].values()))
        inside = first[first["context_length"].isin(lengths)]
        cells = [g.index.to_numpy() for _, g in inside.groupby(["context_length", "depth"])]

        def accuracy(frame: pd.DataFrame, index: np.ndarray) -> float:
            picked = frame.loc[index]
            return picked.groupby(["context_length", "depth"])["top1_correct"].mean().mean()

        samples = [np.concatenate([rng.choice(c, len(c)) for c in cells]) for _ in range(n)]
        everything = np.concatenate(cells)
        for label, frame in trials[task].items():
            base = standard.get(models[label]["seed"])
            if base is None or base == label:
                continue
            other = trials[task][base]
            deltas = [accuracy(frame, i) - accuracy(other, i) for i in samples]
            low, high = np.percentile(deltas, [2.5, 97.5])
            rows.append(
                {
                    "task": task,
                    "model": label,
                    "minus": base,
                    "accuracy": accuracy(frame, everything),
                    "standard_accuracy": accuracy(other, everything),
                    "difference": accuracy(frame, everything) - accuracy(other, everything),
                    "ci_low": low,
                    "ci_high": high,
                }
            )
    return pd.DataFrame(rows)


# Needle-to-end distance bins (tokens from the needle's first token to the prompt's last).
DISTANCE_EDGES = (0, 64, 128, 256, 1024, 4096, 65536)


def distance_table(trials: dict[str, dict[str, pd.DataFrame]]) -> pd.DataFrame:
    """Top-1 accuracy by the needle's distance to the end of the prompt, per model and task,
    with its Wilson interval and the chance rate (1 / candidates: this run measured no
    needle-free baseline, ``analyses/retrieval_distance.py`` does).

    The distance counts from the needle's first token to the prompt's last, so it exceeds the
    distance to the question by the needle's and the question's lengths (about 20-40 tokens)."""
    rows = []
    for task in TASKS:
        for label, frame in trials[task].items():
            distance = frame["context_length"] - frame["needle_position"]
            bins = pd.cut(distance, DISTANCE_EDGES, right=False)
            for interval, group in frame.groupby(bins, observed=True):
                k, n = int(group["top1_correct"].sum()), len(group)
                low, high = wilson_interval(k, n)
                rows.append(
                    {
                        "model": label,
                        "task": task,
                        "distance_lo": int(interval.left),
                        "distance_hi": int(interval.right),
                        "n": n,
                        "correct": k,
                        "accuracy": k / n,
                        "ci_low": low,
                        "ci_high": high,
                        "chance": float((1 / group["n_candidates"]).mean()),
                    }
                )
    return pd.DataFrame(rows)


# Pooled "far" needles of the variant-against-standard test: 1,024 tokens or more from the end.
FAR = 1024


def distance_pairs(trials: dict[str, dict[str, pd.DataFrame]], models: dict) -> pd.DataFrame:
    """Each variant against standard ALiBi of the same training seed on the same prompts, by
    the needle's distance to the end (bins of :func:`distance_table`, and the needles
    :data:`FAR` tokens or more away pooled): the prompts only one of the two gets right (top-1)
    and their exact McNemar p (:func:`headsurgeon.stats.mcnemar_p`)."""
    prompt = ["context_length", "depth", "trial", "key", "needle_position"]
    rows = []
    for task in TASKS:
        for label, frame in trials[task].items():
            model = models[label]
            standard = [
                other
                for other, m in models.items()
                if m["variant"] == "standard" and m["seed"] == model["seed"]
            ]
            if model["variant"] == "standard" or not standard:
                continue
            other = trials[task][standard[0]]
            if not frame[prompt].astype(str).equals(other[prompt].astype(str)):
                raise SystemExit(f"error: {label} and {standard[0]} saw other {task} prompts")
            distance = frame["context_length"] - frame["needle_position"]
            bins = pd.cut(distance, DISTANCE_EDGES, right=False)
            groups = [
                (int(i.left), int(i.right), idx)
                for i, idx in frame.groupby(bins, observed=True).groups.items()
            ]
            groups.append((FAR, DISTANCE_EDGES[-1], frame.index[distance >= FAR]))
            for i, (lo, hi, idx) in enumerate(groups):
                only_a, only_b = discordant(
                    frame.loc[idx, "top1_correct"], other.loc[idx, "top1_correct"]
                )
                rows.append(
                    {
                        "task": task,
                        "model": label,
                        "minus": standard[0],
                        "distance_lo": lo,
                        "distance_hi": hi,
                        "pooled": i == len(groups) - 1,
                        "n": len(idx),
                        "model_only": only_a,
                        "standard_only": only_b,
                        "p": mcnemar_p(only_a, only_b),
                    }
                )
    return pd.DataFrame(rows)


def distance_lines(
    by_distance: pd.DataFrame, pairs: pd.DataFrame, blind: pd.DataFrame, train_ctx: int
) -> list[str]:
    """The near-against-far section: where the differences live, against chance, and each
    variant against standard ALiBi on the same prompts."""
    nearest = "; ".join(
        f"{label} {zeros.min():,.0f}" if zeros.notna().any() else f"{label} none"
        for label, zeros in blind.groupby("model", sort=False)["first_zero_distance"]
    )
    shown = by_distance.assign(
        accuracy=[
            f"{r.correct}/{r.n} = {r.accuracy:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]"
            for r in by_distance.itertuples()
        ],
        distance=[f"{r.distance_lo}-{r.distance_hi - 1}" for r in by_distance.itertuples()],
    ).pivot(index=["task", "distance"], columns="model", values="accuracy")
    order = by_distance.drop_duplicates(["task", "distance_lo"])
    rows = [(r.task, f"{r.distance_lo}-{r.distance_hi - 1}") for r in order.itertuples()]
    shown = shown.loc[rows]
    far = by_distance[by_distance["distance_lo"] >= 1024].groupby(["model", "task"], sort=False)
    far_parts = []
    for (model, task), group in far:
        k, n = int(group["correct"].sum()), int(group["n"].sum())
        low, high = wilson_interval(k, n)
        chance = float(group["chance"].mean())
        word = "above chance" if low > chance else "below chance" if high < chance else "at chance"
        far_parts.append(f"{model} {task} {k}/{n} = {k / n:.2f} [{low:.2f}, {high:.2f}], {word}")
    return [
        "## Accuracy by needle distance: near against far",
        "",
        f"Training length L = {train_ctx}. The nearest first exact zero per model (float32, "
        f"tokens): {nearest}; a standard-ALiBi head with its first zero beyond L was never "
        "blind inside its training window (a zero at distance 0 comes from content, not "
        "distance). "
        "Top-1 accuracy (correct/prompts, 95% Wilson interval) by the needle's distance to the "
        "end of the prompt, all lengths and depths pooled; chance is "
        f"{by_distance['chance'].mean():.2f} (1 of the candidates; no needle-free baseline was "
        "measured in this run).",
        "",
        markdown(shown.reset_index(), 3),
        "",
        "With the needle 1,024 tokens or more from the end (top-1, 95% Wilson interval, against "
        "the nominal chance rate: a one-sample reading, no baseline was measured): "
        + "; ".join(far_parts)
        + ".",
        "",
        "Variant against standard ALiBi of the same seed, on the same prompts (paired: top-1 "
        "prompts right only for the variant vs only for standard, exact McNemar p; "
        f"{len(DISTANCE_EDGES) - 1} bins and the needles {FAR:,} tokens or more away pooled, "
        "per task and variant, no multiplicity correction; one training seed per row, so the "
        "tests cover the sampling of prompts, not of training runs):",
        "",
        *(
            f"- {task}, {model} vs {minus}: "
            + "; ".join(
                f"{'pooled ' if r.pooled else ''}{r.distance_lo}-{r.distance_hi - 1} "
                f"{r.model_only} vs {r.standard_only} (p = {r.p:.2g})"
                for r in group.itertuples()
            )
            for (task, model, minus), group in pairs.groupby(["task", "model", "minus"], sort=False)
        ),
    ]


def blind_lengths(regime: pd.DataFrame, models: dict, train_ctx: int) -> list[int]:
    """The evaluated lengths beyond training at which at least half of every standard-ALiBi
    model's heads are blind within the distance (measured)."""
    standard = regime[regime["model"].map(lambda k: models[k]["variant"] == "standard")]
    half = standard["blind_heads"] * 2 >= standard["n_heads"]
    per_length = half.groupby(standard["context_length"]).all()
    return [int(n) for n, ok in per_length.items() if ok and n > train_ctx]


def regime_lines(
    regime: pd.DataFrame,
    blind: pd.DataFrame,
    losses: pd.DataFrame,
    long_diff: pd.DataFrame,
    lengths: list[int],
    args,
) -> list[str]:
    """The long-range section of the summary: where standard ALiBi's heads are blind, does the
    variant retrieve better there, and by how much."""
    lines = ["## Long prompts: lengths at which standard ALiBi's heads have exact zeros", ""]
    if long_diff.empty:
        lines += ["No evaluated length has half of standard ALiBi's heads blind.", ""]
    else:
        lines.append(
            f"At lengths {lengths} (at least half of each standard model's heads blind "
            "within the distance), top-1 accuracy averaged over lengths and depths, "
            "variant minus standard ALiBi of the same seed (95% paired bootstrap "
            "interval over prompts):"
        )
        lines.append("")
        for r in long_diff.itertuples():
            word = "better" if r.ci_low > 0 else "worse" if r.ci_high < 0 else "not distinguishable"
            lines.append(
                f"- {r.task}: {r.model} {r.accuracy:.2f} vs {r.minus} "
                f"{r.standard_accuracy:.2f}: {r.difference:+.2f} "
                f"[{r.ci_low:+.2f}, {r.ci_high:+.2f}], {word}"
            )
        lines += [
            "",
            "These averages mix near and far needles: the table of accuracy by needle distance "
            "above says which prompts carry the difference. Exact zeros in a head change no "
            "output (a row loses less than its length times the dtype's smallest weight: see "
            "`max_lost_weight` in blindness.csv), so heads 'blind' at a length are not a regime "
            "in which a head cannot see; what limits a head at distance is its linear penalty.",
            "",
        ]
    per_model = blind.groupby("model", sort=False)["first_zero_distance"]
    lines.append(
        "Measured float32 blindness on one sequence of "
        f"{args.blindness_length:,} tokens (first distance with an exact zero, per "
        "head): "
        + "; ".join(
            f"{k}: {int(v.notna().sum())} of {len(v)} heads blind, nearest at {v.min():,.0f} tokens"
            if v.notna().any()
            else f"{k}: no head blind"
            for k, v in per_model
        )
    )
    lines.append("")
    table = regime.pivot(index="context_length", columns="model")
    cols = []
    for label in regime["model"].unique():
        for task in TASKS:
            cols.append(
                (
                    f"{label} {task}",
                    [
                        f"{a:.2f} [{lo:.2f}, {hi:.2f}]"
                        for a, lo, hi in zip(
                            table[(task, label)],
                            table[(f"{task}_ci_low", label)],
                            table[(f"{task}_ci_high", label)],
                            strict=True,
                        )
                    ],
                )
            )
        cols.append(
            (
                f"{label} blind heads",
                [
                    f"{b} of {n}"
                    for b, n in zip(
                        table[("blind_heads", label)], table[("n_heads", label)], strict=True
                    )
                ],
            )
        )
    shown = pd.DataFrame(dict(cols), index=table.index).reset_index()
    lines += [
        "Top-1 accuracy by length (95% Wilson interval over prompts) and heads blind "
        "within that distance (measured, float32):",
        "",
        markdown(shown, 3),
        "",
    ]
    at_end = losses[losses["position_hi"] == losses["position_hi"].max()]
    lines.append(
        "Loss by token position (nats, the last bucket, positions "
        f"{int(at_end['position_lo'].iloc[0]):,}-{int(at_end['position_hi'].iloc[0]):,}"
        "): " + "; ".join(f"{r.model} {r.mean_nll:.2f} ± {r.ci95:.2f}" for r in at_end.itertuples())
    )
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


def _training_length(
    fig: go.Figure, train_ctx: int, low: float, high: float, row: int | None = None
) -> None:
    """A dashed vertical line at the training length, labelled at its foot (a trace: shapes
    misplace on log axes)."""
    fig.add_trace(
        go.Scatter(
            x=[train_ctx, train_ctx],
            y=[low, high],
            mode="lines+text",
            line={"dash": "dash", "color": "#888"},
            text=["training length" if row != 2 else "", ""],
            textposition="top right",
            showlegend=False,
            hoverinfo="skip",
        ),
        **({"row": row, "col": 1} if row else {}),
    )


def all_figures(
    curves: pd.DataFrame,
    ppl: pd.DataFrame,
    regime: pd.DataFrame,
    losses: pd.DataFrame,
    train_ctx: int,
) -> dict[str, go.Figure]:
    figures = {f"curves_{task}": curve_figure(curves, task, train_ctx) for task in TASKS}
    figures["perplexity"] = ppl_figure(ppl, train_ctx)
    figures["regime"] = regime_figure(regime, train_ctx)
    figures["loss_by_position"] = loss_figure(losses, train_ctx)
    return figures


def replot(out: Path, folders: dict[str, str]) -> None:
    """Redraw the PNGs of a finished run in ``out`` from its CSVs (the study takes ~90 min)."""
    train_ctx = model_info(hs.load_model(next(iter(folders.values())))).train_ctx
    frames = {
        n: pd.read_csv(out / f"{n}.csv")
        for n in ("curves", "perplexity", "regime", "loss_by_position")
    }
    figures = all_figures(*frames.values(), train_ctx)
    for name, fig in figures.items():
        save_figure(fig, out / f"{name}.png", scale=1.5)
    print(f"redrew {', '.join(figures)} in {out}")


def resummarize(args, folders: dict[str, str]) -> None:
    """Rewrite ``args.out`` from the CSVs of a finished run (the study takes ~90 min): every
    table kept, the figures redrawn, summary.md written anew by :func:`summary_lines`."""
    out = Path(args.out)
    old_summary = (out / "summary.md").read_text(encoding="utf-8").splitlines()
    tables = {f.name: pd.read_csv(f) for f in sorted(out.glob("*.csv"))}
    models = tables["models.csv"].set_index("model").to_dict("index")
    trials = {
        task: {label: tables[f"trials_{label}_{task}.csv"] for label in folders} for task in TASKS
    }
    train_ctx = model_info(hs.load_model(next(iter(folders.values())))).train_ctx
    by_distance = distance_table(trials)
    pairs = distance_pairs(trials, models)
    tables["by_distance.csv"], tables["distance_pairs.csv"] = by_distance, pairs
    frames = {n: tables[f"{n}.csv"] for n in ("curves", "perplexity", "regime", "loss_by_position")}
    figures = all_figures(*frames.values(), train_ctx)
    original = "The evaluation itself (the run these tables come from): "
    run_time = [line.removeprefix(original) for line in old_summary if line.startswith(original)]
    run_time = run_time or [line for line in old_summary if line.startswith("Run time:")]
    summary = summary_lines(
        models,
        train_ctx,
        args,
        tables["differences.csv"],
        by_distance,
        pairs,
        tables["regime.csv"],
        tables["blindness.csv"],
        tables["loss_by_position.csv"],
        tables["long_range_differences.csv"],
        tables["table.csv"],
    )
    summary += ["", original + run_time[0]]
    summary += ["This summary was rewritten from that run's CSVs (`--resummarize`)."]
    write_topic(out, figures, tables, summary, start(args), scope=SCOPE)


def curve_figure(curves: pd.DataFrame, task: str, train_ctx: int) -> go.Figure:
    fig = go.Figure()
    colours = dict(zip(curves["model"].unique(), COLOURS, strict=False))
    for (label, metric), frame in curves[curves["task"] == task].groupby(["model", "metric"]):
        fig.add_trace(
            go.Scatter(
                x=frame["context_length"],
                y=frame["accuracy"],
                mode="lines+markers",
                name=f"{label}, {metric.removesuffix('_correct')}",
                line={
                    "color": colours[label],
                    "dash": "solid" if metric == "top1_correct" else "dot",
                },
            )
        )
    _training_length(fig, train_ctx, 0, 1)
    fig.add_hline(y=0.1, line_dash="dot", annotation_text="top-1 chance")
    fig.update_xaxes(type="log", title="context length (tokens)")
    fig.update_yaxes(title="accuracy", range=[0, 1.02])
    style(
        fig,
        f"{task}: accuracy by context length",
        "models trained with each ALiBi variant; beyond the dashed line is out of context",
        760,
        460,
    )
    return fig


def regime_figure(regime: pd.DataFrame, train_ctx: int) -> go.Figure:
    """Top-1 accuracy by length (top) above the heads blind within that distance (bottom).

    One colour per model; passkey solid, needle dotted.
    """
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.06
    )
    models = regime.groupby("model", sort=False)
    for i, ((label, frame), colour) in enumerate(zip(models, COLOURS, strict=False)):
        for task in TASKS:
            fig.add_trace(
                go.Scatter(
                    x=frame["context_length"],
                    y=frame[task],
                    mode="lines+markers",
                    name=f"{label}, {task}",
                    legendgroup=label,
                    line={"color": colour, "dash": "solid" if task == "passkey" else "dot"},
                    error_y={
                        "type": "data",
                        "symmetric": False,
                        "array": frame[f"{task}_ci_high"] - frame[task],
                        "arrayminus": frame[task] - frame[f"{task}_ci_low"],
                    },
                ),
                row=1,
                col=1,
            )
        fig.add_trace(
            go.Scatter(
                x=frame["context_length"],
                y=frame["blind_heads"],
                mode="lines+markers",
                name=f"{label}, blind heads",
                legendgroup=label,
                # Widest first, so a model whose count equals an earlier one's still shows beneath.
                line={"color": colour, "dash": "dash", "width": 2 + 2 * (len(models) - 1 - i)},
                marker={"symbol": "square"},
            ),
            row=2,
            col=1,
        )
    _training_length(fig, train_ctx, 0, 1.05, row=1)
    _training_length(fig, train_ctx, 0, regime["n_heads"].max(), row=2)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_xaxes(type="log", title="context length (tokens)", row=2, col=1)
    fig.update_yaxes(title="top-1 accuracy", range=[0, 1.08], row=1, col=1)
    fig.update_yaxes(title="heads blind (float32)", row=2, col=1)
    style(
        fig,
        "Retrieval by length beside measured blindness",
        "dashed grey: training length; blind heads: first exact zero in float32 within the length",
        860,
        680,
    )
    return fig


def loss_figure(losses: pd.DataFrame, train_ctx: int) -> go.Figure:
    """Mean next-token loss by token position, one long pass per sequence."""
    fig = go.Figure()
    for (label, frame), colour in zip(losses.groupby("model", sort=False), COLOURS, strict=False):
        centre = np.sqrt(frame["position_lo"].clip(lower=1) * frame["position_hi"])
        fig.add_trace(
            go.Scatter(
                x=centre,
                y=frame["mean_nll"],
                mode="lines+markers",
                name=label,
                line={"color": colour},
                error_y={"type": "data", "array": frame["ci95"]},
            )
        )
    low, high = losses["mean_nll"] - losses["ci95"], losses["mean_nll"] + losses["ci95"]
    _training_length(fig, train_ctx, low.min(), high.max())
    fig.update_xaxes(type="log", title="token position")
    fig.update_yaxes(title="mean next-token loss (nats)")
    style(
        fig, "Loss by token position", "bundled held-out corpora, one pass per sequence", 760, 460
    )
    return fig


def ppl_figure(ppl: pd.DataFrame, train_ctx: int) -> go.Figure:
    fig = go.Figure()
    for (label, frame), colour in zip(ppl.groupby("model", sort=False), COLOURS, strict=False):
        fig.add_trace(
            go.Scatter(
                x=frame["window"],
                y=frame["perplexity"],
                mode="lines+markers",
                name=label,
                line={"color": colour},
            )
        )
    _training_length(fig, train_ctx, ppl["perplexity"].min(), ppl["perplexity"].max())
    fig.update_xaxes(type="log", title="window (tokens)")
    fig.update_yaxes(type="log", title="held-out perplexity")
    style(fig, "Perplexity by window length", "bundled held-out corpora, 32 windows each", 760, 460)
    return fig


if __name__ == "__main__":
    main()
