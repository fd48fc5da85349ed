"""headsurgeon.blindness: analytic and measured blindness, mitigations through hooks, the CLI."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import head_weight, make_bloom_checkpoint, tl3_only

import headsurgeon as hs
from headsurgeon import alibi, load_model, plots
from headsurgeon.backend.weights import head_tensors
from headsurgeon.blindness import (
    ANALYSED_DTYPES,
    analytic_blindness,
    measure_blindness,
    mitigation,
)
from headsurgeon.cli import run
from headsurgeon.cli.blindness import main
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError

SCORES = "blocks.0.attn.hook_attn_scores"


@pytest.fixture(scope="module")
def bloom8_dir(tmp_path_factory):
    """One layer, 8 heads: slopes 0.5 ... 0.0039, steep enough to go blind within 256 tokens."""
    return make_bloom_checkpoint(tmp_path_factory.mktemp("bloom8"), n_heads=8, n_layers=1)


@pytest.fixture()
def flat_model(bloom8_dir):
    """Queries zeroed: every content logit is exactly 0, so the logits are the ALiBi bias."""
    model = load_model(bloom8_dir)
    with torch.no_grad():
        head_weight(model, 0, "W_Q").zero_()
        head_tensors(model, 0)["b_Q"].param.zero_()
    return model


def _tokens(n_seqs: int, n_pos: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 300, (n_seqs, n_pos), generator=torch.Generator().manual_seed(seed))


def test_analytic_blindness_by_name_needs_no_weights():
    df = analytic_blindness("bloom-560m")
    assert len(df) == 24 * 16 * len(ANALYSED_DTYPES) * len(alibi.LIMITS)
    fp32 = df[(df.dtype == "float32") & (df.limit == "normal") & (df.layer == 5)]
    assert fp32.blind_distance.tolist()[0] == 124 and fp32.blind_distance.tolist()[-1] == 22359
    assert set(df.columns) >= {"layer", "head", "slope", "dtype", "limit", "blind_distance"}
    assert (df.label == "blind").sum() > 0 and (df.label == "sighted").sum() > 0
    heads_176b = analytic_blindness(
        "bloom-176b", dtypes=["bf16"], limits=["zero"], context_length=64
    )
    assert heads_176b["head"].nunique() == 112 and set(heads_176b.dtype) == {"bfloat16"}


@pytest.mark.parametrize("convention", ["hf", "tl"])
def test_measured_zeros_agree_with_analytic_distances(flat_model, convention):
    n = 256
    result = measure_blindness(
        flat_model, _tokens(1, n), convention=convention, n_buckets=n, progress=False
    )
    by_distance = result.by_distance.sort_values("distance_lo")
    n_checked = 0
    for row in result.by_head.itertuples():
        m, analytic = row.slope, row.analytic_distance
        # Real zeros start up to ln(Z)/m earlier; Z <= 1/(1 - e^-m) with equal content logits.
        shift = math.ceil(math.log(1 / (1 - math.exp(-m))) / m) + 1
        zeros = by_distance[(by_distance.dtype == row.dtype) & (by_distance["head"] == row.head)]
        if analytic < n:
            assert (zeros.zero_fraction.to_numpy()[int(analytic) :] == 1).all()
            n_checked += 1
        if analytic - shift >= n:
            assert math.isnan(row.first_zero_distance) and row.label == "sighted"
        elif not math.isnan(row.first_zero_distance):
            assert analytic - shift <= row.first_zero_distance <= analytic
    assert n_checked >= 5  # float16 heads 0-3 and float32 / bfloat16 head 0
    total = result.by_length[result.by_length.context_length == n]
    per_dtype = result.by_distance.groupby("dtype").zero_entries.sum()
    assert (total.set_index("dtype").zero_entries == per_dtype[total.dtype].to_numpy()).all()


def test_zeros_past_float64s_own_underflow_are_counted(flat_model):
    # Head 0 (slope 0.5) puts distances > ~1490 below float64's smallest subnormal as well.
    n = 1600
    result = measure_blindness(
        flat_model, _tokens(1, n), dtypes=["float32"], n_buckets=n, progress=False
    )
    head0 = result.by_distance[result.by_distance["head"] == 0].sort_values("distance_lo")
    analytic = int(result.by_head.analytic_distance.iloc[0])
    assert (head0.zero_fraction.to_numpy()[analytic:] == 1).all()


def test_measurement_streams_batches_into_fixed_sums(flat_model):
    tokens = _tokens(3, 96, seed=1)
    one = measure_blindness(flat_model, tokens, dtypes=["float16"], batch_size=1, progress=False)
    three = measure_blindness(flat_model, tokens, dtypes=["float16"], batch_size=3, progress=False)
    pd.testing.assert_frame_equal(one.by_head, three.by_head)
    pd.testing.assert_frame_equal(one.by_length, three.by_length)
    assert one.n_seqs == 3 and one.by_length.context_length.tolist() == [16, 32, 64, 96]
    lost = one.by_head.lost_mass.iloc[0]
    assert 0 < lost < 1e-5 and one.by_head.max_lost_weight.iloc[0] < 2**-24


def _scores(model, tokens, name=SCORES) -> torch.Tensor:
    _, cache = model.run_with_cache(tokens, names_filter=name)
    return cache[name]


def _masked(scores: torch.Tensor) -> torch.Tensor:
    """Masked cells: -inf on TransformerLens 3.x, the float minimum on 4.x."""
    return scores <= torch.finfo(scores.dtype).min


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("standard", {}),
        ("clamped", {"c": 3.0}),
        ("log", {}),
        ("robust", {"context": 32, "dtype": "float16", "mode": "clip"}),
    ],
)
def test_bias_mitigations_change_scores_exactly_as_documented(flat_model, kind, params):
    tokens = _tokens(2, 40)
    bias = alibi.bias_from_distance(
        kind, alibi.slopes(8), alibi.distance_rows(40, 40), **params
    ).expand(2, -1, -1, -1)
    causal = torch.ones(40, 40).tril().bool()
    with mitigation(flat_model, kind, **params):
        scores = _scores(flat_model, tokens)
    assert torch.equal(scores[..., causal], bias[..., causal])
    assert torch.equal(_masked(scores), ~causal.expand_as(scores))


def test_soft_cap_caps_every_unmasked_logit_and_composes(tiny_model, flat_model):
    tokens = _tokens(2, 24)
    causal = torch.ones(24, 24).tril().bool()
    plain = _scores(tiny_model, tokens)
    with mitigation(tiny_model, "softcap", c=0.5):
        capped = _scores(tiny_model, tokens)
    assert torch.equal(capped[..., causal], alibi.soft_cap(plain, 0.5)[..., causal])
    assert torch.equal(capped[..., ~causal], plain[..., ~causal])  # still masked
    with mitigation(flat_model, "softcap", c=2.0), mitigation(flat_model, "log"):
        both = _scores(flat_model, tokens)
    log_bias = alibi.bias_from_distance("log", alibi.slopes(8), alibi.distance_rows(24, 24))
    assert torch.equal(
        both[..., causal], alibi.soft_cap(log_bias, 2.0).expand_as(both)[..., causal]
    )


@pytest.mark.parametrize("padded", [False, True])
def test_soft_cap_gives_masked_keys_exactly_zero_weight(tiny_model, padded):
    tokens = _tokens(2, 24)
    mask = torch.ones(2, 24, dtype=torch.long)
    if padded:
        mask[0, 20:] = 0  # right padding: keys a causal mask alone would not hide
    hidden = ~torch.ones(24, 24).tril().bool() | (mask[:, None, None, :] == 0)
    with mitigation(tiny_model, "softcap", c=0.5):
        _, cache = tiny_model.run_with_cache(
            tokens,
            attention_mask=mask if padded else None,
            names_filter=lambda name: name.endswith("hook_pattern"),
        )
    for layer in range(tiny_model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert (pattern[hidden.expand_as(pattern)] == 0).all()
        assert (pattern[~hidden.expand_as(pattern)] > 0).all()


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("clamped", {"c": 1.0}),
        ("log", {}),
        ("robust", {"context": 1000, "dtype": "float16"}),
        ("softcap", {"c": 1.0}),
    ],
)
def test_mitigation_leaves_the_model_bit_identical(tiny_model, kind, params):
    tokens = _tokens(2, 48)
    before_logits = tiny_model(tokens)
    before_state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    attns = [block.attn for block in tiny_model.blocks]
    cached = [getattr(attn, "alibi", None) for attn in attns]  # 3.x's bias tensor
    with pytest.raises(RuntimeError, match="inside"), mitigation(tiny_model, kind, **params):
        assert not torch.equal(tiny_model(tokens), before_logits)
        raise RuntimeError("an error inside the context")
    after_state = tiny_model.state_dict()
    assert all(torch.equal(before_state[k], after_state[k]) for k in before_state)
    assert all(
        getattr(attn, "alibi", None) is bias for attn, bias in zip(attns, cached, strict=True)
    )
    assert not any("headsurgeon_bias_builder" in attn.__dict__ for attn in attns)
    assert all(not hp.fwd_hooks for hp in tiny_model.hook_dict.values())
    assert torch.equal(tiny_model(tokens), before_logits)


def plain_transformer():
    """A user's own 3.x HookedTransformer with learned positions."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=1,
        d_model=16,
        d_head=4,
        n_heads=4,
        n_ctx=32,
        d_vocab=50,
        act_fn="gelu",
    )
    return HookedTransformer(cfg)


def rotary_model():
    """A random 1-layer GPT-NeoX (rotary positions) as the installed major's model; 2 heads of
    8 dimensions, as 3.x rotates only a quarter of each head."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from headsurgeon.loading import from_hf_model

    config = GPTNeoXConfig(
        num_hidden_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=32,
        architectures=["GPTNeoXForCausalLM"],
    )
    torch.manual_seed(0)
    return from_hf_model(GPTNeoXForCausalLM(config).eval(), name="neox")


WITHOUT_ALIBI = [pytest.param(plain_transformer, marks=tl3_only), rotary_model]


@pytest.mark.parametrize("build", WITHOUT_ALIBI)
def test_models_without_alibi_or_without_the_exact_hook(build):
    gpt = build()
    with pytest.raises(UnsupportedArchitectureError, match="ALiBi models only"):
        analytic_blindness(gpt)
    measured = measure_blindness(gpt, _tokens(1, 16) % 50, dtypes=["float16"], progress=False)
    assert measured.by_head.analytic_distance.isna().all()
    with pytest.raises(UnsupportedArchitectureError, match="only softcap applies"):
        mitigation(gpt, "log").__enter__()
    with mitigation(gpt, "softcap", c=5.0):
        gpt(_tokens(1, 8) % 50)


@tl3_only  # 4.x builds no ALiBi of its own: a bridge always has Hugging Face's slopes
def test_mitigations_keep_a_transformerlens_models_own_slopes():
    # 6 heads: TransformerLens's slopes differ from Hugging Face's; a mitigation must not
    # switch them (standard and a clamp that never binds change nothing).
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=24,
        d_head=4,
        n_heads=6,
        n_ctx=64,
        d_vocab=50,
        act_fn="gelu",
        positional_embedding_type="alibi",
        seed=0,
    )
    model = HookedTransformer(cfg)
    tokens = _tokens(2, 40) % 50
    plain = model(tokens)
    for kind, params in [("standard", {}), ("clamped", {"c": 1e6})]:
        with mitigation(model, kind, **params):
            torch.testing.assert_close(model(tokens), plain, rtol=0, atol=1e-5)
    with mitigation(model, "log"):
        assert (model(tokens) - plain).abs().max() > 1e-3
    torch.testing.assert_close(model(tokens), plain, rtol=0, atol=0)
    assert not hasattr(model, "headsurgeon_info")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: analytic_blindness("bloom-560m", dtypes=["float64"]), "unknown dtype"),
        (lambda m: analytic_blindness("bloom-560m", limits=["tiny"]), "unknown limit"),
        (lambda m: analytic_blindness("bloom-560m", context_length=0), "integer >= 1"),
        (lambda m: analytic_blindness("bloom-560m", bias="cosine"), "unknown bias kind"),
        (lambda m: measure_blindness(m, _tokens(1, 8), convention="jax"), "unknown convention"),
        (lambda m: measure_blindness(m.half(), _tokens(1, 8)), "needs the model in float32"),
        (lambda m: mitigation(m, "clamped", c=-1.0).__enter__(), "number > 0"),
        (lambda m: mitigation(m, "softcap").__enter__(), "needs c"),
        (lambda m: mitigation(m, "robust", context=0).__enter__(), "integer >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_model, call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call(tiny_model)


def test_cli_writes_tables_and_figures(bloom8_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = [str(bloom8_dir), "--measure", "--seq-len", "64", "--n-seqs", "2", "--out", str(out)]
    assert main([*args, "--dtypes", "float16", "bfloat16", "--limit", "zero"]) == 0
    printed = capsys.readouterr().out
    assert "float16" in printed and "share" in printed
    table = pd.read_csv(out / "blindness.csv")
    assert {"layer", "head", "slope", "dtype", "limit", "blind_distance"} <= set(table.columns)
    assert set(table.dtype) == {"float16", "bfloat16"}
    for name in ("measured_by_head", "measured_by_distance", "measured_by_length"):
        assert not pd.read_csv(out / f"{name}.csv").empty
    for name in ("blind_distance", "zero_fraction", "analytic_vs_measured", "reach"):
        assert f'"name":"{name}"' in (out / "index.html").read_text()  # every figure is there
        if plots.has_browser():  # without one the PNGs are skipped (tests/plots/test_no_browser.py)
            assert (out / f"{name}.png").stat().st_size > 1000
    # The summary's order: how the model was trained (here: unknown), whether precision
    # matters (here: not measured), reach (beside its slope's, beside the first exact zero),
    # exact zeros.
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("training numerics of bloom80: unknown")
    summary = summary[1:]
    assert summary[0].startswith("precision: not measured") and "exact zeros" in summary[1]
    assert summary[2].startswith("reach") and summary[3].startswith("reach beside its slope's")
    assert "arithmetic of the slope" in summary[4] and "blind distance" in summary[5]
    # Its terms said where they print, and the text it read named (issue 52).
    assert "per dtype and limit (where a weight falls below the dtype's smallest" in summary[5]
    assert (
        "measured (hf convention: softmax in float32, weights cast to the dtype, as Hugging "
        "Face; 2 × 64 tokens of bundled held-out corpora (shakespeare, python-docs)): share"
    ) in printed
    census = pd.read_csv(out / "census.csv")
    assert census["reach"].notna().all() and (census["reach"] >= 0).all()
    assert census["reach_baseline"].notna().all()
    assert "reach" in (out / "index.html").read_text()


def test_cli_reach_is_the_census_of_the_measured_text(bloom8_dir, tmp_path):
    """The tool's reach column is run_census's on the same tokens, with --reach-eps."""
    out = tmp_path / "out"
    args = [str(bloom8_dir), "--measure", "--seq-len", "64", "--n-seqs", "2", "--out", str(out)]
    assert main([*args, "--dtypes", "float32", "--reach-eps", "0.05"]) == 0
    model = hs.load_model(bloom8_dir)
    tokens = hs.to_sequences(model, seq_len=64, n_seqs=2).tokens
    expected = hs.run_census(model, tokens, reach_eps=0.05, progress=False)["reach"]
    np.testing.assert_array_equal(pd.read_csv(out / "census.csv")["reach"], expected)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bloom-560m", "--dtypes", "float64"], "unknown dtype"),
        (["bloom-560m", "--mitigation", "clamped"], "needs --c"),
        (["bloom-560m", "--max-distance", "0"], "expected a positive integer"),
        (["bloom-560m", "--reach-eps", "2"], "--reach-eps"),
        (["no-such-model"], "unknown model"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run("blindness", [*args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("error: ") and message in err
    assert "\n" not in err and not (tmp_path / "out").exists()


def test_cli_refuses_an_occupied_output_folder_before_measuring(
    bloom8_dir, tmp_path, monkeypatch, capsys
):
    import headsurgeon.cli.blindness_run

    def not_now(*args, **kwargs):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(headsurgeon.cli.blindness_run, "load_model", not_now)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        run("blindness", [str(bloom8_dir), "--measure", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "already holds files" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
