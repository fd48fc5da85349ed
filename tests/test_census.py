"""Census: numbers against a brute-force reference, planted sinks, streaming, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import head_weight
from test_blindness import WITHOUT_ALIBI
from test_census_reach import reference_reach

from headsurgeon import run_census
from headsurgeon.census import COLUMNS
from headsurgeon.data import to_sequences
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.loading import model_info
from headsurgeon.probes import HeadStats, stream

TEXT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the "
    "slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
) * 12


def reference_census(model, tokens, min_query_pos=1):
    """Every census column, straight from run_with_cache's patterns, row by row in float64."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    n_seqs, n_pos = tokens.shape
    rows = range(min_query_pos, n_pos)
    out = {name: np.zeros((model.cfg.n_layers, model.cfg.n_heads)) for name in COLUMNS}
    # A head with no preference for content: the softmax of its ALiBi bias alone, brute force.
    slopes = model_info(model).slopes
    baseline = np.full(model.cfg.n_heads, math.nan)  # without ALiBi: no slope to follow
    if slopes is not None:
        distance = torch.arange(n_pos)[:, None] - torch.arange(n_pos)[None, :]
        bias = -slopes.double()[:, None, None] * distance
        free = bias.masked_fill(distance < 0, -math.inf).softmax(-1)[None]  # [1, head, T, T]
        baseline = reference_reach(free.numpy(), 0.01, min_query_pos)
    for layer in range(model.cfg.n_layers):
        A = cache["pattern", layer].double()
        out["reach"][layer] = reference_reach(A.numpy(), 0.01, min_query_pos)
        out["reach_baseline"][layer] = baseline
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = out["reach"][layer] / baseline
        out["reach_ratio"][layer] = np.where(np.isfinite(baseline), ratio, math.nan)
        z = cache["z", layer].double()
        W_O = head_weight(model, layer, "W_O").detach().double()
        writes = torch.einsum("bphd,hdm->bphm", z, W_O)  # [seq, pos, head, d_model]
        layer_norm = writes.sum(2).norm(dim=-1)[:, min_query_pos:].mean()
        head_norms = z.norm(dim=-1).mean(1)  # [seq, head]: every position (AHON-LN's rule)
        ahon_ln = (head_norms / head_norms.mean(-1, keepdim=True)).mean(0)
        for head in range(model.cfg.n_heads):
            a = A[:, head]
            per_seq_bos = torch.stack([a[s, min_query_pos:, 0].mean() for s in range(n_seqs)])
            entropy = [
                -(p[p > 0] * p[p > 0].log()).sum() for s in range(n_seqs) for p in a[s, rows]
            ]
            distance = [
                sum(a[s, t, k] * (t - k) for k in range(t + 1)) for s in range(n_seqs) for t in rows
            ]
            norms = writes[:, min_query_pos:, head].norm(dim=-1)
            values = {
                "bos_mass": per_seq_bos.mean(),
                "bos_mass_std": per_seq_bos.std() if n_seqs > 1 else torch.tensor(0.0),
                "sink_score": a[:, :, 0].mean(),
                "entropy": torch.stack(entropy).mean(),
                "max_weight": a[:, min_query_pos:].amax(-1).mean(),
                "mean_distance": torch.stack(distance).mean(),
                "self_mass": torch.stack([a[:, t, t] for t in rows]).mean(),
                "prev_mass": torch.stack([a[:, t, t - 1] for t in rows if t >= 1]).mean(),
                "output_norm": norms.mean(),
                "output_share": norms.mean() / layer_norm,
                "sink_share": (a[:, :, 0].mean(-1) > 0.3).double().mean(),
                "ahon_ln": ahon_ln[head],
            }
            for name, value in values.items():
                out[name][layer, head] = float(value)
    return out


def assert_matches_reference(census, expected):
    for name, values in expected.items():
        if name in ("layer", "head", "slope"):
            continue
        np.testing.assert_allclose(
            census[name].to_numpy(), values.ravel(), rtol=1e-6, atol=1e-6, err_msg=name
        )


@pytest.mark.parametrize(("min_query_pos", "batch_size"), [(1, 3), (0, 8), (5, 1)])
def test_census_equals_brute_force_reference(tiny_model, min_query_pos, batch_size):
    tokens = to_sequences(tiny_model, TEXT, seq_len=24, n_seqs=7).tokens
    census = run_census(
        tiny_model, tokens, batch_size=batch_size, min_query_pos=min_query_pos, progress=False
    )
    assert list(census.columns) == list(COLUMNS)
    assert len(census) == tiny_model.cfg.n_layers * tiny_model.cfg.n_heads
    assert_matches_reference(census, reference_census(tiny_model, tokens, min_query_pos))
    np.testing.assert_allclose(census["slope"].head(4), [0.25, 0.0625, 0.015625, 0.00390625])
    assert census.attrs["min_query_pos"] == min_query_pos
    assert census.attrs["n_seqs"] == 7 and census.attrs["seq_len"] == 24


def test_paper_metric_includes_row_zero(tiny_model):
    """min_query_pos=0 is the paper's BOS mass: row 0 adds its weight 1 to the mean."""
    tokens = to_sequences(tiny_model, TEXT, seq_len=16, n_seqs=4).tokens
    paper = run_census(tiny_model, tokens, min_query_pos=0, progress=False)["bos_mass"]
    ours = run_census(tiny_model, tokens, min_query_pos=1, progress=False)["bos_mass"]
    np.testing.assert_allclose(paper, (1 + 15 * ours) / 16, atol=1e-6)


def test_prepend_bos_override_is_used_and_recorded(tiny_model):
    census = run_census(tiny_model, TEXT, seq_len=20, n_seqs=3, prepend_bos=True, progress=False)
    assert census.attrs["prepend_bos"] is True and census.attrs["seq_len"] == 20
    tokens = to_sequences(tiny_model, TEXT, seq_len=20, n_seqs=3, prepend_bos=True).tokens
    assert (tokens[:, 0] == tiny_model.tokenizer.bos_token_id).all()
    assert_matches_reference(census, reference_census(tiny_model, tokens))
    default = run_census(tiny_model, TEXT, seq_len=20, n_seqs=3, progress=False)
    assert default.attrs["prepend_bos"] is False


def test_streaming_leaves_no_hooks_and_fixed_state(tiny_model):
    stats = HeadStats(tiny_model)
    sizes = [t.numel() for t in (stats.sums, stats.squares, stats.layer_write, stats.counts)]
    tokens = to_sequences(tiny_model, TEXT, seq_len=16, n_seqs=6).tokens
    stream(tiny_model, tokens, stats.hooks(), batch_size=2, progress=False)
    stream(tiny_model, tokens, stats.hooks(), batch_size=5, progress=False)
    assert stats.n_seqs == 12
    assert sizes == [
        t.numel() for t in (stats.sums, stats.squares, stats.layer_write, stats.counts)
    ]
    assert all(not hp.fwd_hooks for hp in tiny_model.hook_dict.values())


def test_bad_input_raises_clear_errors(tiny_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        run_census(tiny_model, [empty], progress=False)
    with pytest.raises(DataError, match="min_query_pos"):
        run_census(tiny_model, TEXT, seq_len=4, min_query_pos=4, progress=False)
    with pytest.raises(DataError, match="token ids"):
        run_census(tiny_model, torch.full((2, 8), 10**6), progress=False)
    with pytest.raises(InvalidArgumentError, match="min_query_pos"):
        run_census(tiny_model, TEXT, min_query_pos=-1, progress=False)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        run_census(tiny_model, TEXT, batch_size=0, progress=False)


def test_low_precision_models_give_close_numbers(bloom_dir):
    from headsurgeon import load_model

    tokens = to_sequences(load_model(bloom_dir), TEXT, seq_len=24, n_seqs=4).tokens
    full = run_census(load_model(bloom_dir), tokens, progress=False)
    half = run_census(load_model(bloom_dir, dtype="bfloat16"), tokens, progress=False)
    assert half.attrs["dtype"] == "bfloat16"
    for name in ("bos_mass", "max_weight", "output_share"):
        np.testing.assert_allclose(half[name], full[name], atol=0.03, err_msg=name)


@pytest.mark.parametrize("build", WITHOUT_ALIBI)
def test_models_without_alibi_have_empty_slopes(build):
    model = build()
    tokens = torch.randint(0, 30, (3, 12))
    census = run_census(model, tokens, prepend_bos=False, progress=False)
    positional = model.cfg.positional_embedding_type
    assert census["slope"].isna().all() and census.attrs["positional"] == positional != "alibi"
    assert census["reach_baseline"].isna().all() and census["reach_ratio"].isna().all()
    assert_matches_reference(census, reference_census(model, tokens))
