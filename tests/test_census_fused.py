"""The census's fused path (run_census(reach=False)): every column against the brute-force
reference from run_with_cache's patterns, the model left as it was, and each refusal in words."""

from __future__ import annotations

import pytest
import torch
from test_census import TEXT, assert_matches_reference, reference_census

from headsurgeon import load_model, mitigation, run_census
from headsurgeon.backend import MAJOR, fused_attention
from headsurgeon.backend.fused import windowed_attention
from headsurgeon.census import COLUMNS
from headsurgeon.data import to_sequences
from headsurgeon.errors import UnsupportedArchitectureError
from headsurgeon.loading import ModelShape, model_info, random_model
from headsurgeon.probes import HeadStats

REACH = ("reach", "reach_baseline", "reach_ratio")


def fused_census(model, tokens, **kwargs):
    census = run_census(model, tokens, reach=False, progress=False, **kwargs)
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
    """The bundled organism (its bias hook) at 160 tokens (three blocks of 64 query rows), and a
    model built from a config with no tokenizer: the same numbers as brute force, within 1e-6."""
    organism = load_model("organism")
    tokens = to_sequences(organism, TEXT * 3, seq_len=160, n_seqs=2).tokens
    census = fused_census(organism, tokens)
    assert census.attrs["float64_heads"] == 0  # float32 within its bound at this length
    assert_matches_reference(census, without_reach(reference_census(organism, tokens)))
    model = random_model(ModelShape(n_layers=2, n_heads=6, d_model=48, d_vocab=64, n_ctx=64))
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(0))
    census = fused_census(model, tokens)
    assert_matches_reference(census, without_reach(reference_census(model, tokens)))


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
        assert not {"forward", "_reconstruct_attention"} & set(vars(block.attn))  # 3.x, 4.x
    assert all(not point.fwd_hooks for point in model.hook_dict.values())


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


def test_a_padded_batch_is_refused_in_one_line():
    """Padding (keys the causal kernel would not mask): one line, on either major."""
    model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=16, d_vocab=32, n_ctx=16))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # three pads on the left of the first sequence
    slopes = model_info(model).slopes
    with (
        torch.no_grad(),
        pytest.raises(UnsupportedArchitectureError, match="whole sequences"),
        fused_attention(
            model, slopes, lambda layer, *qkv, **bias: windowed_attention(*qkv, **bias)
        ),
    ):
        model(tokens, attention_mask=mask)


@pytest.mark.skipif(MAJOR < 4, reason="TransformerLens 3.x has no MPT/Falcon adapter")
def test_bridged_families_with_their_own_bias_or_ours():
    """4.x: MPT through headsurgeon's bias hook (-m (t - j)), BLOOM and MPT without it (their
    own bias of the key position, handed to the kernel as it is), Falcon with its own bfloat16
    products in its mask (one key-value head and one per head): the same numbers as brute
    force."""
    from transformers import FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM

    from headsurgeon.loading import from_hf_model

    torch.manual_seed(0)
    mpt = MptConfig(d_model=48, n_heads=6, n_layers=2, vocab_size=64, max_seq_len=64)
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(1))
    bloom = random_model(ModelShape(n_layers=2, n_heads=6, d_model=48, d_vocab=64, n_ctx=64))
    for model in (from_hf_model(MptForCausalLM(mpt).eval()), bloom):
        for own in (False, True):
            if own:
                for block in model.blocks:
                    block.attn.headsurgeon_alibi_hook.remove()
            census = fused_census(model, tokens)
            assert_matches_reference(census, without_reach(reference_census(model, tokens)))
    for multi_query in (False, True):
        falcon = FalconConfig(
            hidden_size=48,
            num_attention_heads=6,
            num_hidden_layers=2,
            vocab_size=64,
            alibi=True,
            multi_query=multi_query,
        )
        model = from_hf_model(FalconForCausalLM(falcon).eval())
        census = fused_census(model, tokens)
        if multi_query:  # the reference reads per-head W_O, which shared heads refuse: blocked
            blocked = run_census(model, tokens, progress=False)
            expected = {name: blocked[name].to_numpy() for name in census.columns}
        else:
            expected = without_reach(reference_census(model, tokens))
        assert_matches_reference(census, expected)


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
    assert '"attention": "fused"' in found
