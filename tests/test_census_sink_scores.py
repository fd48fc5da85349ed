"""The standard scores (issue 39): Gu et al.'s sink rate and Sandoval-Segura et al.'s AHON-LN,
against a brute force from ``transformers``' eager attention, on a tiny BLOOM and the organism."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import headsurgeon as hs
from headsurgeon.census import GU_PROTOCOL, run_census, sink_rate
from headsurgeon.data import to_sequences
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.model_names import ORGANISM_DIR
from headsurgeon.probes import HeadStats


def eager_outputs(folder, tokens):
    """Every layer's attention weights ``[seq, head, T, T]`` (``output_attentions``) and head
    outputs ``z`` ``[seq, T, head, d_head]`` (the input of ``self_attention.dense``, hooked) of
    the ``transformers`` BLOOM in ``folder``, eager attention, float32."""
    from transformers import BloomForCausalLM

    hf = BloomForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    zs = []
    hooks = [
        block.self_attention.dense.register_forward_pre_hook(lambda m, args: zs.append(args[0]))
        for block in hf.eval().transformer.h
    ]
    try:
        with torch.no_grad():
            patterns = hf(tokens, output_attentions=True).attentions
    finally:
        for hook in hooks:
            hook.remove()
    n_heads = hf.config.n_head
    return (
        [a.double() for a in patterns],
        [z.double().unflatten(-1, (n_heads, -1)) for z in zs],
    )


def gu_sink_indicator(patterns, eps):
    """Gu et al.'s code (eval_sink_open_source.py, compute_attention_sink), transcribed: the
    importance of key k is sum_i A[i, k] / (T - k), a sink where it exceeds eps; per sample,
    layer and head, at k = 0. ``[seq, layer, head]`` booleans."""
    scores = torch.stack(patterns, 1)  # [seq, layer, head, T, T]
    n_tokens = scores.shape[-1]
    ratios = torch.arange(n_tokens, 0, -1).to(scores)[None, None, None, :].expand_as(scores)
    importance = (scores / ratios).sum(dim=-2)  # [seq, layer, head, key]
    return importance[..., 0] > eps


def ahon_ln_reference(zs):
    """Sandoval-Segura et al.'s AHON-LN (monkey_patch_llama.py, HonorHeads): per sequence the
    mean over tokens of ||A V|| per head, over the mean of that across the layer's heads;
    ``[seq, layer, head]``."""
    norms = torch.stack([z.norm(dim=-1).mean(1) for z in zs], 1)  # [seq, layer, head]
    return norms / norms.mean(-1, keepdim=True)


def check_scores(census, patterns, zs, eps):
    sinks = gu_sink_indicator(patterns, eps)
    assert sink_rate(census) == pytest.approx(sinks.double().mean().item(), abs=1e-12)
    np.testing.assert_allclose(
        census["sink_share"], sinks.double().mean(0).ravel().numpy(), rtol=0, atol=1e-12
    )
    sink_scores = torch.stack([a[..., 0].mean(-1) for a in patterns], 1)  # [seq, layer, head]
    np.testing.assert_allclose(census["sink_score"], sink_scores.mean(0).ravel(), atol=1e-6)
    expected = ahon_ln_reference(zs).mean(0).ravel().numpy()
    np.testing.assert_allclose(census["ahon_ln"], expected, rtol=1e-5, atol=1e-6)


def between(values, quantile):
    """A threshold halfway between two neighbouring distinct values of ``values`` near the given
    quantile: no value lies within float rounding of it."""
    distinct = np.unique(np.round(values, 9))
    i = int(quantile * (len(distinct) - 1))
    return float((distinct[i] + distinct[i + 1]) / 2)


def test_sink_rate_and_ahon_ln_equal_transformers_on_a_tiny_bloom(bloom_dir, tiny_model):
    tokens = torch.randint(0, 300, (9, 10), generator=torch.Generator().manual_seed(3))
    patterns, zs = eager_outputs(bloom_dir, tokens)
    # A threshold amid the alpha_0 of the head whose alpha_0 varies most across sequences: a
    # sink in some of them and not in others.
    per_sequence = torch.stack([a[..., 0].mean(-1) for a in patterns], 1).flatten(1).numpy()
    eps = between(per_sequence[:, per_sequence.std(0).argmax()], 0.5)
    census = run_census(tiny_model, tokens, batch_size=4, sink_eps=eps, progress=False)
    check_scores(census, patterns, zs, eps)
    assert census.attrs["sink_eps"] == eps
    shares = census["sink_share"]
    assert ((shares > 0) & (shares < 1)).any()  # thresholded per sequence, not on the mean
    mean_rule = float((census["sink_score"] > eps).mean())
    assert sink_rate(census) != mean_rule


def test_gu_protocol_on_the_organism_equals_transformers():
    """Gu et al.'s protocol (100 sequences x 64 tokens, eps 0.3) on the bundled organism."""
    model = hs.load_model("organism")
    tokens = to_sequences(model, None, seq_len=GU_PROTOCOL["seq_len"], n_seqs=100).tokens
    census = run_census(model, **GU_PROTOCOL, progress=False)
    assert (census.attrs["n_seqs"], census.attrs["seq_len"], census.attrs["sink_eps"]) == (
        100,
        64,
        0.3,
    )
    patterns, zs = eager_outputs(ORGANISM_DIR / "organism", tokens)
    check_scores(census, patterns, zs, 0.3)
    assert 0 < sink_rate(census) < 1


def test_the_scores_in_blocks_equal_the_dense_scores(tiny_model):
    tokens = torch.randint(0, 300, (3, 100), generator=torch.Generator().manual_seed(4))
    kwargs = dict(batch_size=2, sink_eps=0.02, progress=False)
    dense = run_census(tiny_model, tokens, block_size=100, **kwargs)
    blocked = run_census(tiny_model, tokens, block_size=32, **kwargs)
    np.testing.assert_allclose(blocked["ahon_ln"], dense["ahon_ln"], rtol=1e-6)
    np.testing.assert_array_equal(blocked["sink_share"], dense["sink_share"])


def test_ahon_ln_reads_z_before_w_o_and_averages_to_one_per_layer(tiny_model):
    tokens = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(5))
    before = run_census(tiny_model, tokens, progress=False)
    # A layer's per-sequence scores average 1 over its heads, so their means do too.
    np.testing.assert_allclose(before.groupby("layer")["ahon_ln"].mean(), 1.0, rtol=1e-12)
    with torch.no_grad():  # zero head 1's slice of W_O in the last layer (a pruned head)
        attn = tiny_model.blocks[-1].attn
        attn.W_O[1] = 0
    after = run_census(tiny_model, tokens, progress=False)
    pruned = (after["layer"] == tiny_model.cfg.n_layers - 1) & (after["head"] == 1)
    assert after.loc[pruned, "output_norm"].item() == 0
    assert after.loc[pruned, "ahon_ln"].item() == pytest.approx(
        before.loc[pruned, "ahon_ln"].item(), rel=1e-6
    )


def test_sink_rate_refuses_what_it_cannot_answer_exactly(tiny_model):
    tokens = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(6))
    census = run_census(tiny_model, tokens, progress=False)
    assert sink_rate(census) == sink_rate(census, 0.3)
    for eps in (1.5, -0.1, float("nan"), True):
        with pytest.raises(InvalidArgumentError, match="eps must be a finite number >= 0"):
            sink_rate(census, eps)
    with pytest.raises(InvalidArgumentError, match=r"sink_eps must be a finite number >= 0"):
        run_census(tiny_model, tokens, sink_eps=2, progress=False)
    with pytest.raises(InvalidArgumentError, match="sink_eps=0.3, not 0.5; .* sink_eps=0.5"):
        sink_rate(census, 0.5)
    with pytest.raises(InvalidArgumentError, match="lacks column.* sink_share"):
        sink_rate(census.drop(columns="sink_share"))
    with pytest.raises(InvalidArgumentError, match="expected a census DataFrame"):
        sink_rate(census["sink_share"])
    with pytest.raises(InvalidArgumentError, match="does not record the sink_eps"):
        sink_rate(pd.DataFrame(census))  # a copy without attrs, as read back from heads.csv
    with pytest.raises(InvalidArgumentError, match="empty or not finite"):
        sink_rate(census.iloc[:0])
    with pytest.raises(InvalidArgumentError, match="sink_eps must be"):
        HeadStats(tiny_model, sink_eps=-1)


# --- the classify tool: --preset gu, --sink-eps, heads.csv, the summary and the page ------------


def test_classify_preset_gu_writes_both_scores(bloom_dir, tmp_path, capsys, monkeypatch):
    from choreographer.browsers.chromium import Chromium
    from conftest import TEXT

    from headsurgeon.cli.classify import main

    monkeypatch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kwargs: None))
    (tmp_path / "text.txt").write_text(TEXT)
    argv = [str(bloom_dir), "--texts", str(tmp_path / "text.txt"), "--preset", "gu"]
    assert main([*argv, "--n-seqs", "6", "--out", str(tmp_path / "six")]) == 0  # explicit wins
    printed = capsys.readouterr().out
    assert "sink rate (Gu et al.): " in printed
    assert (
        "over 6 sequences x 64 tokens (Gu et al.'s protocol is 100 x 64 tokens, eps 0.3" in printed
    )
    assert "AHON-LN (Sandoval-Segura et al." in printed
    heads = pd.read_csv(tmp_path / "six" / "heads.csv")
    meta = json.loads((tmp_path / "six" / "heads.json").read_text())
    assert (
        {"sink_share", "ahon_ln"}
        <= set(heads.columns)
        <= set(meta["columns"])
        | {
            "label",
            "reason",
        }
    )
    assert (meta["metadata"]["n_seqs"], meta["metadata"]["seq_len"]) == (6, 64)
    assert meta["metadata"]["sink_eps"] == 0.3
    census = heads.copy()
    census.attrs["sink_eps"] = meta["metadata"]["sink_eps"]
    rate = (
        f"{sink_rate(census):.2%} of (sequence, head) pairs have sink_score alpha_0 (mean "
        "attention on position 0) > 0.3"
    )
    assert rate in printed
    page = (tmp_path / "six" / "index.html").read_text()
    assert '"ahon_ln":' in page and '"sink_share":' in page and "sink rate (Gu et al.)" in page


def test_classify_sink_eps_outside_0_1_is_one_line_before_any_model(tmp_path, capsys, no_model):
    from conftest import error_line

    from headsurgeon.cli.classify import main

    line = error_line(main, ["organism", "--sink-eps", "1.5", "--out", tmp_path / "x"], capsys)
    assert line == "error: --sink-eps must be a finite number >= 0 and <= 1, got 1.5"
    assert not (tmp_path / "x").exists()


def test_the_summary_names_gu_protocol_when_the_run_follows_it():
    from headsurgeon.classify import classify_heads
    from headsurgeon.reports.classify import format_summary

    census = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "bos_mass": [0.1, 0.6, 0.2, 0.3],
            "bos_mass_std": [0.0] * 4,
            "entropy": [1.0] * 4,
            "output_share": [0.3] * 4,
            "sink_share": [0.0, 0.9, 0.1, 0.0],
            "ahon_ln": [1.2, 0.05, 1.0, 1.0],
        }
    )
    census.attrs = {"n_seqs": 100, "seq_len": 64, "sink_eps": 0.3}
    summary = format_summary(classify_heads(census))
    assert (
        "sink rate (Gu et al.): 25.00% of (sequence, head) pairs have sink_score alpha_0 (mean "
        "attention on position 0) > 0.3, "
        "over 100 sequences x 64 tokens (Gu et al.'s protocol)"
    ) in summary
    assert "low = inactive): lowest L0H1 0.050, L1H0 1.000" in summary
    census.attrs["sink_eps"] = 0.5
    assert "(Gu et al.'s protocol is 100 x 64 tokens, eps 0.3: --preset gu)" in format_summary(
        classify_heads(census)
    )
