"""Float limits, blind distances and mitigated biases of headsurgeon.alibi against REFERENCE.md."""

from __future__ import annotations

import math

import pytest
import torch

from headsurgeon import alibi
from headsurgeon.errors import InvalidArgumentError

# REFERENCE.md, "Floating-point limits": ln of smallest normal, smallest subnormal, zero point.
REFERENCE_LIMITS = {
    "float32": (-87.34, -103.28, -103.97),
    "bfloat16": (-87.34, -92.19, -92.88),
    "float16": (-9.70, -16.64, -17.33),
}


@pytest.mark.parametrize("dtype", REFERENCE_LIMITS)
def test_float_limits_match_reference(dtype):
    assert [round(x, 2) for x in alibi.float_limits(dtype)] == list(REFERENCE_LIMITS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_point_is_where_the_dtype_rounds_to_zero(dtype):
    limits = alibi.float_limits(dtype)
    below = torch.tensor(math.exp(limits.zero - 0.01), dtype=torch.float64).to(dtype)
    above = torch.tensor(math.exp(limits.zero + 0.01), dtype=torch.float64).to(dtype)
    smallest = torch.tensor(math.exp(limits.subnormal), dtype=torch.float64).to(dtype)
    assert below.item() == 0 and above.item() > 0 and smallest.item() > 0


def test_blind_distance_matches_reference_numbers():
    m = alibi.slopes(16)
    assert alibi.blind_distance(m[0].item(), "float32", "normal") == 124
    assert alibi.blind_distance(m[15].item(), "float32", "normal") == 22359
    log_distance = alibi.blind_distance(m[0].item(), "float32", "normal", bias="log")
    assert log_distance == pytest.approx(4.37e53, rel=1e-3)


def test_blind_distance_vectorises_like_the_scalar_form():
    m = alibi.slopes(32)
    vector = alibi.blind_distance(m, "bfloat16", "subnormal")
    assert vector.tolist() == [alibi.blind_distance(x, "bfloat16", "subnormal") for x in m.tolist()]


def _first_blind_distance(bias_row: torch.Tensor, t: float, capped: float | None = None) -> float:
    """Brute force: first distance whose logit is at least ``t`` below distance 0's."""
    logits = bias_row.double() if capped is None else alibi.soft_cap(bias_row, capped).double()
    gap = logits[0] - logits
    hits = torch.nonzero(gap >= t)
    return hits[0].item() if len(hits) else math.inf


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("standard", {}),
        ("clamped", {"c": 120.0}),
        ("clamped", {"c": 50.0}),
        ("log", {}),
        ("softcap", {"c": 30.0}),
        ("softcap", {"c": 10.0}),
        ("robust", {"context": 600, "mode": "clip"}),
    ],
)
def test_blind_distance_is_the_first_distance_the_bias_makes_blind(kind, params):
    m = torch.tensor([2.0, 0.5, 0.3])
    n = 4000
    # Robust slopes are made for the dtype and underflow limit whose blind distance is asked for.
    target = {"dtype": "float16", "limit": "normal"} if kind == "robust" else {}
    rows = alibi.bias_from_distance(kind, m, alibi.distance_rows(1, n), **params, **target)
    bias = rows[:, 0].flip(-1)  # index = distance
    t = -alibi.log_limit("float16", "normal")
    for head in range(len(m)):
        expected = _first_blind_distance(bias[head], t, params["c"] if kind == "softcap" else None)
        got = alibi.blind_distance(m[head].item(), "float16", "normal", kind, **params)
        if expected == math.inf:  # not blind within the n distances checked
            assert got >= n, (head, got)
        else:
            # Robust slopes put the limit exactly one position past the context, where the
            # float32 rounding of the bias decides between two neighbouring distances.
            assert abs(got - expected) <= (1 if kind == "robust" else 0), (head, got, expected)


def test_bias_kinds_follow_their_formulas():
    m = torch.tensor([0.5, 0.125])
    d = alibi.distance_rows(8, 8)
    assert torch.equal(d, alibi.relative_distance(8))
    standard = alibi.bias_from_distance("standard", m, d)
    assert torch.equal(standard, alibi.alibi_bias(m, 8))
    assert torch.equal(alibi.bias_from_distance("softcap", m, d, c=5.0), standard)
    assert torch.equal(alibi.bias_from_distance("clamped", m, d, c=1.0), standard.clamp(min=-1.0))
    assert torch.allclose(alibi.bias_from_distance("log", m, d), -m[:, None, None] * (1 + d).log())
    # log with match=L: standard's penalty exactly at distance L, the log's shape elsewhere
    matched = alibi.bias_from_distance("log", m, d, match=4)
    assert torch.allclose(matched[:, 4, 0], standard[:, 4, 0])
    assert torch.allclose(matched, -m[:, None, None] * 4 / math.log(5) * (1 + d).log())
    assert alibi.blind_distance(0.5, bias="log", match=4) == math.ceil(
        math.expm1(-alibi.log_limit("float32") / (0.5 * 4 / math.log(5)))
    )
    robust = alibi.bias_from_distance("robust", m, d, context=4, dtype="float16", mode="scale")
    scale = -alibi.log_limit("float16", "normal") / (4 * 0.5)
    assert torch.allclose(robust, standard * min(1.0, scale))


def test_robust_slopes_keep_the_whole_context_above_the_limit():
    m = alibi.slopes(16)
    for mode in alibi.ROBUST_MODES:
        for dtype in ("float32", "float16"):
            robust = alibi.robust_slopes(m, 2048, dtype, "normal", mode)
            t = -alibi.log_limit(dtype, "normal")
            assert (robust.double() * 2047 < t).all()
            assert (alibi.blind_distance(robust, dtype, "normal") >= 2048).all()
    scaled = alibi.robust_slopes(m, 2048, mode="scale")
    assert torch.allclose(scaled / scaled[0], m / m[0])  # geometric ratios kept
    clipped = alibi.robust_slopes(m, 2048, mode="clip")
    unchanged = m < 87.3365 / 2048
    assert torch.equal(clipped[unchanged], m[unchanged]) and not unchanged.all()


def test_soft_cap_keeps_masked_cells_masked():
    scores = torch.tensor([[0.0, -math.inf], [-200.0, 3.0]])
    capped = alibi.soft_cap(scores, 20.0)
    assert capped[0, 1] == -math.inf
    assert capped[1, 0] == pytest.approx(-20.0) and capped[1, 1] == pytest.approx(
        20 * math.tanh(0.15)
    )


def test_blind_share_counts_entries_beyond_the_blind_distance():
    distances, n = [3.0, 1.0, math.inf], 6
    blind = sum(
        (i - j) >= d for d in distances for i in range(n) for j in range(i + 1)
    )  # brute force
    assert alibi.blind_share(distances, n) == pytest.approx(blind / (3 * n * (n + 1) / 2))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: alibi.float_limits("float64"), "unknown dtype"),
        (lambda: alibi.log_limit("float32", "tiny"), "unknown limit"),
        (lambda: alibi.log_limit("float32", 1.0), "natural log below 0"),
        (lambda: alibi.check_bias_params("cosine"), "unknown bias kind"),
        (lambda: alibi.check_bias_params("clamped"), "needs c"),
        (lambda: alibi.check_bias_params("clamped", c=0.0), "number > 0"),
        (lambda: alibi.check_bias_params("softcap", c=math.inf), "number > 0"),
        (lambda: alibi.check_bias_params("log", c=3.0), "takes no parameter c"),
        (lambda: alibi.check_bias_params("log", match=0), "integer >= 1"),
        (lambda: alibi.check_bias_params("robust"), "needs context"),
        (lambda: alibi.check_bias_params("robust", context=0), "integer >= 1"),
        (lambda: alibi.check_bias_params("robust", context=9, mode="x"), "unknown robust mode"),
        (lambda: alibi.blind_distance(-0.5), "positive and finite"),
        (lambda: alibi.blind_share([1.0], 0), "integer >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call()
