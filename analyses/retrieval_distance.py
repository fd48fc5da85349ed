"""Retrieval by the needle's distance to the question, beside a chance baseline: how far back do
the Table 3 models retrieve, and from which distance on are they no better than without the needle?

ALiBi's penalty depends on how far a key lies from the query, not on how long the prompt is, so
the passkey and needle-in-a-haystack tasks are scored by the needle's distance to the question
(:func:`headsurgeon.retrieval_by_distance`): per distance bin (default ``[0, 16)`` to
``[4096, 8192)``, doubling) ``--trials`` prompts, each just as long as its distance needs, and
each scored twice against the same candidates: with the needle and with the needle deleted (the
chance baseline: what the model guesses without the information). Accuracy is top-1 of 10
candidates (log-likelihood rank) and greedy exact match, each with its 95% Wilson interval over
prompts. The same prompts for every model (one seed, one tokenizer), so the data are paired
twice: each prompt with and without its needle (a bin is above its baseline when the exact
McNemar test of its discordant prompts gives p < 0.05 and the needle's accuracy is the higher),
and two models on the same prompts (``headsurgeon.evals.compare_retrieval``: every model
against the standard-ALiBi model of its training length, per bin and pooled from
``--pool-from`` tokens).

Beside the curves, every head's first exact zero and reach (from ``analyses/table3_regimes.py``'s
``heads.csv``; first zeros of the L = 128 models measured on one 32,768-token sequence
by ``analyses/mitigation_training.py``: its ``blindness.csv``) on the same distance axis, and
each model's training length from its ``headsurgeon.json``.

Writes ``by_distance.csv`` (per model, task and bin: accuracy, baseline, intervals, n, the
discordant prompts and McNemar p), ``where.csv`` (per model, task and metric: the bins tested
and above the baseline, up to where, from where not), ``paired.csv`` (model against model on
the same prompts), ``models.csv`` (with each task's scoring minutes), ``heads.csv``,
``trials_<model>_<task>.csv``, PNG figures and ``summary.md``. Each (model, task)'s trials are
also written to ``--cache`` as soon as they are scored; ``--replot`` rebuilds everything from
there without scoring; ``--summarise FOLDER`` rebuilds everything from a finished output folder
(its ``trials_*.csv`` and ``models.csv``, e.g. the committed ``figures/retrieval_distance``)
without loading a model.

    python analyses/retrieval_distance.py \\
        --model standard=analyses/mitigation_models/standard \\
        --model log=analyses/mitigation_models/log
    python analyses/retrieval_distance.py --summarise figures/retrieval_distance --note "..."
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from _common import FIGURES, ROOT, markdown, parser, start, write_topic

import headsurgeon as hs
from headsurgeon.evals import (
    ALPHA,
    DISTANCE_EDGES,
    compare_retrieval,
    distance_summary,
    distance_table,
    retrieval_by_distance,
)
from headsurgeon.exact_alibi import trained_bias
from headsurgeon.loading import model_info
from headsurgeon.plots.evaluation import retrieval_distance_plot

TASKS = ("passkey", "needle")
METRICS = {"top1_accuracy": "top-1 of 10", "greedy_accuracy": "greedy exact match"}
logger = logging.getLogger("retrieval_distance")


# What the summary's numbers test and what they do not (its opening section).
SCOPE = (
    (
        "whether organisms trained at L = 128 and L = 512 (standard, log and log-match ALiBi; one "
        "training seed each) retrieve a passkey (and, for standard at L = 128, a needle) by the "
        "needle's distance to the question, against the same prompt without the needle, tested "
        "per bin on the paired prompts (exact McNemar), and models against each other on the "
        "same prompts."
    ),
    (
        "the spread over training seeds (one model per variant), tasks other than these, or models "
        "of real size; 'above the baseline' is p < 0.05 in each of 10 bins without correction "
        "(the Holm-corrected count is beside it), and the pooled range from 1,024 tokens was "
        "chosen after seeing the bins."
    ),
)


def main() -> None:
    p = parser(__doc__, "retrieval_distance")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="LABEL=FOLDER (repeat; the training length comes from headsurgeon.json)",
    )
    p.add_argument("--distances", type=int, nargs="+", default=list(DISTANCE_EDGES))
    p.add_argument("--trials", type=int, default=40, help="prompts per distance bin")
    p.add_argument("--n-before", type=int, default=32, help="haystack tokens before the needle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument(
        "--blindness",
        type=Path,
        default=FIGURES / "mitigation_training" / "blindness.csv",
        help="per-head first exact zeros (layer, head, dtype, first_zero_distance, model)",
    )
    p.add_argument(
        "--regimes",
        type=Path,
        default=FIGURES / "table3_regimes" / "heads.csv",
        help="heads.csv of analyses/table3_regimes.py: each head's reach (drawn beside its zero)",
    )
    p.add_argument(
        "--cache", type=Path, default=ROOT / "runs" / "retrieval_distance", help="trials as scored"
    )
    p.add_argument("--replot", action="store_true", help="rebuild the outputs from --cache")
    p.add_argument(
        "--summarise",
        type=Path,
        help="rebuild the outputs from this folder's trials_*.csv and models.csv (no model, no "
        "scoring; the distances and trials come from the CSVs)",
    )
    p.add_argument(
        "--pool-from",
        type=int,
        default=1024,
        help="model against model: also pooled over the needles this many tokens away or more",
    )
    p.add_argument("--note", default="", help="a line for the summary (e.g. what was cut)")
    args = p.parse_args()
    if not args.model and args.summarise is None:
        p.error("give --model LABEL=FOLDER (repeat) or --summarise FOLDER")
    started = start(args)
    if args.summarise is not None:
        models, trials = read_outputs(args.summarise)
        args.trials = int(next(iter(trials.values())).groupby("distance_lo").size().max())
        every = pd.concat(trials.values())
        args.distances = sorted({*map(int, every["distance_lo"]), int(every["distance_hi"].max())})
        args.tasks = [t for t in TASKS if any(task == t for _, task in trials)]
    else:
        models, trials = score(args)
    write_outputs(args, models, trials, started)


def read_outputs(folder: Path) -> tuple[dict, dict]:
    """The models and trials of a finished output folder, as :func:`score` returns them."""
    table = pd.read_csv(folder / "models.csv")
    models = {r.pop("model"): r for r in table.to_dict("records")}
    trials = {}
    for label in models:
        for task in TASKS:
            path = folder / f"trials_{label}_{task}.csv"
            if path.exists():
                trials[label, task] = pd.read_csv(path)
    if not trials:
        raise SystemExit(f"error: no trials_<model>_<task>.csv in {folder}")
    return models, trials


def score(args) -> tuple[dict, dict]:
    """Load and score each model (or read its trials from ``--cache`` with ``--replot``)."""
    folders = dict(spec.split("=", 1) for spec in args.model)
    args.cache.mkdir(parents=True, exist_ok=True)
    models, trials = {}, {}
    for label, folder in folders.items():
        model = hs.load_model(folder)
        info = model_info(model)
        models[label] = {
            "folder": folder,
            "name": info.name,
            "variant": trained_bias(info.metadata)[0],
            "seed": info.metadata["training"]["seed"],
            "train_ctx": info.train_ctx,
        }
        for task in args.tasks:
            path = args.cache / f"{label}_{task}.csv"
            if args.replot and not path.exists():
                logger.warning("%s %s: not scored (no %s); left out", label, task, path)
                continue
            if args.replot:
                trials[label, task] = pd.read_csv(path)
                seconds = float((args.cache / f"{label}_{task}.seconds").read_text())
                models[label][f"{task}_minutes"] = round(seconds / 60, 1)
                continue
            begin = time.perf_counter()
            result = retrieval_by_distance(
                model,
                task,
                distances=args.distances,
                n_trials=args.trials,
                seed=args.seed,
                n_before=args.n_before,
            )
            seconds = time.perf_counter() - begin
            models[label][f"{task}_minutes"] = round(seconds / 60, 1)
            trials[label, task] = result.trials
            result.trials.to_csv(path, index=False)
            (args.cache / f"{label}_{task}.seconds").write_text(f"{seconds:.1f}\n")
            logger.warning("%s %s: %.0f s; %s", label, task, seconds, where_line(result.summary))
    return models, trials


def write_outputs(args, models: dict, trials: dict, started: float) -> None:
    """Every table, figure and the summary, from the models and their trials."""
    tables, where = [], []
    for (label, task), frame in trials.items():
        train_ctx = models[label]["train_ctx"]
        table = distance_table(frame, train_ctx)
        head = {"model": label, "task": task}
        tables.append(table.assign(**head, train_ctx=train_ctx))
        where.append(distance_summary(table).assign(**head))
    by_distance = pd.concat(tables, ignore_index=True)
    where = pd.concat(where, ignore_index=True)
    paired = pairs(models, trials, args.pool_from)
    heads = first_zeros(args.blindness, list(models), args.regimes)
    figures = {
        f"{metric.removesuffix('_accuracy')}_{task}": distance_figure(
            by_distance[by_distance["task"] == task], heads, metric, task
        )
        for task in args.tasks
        for metric in METRICS
    }
    out_tables = {
        "by_distance.csv": by_distance,
        "where.csv": where,
        "paired.csv": paired,
        "models.csv": pd.DataFrame(models).T.rename_axis("model").reset_index(),
        "heads.csv": heads,
        **{f"trials_{label}_{task}.csv": frame for (label, task), frame in trials.items()},
    }
    summary = summary_lines(by_distance, where, paired, models, heads, args)
    write_topic(args.out, figures, out_tables, summary, started, scope=SCOPE)


def pairs(models: dict, trials: dict, pool_from: int) -> pd.DataFrame:
    """Every model against the standard-ALiBi model of its training length, per task, on the
    same prompts (:func:`headsurgeon.evals.compare_retrieval`, pooled from ``pool_from``)."""
    out = []
    for (label, task), frame in trials.items():
        model = models[label]
        standard = [
            other
            for other, m in models.items()
            if m["variant"] == "standard" and m["train_ctx"] == model["train_ctx"]
        ]
        if model["variant"] == "standard" or not standard or (standard[0], task) not in trials:
            continue
        compared = compare_retrieval(frame, trials[standard[0], task], from_distance=pool_from)
        out.append(compared.assign(model_a=label, model_b=standard[0], task=task))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def where_line(summary: pd.DataFrame) -> str:
    """One log line: per metric, from which distance the accuracy is at the baseline."""
    return "; ".join(
        f"{r.metric} at baseline from {r.at_baseline_from}" for r in summary.itertuples()
    )


def first_zeros(path: Path, labels: list[str], regimes: Path | None = None) -> pd.DataFrame:
    """Each model's heads with their float32 first exact zero, from a ``blindness.csv``, and
    their reach (and first zero, for models the blindness table lacks) from the ``heads.csv`` of
    ``analyses/table3_regimes.py`` when ``regimes`` exists."""
    columns = ["model", "layer", "head", "first_zero_distance"]
    heads = pd.DataFrame(columns=columns)
    if path.exists():
        blind = pd.read_csv(path)
        blind = blind[(blind["dtype"] == "float32") & blind["model"].isin(labels)]
        heads = blind[columns].reset_index(drop=True)
    if regimes is not None and regimes.exists():
        measured = pd.read_csv(regimes)
        measured = measured[measured["model"].isin(labels)].rename(
            columns={"first_zero_distance_float32": "first_zero_distance"}
        )
        keys = ["model", "layer", "head"]
        missing = measured[~measured["model"].isin(heads["model"])][columns]
        heads = pd.concat([heads, missing], ignore_index=True)
        heads = heads.merge(measured[[*keys, "reach"]], on=keys, how="left")
    if heads.empty:
        logger.warning("no %s: the figures show no heads", path)
    return heads


def distance_figure(table: pd.DataFrame, heads: pd.DataFrame, metric: str, task: str) -> go.Figure:
    title = f"{task}: {METRICS[metric]} by needle distance"
    return retrieval_distance_plot(
        table.drop(columns="task"), heads if len(heads) else None, metric=metric, title=title
    )


def interval(value: float, low: float, high: float) -> str:
    return f"{value:.2f} [{low:.2f}, {high:.2f}]"


def fmt_p(p: float) -> str:
    """A p-value in two significant figures (``0.012``), tiny ones in powers of ten."""
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def bin_name(lo: int, hi: int) -> str:
    return f"{lo:,}-{hi - 1:,}"


def paired(b: int, c: int, p: float) -> str:
    """Discordant prompts and their McNemar p: ``10 vs 1, p = 0.012``."""
    return f"{b} vs {c}, p = {fmt_p(p)}"


def bins_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per bin of one model and task: each metric and its baseline with intervals, and the
    paired test of the two (prompts right only with the needle vs only without, McNemar p)."""
    out = pd.DataFrame(
        {
            "distance": [
                bin_name(lo, hi)
                for lo, hi in zip(table["distance_lo"], table["distance_hi"], strict=True)
            ],
            "n": table["n_trials"],
            "longest prompt": table["max_length"],
            "in context": table["in_context"].map({True: "yes", False: "no"}),
        }
    )
    for metric, name in METRICS.items():
        for prefix, what in (("", name), ("baseline_", f"{name}, no needle")):
            out[what] = [
                interval(*r)
                for r in table[
                    [f"{prefix}{metric}", f"{prefix}{metric}_low", f"{prefix}{metric}_high"]
                ].itertuples(index=False)
            ]
        out[f"{name}: needle only vs baseline only"] = [
            paired(*r)
            for r in table[
                [f"{metric}_needle_only", f"{metric}_baseline_only", f"{metric}_p"]
            ].itertuples(index=False)
        ]
    return out


def above_bins(table: pd.DataFrame, metric: str) -> list[str]:
    """The bins of one model, task and metric above the baseline (paired p < ALPHA, the
    needle's accuracy higher), each with its discordant prompts and p."""
    above = table[(table[f"{metric}_p"] < ALPHA) & (table[metric] > table[f"baseline_{metric}"])]
    return [
        f"{bin_name(r.distance_lo, r.distance_hi)} "
        f"({paired(r[f'{metric}_needle_only'], r[f'{metric}_baseline_only'], r[f'{metric}_p'])})"
        for _, r in above.iterrows()
    ]


def model_lines(
    label: str, model: dict, where: pd.DataFrame, by_distance: pd.DataFrame, heads: pd.DataFrame
) -> list[str]:
    """Per model: training length, the bins above the baseline per task and metric, where
    accuracy falls to it, its heads' zeros."""
    lines = [f"### {label}", ""]
    own = heads[heads["model"] == label]["first_zero_distance"].dropna()
    zeros = (
        f"first exact zero (float32) of its heads: nearest {own.min():.0f}, median "
        f"{own.median():.0f} tokens ({len(own)} of "
        f"{int((heads['model'] == label).sum())} heads have one within the measured length: "
        "32,768 tokens for the L = 128 models (analyses/mitigation_training.py), 4,096 for "
        "the others (analyses/table3_regimes.py))"
        if len(own)
        else "no head has an exact zero within the measured length"
    )
    lines.append(
        f"Trained at L = {model['train_ctx']} tokens ({model['variant']} ALiBi, one model: "
        f"training seed {model['seed']}); {zeros}."
    )
    lines.append("")
    length = model["train_ctx"]
    for r in where[where["model"] == label].itertuples():
        table = by_distance[(by_distance["model"] == label) & (by_distance["task"] == r.task)]
        bins = above_bins(table, r.metric)
        above = (
            f"above its baseline in {r.n_above} of {r.n_bins} bins tested ({r.n_above_holm} "
            f"after Holm's correction over the {r.n_bins}): {'; '.join(bins)}; the farthest "
            f"ends at {r.above_up_to:,.0f} tokens ({r.above_up_to / length:.3g} L)"
            if r.n_above
            else f"above its baseline in none of {r.n_bins} bins tested"
        )
        at = (
            f"from {r.at_baseline_from:,.0f} tokens ({r.at_baseline_from / length:.3g} L) on no "
            f"bin is above it; in the first, {r.accuracy:.2f} with the needle against "
            f"{r.baseline:.2f} without ({paired(r.needle_only, r.baseline_only, r.p)}; "
            f"n = {r.n_trials})"
            if pd.notna(r.at_baseline_from)
            else "still above it in the farthest bin"
        )
        lines.append(f"- {r.task}, {METRICS[r.metric]}: {above}; {at}.")
    return lines


def pair_lines(paired_table: pd.DataFrame, pool_from: int) -> list[str]:
    """Model against model on the same prompts: the pooled test and the bins where p < ALPHA."""
    lines = []
    for (a, b, task), group in paired_table.groupby(["model_a", "model_b", "task"], sort=False):
        for metric, name in METRICS.items():
            pooled = group[group["pooled"]].iloc[0]
            test = paired(
                pooled[f"{metric}_a_only"], pooled[f"{metric}_b_only"], pooled[f"{metric}_p"]
            )
            bins = group[~group["pooled"] & (group[f"{metric}_p"] < ALPHA)]
            each = "; ".join(
                f"{bin_name(r.distance_lo, r.distance_hi)} "
                f"({paired(r[f'{metric}_a_only'], r[f'{metric}_b_only'], r[f'{metric}_p'])})"
                for _, r in bins.iterrows()
            )
            lines.append(
                f"- {a} vs {b}, {task}, {name}: pooled over needles {pool_from:,} tokens or more "
                f"away ({int(pooled['n_trials'])} prompts), {pooled[f'a_{metric}']:.2f} against "
                f"{pooled[f'b_{metric}']:.2f}: right only for {a} vs only for {b}: {test}. "
                f"Bins with p < {ALPHA} ({len(group) - 1} tested): {each or 'none'}."
            )
    return lines


def summary_lines(
    by_distance: pd.DataFrame,
    where: pd.DataFrame,
    paired_table: pd.DataFrame,
    models: dict,
    heads: pd.DataFrame,
    args,
) -> list[str]:
    folders = ", ".join(f"{k} ({m['folder']})" for k, m in models.items())
    scored = ", ".join(f"{label} {task}" for label, task in by_distance.groupby(
        ["model", "task"], sort=False).groups)  # fmt: skip
    n_bins = len(args.distances) - 1
    seeds = ", ".join(sorted({str(m["seed"]) for m in models.values()}))
    lines = [
        "# Retrieval by needle distance, with a chance baseline",
        "",
        f"Models: {folders}. "
        f"Distance bins {args.distances} (tokens), {args.trials} prompts per bin and task, "
        f"seed {args.seed}, the same prompts for every model. {args.note}".rstrip(),
        "",
        "## What the numbers test, and what they do not",
        "",
        f"- **What is scored**: {scored} ({n_bins} bins of {args.trials} prompts each). One "
        f"trained model per variant and training length (training seed {seeds}): differences "
        "between models are differences between single training runs, and the tests below "
        "cover the sampling of prompts, not of training seeds.",
        "- **Metrics**: top-1 of 10 candidates (the true key's log-likelihood ranks first "
        "among 10 keys; chance 1/10) and greedy exact match (every token of the key is the "
        "argmax).",
        "- **Distance**: the number of haystack tokens strictly between the needle's last token "
        "and the question's first, drawn uniformly within the bin; the answer is predicted a "
        "question's length (about 10 tokens) further on. Each prompt is the task's intro, "
        f"{args.n_before} haystack tokens, the needle, the distance, the question: no longer than "
        "the distance needs.",
        "- **Baseline**: the same prompt with the needle's tokens deleted, the same 10 "
        "candidates, the same scoring: what the model guesses without the information (it need "
        "not be 1/10: a model may prefer some keys). Accuracy above it is retrieval of the "
        "needle.",
        "- **Above / at the baseline (paired)**: each prompt is scored with and without its "
        "needle, so a bin is tested on its discordant prompts (right only with the needle vs "
        "right only without) by the exact two-sided McNemar test (binomial(b + c, 1/2)); a bin "
        f"is above its baseline when p < {ALPHA} and the needle's accuracy is the higher. "
        f"{n_bins} bins are tested per model, task and metric, with no multiplicity correction "
        f"(about {ALPHA * n_bins:.1f} false calls per {n_bins} bins if none retrieved); the "
        "count that survives Holm's correction over the bins is given beside it. At the "
        f"baseline means not distinguishable with {args.trials} prompts, not equal. The Wilson "
        "intervals in the tables describe each side alone; two overlapping intervals do not "
        "say the two sides are equal (the pairs carry more information).",
        "- **Model against model**: every model is compared with the standard-ALiBi model of "
        "its training length on the same prompts, by the same test on the prompts only one of "
        f"them gets right, per bin and pooled over the needles {args.pool_from:,} tokens or "
        "more away (`--pool-from`; a range picked after seeing the per-bin results makes its "
        "p optimistic).",
        "- **Training length**: distances beyond L - (the fixed parts) put the prompt out of "
        "context; the model never saw a needle that far back in training. A bin is in context "
        "when its longest prompt is at most L tokens.",
        "- **Heads**: the first exact zero says where a head's weights underflow in float32, not "
        "whether the model uses that head to retrieve; the figures set both on one axis and do "
        "not show that one causes the other.",
        "",
        "## Where accuracy is above its baseline (paired)",
        "",
    ]
    for label, model in models.items():
        lines += [*model_lines(label, model, where, by_distance, heads), ""]
    if len(paired_table):
        lines += [
            "## Model against model, on the same prompts",
            "",
            *pair_lines(paired_table, args.pool_from),
            "",
        ]
    for (label, task), group in by_distance.groupby(["model", "task"], sort=False):
        lines += [f"## {label}, {task}", "", markdown(bins_table(group), 3), ""]
    cost = "; ".join(
        f"{label} {task} {model[f'{task}_minutes']:.1f} min"
        for label, model in models.items()
        for task in TASKS
        if pd.notna(model.get(f"{task}_minutes", float("nan")))
    )
    if cost:
        lines += [f"Scoring time per model and task (one CPU thread, shared cores): {cost}."]
    return lines


if __name__ == "__main__":
    main()
