"""The statistics of retrieval by distance: per bin, accuracy with and without the needle, their
Wilson intervals and the paired test of the two; where accuracy falls to the baseline; two
models compared prompt by prompt. From :func:`headsurgeon.evals.retrieval_by_distance`'s trials.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from headsurgeon.errors import InvalidArgumentError
from headsurgeon.stats import discordant, holm, mcnemar_p
from headsurgeon.validation import check_int, check_number

__all__ = [
    "ALPHA",
    "METRICS",
    "compare_retrieval",
    "distance_summary",
    "distance_table",
    "wilson_interval",
]

METRICS = ("greedy_accuracy", "top1_accuracy")
# The level of the paired tests: a bin is above its baseline when its McNemar p is below it.
ALPHA = 0.05


def wilson_interval(k: int | np.ndarray, n: int | np.ndarray, z: float = 1.96) -> tuple:
    """The Wilson score interval ``(low, high)`` of a proportion of ``k`` successes in ``n``
    (elementwise for arrays): the 95% interval of an accuracy over ``n`` independent prompts.

    >>> [round(float(x), 3) for x in wilson_interval(15, 15)]
    [0.796, 1.0]
    >>> [round(float(x), 3) for x in wilson_interval(0, 40)]
    [0.0, 0.088]
    """
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    p, z2 = k / n, z * z
    centre = p + z2 / (2 * n)
    half = z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # Clipped: rounding would otherwise give -0.0 at k = 0 and 1.0000000000000002 at k = n.
    low = np.clip((centre - half) / (1 + z2 / n), 0.0, 1.0)
    high = np.clip((centre + half) / (1 + z2 / n), 0.0, 1.0)
    return (float(low), float(high)) if low.ndim == 0 else (low, high)


def distance_table(trials: pd.DataFrame, train_ctx: int) -> pd.DataFrame:
    """:func:`retrieval_by_distance`'s table from its trials (e.g. read back from a CSV): per
    bin, each metric with and without the needle, with Wilson intervals (a description of each
    side), and the paired test of the two: the discordant prompts and their exact McNemar p,
    raw and Holm-adjusted over the bins; ``in_context`` when every prompt of the bin is at most
    ``train_ctx`` tokens long.

    >>> trials = pd.DataFrame({"distance_lo": 0, "distance_hi": 16, "trial": range(11),
    ...     "distance": 8, "prompt_length": 60, "n_candidates": 10, "rank": 1,
    ...     "baseline_rank": [1] + [2] * 10, "greedy_correct": True,
    ...     "baseline_greedy_correct": [True] * 10 + [False]})
    >>> trials["top1_correct"] = trials["rank"] == 1
    >>> trials["baseline_top1_correct"] = trials["baseline_rank"] == 1
    >>> t = distance_table(trials, 128).iloc[0]  # 10 vs 0 discordant prompts: p = 2 / 2**10
    >>> [t.top1_accuracy_needle_only, t.top1_accuracy_baseline_only, t.top1_accuracy_p]
    [np.int64(10), np.int64(0), np.float64(0.001953125)]
    """
    groups = trials.groupby(["distance_lo", "distance_hi"], sort=True)
    table = groups.agg(
        n_trials=("trial", "size"),
        mean_distance=("distance", "mean"),
        max_length=("prompt_length", "max"),
        n_candidates=("n_candidates", "first"),
    ).reset_index()
    n = table["n_trials"].to_numpy()
    for metric in METRICS:
        for prefix in ("", "baseline_"):
            k = groups[prefix + metric.replace("_accuracy", "_correct")].sum().to_numpy()
            low, high = wilson_interval(k, n)
            table[f"{prefix}{metric}"] = k / n
            table[f"{prefix}{metric}_low"] = low
            table[f"{prefix}{metric}_high"] = high
    table["mean_rank"] = groups["rank"].mean().to_numpy()
    table["baseline_mean_rank"] = groups["baseline_rank"].mean().to_numpy()
    table["chance"] = 1 / table["n_candidates"]
    table["in_context"] = table["max_length"] <= train_ctx
    for metric in METRICS:
        right = metric.replace("_accuracy", "_correct")
        pairs = [discordant(g[right], g["baseline_" + right]) for _, g in groups]
        table[f"{metric}_needle_only"] = [b for b, _ in pairs]
        table[f"{metric}_baseline_only"] = [c for _, c in pairs]
        table[f"{metric}_p"] = [mcnemar_p(b, c) for b, c in pairs]
        table[f"{metric}_p_holm"] = holm(table[f"{metric}_p"])
    return table


def distance_summary(table: pd.DataFrame, alpha: float = ALPHA) -> pd.DataFrame:
    """Where accuracy falls to the chance baseline, per metric, from a
    :func:`retrieval_by_distance` table.

    A bin is **above the baseline** when its paired test says so: the exact McNemar p of its
    prompts with against without the needle is below ``alpha`` (``<metric>_p``) and the
    accuracy is the higher. One row per metric: ``n_bins`` (the bins tested: with no
    multiplicity correction, about ``alpha x n_bins`` of them can pass by chance), ``n_above``,
    ``n_above_holm`` (those whose Holm-adjusted p, over the bins, is below ``alpha``),
    ``above_up_to``, the upper edge of the farthest bin above the baseline (NaN if none),
    ``at_baseline_from``, the lower edge of the first bin from which no bin is above it (NaN if
    the farthest bin still is), and that bin's ``n_trials``, accuracy and baseline with their
    Wilson intervals, discordant prompts (``needle_only``, ``baseline_only``) and ``p``. "At the
    baseline" means not distinguishable from it with these prompts, not equal to it.

    >>> t = pd.DataFrame({"distance_lo": [0, 16], "distance_hi": [16, 32], "n_trials": 40,
    ...     "top1_accuracy": [1.0, 0.2], "baseline_top1_accuracy": [0.1, 0.05],
    ...     "top1_accuracy_needle_only": [36, 6], "top1_accuracy_baseline_only": [0, 0]})
    >>> t["top1_accuracy_p"] = [mcnemar_p(36, 0), mcnemar_p(6, 0)]
    >>> t["top1_accuracy_p_holm"] = holm(t["top1_accuracy_p"])
    >>> s = distance_summary(t)
    >>> s[["metric", "n_bins", "n_above", "n_above_holm", "above_up_to"]].to_dict("records")
    [{'metric': 'top1_accuracy', 'n_bins': 2, 'n_above': 2, 'n_above_holm': 2, 'above_up_to': 32.0}]
    """
    alpha = check_number(alpha, "alpha", low=0, high=1)
    rows = []
    for metric in (m for m in METRICS if m in table):
        higher = (table[metric] > table[f"baseline_{metric}"]).to_numpy()
        above = higher & (table[f"{metric}_p"] < alpha).to_numpy()
        hits = np.flatnonzero(above)
        last = int(hits[-1]) if len(hits) else -1
        row: dict[str, object] = {
            "metric": metric,
            "n_bins": len(table),
            "n_above": len(hits),
            "n_above_holm": int((higher & (table[f"{metric}_p_holm"] < alpha).to_numpy()).sum()),
            "above_up_to": float(table["distance_hi"].iloc[last]) if last >= 0 else math.nan,
            "at_baseline_from": math.nan,
        }
        if last + 1 < len(table):
            at = table.iloc[last + 1]
            row["at_baseline_from"] = float(at["distance_lo"])
            row.update(
                n_trials=int(at["n_trials"]),
                accuracy=at[metric],
                baseline=at[f"baseline_{metric}"],
                needle_only=int(at[f"{metric}_needle_only"]),
                baseline_only=int(at[f"{metric}_baseline_only"]),
                p=at[f"{metric}_p"],
            )
            for side, prefix in (("accuracy", ""), ("baseline", "baseline_")):
                for end in ("low", "high"):
                    if f"{prefix}{metric}_{end}" in at:
                        row[f"{side}_{end}"] = at[f"{prefix}{metric}_{end}"]
        rows.append(row)
    return pd.DataFrame(rows)


# The columns that fix a prompt of retrieval_by_distance: equal in two results, same prompts.
_PROMPT_COLUMNS = (
    "distance_lo",
    "distance_hi",
    "trial",
    "key",
    "distance",
    "needle_start",
    "needle_end",
    "question_start",
    "prompt_length",
    "n_candidates",
)
# Each metric's per-prompt column of the trials.
_CORRECT = {m: m.replace("_accuracy", "_correct") for m in METRICS}


def _trials(result: object, name: str) -> pd.DataFrame:
    trials = result if isinstance(result, pd.DataFrame) else getattr(result, "trials", result)
    if not isinstance(trials, pd.DataFrame):
        raise InvalidArgumentError(
            f"{name} must be a Retrieval of retrieval_by_distance or its trials table, got "
            f"{type(result).__name__}"
        )
    missing = [c for c in (*_PROMPT_COLUMNS, *_CORRECT.values()) if c not in trials]
    if missing:
        raise InvalidArgumentError(
            f"{name} lacks the trials columns {missing}: give retrieval_by_distance's result "
            "or its trials"
        )
    return trials.sort_values(["distance_lo", "trial"], ignore_index=True)


def compare_retrieval(
    a: object,
    b: object,
    *,
    from_distance: int | None = None,
) -> pd.DataFrame:
    """Two models (or variants) on the same :func:`retrieval_by_distance` prompts, prompt by
    prompt: the paired test of their accuracies with the needle.

    Usage::

        log = retrieval_by_distance(log_model, seed=0)
        standard = retrieval_by_distance(standard_model, seed=0)  # the same prompts
        compare_retrieval(log, standard, from_distance=1024)

    ``a``, ``b``: results (or their ``trials``, e.g. read back from CSV) of the same prompts:
    same task, seed, distances, ``n_before`` and tokenizer, so the same keys, distances and
    needle positions; anything else is refused in one line. ``from_distance``: also a pooled
    row over every prompt whose needle is at least that many tokens from the question.

    One row per bin (and the pooled one, ``pooled`` True, ``distance_lo = from_distance``):
    ``distance_lo``, ``distance_hi``, ``n_trials``, ``pooled`` and per metric
    (``greedy_accuracy``, ``top1_accuracy``) ``a_<metric>``, ``b_<metric>``, ``<metric>_a_only``
    and ``<metric>_b_only`` (prompts only ``a``, only ``b`` gets right) and ``<metric>_p``
    (exact McNemar, :func:`headsurgeon.stats.mcnemar_p`; no multiplicity correction).

    >>> t = pd.DataFrame({c: [0, 0] for c in _PROMPT_COLUMNS} | {"distance_hi": 16,
    ...     "trial": [0, 1], "greedy_correct": False, "top1_correct": [True, True]})
    >>> u = t.assign(top1_correct=[False, True])
    >>> compare_retrieval(t, u)[["top1_accuracy_a_only", "top1_accuracy_b_only",
    ...     "top1_accuracy_p"]].values.tolist()
    [[1.0, 0.0, 1.0]]
    """
    first, second = _trials(a, "a"), _trials(b, "b")
    _check_same_prompts(a, b, first, second)
    groups = _bins(first, from_distance)
    rows = []
    for i, ((lo, hi), idx) in enumerate(groups):
        row: dict[str, object] = {
            "distance_lo": lo,
            "distance_hi": hi,
            "n_trials": len(idx),
            "pooled": from_distance is not None and i == len(groups) - 1,
        }
        rows.append(row | _paired_columns(first.loc[idx], second.loc[idx]))
    return pd.DataFrame(rows)


def _check_same_prompts(a: object, b: object, first: pd.DataFrame, second: pd.DataFrame) -> None:
    """One line unless results ``a`` and ``b`` (their trials ``first``, ``second``) are of the
    same task and settings, with the same prompts row by row."""
    task_a, task_b = (
        None if isinstance(r, pd.DataFrame) else getattr(r, "task", None) for r in (a, b)
    )
    if task_a and task_b and task_a != task_b:
        raise InvalidArgumentError(
            f"a is a {a.task} result and b a {b.task} one: compare_retrieval pairs the same "
            "prompts; give two results of the same task"
        )
    keys = ("task", "seed", "n_before", "distances")
    differ = [k for k in keys if k in first.attrs and k in second.attrs]
    differ = [k for k in differ if first.attrs[k] != second.attrs[k]]
    if not differ and len(first) == len(second):
        same = first[list(_PROMPT_COLUMNS)].astype(str) == second[list(_PROMPT_COLUMNS)].astype(str)
        differ = [c for c in _PROMPT_COLUMNS if not same[c].all()]
    elif not differ:
        differ = ["the number of prompts"]
    if differ:
        raise InvalidArgumentError(
            f"a and b are not the same prompts (they differ in {', '.join(differ)}): "
            "compare_retrieval "
            "pairs them one by one; score both models with the same task, seed, distances, "
            "n_before and tokenizer"
        )


def _bins(first: pd.DataFrame, from_distance: int | None) -> list[tuple[tuple, pd.Index]]:
    """Each bin's ``((distance_lo, distance_hi), rows of first)``, then, from ``from_distance``,
    the pooled one's."""
    groups = list(first.groupby(["distance_lo", "distance_hi"]).groups.items())
    if from_distance is not None:
        from_distance = check_int(from_distance, "from_distance", minimum=0)
        idx = first.index[first["distance"] >= from_distance]
        if not len(idx):
            raise InvalidArgumentError(
                f"no prompt has its needle {from_distance} tokens or more from the question; the "
                f"farthest is {int(first['distance'].max())}"
            )
        groups.append(((from_distance, int(first.loc[idx, "distance_hi"].max())), idx))
    return groups


def _paired_columns(first: pd.DataFrame, second: pd.DataFrame) -> dict[str, object]:
    """Per metric, the accuracies of two models on the same prompts, the prompts only each gets
    right and the exact McNemar p of those."""
    row: dict[str, object] = {}
    for metric, right in _CORRECT.items():
        x, y = first[right].astype(bool), second[right].astype(bool)
        only_a, only_b = discordant(x, y)
        row |= {
            f"a_{metric}": x.mean(),
            f"b_{metric}": y.mean(),
            f"{metric}_a_only": only_a,
            f"{metric}_b_only": only_b,
            f"{metric}_p": mcnemar_p(only_a, only_b),
        }
    return row
