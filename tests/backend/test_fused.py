"""The fused attention statistics (backend.fused) against a float64 softmax and the census's
blocked reduction of the pattern (probes.pattern_sums): the bundled organism through
TransformerLens (its bias hook, -m (t - j)), tiny transformers BLOOM, MPT and Falcon-ALiBi models
(their own bias of the key position) and, on 4.x, MPT and Falcon through the bridge; the flash
kernel and FlexAttention's score_mod (eager); the float64 refinement of ill-conditioned heads and
the weights callback (the census's reach histogram)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TEXT
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    MptConfig,
    MptForCausalLM,
)

from headsurgeon import load_model
from headsurgeon.backend import MAJOR, fused
from headsurgeon.backend.fused import attention_stats, census_row_sums
from headsurgeon.data import to_sequences
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.families import BLOOM, FALCON, MPT
from headsurgeon.loading import from_hf_model, model_info
from headsurgeon.probes import PATTERN_STATS, distance_sums, pattern_sums

TOLERANCE = 1e-6
BLOCKED = 1e-5


def reference_rows(q, k, v, bias, scale):
    """Float64 softmax attention: the pattern and the outputs ``z``; ``bias`` ``[head, q, k]``."""
    q, k, v = q.double(), k.double(), v.double()
    n_pos = q.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale + bias.double()
    future = torch.ones(n_pos, n_pos, dtype=torch.bool).triu(1)
    pattern = scores.masked_fill(future, -math.inf).softmax(-1)
    return pattern, torch.einsum("bhqk,bkhd->bqhd", pattern, v)


def means(sums_and_rows):
    sums, rows = sums_and_rows
    return sums.double() / torch.tensor(rows, dtype=torch.float64).clamp(min=1)[:, None, None]


def check_layer(
    q,
    k,
    v,
    pattern,
    z,
    bias,
    scale,
    slopes=None,
    key_bias=None,
    min_query_pos=1,
    tolerance=1e-6,
    block_size=24,
):
    """Every census statistic per (sequence, head) equals the float64 one within TOLERANCE
    times its size (or 1, if larger: attention_stats' contract), and the blocked one (the float32
    pattern reduced) within BLOCKED: that path's own rounding reaches 3e-6 on mean_distance over
    80 tokens (1e-5 over 512); a wrong row or definition would not."""
    stats = attention_stats(
        q, k, v, slopes, key_bias=key_bias, scale=scale, block_size=block_size, tolerance=tolerance
    )
    measured = means(census_row_sums(stats, min_query_pos))
    exact_pattern, exact_z = reference_rows(q, k, v, bias, scale)
    exact = means(pattern_sums(exact_pattern, min_query_pos))
    blocked = means(pattern_sums(pattern, min_query_pos))
    for i, name in enumerate(PATTERN_STATS):
        assert ((measured[i] - exact[i]).abs() / exact[i].abs().clamp(min=1)).max() <= TOLERANCE
        assert (measured[i] - blocked[i]).abs().max() <= BLOCKED, name
    assert (stats.z.double() - exact_z).abs().max() <= TOLERANCE
    assert (stats.z - z).abs().max() <= TOLERANCE


@pytest.mark.parametrize(("min_query_pos", "tolerance"), [(0, 1e-6), (1, 1e-6), (1, math.inf)])
def test_organism_statistics_equal_float64_and_the_census_reduction(min_query_pos, tolerance):
    """hook_q/k/v of every layer of the bundled organism (TransformerLens, either major); over
    80 tokens float32 alone (no head refined: tolerance inf) is within 1e-6 too."""
    model = load_model("organism")
    info = model_info(model)
    tokens = to_sequences(model, TEXT, seq_len=80, n_seqs=2).tokens
    names = ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")
    seen = {}

    def keep(name):  # 4.x calls its aliases (hook_q) by their own names (q.hook_out)
        return lambda tensor, hook: seen.__setitem__(name, tensor.detach().clone())

    hook_names = [f"blocks.{i}.attn.{n}" for i in range(model.cfg.n_layers) for n in names]
    hooks = [(name, keep(name)) for name in hook_names]
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=hooks, stop_at_layer=model.cfg.n_layers)
    distance = torch.arange(80)[:, None] - torch.arange(80)[None, :]
    bias = -info.slopes.double()[:, None, None] * distance
    for layer in range(model.cfg.n_layers):
        q, k, v, pattern, z = (seen[f"blocks.{layer}.attn.{n}"] for n in names)
        assert q.shape == (2, 80, model.cfg.n_heads, model.cfg.d_head)  # [batch, pos, head, d]
        scale = 1 / math.sqrt(model.cfg.d_head)
        check_layer(q, k, v, pattern, z, bias, scale, info.slopes, None, min_query_pos, tolerance)


def tiny_hf(family):
    """A tiny random transformers model of ``family`` with eager attention (float32)."""
    torch.manual_seed(0)
    if family is BLOOM:
        model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4))
    elif family is MPT:
        config = MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64)
        model = MptForCausalLM(config)
    else:
        config = FalconConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=128,
            alibi=True,
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
            bias=True,
        )
        model = FalconForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("kernel", ["flash", "flex"])
@pytest.mark.parametrize("tolerance", [1e-6, math.inf])
@pytest.mark.parametrize("family", [BLOOM, MPT, FALCON], ids=lambda f: f.name)
def test_families_own_bias_equals_float64_and_eager(family, tolerance, kernel, monkeypatch):
    """Each family's own bias of the key position (``key_bias``), against transformers' eager
    pattern (output_attentions) reduced as the census reduces it; through the CPU flash kernel
    and through FlexAttention (CUDA's kernel, run here eager: its ALiBi score_mod checked)."""
    if kernel == "flex":
        monkeypatch.setattr(fused, "_block_kernel", lambda device: fused._flex_block)
    hf = tiny_hf(family)
    n_heads, d_head, n_pos = 4, 16, 48
    layers = [m for m in hf.modules() if type(m).__name__ == family.attention]
    inputs, outputs = [], []
    handles = [
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: inputs.append(args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True,
        )
        for layer in layers
    ]
    out_proj = [getattr(layer, "out_proj", None) or layer.dense for layer in layers]
    handles += [o.register_forward_pre_hook(lambda m, a: outputs.append(a[0])) for o in out_proj]
    tokens = torch.randint(0, 128, (2, n_pos), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        patterns = hf(tokens, output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    factors = family.factors(family.config_slopes(hf.config.to_dict()), d_head)
    key_bias = family.own_bias(factors, n_pos, torch.float32, d_head, "cpu")[:, 0]
    for layer, hidden, pattern, z in zip(layers, inputs, patterns, outputs, strict=True):
        with torch.no_grad():
            q, k, v = (t.transpose(1, 2) for t in family.project(layer, hidden, n_heads, d_head))
        z = z.unflatten(-1, (n_heads, d_head))
        bias = key_bias[:, None, :].expand(-1, n_pos, -1)
        scale = 1 / math.sqrt(d_head)
        # The default block (64 rows: one block here), where the organism's test takes 24.
        check_layer(q, k, v, pattern, z, bias, scale, None, key_bias, 1, tolerance, None)


@pytest.mark.skipif(MAJOR < 4, reason="TransformerLens 3.x has no MPT/Falcon adapter")
@pytest.mark.parametrize("family", [MPT, FALCON], ids=lambda f: f.name)
def test_bridged_families_equal_float64_and_their_patterns(family):
    """TransformerLens 4.x's MPT and Falcon: hook_q/k/v are [batch, pos, head, d_head] as 3.x's,
    and the census's bias is what the model applies: MPT headsurgeon's hook (-m (t - j)), Falcon
    its own bfloat16 products (``key_bias``)."""
    model = from_hf_model(tiny_hf(family))
    info = model_info(model)
    n_pos, d_head = 30, model.cfg.d_head
    names = ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")
    seen = {}

    def keep(name):
        return lambda tensor, hook: seen.__setitem__(name, tensor.detach().clone())

    tokens = torch.randint(0, 128, (2, n_pos), generator=torch.Generator().manual_seed(2))
    hooks = [(f"blocks.{i}.attn.{n}", keep(f"{i}.{n}")) for i in range(2) for n in names]
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=hooks)
    distance = torch.arange(n_pos)[:, None] - torch.arange(n_pos)[None, :]
    if family.keeps_own_standard_bias:
        factors = family.factors(info.slopes, d_head)
        slopes, key_bias = None, family.own_bias(factors, n_pos, torch.float32, d_head, "cpu")[:, 0]
        bias = key_bias[:, None, :].expand(-1, n_pos, -1)
    else:
        slopes, key_bias = info.slopes, None
        bias = -info.slopes.double()[:, None, None] * distance
    for layer in range(2):
        q, k, v, pattern, z = (seen[f"{layer}.{n}"] for n in names)
        assert q.shape == (2, n_pos, model.cfg.n_heads, d_head)
        check_layer(q, k, v, pattern, z, bias, 1 / math.sqrt(d_head), slopes, key_bias)


@pytest.mark.parametrize("kernel", ["flash", "flex"])
def test_ill_conditioned_entropy_is_computed_again_in_float64(kernel, monkeypatch):
    """Large scores: lse - Σ A s cancels beyond float32's tolerance. The heads whose bound
    exceeds it (1e-5 here) are computed in float64 and reported; the others stay float32,
    within their bound."""
    if kernel == "flex":
        monkeypatch.setattr(fused, "_block_kernel", lambda device: fused._flex_block)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 16, 3, 8) for _ in range(3))
    q[:, :, 0] *= 60  # head 0: scores of hundreds
    q[:, :, 1:] *= 0.1  # heads 1, 2: scores below 1, lse near ln 16
    slopes = torch.tensor([0.5, 0.25, 0.125])
    distance = torch.arange(16)[:, None] - torch.arange(16)[None, :]
    pattern, _ = reference_rows(q, k, v, -slopes.double()[:, None, None] * distance, 1 / 8**0.5)
    exact = means(pattern_sums(pattern))[PATTERN_STATS.index("entropy")]
    plain = attention_stats(q, k, v, slopes, tolerance=math.inf)
    refined = attention_stats(q, k, v, slopes, tolerance=1e-5)
    assert refined.refined.tolist() == [True, False, False]
    assert not plain.refined.any()
    errors = {
        name: (means(census_row_sums(stats))[2] - exact).abs().amax(0)
        for name, stats in (("plain", plain), ("refined", refined))
    }
    assert errors["plain"][0] > TOLERANCE  # float32 alone misses it: the refinement is needed
    assert errors["refined"][0] <= 1e-9
    assert errors["refined"][1:].max() <= 1e-5  # the float32 heads, within their bound


def test_row_zero_is_exact_and_bad_input_is_one_line():
    q, k, v = (torch.randn(1, 3, 2, 4) * 100 for _ in range(3))
    stats = attention_stats(q, k, v, torch.tensor([0.5, 0.25]))
    assert stats.entropy[..., 0].tolist() == [[0.0, 0.0]]
    assert stats.max_weight[..., 0].tolist() == stats.self_weight[..., 0].tolist() == [[1.0, 1.0]]
    for bad in (
        lambda: attention_stats(q, k, v[:, :2], torch.tensor([0.5, 0.25])),
        lambda: attention_stats(q, k, v),
        lambda: attention_stats(q, k, v, torch.tensor([0.5])),
        lambda: attention_stats(q, k, v, key_bias=torch.zeros(2, 4)),
    ):
        with pytest.raises(InvalidArgumentError) as error:
            bad()
        assert "\n" not in str(error.value)


def test_weights_reach_every_entry_once_in_each_heads_dtype():
    """The ``weights`` callback sees each (head, block) once, float64 for refined heads: the
    census's reach histogram (probes.distance_sums) summed over its blocks equals float64's."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 40, 3, 8) for _ in range(3))
    q[:, :, 0] *= 60  # head 0 refined at 1e-5, heads 1 and 2 not
    q[:, :, 1:] *= 0.1
    slopes = torch.tensor([0.5, 0.25, 0.125])
    histogram = torch.zeros(3, 40, dtype=torch.float64)
    seen = []

    def add(heads, start, weights):
        seen.append((heads.tolist(), start, weights.dtype))
        histogram[heads, : weights.shape[-1]] += distance_sums(weights)

    stats = attention_stats(q, k, v, slopes, block_size=16, tolerance=1e-5, weights=add)
    assert stats.refined.tolist() == [True, False, False]
    assert sorted(seen) == sorted(
        [([1, 2], start, torch.float32) for start in (0, 16, 32)]
        + [([0], start, torch.float64) for start in (0, 16, 32)]
    )
    distance = torch.arange(40)[:, None] - torch.arange(40)[None, :]
    pattern, _ = reference_rows(q, k, v, -slopes.double()[:, None, None] * distance, 1 / 8**0.5)
    torch.testing.assert_close(histogram, distance_sums(pattern), rtol=1e-6, atol=1e-6)


def cached_reference(q, k, v, bias, scale, window, sinks, heads, cache_distance, slopes=None):
    """Float64 softmax attention with the keys a StreamingLLM-style cache drops masked by hand:
    query t of a cut head sees j < sinks[h] or t - j <= window (cache distances: a sink's bias
    -m (min(t, sinks + window) - j))."""
    n_pos, n_heads = q.shape[1], q.shape[2]
    t, j = torch.arange(n_pos)[:, None], torch.arange(n_pos)[None, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale + bias
    for h in range(n_heads):
        if window is None or (heads is not None and h not in heads):
            continue
        x = sinks[h] if isinstance(sinks, list) else sinks
        if cache_distance:  # the sinks' bias at their slot distance instead of t - j
            seen = t.clamp(max=x + window)
            moved = -slopes[h] * (seen - j).double() + slopes[h] * (t - j).double()
            scores[:, h] = torch.where(j < x, scores[:, h] + moved, scores[:, h])
        scores[:, h] = scores[:, h].masked_fill((j >= x) & (t - j > window), -math.inf)
    scores = scores.masked_fill(j > t, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("window", "sinks", "heads", "cache_distance"),
    [
        (None, 1, None, False),
        (0, 1, None, False),
        (5, 1, [1, 2], False),
        (63, 0, None, False),
        (64, 4, None, True),
        (100, [0, 3, 1, 3], None, True),
        (7, 200, [0], False),  # more sinks than a block has rows
        (298, 1, None, False),
    ],
)
@pytest.mark.parametrize("own", [False, True], ids=["slopes", "key_bias"])
def test_windowed_attention_equals_float64_masked_attention(
    window, sinks, heads, cache_distance, own
):
    """Every cut (window, sinks, per-head sinks, some heads, cache distances) against a float64
    attention masked by hand, over several blocks of rows and a ragged last one; float32
    within its rounding."""
    if own and cache_distance:
        pytest.skip("cache distances are measured from slopes")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 300, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.02], dtype=torch.float64)
    t, j = torch.arange(300)[:, None], torch.arange(300)[None, :]
    key_bias = torch.randn(4, 300, generator=gen, dtype=torch.float64)
    bias = key_bias[:, None, :] if own else -slopes[:, None, None] * (t - j)
    given = {"key_bias": key_bias} if own else {"slopes": slopes}
    cut = dict(window=window, sinks=sinks, heads=heads, cache_distance=cache_distance)
    expected = cached_reference(q, k, v, bias, 8**-0.5, **cut, slopes=slopes)
    z = fused.windowed_attention(q, k, v, **given, **cut)
    torch.testing.assert_close(z, expected, rtol=0, atol=1e-12)
    z32 = fused.windowed_attention(
        *(x.float() for x in (q, k, v)), **{n: b.float() for n, b in given.items()}, **cut
    )
    torch.testing.assert_close(z32.double(), expected, rtol=0, atol=2e-6)


def test_a_window_that_cuts_nothing_is_the_whole_attention_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 130, 2, 8, generator=gen) for _ in range(3))
    slopes = torch.tensor([0.5, 0.125])
    whole = fused.windowed_attention(q, k, v, slopes)
    assert torch.equal(fused.windowed_attention(q, k, v, slopes, window=130), whole)
    assert torch.equal(fused.windowed_attention(q, k, v, slopes, window=3, heads=[]), whole)
    with pytest.raises(InvalidArgumentError, match="cache_distance"):
        fused.windowed_attention(q, k, v, key_bias=torch.zeros(2, 130), cache_distance=True)
