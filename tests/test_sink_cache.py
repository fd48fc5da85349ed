"""The sink-cache test against two brute forces written here: StreamingLLM's own evaluation loop
(transformers in float64, one token at a time, the cache cut back to x + y after each) and a dense
float64 masked forward from the Hugging Face weights (each query's cache slots simulated one by
one: per-head sinks, cache or true distances); blocks as dense; window_effect as a special
case; one-line refusals."""

# ruff: noqa: F811 (test_window's fixtures, imported, are used by name)
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from test_window import hf, ids, sharp_dir, tiny_model  # noqa: F401 (fixtures)

from headsurgeon import load_model
from headsurgeon.backend import MAJOR
from headsurgeon.backend.forward import resumes_at_layer
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.evals.loss import LayerInputs
from headsurgeon.loading import model_info
from headsurgeon.sink_cache import (
    _cache_nll,
    _trained_kind,
    cache_keys,
    sink_cache_effect,
)
from headsurgeon.stats import batch_means_se, nll_change
from headsurgeon.window import window_effect


def slots(t, x, y):
    """The positions in query ``t``'s cache, oldest first, the query last (StreamingLLM)."""
    return list(range(t + 1)) if t <= x + y else [*range(x), *range(t - y, t + 1)]


def cache_view(n_pos, x, y, positions):
    """``(seen [query, key], distance [query, key])``: which keys each query's cache holds, and
    the ALiBi distance each gets: its slot counted back from the query's (``"cache"``) or
    ``t - j`` (``"true"``)."""
    seen = torch.zeros(n_pos, n_pos, dtype=torch.bool)
    distance = torch.zeros(n_pos, n_pos, dtype=torch.float64)
    for t in range(n_pos):
        held = slots(t, x, y)
        for slot, j in enumerate(held):
            seen[t, j] = True
            distance[t, j] = len(held) - 1 - slot if positions == "cache" else t - j
    return seen, distance


def dense_nll(hf, tokens, x=0, y=10**9, positions="cache", without=()):
    """Next-token NLL ``[seq, position]`` of a BLOOM in float64, every head with the cache
    ``x`` + ``y``, except the ``(layer, head)`` pairs of ``without``: ``0`` + ``y``."""
    cfg = hf.config
    n_heads, d_head = cfg.n_head, cfg.hidden_size // cfg.n_head
    model = hf.transformer
    n_pos = tokens.shape[1]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)]).double()
    views = {sinks: cache_view(n_pos, sinks, y, positions) for sinks in {x, 0}}
    with torch.no_grad():
        h = model.word_embeddings_layernorm(model.word_embeddings(tokens))
        for layer, block in enumerate(model.h):
            ln = block.input_layernorm(h)
            qkv = block.self_attention.query_key_value(ln).view(*tokens.shape, n_heads, 3, d_head)
            q, k, v = qkv.unbind(-2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d_head)
            for head in range(n_heads):
                seen, distance = views[0 if (layer, head) in without else x]
                logits = scores[:, head] - slopes[head] * distance
                scores[:, head] = logits.masked_fill(~seen, -math.inf)
            context = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
            h = h + block.self_attention.dense(context.flatten(2))
            hidden = block.mlp.dense_h_to_4h(block.post_attention_layernorm(h))
            h = h + block.mlp.dense_4h_to_h(torch.nn.functional.gelu(hidden, approximate="tanh"))
        logits = hf.lm_head(model.ln_f(h))
    return -logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]


def streaming_nll(reference, tokens, x, y):
    """StreamingLLM's ``eval_long_ppl.py`` on a transformers model: one token at a time, the
    key-value cache cut back to its first ``x`` and last ``y`` positions after each (their
    ``StartRecentKVCache``); the model forms its own ALiBi over the cache."""
    from transformers import DynamicCache

    n_seqs, n_pos = tokens.shape
    out = torch.empty(n_seqs, n_pos - 1, dtype=torch.float64)
    for row in range(n_seqs):
        cache = DynamicCache()
        with torch.no_grad():
            for t in range(n_pos - 1):
                logits = reference(tokens[row : row + 1, t : t + 1], past_key_values=cache).logits
                out[row, t] = -logits[0, -1].double().log_softmax(-1)[tokens[row, t + 1]]
                for layer in cache.layers:
                    if layer.keys.shape[-2] > x + y:
                        keep = [*range(x), *range(layer.keys.shape[-2] - y, layer.keys.shape[-2])]
                        layer.keys, layer.values = (
                            layer.keys[..., keep, :],
                            layer.values[..., keep, :],
                        )
    return out


def test_the_brute_forces_are_the_model_and_each_other(hf, ids):
    with torch.no_grad():
        logits = hf(ids).logits
    own = -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(dense_nll(hf, ids), own, rtol=0, atol=1e-8)
    for x, y in [(0, 5), (2, 7)]:
        torch.testing.assert_close(
            streaming_nll(hf, ids[:1], x, y), dense_nll(hf, ids[:1], x, y), rtol=0, atol=1e-8
        )
    assert (dense_nll(hf, ids, 0, 5) - own).abs().max() > 1e-2  # the cut matters


@pytest.mark.parametrize("positions", ["cache", "true"])
@pytest.mark.parametrize("block_size", [None, 16, 5])
def test_sink_cache_effect_equals_the_dense_brute_force(tiny_model, hf, ids, positions, block_size):
    """Every cache of sinks 0, 1, 3 x windows 4, 10, and each head alone without its 2 sinks
    under a 2 + 5 cache, against dense_nll."""
    effect = sink_cache_effect(
        tiny_model,
        ids,
        sinks=[0, 1, 3],
        windows=[4, 10],
        positions=positions,
        head_cache=(2, 5),
        n_seqs=3,
        block_size=block_size,
        progress=False,
    )
    full = dense_nll(hf, ids)
    np.testing.assert_allclose(effect.nll, full.numpy(), rtol=0, atol=2e-5)
    assert len(effect.by_cache) == 6
    for row in effect.by_cache.itertuples():
        nll = dense_nll(hf, ids, row.sinks, row.window, positions)
        delta = nll - full
        assert row.nll == pytest.approx(nll.mean().item(), abs=2e-5)
        assert row.ppl == pytest.approx(math.exp(nll.mean().item()), rel=3e-5)
        assert row.dnll == pytest.approx(delta.mean().item(), abs=2e-6)
        # 39 predictions a sequence: one block of SE_BLOCK each, so the sequences' spread
        assert row.dnll_se == pytest.approx(batch_means_se(delta), abs=2e-6)
        assert row.dnll_se == pytest.approx(delta.mean(1).std().item() / math.sqrt(3), abs=2e-6)
        late = torch.arange(39) > row.sinks + row.window
        assert row.evicted == 3 * int(late.sum()) and row.tokens == 3 * 39
        assert row.dnll_evicted == pytest.approx(delta[:, late].mean().item(), abs=2e-6)
        assert (delta[:, ~late].abs() < 1e-12).all()  # nothing dropped yet: the full context
    assert abs(effect.by_cache.query("sinks == 0 and window == 4")["dnll"].item()) > 5e-4
    by_head = effect.by_head
    assert len(by_head) == 8 and list(by_head["rank"]) == list(range(1, 9))
    assert by_head["dnll"].is_monotonic_decreasing
    base = dense_nll(hf, ids, 2, 5, positions)
    assert by_head["base_nll"].iloc[0] == pytest.approx(base.mean().item(), abs=2e-5)
    for row in by_head.itertuples():
        delta = dense_nll(hf, ids, 2, 5, positions, {(row.layer, row.head)}) - base
        assert row.dnll == pytest.approx(delta.mean().item(), abs=2e-6)
    assert by_head["dnll"].abs().max() > 1e-4  # 50x the tolerance: not zero against zero
    assert by_head.attrs["head_seq_len"] == 40 and by_head.attrs["positions"] == positions


def test_blocks_give_the_dense_effect(tiny_model, ids):
    kwargs = dict(sinks=[0, 4], windows=[3, 9], heads="L1H0-3", head_cache=(1, 6), n_seqs=3)
    dense = sink_cache_effect(tiny_model, ids, block_size=40, progress=False, **kwargs)
    for block in [16, 7]:
        blocked = sink_cache_effect(tiny_model, ids, block_size=block, progress=False, **kwargs)
        for a, b in [(dense.by_cache, blocked.by_cache), (dense.by_head, blocked.by_head)]:
            np.testing.assert_allclose(b["dnll"], a["dnll"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "blocked"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_heads_pass_reuses_the_layers_below_it_bit_for_bit(tiny_model, ids, batch_size, fused):
    """Per head, only the layers from the head's up run again (3.x; 4.x runs every layer), from
    what enters them in the base pass: the numbers equal a from-scratch pass of the same cut
    (the way before), torch.equal, and so does by_head; on the fused attention (the default
    here) and the blocked one (a hook on a pattern, which the fused one would not fire)."""
    n_layers, n_heads = tiny_model.cfg.n_layers, tiny_model.cfg.n_heads
    info = model_info(tiny_model, "test")
    bias_of = (info.slopes, _trained_kind(tiny_model, info))

    def nll(cut, **kwargs):
        return _cache_nll(
            tiny_model, ids, cut, 5, "cache", bias_of, batch_size, 7, **kwargs, fused=fused
        )

    def cut(layer, head):
        sinks = [[2] * n_heads for _ in range(n_layers)]
        sinks[layer][head] = 0
        return sinks

    reuse = resumes_at_layer(tiny_model)
    assert reuse == (MAJOR < 4)
    layer, head = n_layers - 1, 2
    seen = []  # positions entering block 0, every pass: reference, sweep, base, the head's
    hooks = [("blocks.0.hook_resid_pre", lambda r, hook: seen.append(r.shape[:2]))]
    if not fused:
        hooks.append(("blocks.0.attn.hook_pattern", lambda pattern, hook: None))
    with tiny_model.hooks(hooks):
        effect = sink_cache_effect(
            tiny_model,
            ids,
            sinks=[2],
            windows=[5],
            heads=[(layer, head)],
            batch_size=batch_size,
            block_size=7,
            progress=False,
        )
    assert sum(rows * n for rows, n in seen) == (3 if reuse else 4) * ids.numel()
    base = nll([[2] * n_heads] * n_layers)
    change = nll_change(nll(cut(layer, head)) - base, base)
    row = effect.by_head.iloc[0]
    assert effect.by_head.attrs["attention"] == ("fused" if fused else "blocked")
    assert (row.base_nll, row.dnll, row.dnll_se, row.tokens) == (
        base.mean().item(),
        change["dnll"],
        change["dnll_se"],
        change["tokens"],
    )
    if not reuse:
        return
    inputs = LayerInputs(range(n_layers))
    assert torch.equal(nll([[2] * n_heads] * n_layers, keep=inputs), base)
    for layer in range(1, n_layers):
        for head in (0, n_heads - 1):
            from_layer = nll(cut(layer, head), start=(layer, inputs))
            assert torch.equal(from_layer, nll(cut(layer, head)))


def test_a_window_over_the_whole_sequence_is_the_full_context(tiny_model, ids):
    effect = sink_cache_effect(
        tiny_model, ids, sinks=[0, 3], windows=[38, 100], heads=[], n_seqs=3, progress=False
    )
    assert (effect.by_cache["dnll"].abs() < 1e-6).all() and (effect.by_cache["evicted"] == 0).all()
    assert effect.by_cache["dnll_evicted"].isna().all() and effect.by_head.empty


def test_one_sink_at_true_distances_is_window_effect(tiny_model, ids):
    """window_effect keeps position 0 and the keys within d: a cache 1 + d at true distances."""
    cut = window_effect(tiny_model, ids, distances=[3, 8], edges=[0, 39], progress=False)
    effect = sink_cache_effect(
        tiny_model,
        ids,
        sinks=[1],
        windows=[3, 8],
        positions="true",
        heads=[],
        n_seqs=3,
        progress=False,
    )
    np.testing.assert_allclose(effect.by_cache["dnll"], cut.by_distance["dnll"], rtol=0, atol=1e-6)


def test_cache_keys_are_the_union_of_the_blocks_caches():
    keys = cache_keys(3, 5)
    for offset, n in [(0, 4), (4, 4), (8, 4), (20, 7)]:
        held = {j for t in range(offset, offset + n) for j in slots(t, 3, 5)}
        assert keys(offset, n).tolist() == sorted(j for j in held if j < offset)


def test_refusals(tiny_model, ids):
    def run(**kwargs):
        return sink_cache_effect(tiny_model, ids, progress=False, **kwargs)

    with pytest.raises(InvalidArgumentError, match="positions"):
        run(positions="shifted")
    with pytest.raises(InvalidArgumentError, match="sinks"):
        run(sinks=[-1], windows=[4])
    with pytest.raises(InvalidArgumentError, match="windows"):
        run(windows=[0])
    with pytest.raises(InvalidArgumentError, match="head_cache's sinks"):
        run(windows=[4], head_cache=(0, 4))
    with pytest.raises(InvalidArgumentError, match="drops nothing"):
        run(windows=[4], head_cache=(2, 4), head_seq_len=7)
    from headsurgeon.blindness import mitigation

    with mitigation(tiny_model, "log"), pytest.raises(UnsupportedArchitectureError, match="log"):
        run(windows=[4])


def test_models_without_alibi_are_refused_in_one_line():
    from test_model_families import loaded, tokens

    model, _ = loaded("llama")
    with pytest.raises(UnsupportedArchitectureError, match="rotary positions") as info:
        sink_cache_effect(model, tokens(), windows=[4], progress=False)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(MAJOR < 4, reason="TransformerLens 3.x has no MPT/Falcon adapter")
@pytest.mark.parametrize("family", ["mpt", "falcon", "falcon-mq"])
def test_mpt_and_falcon_equal_streamingllms_loop(family):
    """transformers' MPT and Falcon form ALiBi over the cache themselves: StreamingLLM's loop."""
    from test_alibi_families import converted, hf_model

    reference = hf_model(family, scale=3.0)
    model = converted(copy.deepcopy(reference))
    reference = reference.double().eval()
    tokens = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    effect = sink_cache_effect(
        model,
        tokens,
        sinks=[0, 2],
        windows=[5],
        heads=[],
        n_seqs=2,
        block_size=8,
        progress=False,
    )
    full = streaming_nll(reference, tokens, 0, 100)
    np.testing.assert_allclose(effect.nll, full.numpy(), rtol=0, atol=2e-5)
    for row in effect.by_cache.itertuples():
        delta = streaming_nll(reference, tokens, row.sinks, row.window) - full
        assert row.dnll == pytest.approx(delta.mean().item(), abs=2e-6)
        assert abs(row.dnll) > 1e-4


organisms = pytest.mark.skipif(
    "organism" not in __import__("headsurgeon.loading").loading.organism_names(),
    reason="the bundled organisms are not installed",
)


@organisms
def test_a_trained_model_against_the_brute_force_on_its_weights():
    from transformers import BloomForCausalLM

    from headsurgeon.data import to_sequences
    from headsurgeon.model_names import ORGANISM_DIR

    model = load_model("organism-injured")
    tokens = to_sequences(model, None, seq_len=80, n_seqs=2).tokens
    effect = sink_cache_effect(
        model,
        tokens,
        sinks=[0, 1],
        windows=[8],
        heads="L1H12,L3H0",
        head_cache=(1, 8),
        n_seqs=2,
        block_size=32,
        progress=False,
    )
    folder = ORGANISM_DIR / "organism-injured"
    hf = BloomForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    full = dense_nll(hf, tokens)
    for row in effect.by_cache.itertuples():
        delta = dense_nll(hf, tokens, row.sinks, 8) - full
        assert row.dnll == pytest.approx(delta.mean().item(), abs=1e-4)
    base = dense_nll(hf, tokens, 1, 8)
    for row in effect.by_head.itertuples():
        delta = dense_nll(hf, tokens, 1, 8, without={(row.layer, row.head)}) - base
        assert row.dnll == pytest.approx(delta.mean().item(), abs=1e-4)


def test_cli_sink_cache_writes_its_tables_figure_and_lines(bloom_dir, tmp_path, capsys):
    """--sink-cache: the tables equal sink_cache_effect on the same text, the figure and the
    summary lines are written."""
    import pandas as pd

    from headsurgeon.cli.blindness import main

    out = tmp_path / "out"
    args = [str(bloom_dir), "--sink-cache", "--sink-seq-len", "48", "--sinks", "0", "2"]
    args += ["--windows", "6", "--sink-head-seq-len", "24", "--dtypes", "float32"]
    assert main([*args, "--limit", "zero", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sink cache (StreamingLLM" in printed and "need their sinks most" in printed
    assert "tokens; fused attention): full-context perplexity" in printed  # which path, said
    by_cache = pd.read_csv(out / "sink_cache.csv")
    model = load_model(bloom_dir)
    expected = sink_cache_effect(
        model, sinks=[0, 2], windows=[6], seq_len=48, head_seq_len=24, progress=False
    )
    np.testing.assert_allclose(by_cache["dnll"], expected.by_cache["dnll"], rtol=0, atol=1e-9)
    heads = pd.read_csv(out / "sink_cache_heads.csv")
    assert list(heads["rank"]) == list(range(1, 9)) and (heads["sinks"] == 2).all()
    assert '"name":"sink_cache"' in (out / "index.html").read_text()
    assert "sink cache" in (out / "summary.txt").read_text()


def test_sink_cache_figure_draws_each_number_of_sinks_and_the_full_context():
    import pandas as pd

    from headsurgeon.plots import sink_cache_figure

    table = pd.DataFrame(
        {
            "sinks": [0, 0, 4, 4],
            "window": [64, 256, 64, 256],
            "ppl": [90.0, 60.0, 48.0, 47.0],
            "dnll": [0.7, 0.3, 0.05, 0.03],
            "dnll_se": [0.02, 0.01, 0.004, 0.003],
            "full_ppl": 46.0,
        }
    )
    fig = sink_cache_figure(table)
    assert [t.name for t in fig.data] == ["0 sinks", "4 sinks", "full context"]
    assert list(fig.data[0].y) == [90.0, 60.0] and list(fig.data[2].y) == [46.0, 46.0]
    np.testing.assert_allclose(fig.data[1].error_y.array, [48.0 * 0.004, 47.0 * 0.003])
    with pytest.raises(InvalidArgumentError, match="sink_cache_effect"):
        sink_cache_figure(table.drop(columns="full_ppl"))


def test_sinks_zero_alone_is_a_window_only_cache(tiny_model, hf, ids):
    """sinks=[0]: window-only caches against the dense brute force, and no per-head test (no
    head has sinks to lose), rather than a refusal of the default per-head cache (0, y)."""
    effect = sink_cache_effect(
        tiny_model, ids, sinks=[0], windows=[4, 10], n_seqs=3, progress=False
    )
    assert effect.by_head.empty and list(effect.by_cache["sinks"]) == [0, 0]
    for row in effect.by_cache.itertuples():
        nll = dense_nll(hf, ids, 0, row.window)
        assert row.nll == pytest.approx(nll.mean().item(), abs=2e-5)
    with pytest.raises(InvalidArgumentError, match="head_cache's sinks"):
        sink_cache_effect(tiny_model, ids, sinks=[0], windows=[4], heads="L0H0", progress=False)


@pytest.mark.parametrize("positions", ["cache", "true"])
def test_the_fused_and_blocked_paths_agree(tiny_model, ids, positions):
    """The fused attention (each block of rows against its cache's keys) and the blocked one
    (taken under a hook on a pattern, said why): the same table within float32 rounding."""
    kwargs = dict(sinks=[0, 2], windows=[4, 9], heads="L0H1,L1H3", head_cache=(2, 5), n_seqs=3)
    fused = sink_cache_effect(tiny_model, ids, positions=positions, progress=False, **kwargs)
    pattern = [("blocks.1.attn.hook_pattern", lambda pattern, hook: None)]
    with tiny_model.hooks(pattern):
        blocked = sink_cache_effect(tiny_model, ids, positions=positions, progress=False, **kwargs)
    assert fused.by_cache.attrs["attention"] == "fused"
    assert blocked.by_cache.attrs["blocked_because"] == (
        "a hook on blocks.1.attn.hook_pattern would not fire"
    )
    for a, b in [(fused.by_cache, blocked.by_cache), (fused.by_head, blocked.by_head)]:
        np.testing.assert_allclose(a["dnll"], b["dnll"], rtol=0, atol=2e-6)
        assert a["dnll"].abs().max() > 2e-5  # 10x the tolerance: the cut matters
    np.testing.assert_allclose(fused.nll, blocked.nll, rtol=0, atol=1e-5)
