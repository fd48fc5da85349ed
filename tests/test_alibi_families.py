"""MPT and Falcon-ALiBi (TransformerLens 4.x): slopes, census, blindness, mitigations, importance
and loading against transformers' eager attention (``output_attentions=True``) on tiny models."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM

from headsurgeon import alibi, load_model, run_census
from headsurgeon.backend import MAJOR
from headsurgeon.blindness import analytic_blindness, measure_blindness, mitigation
from headsurgeon.classify import Thresholds, classify_heads
from headsurgeon.errors import CheckpointError, UnsupportedArchitectureError
from headsurgeon.exact_alibi import install_hf_bias
from headsurgeon.importance import head_importance
from headsurgeon.loading import alibi_slopes, from_hf_model, model_shape
from headsurgeon.long_context import continuation_logprobs

needs_tl4 = pytest.mark.skipif(MAJOR < 4, reason="TransformerLens 3.x has no MPT/Falcon adapter")

# Falcon variants: the falcon-rw layout (sequential), parallel attention, multi-query.
FALCON = {
    "falcon": {},
    "falcon-parallel": {"parallel_attn": True},
    "falcon-mq": {"multi_query": True},
}
FAMILIES = ["mpt", *FALCON]


def hf_model(family: str, *, n_heads: int = 4, d_model: int = 64, scale: float = 1.0, **extra):
    """A tiny random transformers model of ``family`` (eager attention, float32); ``scale``
    multiplies the fused QKV weights, making content logits large enough to underflow."""
    torch.manual_seed(0)
    if family == "mpt":
        attn = {"alibi": True, "alibi_bias_max": 16}
        config = MptConfig(
            d_model=d_model,
            n_heads=n_heads,
            n_layers=2,
            vocab_size=128,
            max_seq_len=64,
            attn_config=attn,
            **extra,
        )
        model = MptForCausalLM(config)
    else:
        falcon_rw = {
            "new_decoder_architecture": False,
            "multi_query": False,
            "parallel_attn": False,
            "bias": True,
        }
        config = FalconConfig(
            hidden_size=d_model,
            num_attention_heads=n_heads,
            num_hidden_layers=2,
            vocab_size=128,
            alibi=True,
            **(falcon_rw | FALCON[family] | extra),
        )
        model = FalconForCausalLM(config)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for attn in _attention_layers(model):
            _qkv(attn).weight.mul_(scale)
    return model.eval()


def _attention_layers(hf) -> list[torch.nn.Module]:
    return [m for m in hf.modules() if type(m).__name__ in ("MptAttention", "FalconAttention")]


def _qkv(attn) -> torch.nn.Module:
    """The fused query-key-value projection of an MPT or Falcon attention layer."""
    return getattr(attn, "Wqkv", None) or attn.query_key_value


def _out(attn) -> torch.nn.Module:
    """Its output projection, whose input is every head's ``z``."""
    return getattr(attn, "out_proj", None) or attn.dense


def converted(hf):
    """The TransformerLens model of a copy of ``hf`` (the bridge takes over the module it wraps)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MPT's ignored alibi_bias_max, tested on its own
        return from_hf_model(copy.deepcopy(hf))


def eager(hf, tokens):
    """transformers' eager attention patterns (float64) and each layer's per-head writes
    ``z_h W_O[h]`` (``[batch, pos, head, d_model]``, no bias), and the logits."""
    z = []
    layers = _attention_layers(hf)
    outs = [_out(a) for a in layers]
    handles = [o.register_forward_pre_hook(lambda m, args: z.append(args[0])) for o in outs]
    with torch.no_grad():
        out = hf(tokens, output_attentions=True)
    for h in handles:
        h.remove()
    n_heads = getattr(layers[0], "n_heads", None) or layers[0].num_heads
    writes = []
    for zl, o in zip(z, outs, strict=True):
        zh = zl.double().unflatten(-1, (n_heads, -1))
        w_o = o.weight.detach().double().unflatten(-1, (n_heads, -1))  # [d_model, head, d_head]
        writes.append(torch.einsum("bphd,mhd->bphm", zh, w_o))
    return [a.double() for a in out.attentions], writes, out.logits


def reference_census(attentions, writes, min_query_pos=1):
    """Every census column (but layer, head, slope) from eager patterns, in float64."""
    out = {}
    for A, w in zip(attentions, writes, strict=True):
        n_pos = A.shape[-1]
        t = torch.arange(n_pos, dtype=torch.float64)
        rows = slice(min_query_pos, None)
        a = A[:, :, rows]  # [seq, head, row, key]
        per_seq_bos = a[..., 0].mean(-1)
        ent = -(A * A.clamp(min=1e-300).log()).sum(-1)[:, :, rows]
        distance = (A * (t[:, None] - t[None, :]).clamp(min=0)).sum(-1)[:, :, rows]
        diag = A.diagonal(dim1=-2, dim2=-1)[:, :, rows]
        prev = A.diagonal(offset=-1, dim1=-2, dim2=-1)[:, :, max(min_query_pos, 1) - 1 :]
        norms = w[:, rows].norm(dim=-1).mean((0, 1))  # [head]
        layer_norm = w[:, rows].sum(2).norm(dim=-1).mean()
        values = {
            "bos_mass": per_seq_bos.mean(0),
            "bos_mass_std": per_seq_bos.std(0) if len(A) > 1 else torch.zeros(A.shape[1]),
            "sink_score": A[..., 0].mean((0, 2)),
            "entropy": ent.mean((0, 2)),
            "max_weight": a.amax(-1).mean((0, 2)),
            "mean_distance": distance.mean((0, 2)),
            "self_mass": diag.mean((0, 2)),
            "prev_mass": prev.mean((0, 2)),
            "output_norm": norms,
            "output_share": norms / layer_norm,
        }
        for name, v in values.items():
            out.setdefault(name, []).append(v.numpy())
    return {name: np.concatenate(v) for name, v in out.items()}


def applied_slopes(hf, n_pos=8):
    """The slope per token the model's eager attention applies, measured: with its QKV weights
    zeroed every content logit is 0, so ``ln A[t, k + 1] - ln A[t, k]`` is the slope."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for attn in _attention_layers(hf):
            for p in _qkv(attn).parameters():
                p.zero_()
        A = hf(torch.zeros(1, n_pos, dtype=torch.long), output_attentions=True).attentions[0]
    return A[0, :, -1].double().log().diff(dim=-1).mean(-1)


# --- TransformerLens 3.x: one line ------------------------------------------------------------


@pytest.mark.skipif(MAJOR >= 4, reason="TransformerLens 4.x loads MPT and Falcon")
@pytest.mark.parametrize("family", ["mpt", "falcon"])
def test_tl3_refuses_mpt_and_falcon_in_one_line(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    for load in (lambda: from_hf_model(hf), lambda: load_model(tmp_path)):
        with pytest.raises(UnsupportedArchitectureError) as error:
            load()
        message = str(error.value)
        assert "\n" not in message and "TransformerLens 3.x" in message
        assert "MPT and Falcon need 4.x" in message


# --- slopes -----------------------------------------------------------------------------------


@needs_tl4
@pytest.mark.parametrize("family", ["mpt", "falcon"])
@pytest.mark.parametrize(("n_heads", "d_model"), [(4, 64), (6, 48)])
def test_reported_slopes_are_the_ones_the_model_applies(family, n_heads, d_model):
    hf = hf_model(family, n_heads=n_heads, d_model=d_model)
    model = converted(hf)
    measured = applied_slopes(hf)
    slopes = alibi_slopes(model)
    np.testing.assert_allclose(slopes.double(), measured, rtol=1e-4)
    census = run_census(model, torch.randint(0, 128, (2, 16)), progress=False)
    np.testing.assert_allclose(census["slope"], slopes.repeat(2).double(), rtol=1e-7)
    analytic = analytic_blindness(model, dtypes=["float32"], limits=["normal"])
    np.testing.assert_allclose(analytic["slope"], slopes.repeat(2).double(), rtol=1e-7)
    expected = math.ceil(-alibi.log_limit("float32", "normal") / slopes[0].item())
    assert analytic["blind_distance"].iloc[0] == expected


@needs_tl4
def test_mpt_applies_bias_max_8_whatever_its_config_says():
    """transformers' MptModel builds its bias without the config's alibi_bias_max (16 here)."""
    hf = hf_model("mpt")
    assert hf.config.attn_config.alibi_bias_max == 16
    np.testing.assert_allclose(applied_slopes(hf), alibi.mpt_slopes(4, 8).double(), rtol=1e-4)
    with pytest.warns(UserWarning, match="alibi_bias_max=16.*alibi_bias_max=8"):
        from_hf_model(copy.deepcopy(hf))


@needs_tl4
def test_falcon_slope_is_scaled_by_sqrt_d_head():
    model = converted(hf_model("falcon", n_heads=4, d_model=64))  # d_head 16
    torch.testing.assert_close(alibi_slopes(model), alibi.slopes(4) / 4, rtol=0, atol=0)


# --- census, classification, blindness, importance against eager -----------------------------


@needs_tl4
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [None, 8])
def test_census_matches_eager(family, block_size):
    hf = hf_model(family)
    tokens = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(1))
    census = run_census(converted(hf), tokens, block_size=block_size, progress=False)
    expected = reference_census(*eager(hf, tokens)[:2])
    for name, values in expected.items():
        np.testing.assert_allclose(census[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    # A sink threshold between the heads' BOS masses splits them into two labels.
    thresholds = Thresholds(sink=float(np.median(expected["bos_mass"])))
    reference = census.assign(**{name: expected[name] for name in ("bos_mass", "output_share")})
    labels = classify_heads(census, thresholds)["label"]
    assert labels.nunique() == 2
    assert labels.tolist() == classify_heads(reference, thresholds)["label"].tolist()


@needs_tl4
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [None, 8])
def test_measured_zeros_are_eager_zeros(family, block_size):
    """Large content logits underflow in float32: the zeros counted per layer, head and
    distance are exactly the eager pattern's zeros on causal entries."""
    hf = hf_model(family, scale=40.0)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    measured = measure_blindness(
        converted(hf),
        tokens,
        dtypes=["float32"],
        n_seqs=2,
        n_buckets=32,
        block_size=block_size,
        progress=False,
    )
    got = measured.by_distance.pivot_table(
        index=["layer", "head"], columns="distance_lo", values="zero_entries"
    ).to_numpy()
    attentions = eager(hf, tokens)[0]
    t = torch.arange(32)
    distance = t[:, None] - t[None, :]
    expected = np.stack([_by_distance(A[:, h], distance) for A in attentions for h in range(4)])
    assert expected.sum() > 50  # the test has zeros to count
    np.testing.assert_array_equal(got, expected)


def _by_distance(A, distance):
    zero = (A == 0) & (distance >= 0)
    return torch.stack([zero[..., distance == d].sum() for d in range(A.shape[-1])]).numpy()


@needs_tl4
@pytest.mark.parametrize("family", FAMILIES)
def test_zero_ablation_importance_matches_eager(family):
    hf = hf_model(family)
    tokens = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(3))
    got = head_importance(converted(hf), tokens, method="zero", progress=False)

    def losses(ablate=None):
        layers = _attention_layers(hf)
        handles = []
        if ablate is not None:
            layer, head = ablate
            out = _out(layers[layer])
            d_head = out.weight.shape[1] // 4

            def zero(module, args):
                z = args[0].clone()
                z[..., head * d_head : (head + 1) * d_head] = 0
                return (z,)

            handles.append(out.register_forward_pre_hook(zero))
        with torch.no_grad():
            logits = hf(tokens).logits.double()
        for h in handles:
            h.remove()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none"
        )
        return nll.mean(-1)

    clean = losses()
    expected = [(losses((r.layer, r.head)) - clean).mean().item() for r in got.itertuples()]
    np.testing.assert_allclose(got["delta_loss"], expected, rtol=1e-4, atol=1e-6)


# --- mitigations ------------------------------------------------------------------------------


def _scores(model, tokens, block_size=None):
    """Layer 0's hook_attn_scores, the blocks' rows put together."""
    rows = []
    with model.hooks(
        fwd_hooks=[
            ("blocks.0.attn.hook_attn_scores", lambda s, hook: rows.append(s.detach().clone()))
        ]
    ):
        run_census(model, tokens, block_size=block_size, progress=False)
    n = tokens.shape[1]
    lowest = torch.finfo(torch.float32).min  # keys after a block: masked
    return torch.cat(
        [torch.nn.functional.pad(r, (0, n - r.shape[-1]), value=lowest) for r in rows], dim=-2
    )


@needs_tl4
@pytest.mark.parametrize("family", ["mpt", "falcon", "falcon-mq"])
@pytest.mark.parametrize(("kind", "params"), [("clamped", {"c": 0.3}), ("log", {})])
def test_mitigation_changes_the_bias_as_for_bloom(family, kind, params):
    """The logits under a mitigation minus those under standard ALiBi are the difference of the
    two biases of the model's own slopes (added to the scaled logits), dense and in blocks; the
    standard one computes what the model computes."""
    model = converted(hf_model(family))
    tokens = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(4))
    slopes = alibi_slopes(model)
    d = alibi.distance_rows(32, 32)
    causal = alibi.causal_rows(32, 32)
    expected = (
        alibi.bias_from_distance(kind, slopes, d, **params)
        - alibi.bias_from_distance("standard", slopes, d)
    )[None]
    plain = run_census(model, tokens, progress=False)
    with mitigation(model, "standard"):
        standard = _scores(model, tokens)
        same = run_census(model, tokens, progress=False)
    np.testing.assert_allclose(same["entropy"], plain["entropy"], rtol=1e-5)
    for block_size in (None, 8):
        with mitigation(model, kind, **params):
            mitigated = _scores(model, tokens, block_size)
        torch.testing.assert_close(
            (mitigated - standard)[..., causal], expected[..., causal], atol=2e-6, rtol=0
        )
        assert (mitigated[..., ~causal] < -1e30).all()  # the mask stays
    assert torch.equal(_scores(model, tokens), _scores(model, tokens))  # nothing left behind


@needs_tl4
@pytest.mark.parametrize("family", ["mpt", "falcon", "falcon-mq"])
def test_transformers_model_takes_the_same_variant_bias(family):
    """install_hf_bias gives the transformers model the bias a mitigation gives the converted
    one (how variants are trained and exports checked)."""
    hf = hf_model(family)
    model = converted(hf)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(9))
    handles = install_hf_bias(hf, "log")
    try:
        with torch.no_grad():
            expected = hf(tokens).logits
    finally:
        for handle in handles:
            handle.remove()
    with mitigation(model, "log"):
        got = model(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got - model(tokens)).abs().max() > 1e-3  # the variant is not the model's own bias


# --- lengths and loading ----------------------------------------------------------------------


@needs_tl4
def test_mpt_runs_past_max_seq_len_as_alibi_extrapolates():
    """transformers' MPT cannot take more than max_seq_len (64) tokens; the exact-ALiBi bias
    has no end, and its first 64 positions are eager's (causal attention)."""
    hf = hf_model("mpt")
    tokens = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError):
        hf(tokens)
    patterns = []
    model = converted(hf)
    with model.hooks(
        fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, hook: patterns.append(p))]
    ):
        model(tokens)
    reference = eager(hf, tokens[:, :64])[0][1]
    torch.testing.assert_close(patterns[0][..., :64, :64].double(), reference, atol=1e-6, rtol=0)


@needs_tl4
@pytest.mark.parametrize("family", ["mpt", "falcon", "falcon-mq"])
def test_continuations_of_a_cached_prompt_match_eager(family):
    """continuation_logprobs runs the prompt in blocks into the key-value cache, then every
    continuation reads it: the log-probabilities of one eager pass of prompt + continuation."""
    hf = hf_model(family)
    g = torch.Generator().manual_seed(8)
    prompt, continuations = (
        torch.randint(0, 128, (20,), generator=g),
        torch.randint(0, 128, (3, 4), generator=g),
    )
    got = continuation_logprobs(converted(hf), prompt, continuations, block_size=8)
    rows = torch.cat([prompt[None].expand(3, -1), continuations], dim=1)
    expected = eager(hf, rows)[2][:, 19:].log_softmax(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@needs_tl4
@pytest.mark.parametrize("family", FAMILIES)
def test_reach_baseline_is_the_reach_of_a_model_without_content_logits(family):
    """With every QKV weight zeroed the logits are the bias alone: the census's reach is its
    reach_baseline wherever that is given; a standard Falcon's own bias (rounded by key
    position) gives none, and under a mitigation its bias is ours again."""
    hf = hf_model(family)
    with torch.no_grad():
        for attn in _attention_layers(hf):
            for p in _qkv(attn).parameters():
                p.zero_()
    model = converted(hf)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(2))
    census = run_census(model, tokens, progress=False)
    if family == "mpt":
        np.testing.assert_array_equal(census["reach"], census["reach_baseline"])
    else:
        assert census["reach_baseline"].isna().all() and census["reach_ratio"].isna().all()
    with mitigation(model, "log"):
        logged = run_census(model, tokens, progress=False)
    np.testing.assert_array_equal(logged["reach"], logged["reach_baseline"])
    assert (logged["reach_baseline"] != census["reach"]).any()


@needs_tl4
def test_falcon_keeps_transformers_bias_past_256_tokens():
    """transformers builds Falcon's positions in bfloat16, a staircase past 256 tokens that a
    linear bias of the same slope misses (by 4e-3 in the patterns at 400 tokens): the census
    reads transformers' own bias, dense and through the key-value cache."""
    hf = hf_model("falcon")
    tokens = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(7))
    expected = reference_census(*eager(hf, tokens)[:2])
    model = converted(hf)
    for block_size in (None, 64):
        census = run_census(model, tokens, block_size=block_size, progress=False)
        for name in ("entropy", "mean_distance", "max_weight", "bos_mass"):
            np.testing.assert_allclose(census[name], expected[name], rtol=1e-5, err_msg=name)


@needs_tl4
@pytest.mark.parametrize("family", ["mpt", "falcon"])
def test_load_model_from_a_saved_folder_without_tokenizer(family, tmp_path):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(tmp_path)
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(model(tokens), eager(hf, tokens)[2], atol=1e-5, rtol=0)
    np.testing.assert_allclose(alibi_slopes(model).double(), applied_slopes(hf), rtol=1e-4)


@pytest.mark.parametrize("family", ["mpt", "falcon"])
def test_analytic_blindness_of_a_folder_uses_the_familys_slopes(family, tmp_path):
    """Weight-free, on both majors: the folder's config gives the shape and the slopes."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    shape = model_shape(tmp_path)
    assert (shape.family, shape.n_layers, shape.n_heads, shape.d_model) == (family, 2, 4, 64)
    analytic = analytic_blindness(tmp_path, dtypes=["float32"], limits=["normal"])
    np.testing.assert_allclose(analytic["slope"], applied_slopes(hf).repeat(2), rtol=1e-4)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"vocab_size": 128', '"vocab_size": "many"'))
    with pytest.raises(CheckpointError, match="config.json") as error:
        model_shape(tmp_path)
    assert "\n" not in str(error.value)


@needs_tl4
def test_grouped_falcon_is_refused_in_one_line(tmp_path):
    """TransformerLens 4.3 splits new_decoder_architecture's grouped QKV in the wrong order."""
    hf = hf_model("falcon", new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True)
    hf.save_pretrained(tmp_path)
    for load in (lambda: from_hf_model(hf), lambda: load_model(tmp_path)):
        with pytest.raises(UnsupportedArchitectureError, match="new_decoder_architecture") as e:
            load()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["mpt", "falcon-mq"])
def test_weight_changes_refuses_per_head_slices_of_other_fused_layouts(family):
    from headsurgeon.checkpoint_diff import weight_changes
    from headsurgeon.errors import UnsupportedArchitectureError

    state = hf_model(family).state_dict()
    changed = {name: t.clone() for name, t in state.items()}
    with pytest.raises(UnsupportedArchitectureError, match="another layout"):
        weight_changes(state, changed, [(0, 1)], d_head=16)
    assert weight_changes(state, changed)["other_changed"].sum() == 0  # heads=(): a plain diff


def test_falcon_standard_bias_is_its_own_on_both_paths():
    from headsurgeon.exact_alibi import install_hf_bias

    assert install_hf_bias(hf_model("falcon"), "standard") == []
