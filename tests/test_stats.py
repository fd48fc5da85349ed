"""headsurgeon.stats: the exact McNemar test against hand computations and brute force, Holm's
adjustment, the batch-means standard error."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from headsurgeon.errors import InvalidArgumentError
from headsurgeon.stats import SE_BLOCK, batch_means_se, discordant, holm, mcnemar_p, nll_change


@pytest.mark.parametrize(
    ("b", "c", "by_hand"),
    [
        (10, 1, 2 * (1 + 11) / 2**11),  # log, 1,024-2,047 tokens: 24 / 2048
        (7, 0, 2 / 2**7),  # log, 2,048-4,095
        (6, 0, 2 / 2**6),  # standard, 1,024-2,047
        (0, 6, 2 / 2**6),
        (21, 9, 2 * sum(math.comb(30, k) for k in range(10)) / 2**30),  # log vs standard
        (5, 5, 1.0),  # 2 P(X <= 5) > 1: capped
        (0, 0, 1.0),
    ],
)
def test_mcnemar_p_is_the_hand_computation(b, c, by_hand):
    assert mcnemar_p(b, c) == by_hand


def test_mcnemar_p_21_vs_9_is_about_0_043():
    assert mcnemar_p(21, 9) == pytest.approx(0.04277, abs=1e-5)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 11])
def test_mcnemar_p_is_the_share_of_sign_patterns_at_least_as_lopsided(n):
    # Brute force: every way n discordant pairs can fall, each with probability 2**-n; the
    # two-sided p of (b, c) is the share whose smaller side is at most min(b, c), capped at 1.
    patterns = list(itertools.product([0, 1], repeat=n))
    for b in range(n + 1):
        lopsided = sum(min(sum(p), n - sum(p)) <= min(b, n - b) for p in patterns)
        # the equal-tail share, counted once per tail
        tail = sum(sum(p) <= min(b, n - b) for p in patterns)
        assert mcnemar_p(b, n - b) == min(1.0, 2 * tail / 2**n)
        assert mcnemar_p(b, n - b) >= lopsided / 2**n - 1e-12


def test_mcnemar_p_refuses_negative_counts():
    with pytest.raises(InvalidArgumentError, match="b"):
        mcnemar_p(-1, 3)


def test_discordant_counts_each_way():
    assert discordant([1, 1, 0, 0, 1], [0, 1, 1, 0, 0]) == (2, 1)


def test_holm_by_hand():
    p = [0.5, 2 / 2**40, 0.01171875, 0.015625, 0.3]
    # sorted: 2^-39 x 5; 0.0117 x 4 = 0.0469; 0.0156 x 3 = 0.0469; 0.3 x 2; max(0.6, 0.5)
    np.testing.assert_allclose(holm(p), [0.6, 5 * 2 / 2**40, 0.046875, 0.046875, 0.6])


def test_batch_means_se_is_the_spread_of_64_prediction_block_means():
    values = torch.randn(3, 200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    blocks = [values[:, i : i + SE_BLOCK].mean(1) for i in range(0, 200, SE_BLOCK)]
    means = torch.cat(blocks)  # 4 blocks a sequence, the last of 8 predictions
    assert len(means) == 12
    assert batch_means_se(values) == pytest.approx(means.std().item() / math.sqrt(12), rel=1e-12)
    assert math.isnan(batch_means_se(values[:1, :SE_BLOCK]))
    row = nll_change(values, values + 2)
    assert row["tokens"] == 600 and row["dnll_se"] == batch_means_se(values)
    assert row["base_nll"] == pytest.approx(values.mean().item() + 2)
