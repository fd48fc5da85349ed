"""headsurgeon.evals.retrieval_by_distance: the needle where the trials say, the baseline the same
prompt without it, the same prompts for every model, the statistics against brute force."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from test_evals import InductionOracle, full_sequence_logprobs

from headsurgeon.blindness import mitigation
from headsurgeon.data import tokenize
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.evals import (
    compare_retrieval,
    distance_summary,
    distance_table,
    retrieval,
    retrieval_by_distance,
    wilson_interval,
)
from headsurgeon.evals.retrieval import (
    NEEDLE_QUESTION,
    NEEDLE_SENTENCE,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
)
from headsurgeon.loading import model_info
from headsurgeon.stats import mcnemar_p

EDGES = [0, 3, 20]  # two bins; the tiny tokenizer spends ~170 tokens on the fixed parts
PARTS = {
    "passkey": (PASSKEY_NEEDLE, PASSKEY_QUESTION),
    "needle": (NEEDLE_SENTENCE, NEEDLE_QUESTION),
}


def scored_prompts(monkeypatch) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Every (prompt, candidates) the evaluation scores, in order, recorded."""
    calls = []
    real = retrieval.answer_scores

    def record(model, prompt, candidates):
        calls.append((prompt.clone(), [c.clone() for c in candidates]))
        return real(model, prompt, candidates)

    monkeypatch.setattr(retrieval, "answer_scores", record)
    return calls


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_each_prompt_has_its_needle_at_the_distance_the_trials_say(tiny_model, monkeypatch, task):
    calls = scored_prompts(monkeypatch)
    result = retrieval_by_distance(tiny_model, task, distances=EDGES, n_trials=3, n_before=5)
    trials, decode = result.trials, tiny_model.tokenizer.decode
    assert len(calls) == 2 * len(trials) == 12  # a needle prompt and its baseline per trial
    needle_text, question_text = PARTS[task]
    intro = len(tokenize(model_info(tiny_model), PASSKEY_INTRO)) if task == "passkey" else 0
    intro += bool(tiny_model.cfg.default_prepend_bos)
    for row, (prompt, candidates), (baseline, baseline_candidates) in zip(
        trials.itertuples(), calls[::2], calls[1::2], strict=True
    ):
        assert row.distance_lo <= row.distance < row.distance_hi
        assert row.question_start - row.needle_end == row.distance
        assert row.needle_start == intro + 5  # n_before haystack tokens after the intro
        assert len(prompt) == row.prompt_length
        assert decode(prompt[row.needle_start : row.needle_end]) == needle_text.format(key=row.key)
        assert decode(prompt[row.question_start :]) == question_text
        # The baseline is the needle prompt with exactly the needle's tokens deleted.
        kept = torch.cat([prompt[: row.needle_start], prompt[row.needle_end :]])
        assert torch.equal(baseline, kept)
        assert all(torch.equal(a, b) for a, b in zip(candidates, baseline_candidates, strict=True))
        assert decode(candidates[0]) == " " + row.key


def test_the_same_prompts_for_every_model_and_seed(tiny_model, monkeypatch):
    calls = scored_prompts(monkeypatch)
    first = retrieval_by_distance(tiny_model, "needle", distances=EDGES, n_trials=2, seed=4)
    seen = len(calls)
    with mitigation(tiny_model, "softcap", c=0.5):  # another model: other outputs
        other = retrieval_by_distance(tiny_model, "needle", distances=EDGES, n_trials=2, seed=4)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(calls[:seen], calls[seen:], strict=True))
    prompt_columns = ["key", "distance", "needle_start", "needle_end", "prompt_length"]
    pd.testing.assert_frame_equal(first.trials[prompt_columns], other.trials[prompt_columns])
    assert not first.trials["true_loglik"].equals(other.trials["true_loglik"])
    again = retrieval_by_distance(tiny_model, "needle", distances=EDGES, n_trials=2, seed=4)
    pd.testing.assert_frame_equal(first.trials, again.trials)
    moved = retrieval_by_distance(tiny_model, "needle", distances=EDGES, n_trials=2, seed=5)
    assert not first.trials["key"].equals(moved.trials["key"])


def test_an_oracle_finds_every_needle_and_no_baseline_key(tiny_model, monkeypatch):
    monkeypatch.setattr(retrieval, "continuation_logprobs", full_sequence_logprobs)
    # A stand-in for tiny_model, on purpose: its record is tiny_model's.
    monkeypatch.setattr(retrieval, "model_info", lambda model, name: model_info(tiny_model))
    result = retrieval_by_distance(
        InductionOracle(tiny_model), "passkey", distances=EDGES, n_trials=8, n_candidates=4
    )
    table = result.table
    assert (table.top1_accuracy == 1).all() and (table.greedy_accuracy == 1).all()
    # Without the needle the oracle copies whatever followed the question's last words in the
    # haystack: never the key, now and then a candidate's first token by coincidence.
    assert (table.baseline_greedy_accuracy == 0).all()
    assert (table.baseline_top1_accuracy < 0.5).all()
    assert table.chance.tolist() == [0.25, 0.25]
    # Both bins above the baseline: 8 of 8 against at most 1 of 8 is 7 vs 0 or more discordant
    # prompts, p <= 2 / 2**7 by the exact McNemar test.
    summary = result.summary.set_index("metric")
    assert summary.loc["top1_accuracy", "above_up_to"] == 20
    assert math.isnan(summary.loc["top1_accuracy", "at_baseline_from"])


def test_the_table_counts_the_trials_with_wilson_intervals(tiny_model):
    result = retrieval_by_distance(tiny_model, "passkey", distances=EDGES, n_trials=5, seed=1)
    trials, table = result.trials, result.table
    assert table.n_trials.tolist() == [5, 5] and table.distance_hi.tolist() == [3, 20]
    for (lo, _), group in trials.groupby(["distance_lo", "distance_hi"]):
        row = table.set_index("distance_lo").loc[lo]
        for prefix in ("", "baseline_"):
            k = int(group[f"{prefix}top1_correct"].sum())
            assert row[f"{prefix}top1_accuracy"] == k / 5
            assert (row[f"{prefix}top1_accuracy_low"], row[f"{prefix}top1_accuracy_high"]) == (
                wilson_interval(k, 5)
            )
        assert row["mean_distance"] == group["distance"].mean()
        assert row["in_context"] == (group["prompt_length"].max() <= result.train_ctx)
    assert table.attrs["task"] == "passkey" and table.attrs["distances"] == EDGES


@pytest.mark.parametrize(("k", "n"), [(0, 40), (1, 40), (17, 40), (40, 40), (3, 7)])
def test_wilson_interval_is_where_the_score_test_accepts(k, n):
    # Brute force: the proportions p whose score test |k/n - p| <= 1.96 sqrt(p(1 - p)/n) accepts.
    p = np.linspace(0, 1, 2_000_001)
    accepted = p[np.abs(k / n - p) <= 1.96 * np.sqrt(p * (1 - p) / n)]
    low, high = wilson_interval(k, n)
    assert low == pytest.approx(accepted.min(), abs=1e-6)
    assert high == pytest.approx(accepted.max(), abs=1e-6)


def paired_trials(bins: list[tuple[int, int, int]], n: int = 40) -> pd.DataFrame:
    """Trials of bins [0, 16), [16, 32), ...: per bin ``(both, needle_only, baseline_only)``
    prompts right with and without the needle, right only with it, right only without; the
    rest wrong both ways."""
    rows = []
    for i, (both, needle_only, baseline_only) in enumerate(bins):
        right = [True] * (both + needle_only) + [False] * baseline_only
        base = [True] * both + [False] * needle_only + [True] * baseline_only
        right += [False] * (n - len(right))
        base += [False] * (n - len(base))
        for trial in range(n):
            rows.append(
                {"distance_lo": 16 * i, "distance_hi": 16 * (i + 1), "trial": trial,
                 "key": 10_000 + trial, "distance": 16 * i + 8, "needle_start": 40,
                 "needle_end": 50, "question_start": 58 + 16 * i, "prompt_length": 70 + 16 * i,
                 "n_candidates": 10, "top1_correct": right[trial],
                 "baseline_top1_correct": base[trial], "greedy_correct": False,
                 "baseline_greedy_correct": False, "rank": 1 if right[trial] else 2,
                 "baseline_rank": 1 if base[trial] else 2}
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_above_the_baseline_is_the_paired_test_not_disjoint_intervals():
    # 36 vs 0; 6 vs 0 (0.20 against 0.05: the Wilson intervals overlap, p = 2 / 2**6);
    # 3 vs 3; 4 vs 0 (p = 0.125); 0 vs 7 (p = 2 / 2**7, but the baseline is the higher).
    trials = paired_trials([(4, 36, 0), (2, 6, 0), (3, 3, 3), (0, 4, 0), (1, 0, 7)])
    table = distance_table(trials, train_ctx=128)
    assert table.top1_accuracy_needle_only.tolist() == [36, 6, 3, 4, 0]
    assert table.top1_accuracy_baseline_only.tolist() == [0, 0, 3, 0, 7]
    assert table.top1_accuracy_p.tolist() == [2 / 2**36, 2 / 2**6, 1.0, 0.125, 2 / 2**7]
    assert table.top1_accuracy_low[1] < table.baseline_top1_accuracy_high[1]  # they overlap
    assert table.greedy_accuracy_p.tolist() == [1.0] * 5
    row = distance_summary(table).set_index("metric").loc["top1_accuracy"]
    assert (row.n_bins, row.n_above, row.above_up_to, row.at_baseline_from) == (5, 2, 32, 32)
    # Holm over 5 bins: 0.03125 x 4 = 0.125 no longer passes; 2 / 2**36 x 5 does.
    assert row.n_above_holm == 1
    assert (row.needle_only, row.baseline_only, row.p, row.accuracy) == (3, 3, 1.0, 0.15)
    assert (row.baseline_low, row.baseline_high) == wilson_interval(6, 40)
    greedy = distance_summary(table).set_index("metric").loc["greedy_accuracy"]
    assert greedy.n_above == 0 and math.isnan(greedy.above_up_to) and greedy.at_baseline_from == 0


def test_compare_retrieval_pairs_two_models_prompt_by_prompt():
    a = paired_trials([(4, 36, 0), (2, 6, 0), (3, 3, 3)])
    b = paired_trials([(4, 36, 0), (2, 6, 0), (3, 3, 3)])
    # b right on the first 30 prompts of every bin with the needle; a as above
    b["top1_correct"] = b["trial"] < 30
    out = compare_retrieval(a, b, from_distance=16)
    assert out.pooled.tolist() == [False, False, False, True]
    assert out[["distance_lo", "distance_hi", "n_trials"]].values.tolist() == [
        [0, 16, 40],
        [16, 32, 40],
        [32, 48, 40],
        [16, 48, 80],
    ]
    # by hand: bin 0, a right on 0-39: 10 a only; bin 16, a right on 0-7: 22 b only; bin 32,
    # a right on 0-5: 24 b only; pooled from 16: 0 vs 46
    assert out.top1_accuracy_a_only.tolist() == [10, 0, 0, 0]
    assert out.top1_accuracy_b_only.tolist() == [0, 22, 24, 46]
    assert out.top1_accuracy_p.tolist() == [2 / 2**10, 2 / 2**22, 2 / 2**24, 2 / 2**46]
    assert out.a_top1_accuracy.tolist() == [1.0, 0.2, 0.15, 0.175]
    assert out.b_top1_accuracy.tolist() == [0.75] * 4
    assert out.greedy_accuracy_p.tolist() == [1.0] * 4
    assert not compare_retrieval(a, b).pooled.any() and len(compare_retrieval(a, b)) == 3


def test_compare_retrieval_refuses_other_prompts_in_one_line():
    a = paired_trials([(4, 36, 0), (2, 6, 0)])
    for column, value in [("key", 1), ("distance", 9), ("needle_start", 41)]:
        other = a.copy()
        other.loc[3, column] = value
        with pytest.raises(
            InvalidArgumentError, match=f"not the same prompts \\(they differ in {column}"
        ):
            compare_retrieval(a, other)
    with pytest.raises(InvalidArgumentError, match="number of prompts"):
        compare_retrieval(a, a.iloc[:-1])
    seeded = a.copy()
    a.attrs["seed"], seeded.attrs["seed"] = 0, 1
    with pytest.raises(InvalidArgumentError, match="differ in seed"):
        compare_retrieval(a, seeded)
    with pytest.raises(InvalidArgumentError, match="lacks the trials columns"):
        compare_retrieval(a, a.drop(columns="key"))
    with pytest.raises(InvalidArgumentError, match="no prompt has its needle 100 tokens"):
        compare_retrieval(a, a, from_distance=100)


def test_compare_retrieval_of_two_models_end_to_end(tiny_model):
    first = retrieval_by_distance(tiny_model, "passkey", distances=EDGES, n_trials=4, seed=2)
    with mitigation(tiny_model, "softcap", c=0.5):  # another model on the same prompts
        other = retrieval_by_distance(tiny_model, "passkey", distances=EDGES, n_trials=4, seed=2)
    out = compare_retrieval(first, other, from_distance=0)
    assert out.n_trials.tolist() == [4, 4, 8] and out.pooled.tolist() == [False, False, True]
    for row, (_, x), (_, y) in zip(
        out.itertuples(),
        [*first.trials.groupby("distance_lo"), (0, first.trials)],
        [*other.trials.groupby("distance_lo"), (0, other.trials)],
        strict=True,
    ):
        b = int((x.top1_correct & ~y.top1_correct.to_numpy()).sum())
        c = int((~x.top1_correct & y.top1_correct.to_numpy()).sum())
        assert (row.top1_accuracy_a_only, row.top1_accuracy_b_only) == (b, c)
        assert row.top1_accuracy_p == mcnemar_p(b, c)
    with pytest.raises(InvalidArgumentError, match="not the same prompts"):
        compare_retrieval(first, retrieval_by_distance(tiny_model, distances=EDGES, n_trials=4))
    needle = retrieval_by_distance(tiny_model, "needle", distances=EDGES, n_trials=4, seed=2)
    with pytest.raises(InvalidArgumentError, match="a passkey result and b a needle one"):
        compare_retrieval(first, needle)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"distances": [5]}, "at least two increasing"),
        ({"distances": [10, 5]}, "at least two increasing"),
        ({"distances": [-1, 5]}, "distances"),
        ({"task": "haystack"}, "unknown task"),
        ({"n_before": -1}, "n_before"),
        ({"n_trials": 0}, "n_trials"),
        ({"n_candidates": 1}, "n_candidates"),
        ({"keys": ["a", "b"]}, "number of digits"),
        ({"keys": 0}, "keys"),
        ({"task": "needle", "keys": 3}, "words"),
        ({"task": "needle", "keys": "abc"}, "words"),
        ({"task": "needle", "keys": ["a", "b"]}, "distinct words"),
    ],
)
def test_bad_arguments_are_one_line(tiny_model, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        retrieval_by_distance(tiny_model, **kwargs)


def test_the_figure_draws_the_table_its_baseline_and_every_head(tiny_model):
    from headsurgeon.plots.evaluation import retrieval_distance_plot

    table = retrieval_by_distance(tiny_model, "passkey", distances=EDGES, n_trials=3).table
    heads = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "first_zero_distance": [200.0, np.nan, 0.0, 90.0],
            "reach": [12.0, 30.0, 5.0, 7.0],
        }
    )
    fig = retrieval_distance_plot(table, heads)
    curve, baseline, *strip = fig.data
    assert list(curve.y) == table.top1_accuracy.tolist()
    assert list(curve.x) == table.mean_distance.tolist()
    np.testing.assert_allclose(curve.y + curve.error_y.array, table.top1_accuracy_high)
    np.testing.assert_allclose(
        baseline.y - baseline.error_y.arrayminus, table.baseline_top1_accuracy_low
    )
    assert baseline.line.dash == "dash"
    assert [list(t.x) for t in strip] == [[12, 30, 5, 7], [200, 90]]
    assert strip[1].y[0] == "first exact zero (1 of 4 none, 1 at 0)"
    greedy = retrieval_distance_plot(table, metric="greedy_accuracy")
    assert len(greedy.data) == 2 and list(greedy.data[0].y) == table.greedy_accuracy.tolist()
    with pytest.raises(InvalidArgumentError, match="reach, first_zero_distance"):
        retrieval_distance_plot(table, heads[["layer", "head"]])
    with pytest.raises(InvalidArgumentError, match="baseline_top1_accuracy"):
        retrieval_distance_plot(table.drop(columns="baseline_top1_accuracy"))


def test_keys_set_the_passkey_digits_and_the_needle_words(tiny_model):
    passkey = retrieval_by_distance(tiny_model, keys=3, distances=EDGES, n_trials=2).trials
    assert passkey["key"].str.fullmatch(r"[1-9][0-9]{2}").all()
    words = [f"w{i}" for i in range(12)]
    needle = retrieval_by_distance(tiny_model, "needle", keys=words, distances=EDGES, n_trials=2)
    assert set(needle.trials["key"]) <= set(words)
