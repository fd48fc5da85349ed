"""Retrieval by the needle's distance to the question, beside a chance baseline: how far back do
the Table 3 models retrieve, and from which distance on are they no better than without the needle?

ALiBi's penalty depends on how far a key lies from the query, not on how long the prompt is, so
the passkey and needle-in-a-haystack tasks are scored by the needle's distance to the question
(:func:`headsurgeon.retrieval_by_distance`): per distance bin (default ``[0, 16)`` to
``[4096, 8192)``, doubling) ``--trials`` prompts, each just as long as its distance needs, and
each scored twice against the same candidates: with the needle and with the needle deleted (the
chance baseline: what the model guesses without the information). Accuracy is top-1 of 10
candidates (log-likelihood rank) and greedy exact match, each with its 95% Wilson interval over
prompts. The same prompts for every model (one seed, one tokenizer).

Beside the curves, every head's first exact zero and reach (from ``analyses/table3_regimes.py``'s
``heads.csv``; first zeros of the L = 128 models measured on one 32,768-token sequence
by ``analyses/mitigation_training.py``: its ``blindness.csv``) on the same distance axis, and
each model's training length from its ``headsurgeon.json``.

Writes ``by_distance.csv`` (per model, task and bin: accuracy, baseline, intervals, n),
``where.csv`` (per model, task and metric: up to where accuracy is above the baseline, from
where it is not), ``models.csv``, ``heads.csv``, ``trials_<model>_<task>.csv``, PNG figures
and ``summary.md``. Each (model, task)'s trials are also written to ``--cache`` as soon as they
are scored; ``--replot`` rebuilds everything from there without scoring.

    python analyses/retrieval_distance.py \\
        --model standard=analyses/mitigation_models/standard \\
        --model log=analyses/mitigation_models/log
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
    DISTANCE_EDGES,
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


def main() -> None:
    p = parser(__doc__, "retrieval_distance")
    p.add_argument(
        "--model",
        action="append",
        required=True,
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
    p.add_argument("--note", default="", help="a line for the summary (e.g. what was cut)")
    args = p.parse_args()
    folders = dict(spec.split("=", 1) for spec in args.model)
    started = start(args)
    args.cache.mkdir(parents=True, exist_ok=True)

    models, trials, seconds = {}, {}, {}
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
                seconds[label, task] = float((args.cache / f"{label}_{task}.seconds").read_text())
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
            seconds[label, task] = time.perf_counter() - begin
            trials[label, task] = result.trials
            result.trials.to_csv(path, index=False)
            (args.cache / f"{label}_{task}.seconds").write_text(f"{seconds[label, task]:.1f}\n")
            logger.warning(
                "%s %s: %.0f s; %s", label, task, seconds[label, task], where_line(result.summary)
            )

    tables, where = [], []
    for (label, task), frame in trials.items():
        train_ctx = models[label]["train_ctx"]
        table = distance_table(frame, train_ctx)
        head = {"model": label, "task": task}
        tables.append(table.assign(**head, train_ctx=train_ctx))
        where.append(distance_summary(table).assign(**head))
    by_distance = pd.concat(tables, ignore_index=True)
    where = pd.concat(where, ignore_index=True)
    heads = first_zeros(args.blindness, list(folders), args.regimes)
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
        "models.csv": pd.DataFrame(models).T.rename_axis("model").reset_index(),
        "heads.csv": heads,
        **{f"trials_{label}_{task}.csv": frame for (label, task), frame in trials.items()},
    }
    summary = summary_lines(by_distance, where, models, heads, seconds, args)
    write_topic(args.out, figures, out_tables, summary, started)


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


def bins_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per bin of one model and task: each metric and its baseline with intervals, as text."""
    out = pd.DataFrame(
        {
            "distance": [
                f"{lo}-{hi - 1}"
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
    return out


def model_lines(label: str, model: dict, where: pd.DataFrame, heads: pd.DataFrame) -> list[str]:
    """Per model: training length, where each task falls to the baseline, its heads' zeros."""
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
        f"Trained at L = {model['train_ctx']} tokens ({model['variant']} ALiBi, seed "
        f"{model['seed']}); {zeros}."
    )
    lines.append("")
    length = model["train_ctx"]
    for r in where[where["model"] == label].itertuples():
        above = (
            f"above the baseline up to {r.above_up_to:.0f} tokens ({r.above_up_to / length:.3g} L)"
            if pd.notna(r.above_up_to)
            else "above the baseline in no bin"
        )
        at = (
            f"from {r.at_baseline_from:.0f} tokens ({r.at_baseline_from / length:.3g} L) on no "
            "bin is above it; in the first, "
            f"{interval(r.accuracy, r.accuracy_low, r.accuracy_high)} with the needle against "
            f"{interval(r.baseline, r.baseline_low, r.baseline_high)} without (n = {r.n_trials})"
            if pd.notna(r.at_baseline_from)
            else "still above the baseline in the farthest bin"
        )
        lines.append(f"- {r.task}, {METRICS[r.metric]}: {above}; {at}.")
    return lines


def summary_lines(
    by_distance: pd.DataFrame,
    where: pd.DataFrame,
    models: dict,
    heads: pd.DataFrame,
    seconds: dict,
    args,
) -> list[str]:
    folders = ", ".join(f"{k} ({m['folder']})" for k, m in models.items())
    lines = [
        "# Retrieval by needle distance, with a chance baseline",
        "",
        f"Models: {folders}. "
        f"Distance bins {args.distances} (tokens), {args.trials} prompts per bin and task, "
        f"seed {args.seed}, the same prompts for every model. {args.note}".rstrip(),
        "",
        "## What the numbers test, and what they do not",
        "",
        "- **Distance**: the number of haystack tokens strictly between the needle's last token "
        "and the question's first, drawn uniformly within the bin; the answer is predicted a "
        "question's length (about 10 tokens) further on. Each prompt is the task's intro, "
        f"{args.n_before} haystack tokens, the needle, the distance, the question: no longer than "
        "the distance needs.",
        "- **Baseline**: the same prompt with the needle's tokens deleted, the same 10 "
        "candidates, the same scoring: what the model guesses without the information (it need "
        "not be 1/10: a model may prefer some keys). Accuracy above it is retrieval of the "
        "needle.",
        "- **Above / at the baseline**: above when the accuracy's 95% Wilson interval lies wholly "
        "above the baseline's (conservative); at the baseline means not distinguishable with "
        f"{args.trials} prompts, not equal. The intervals cover prompt sampling, not training "
        "seeds (one model per variant here).",
        "- **Training length**: distances beyond L - (the fixed parts) put the prompt out of "
        "context; the model never saw a needle that far back in training. A bin is in context "
        "when its longest prompt is at most L tokens.",
        "- **Heads**: the first exact zero says where a head's weights underflow in float32, not "
        "whether the model uses that head to retrieve; the figures set both on one axis and do "
        "not show that one causes the other.",
        "",
        "## Where accuracy falls to the baseline",
        "",
    ]
    for label, model in models.items():
        lines += [*model_lines(label, model, where, heads), ""]
    for (label, task), group in by_distance.groupby(["model", "task"], sort=False):
        lines += [f"## {label}, {task}", "", markdown(bins_table(group), 3), ""]
    if seconds:
        cost = "; ".join(f"{k[0]} {k[1]} {v / 60:.1f} min" for k, v in seconds.items())
        lines += [f"Scoring time per model and task (one CPU thread, shared cores): {cost}."]
    return lines


if __name__ == "__main__":
    main()
