"""The census's fused path (run_census(reach=False)): every column against the brute-force
reference from run_with_cache's patterns, the model left as it was, and each refusal in words."""

from __future__ import annotations

import pytest
import torch
from test_census import TEXT, assert_matches_reference, reference_census

from headsurgeon import load_model, mitigation, run_census
from headsurgeon.backend import MAJOR
from headsurgeon.census import COLUMNS
from headsurgeon.data import to_sequences
from headsurgeon.loading import ModelShape, random_model
from headsurgeon.probes import HeadStats

REACH = ("reach", "reach_baseline", "reach_ratio")


def fused_census(model, tokens, **kwargs):
    census = run_census(model, tokens, reach=False, progress=False, **kwargs)
    if MAJOR >= 4:  # the bridge's attention has no fused path: the blocked one, said so
        assert census.attrs["attention"] == "blocked"
        assert "4.x" in census.attrs["blocked_because"]
    else:
        assert census.attrs["attention"] == "fused", census.attrs["blocked_because"]
    return census


def without_reach(expected):
    return {name: values for name, values in expected.items() if name not in REACH}


@pytest.mark.parametrize(("min_query_pos", "batch_size"), [(1, 3), (0, 8)])
def test_fused_census_equals_brute_force_reference(tiny_model, min_query_pos, batch_size):
    tokens = to_sequences(tiny_model, TEXT, seq_len=24, n_seqs=7).tokens
    census = fused_census(tiny_model, tokens, min_query_pos=min_query_pos, batch_size=batch_size)
    assert list(census.columns) == [name for name in COLUMNS if name not in REACH]
    assert census.attrs["reach_eps"] is None
    expected = reference_census(tiny_model, tokens, min_query_pos)
    assert_matches_reference(census, without_reach(expected))


def test_fused_census_of_the_organism_and_a_config_model():
    """The bundled organism (its bias hook) at 300 tokens, and a model built from a config with
    no tokenizer: the same numbers as brute force, within the tests' 1e-6."""
    organism = load_model("organism")
    tokens = to_sequences(organism, TEXT * 3, seq_len=300, n_seqs=2).tokens
    census = fused_census(organism, tokens)
    assert census.attrs["float64_heads"] == 0  # float32 within its bound at this length
    assert_matches_reference(census, without_reach(reference_census(organism, tokens)))
    model = random_model(ModelShape(n_layers=2, n_heads=6, d_model=48, d_vocab=64, n_ctx=64))
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(0))
    census = fused_census(model, tokens)
    assert_matches_reference(census, without_reach(reference_census(model, tokens)))


@pytest.mark.skipif(MAJOR >= 4, reason="the fused path replaces TransformerLens 3.x's attention")
def test_the_model_is_left_as_it_was_even_when_the_census_fails(monkeypatch):
    model = load_model("organism")
    tokens = to_sequences(model, TEXT, seq_len=40, n_seqs=2).tokens
    before = [dict(block.attn._forward_pre_hooks) for block in model.blocks]
    run_census(model, tokens, reach=False, progress=False)

    def fail(self, layer, stats):
        raise RuntimeError("stopped")

    monkeypatch.setattr(HeadStats, "fused_sums", fail)
    with pytest.raises(RuntimeError, match="stopped"):
        run_census(model, tokens, reach=False, progress=False)
    for block, hooks in zip(model.blocks, before, strict=True):
        assert dict(block.attn._forward_pre_hooks) == hooks  # the bias hooks, the same objects
        assert "forward" not in vars(block.attn)
    assert all(not point.fwd_hooks for point in model.hook_dict.values())


@pytest.mark.skipif(MAJOR >= 4, reason="the fused path replaces TransformerLens 3.x's attention")
def test_what_the_fused_path_cannot_compute_takes_the_blocked_path():
    """An active mitigation (another bias), a hook on the pattern (it would not fire) and the
    default reach: the blocked path, with the reason in attrs."""
    model = load_model("organism")
    tokens = to_sequences(model, TEXT, seq_len=40, n_seqs=2).tokens
    assert run_census(model, tokens, progress=False).attrs["blocked_because"] == (
        "reach needs every weight"
    )
    with mitigation(model, "clamped", c=16):
        census = run_census(model, tokens, reach=False, progress=False)
    assert census.attrs["attention"] == "blocked"
    assert "clamped mitigation" in census.attrs["blocked_because"]
    seen = []
    model.blocks[1].attn.hook_pattern.add_hook(lambda pattern, hook: seen.append(hook.name))
    try:
        census = run_census(model, tokens, reach=False, progress=False)
    finally:
        model.reset_hooks()
    assert census.attrs["blocked_because"] == "a hook on blocks.1.attn.hook_pattern would not fire"
    assert seen  # the user's hook saw the patterns


def test_classify_no_reach_writes_the_same_labels_without_reach(tmp_path):
    """``classify --no-reach``: the labels and every other column as the default run's (within
    the fused path's 1e-6), no reach column, and heads.json saying which path ran."""
    import json

    import pandas as pd

    from headsurgeon.cli.classify import main

    argv = ["organism-injured", "--n-seqs", "3", "--seq-len", "48", "--no-secondary-sinks"]
    assert main([*argv, "--out", str(tmp_path / "default")]) == 0
    assert main([*argv, "--no-reach", "--out", str(tmp_path / "fast")]) == 0
    default = pd.read_csv(tmp_path / "default" / "heads.csv")
    fast = pd.read_csv(tmp_path / "fast" / "heads.csv")
    assert not set(REACH) & set(fast.columns)
    assert list(fast["label"]) == list(default["label"])
    numbers = [c for c in fast.columns if c not in ("label", "reason")]
    pd.testing.assert_frame_equal(fast[numbers], default[numbers], rtol=1e-6, atol=1e-6)
    metadata = json.loads((tmp_path / "fast" / "heads.json").read_text())
    found = json.dumps(metadata)
    assert ('"attention": "fused"' in found) == (MAJOR < 4)
