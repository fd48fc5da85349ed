"""Each head's reach (the census's ``reach`` column): exact against a brute force from
transformers' eager attention for every head of the organism, the same in blocks as dense, and
its histogram reducer against a loop over every entry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headsurgeon import load_model, run_census
from headsurgeon.alibi import content_free_far_mass, content_free_reach, reach_from_far_mass
from headsurgeon.backend.weights import head_tensors
from headsurgeon.blindness import mitigation
from headsurgeon.blindness.analysis import applied_bias
from headsurgeon.data import to_sequences
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.loading import organism_names
from headsurgeon.model_names import ORGANISM_DIR
from headsurgeon.probes import HeadStats, distance_sums, stream

needs_organisms = pytest.mark.skipif(
    "organism" not in organism_names(), reason="the bundled organisms are not installed"
)


def reference_far_mass(A: np.ndarray, min_query_pos: int = 1) -> np.ndarray:
    """``[head, distance]`` from whole patterns ``A`` ``[seq, head, T, T]`` (float64): for each
    distance ``d``, the mean over rows ``t >= max(d + 1, min_query_pos)`` of every sequence of
    ``Σ_{1 <= j <= t - d} A[t, j]``, read off the cumulative sums of each row (NaN: no row)."""
    n_pos = A.shape[-1]
    C = A.copy()
    C[..., 0] = 0
    C = np.cumsum(C, -1)
    far = np.full(A.shape[1:3], np.nan)
    for d in range(n_pos - 1):
        rows = np.diagonal(C, offset=-d, axis1=-2, axis2=-1)  # C[t, t - d] for t = d, d + 1, ...
        first = max(1, min_query_pos - d)
        if first < rows.shape[-1]:
            far[:, d] = rows[..., first:].mean((0, -1))
    return far


def reference_reach(A: np.ndarray, eps: float, min_query_pos: int = 1) -> np.ndarray:
    """The smallest distance whose :func:`reference_far_mass` is at most ``eps``, per head."""
    within = reference_far_mass(A, min_query_pos) <= eps
    return np.where(within.any(-1), within.argmax(-1), math.inf)


def test_distance_sums_equal_a_loop_over_every_entry():
    torch.manual_seed(0)
    for n_seqs, n_rows, n_keys in [(1, 7, 7), (3, 4, 10), (2, 1, 5)]:
        logits = torch.randn(n_seqs, 2, n_keys, n_keys)
        causal = torch.ones(n_keys, n_keys, dtype=torch.bool).tril()
        pattern = logits.masked_fill(~causal, -math.inf).softmax(-1)[:, :, -n_rows:]
        for min_query_pos in (0, 1, 3, 8):
            expected = torch.zeros(2, n_keys, dtype=torch.float64)
            for i in range(n_rows):
                t = n_keys - n_rows + i
                for j in range(1, t + 1):
                    if t >= min_query_pos:
                        expected[:, t - j] += pattern[:, :, i, j].double().sum(0)
            got = distance_sums(pattern.contiguous(), min_query_pos)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@needs_organisms
def test_reach_equals_transformers_eager_attention_for_every_organism_head():
    """The acceptance test of issue 38: every head of the organism at 1,024 tokens."""
    from transformers import BloomForCausalLM

    model = load_model("organism")
    tokens = to_sequences(model, None, seq_len=1024, n_seqs=2).tokens
    census = run_census(model, tokens, progress=False)
    hf = BloomForCausalLM.from_pretrained(
        ORGANISM_DIR / "organism", attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        patterns = [a.double().numpy() for a in hf(tokens, output_attentions=True).attentions]
    expected = np.concatenate([reference_reach(A, 0.01) for A in patterns])
    assert census.attrs["reach_eps"] == 0.01
    np.testing.assert_array_equal(census["reach"].to_numpy(), expected)
    assert 1 <= expected.min() and expected.max() < 1024  # bounded, and neither 0 nor inf
    # The curve it comes from, not only the crossing.
    stats = HeadStats(model)
    stream(model, tokens, stats.hooks(), progress=False)
    far = np.concatenate([reference_far_mass(A) for A in patterns])
    np.testing.assert_allclose(stats.far_mass().reshape(far.shape), far, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("min_query_pos", [0, 1, 40])
def test_reach_in_blocks_equals_the_dense_reach(tiny_model, min_query_pos):
    tokens = torch.randint(0, 300, (3, 100), generator=torch.Generator().manual_seed(1))
    kwargs = dict(batch_size=2, min_query_pos=min_query_pos, reach_eps=0.05, progress=False)
    dense = run_census(tiny_model, tokens, block_size=100, **kwargs)
    blocked = run_census(tiny_model, tokens, block_size=32, **kwargs)
    np.testing.assert_array_equal(blocked["reach"], dense["reach"])
    assert dense["reach"].between(1, 99).any()  # some reach is measured, not all inf

    def far(block_size):
        stats = HeadStats(tiny_model, min_query_pos=min_query_pos)
        stream(tiny_model, tokens, stats.hooks(), block_size=block_size, progress=False)
        return stats.far_mass()

    np.testing.assert_allclose(far(32), far(100), rtol=1e-6, atol=1e-7)


def test_reach_extremes_and_its_argument(tiny_model):
    tokens = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(2))
    nothing = run_census(tiny_model, tokens, reach_eps=1.0, progress=False)
    assert (nothing["reach"] == 0).all()  # every head's mass beyond distance 0 is at most 1
    # A random model attends everywhere: some mass at the farthest distance, so no d qualifies.
    everything = run_census(tiny_model, tokens, reach_eps=0.0, progress=False)
    assert np.isinf(everything["reach"]).all() and everything.attrs["reach_eps"] == 0.0
    for bad in (-0.1, 1.5, float("nan"), "0.01"):
        with pytest.raises(InvalidArgumentError, match="reach_eps"):
            run_census(tiny_model, tokens, reach_eps=bad, progress=False)


def test_reach_figure_joins_the_census_and_the_zeros_of_one_dtype():
    import pandas as pd

    from headsurgeon.plots.distance import reach_figure

    census = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "slope": [0.25, 0.5, 0.25, 0.5],
            "reach": [30.0, 9.0, math.inf, 12.0],
        }
    )
    census.attrs.update(seq_len=512, reach_eps=0.01, model="m", n_seqs=2)
    by_head = pd.concat(
        [
            pd.DataFrame(
                {
                    "layer": [0, 0, 1, 1],
                    "head": [0, 1, 0, 1],
                    "dtype": dtype,
                    "first_zero_distance": [400.0, 200.0, math.nan, 210.0],
                    "analytic_distance": [414.0 * k, 207.0 * k, 414.0 * k, 207.0 * k],
                }
            )
            for dtype, k in [("bfloat16", 0.9), ("float32", 1.0)]
        ]
    )
    fig = reach_figure(census, by_head)
    traces = {t.name: t for t in fig.data}
    # Steepest first within each layer, layer 0 first.
    assert list(fig.layout.yaxis.categoryarray) == ["L0H1", "L0H0", "L1H1", "L1H0"]
    assert list(traces["reach"].y) == ["L0H1", "L0H0", "L1H1"]
    assert list(traces["reach"].x) == [9.0, 30.0, 12.0]
    unbounded = traces["reach > 512 (not bounded within the sequence)"]
    assert list(unbounded.y) == ["L1H0"] and list(unbounded.x) == [512.0]
    assert unbounded.marker.symbol == "circle-open"
    assert list(traces["first exact zero (float32)"].x) == [200.0, 400.0, 210.0]
    assert list(traces["no exact zero within the sequence"].y) == ["L1H0"]
    assert list(traces["analytic blind distance (float32)"].x) == [207.0, 414.0, 207.0, 414.0]
    assert fig.layout.xaxis.type == "log"
    bf16 = {t.name: t for t in reach_figure(census, by_head, dtype="bfloat16").data}
    assert bf16["analytic blind distance (bfloat16)"].x[0] == pytest.approx(207.0 * 0.9)
    with pytest.raises(InvalidArgumentError, match="'float16'; use one of bfloat16, float32"):
        reach_figure(census, by_head, dtype="float16")
    with pytest.raises(InvalidArgumentError, match="measure_blindness"):
        reach_figure(census, by_head.drop(columns="analytic_distance"))
    with pytest.raises(InvalidArgumentError, match="reach"):
        reach_figure(census.drop(columns="reach"), by_head)


def test_content_free_far_mass_equals_a_loop_over_every_row():
    """The suffix-sum formula against each row's softmax of the bias alone, for standard, log
    and random (non-monotone) biases and several ``min_query_pos``."""
    rng = np.random.default_rng(0)
    for n_pos in (2, 5, 30):
        k = np.arange(n_pos)
        biases = np.stack([-0.3 * k, -1.5 * np.log1p(k), rng.normal(0, 2, n_pos)])
        for min_query_pos in (0, 1, 3, 7):
            expected = np.full(biases.shape, np.nan)
            for d in range(n_pos):
                rows = range(max(d + 1, min_query_pos), n_pos)
                masses = []
                for t in rows:
                    weights = np.exp(biases[:, t - np.arange(t + 1)])  # keys 0 ... t
                    weights /= weights.sum(-1, keepdims=True)
                    masses.append(weights[:, 1 : t - d + 1].sum(-1))  # keys 1 ... t - d
                if masses:
                    expected[:, d] = np.mean(masses, 0)
            got = content_free_far_mass(biases, min_query_pos)
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-300)
            assert np.array_equal(
                content_free_reach(biases, 0.05, min_query_pos), reach_from_far_mass(expected, 0.05)
            )


def content_free(model) -> None:
    """Zero ``W_Q`` and ``b_Q`` of every layer: every logit is the positional bias alone."""
    for layer in range(model.cfg.n_layers):
        tensors = head_tensors(model, layer)
        with torch.no_grad():
            for name in ("W_Q", "b_Q"):
                if name in tensors:
                    tensors[name].heads(tensors[name].param).zero_()


@needs_organisms
@pytest.mark.parametrize("min_query_pos", [1, 5])
def test_reach_baseline_is_the_reach_of_an_organism_without_queries(min_query_pos):
    """The acceptance test of issue 50 (item 2): with its queries zeroed every head of the
    organism is content-free, and its census reach is exactly its ``reach_baseline``."""
    model = load_model("organism")
    content_free(model)
    tokens = to_sequences(model, None, seq_len=300, n_seqs=2).tokens
    kwargs = dict(min_query_pos=min_query_pos, progress=False)
    census = run_census(model, tokens, **kwargs)
    np.testing.assert_array_equal(census["reach"], census["reach_baseline"])
    assert census["reach"].between(5, 299).all()  # bounded, and not pinned at either end
    np.testing.assert_array_equal(census["reach_ratio"], 1.0)
    stats = HeadStats(model, min_query_pos=min_query_pos)
    stream(model, tokens, stats.hooks(), progress=False)
    bias = applied_bias(model, 300)
    expected = np.broadcast_to(content_free_far_mass(bias, min_query_pos), stats.far_mass().shape)
    np.testing.assert_allclose(stats.far_mass(), expected, rtol=0, atol=1e-6)


def test_reach_baseline_without_alibi_and_under_a_mitigation(tiny_model):
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
    census = run_census(tiny_model, tokens, progress=False)
    ratio = census["reach"] / census["reach_baseline"]
    bounded = np.isfinite(census["reach_baseline"])
    np.testing.assert_array_equal(census["reach_ratio"][bounded], ratio[bounded])
    assert census["reach_ratio"][~bounded].isna().all()
    with mitigation(tiny_model, "clamped", c=1.0):  # every key within 1 logit: the far end
        clamped = run_census(tiny_model, tokens, progress=False)
    assert (clamped["reach_baseline"] >= census["reach_baseline"]).all()
    assert (clamped["reach_baseline"] > census["reach_baseline"]).any()
