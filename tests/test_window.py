"""The window counterfactual: ΔNLL against a dense masked forward written here from the Hugging
Face weights alone, in blocks as dense, exactly 0 where the window cuts nothing, one-line
refusals."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from headsurgeon import load_model
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.stats import batch_means_se
from headsurgeon.window import window_effect, window_hook


def brute_nll(hf, tokens, distance=None, heads=None):
    """Next-token NLL ``[seq, position]`` of a BLOOM in float64, attention masked by hand: query
    ``i`` sees keys ``j <= i`` with ``i - j <= distance`` or ``j == 0`` (``None``: all), in the
    ``(layer, head)`` pairs of ``heads`` (``None``: every head)."""
    cfg = hf.config
    n_heads, d_head = cfg.n_head, cfg.hidden_size // cfg.n_head
    model = hf.transformer
    n_pos = tokens.shape[1]
    i, j = torch.arange(n_pos)[:, None], torch.arange(n_pos)[None, :]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)]).double()
    bias = -slopes[:, None, None] * (i - j)  # [head, query, key]
    far = (i - j > distance) & (j > 0) if distance is not None else torch.zeros_like(i - j).bool()
    with torch.no_grad():
        x = model.word_embeddings_layernorm(model.word_embeddings(tokens))
        for layer, block in enumerate(model.h):
            ln = block.input_layernorm(x)
            qkv = block.self_attention.query_key_value(ln).view(*tokens.shape, n_heads, 3, d_head)
            q, k, v = qkv.unbind(-2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d_head) + bias
            cut = torch.stack(
                [
                    far if heads is None or (layer, h) in heads else torch.zeros_like(far)
                    for h in range(n_heads)
                ]
            )
            scores = scores.masked_fill((j > i) | cut, -math.inf)
            context = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
            x = x + block.self_attention.dense(context.flatten(2))
            hidden = block.mlp.dense_h_to_4h(block.post_attention_layernorm(x))
            x = x + block.mlp.dense_4h_to_h(torch.nn.functional.gelu(hidden, approximate="tanh"))
        logits = hf.lm_head(model.ln_f(x))
    return -logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory):
    """conftest's random BLOOM with larger attention weights: its heads matter to the loss."""
    from conftest import make_bloom_checkpoint
    from transformers import BloomForCausalLM

    folder = make_bloom_checkpoint(tmp_path_factory.mktemp("sharp"))
    model = BloomForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for block in model.transformer.h:
            block.self_attention.query_key_value.weight.mul_(3.0)
            block.self_attention.dense.weight.mul_(6.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture()
def tiny_model(sharp_dir):
    return load_model(sharp_dir)


@pytest.fixture(scope="module")
def hf(sharp_dir):
    from transformers import BloomForCausalLM

    return BloomForCausalLM.from_pretrained(sharp_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(4, 300, (3, 40), generator=torch.Generator().manual_seed(0))


def test_the_brute_force_is_the_model(hf, ids):
    with torch.no_grad():
        logits = hf(ids).logits
    own = -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(brute_nll(hf, ids), own, rtol=0, atol=1e-8)  # its bias: float32


def test_window_effect_dnll_se_is_the_batch_means_se_of_the_same_dnll(tiny_model, hf):
    """One definition of dnll_se across the *_effect verbs: headsurgeon.stats.batch_means_se of
    the paired ΔNLL, over blocks of 64 predictions (here 2 and 1 blocks a sequence)."""
    tokens = torch.randint(4, 300, (2, 161), generator=torch.Generator().manual_seed(1))
    effect = window_effect(
        tiny_model, tokens, distances=[3], edges=[0, 100, 160], head_distance=3,
        heads=[(0, 0)], progress=False,
    )  # fmt: skip
    delta = brute_nll(hf, tokens, 3) - brute_nll(hf, tokens)
    for row in effect.by_distance.itertuples():
        part = delta[:, row.position_lo : row.position_hi]
        assert row.dnll_se == pytest.approx(batch_means_se(part), rel=1e-4)
        spread = part.mean(1).std().item() / math.sqrt(2)  # of the sequences' means
        # the same for a bucket of one block a sequence, not for a wider one
        assert (row.dnll_se == pytest.approx(spread, rel=1e-4)) == (part.shape[1] <= 64)
    head = brute_nll(hf, tokens, 3, heads={(0, 0)}) - brute_nll(hf, tokens)
    assert effect.by_head["dnll_se"].item() == pytest.approx(batch_means_se(head), rel=1e-4)


@pytest.mark.parametrize("block_size", [None, 16])
def test_window_effect_equals_a_dense_masked_forward(tiny_model, hf, ids, block_size):
    """Every head cut at 0, 3, 10 and each head alone at 2, against brute_nll's ΔNLL."""
    effect = window_effect(
        tiny_model,
        ids,
        distances=[0, 3, 10],
        head_distance=2,
        edges=[0, 4, 16, 39],
        block_size=block_size,
        progress=False,
    )
    base = brute_nll(hf, ids)
    np.testing.assert_allclose(effect.nll, base.numpy(), rtol=0, atol=2e-5)
    for d, table in effect.by_distance.groupby("distance"):
        delta = brute_nll(hf, ids, d) - base
        for row in table.itertuples():
            part = delta[:, row.position_lo : row.position_hi]
            assert row.tokens == part.numel()
            assert row.dnll == pytest.approx(part.mean().item(), abs=2e-6)
            se = part.mean(1).std().item() / math.sqrt(len(ids))
            assert row.dnll_se == pytest.approx(se, abs=2e-6)
    assert (effect.by_distance.query("distance == 10 and position_hi <= 11")["dnll"] == 0).all()
    assert effect.by_distance.query("distance == 0")["dnll"].abs().max() > 1e-3  # a real cut
    by_head = effect.by_head
    assert len(by_head) == 8 and (by_head["distance"] == 2).all()
    for row in by_head.itertuples():
        delta = brute_nll(hf, ids, 2, heads={(row.layer, row.head)}) - base
        assert row.dnll == pytest.approx(delta[:, :39].mean().item(), abs=2e-6)
    assert by_head["dnll"].abs().max() > 3e-4
    np.testing.assert_allclose(by_head["slope"].head(4), [0.25, 0.0625, 0.015625, 0.00390625])


@pytest.mark.parametrize("block_size", [None, 16])
def test_a_window_beyond_the_sequence_changes_nothing_bit_for_bit(tiny_model, ids, block_size):
    effect = window_effect(
        tiny_model,
        ids,
        distances=[38, 39, 1000],
        heads="L0H0,L1H3",
        head_distance=38,
        block_size=block_size,
        progress=False,
    )
    assert (effect.by_distance["dnll"] == 0).all() and (effect.by_distance["dnll_se"] == 0).all()
    assert (effect.by_head["dnll"] == 0).all() and len(effect.by_head) == 2
    assert effect.by_distance.attrs["seq_len"] == 40 and effect.by_head.attrs["head_distance"] == 38


def test_blocks_give_the_dense_effect(tiny_model, ids):
    kwargs = dict(distances=[1, 5], heads="L1H0-3", head_distance=4, progress=False)
    dense = window_effect(tiny_model, ids, block_size=40, **kwargs)
    blocked = window_effect(tiny_model, ids, block_size=16, **kwargs)
    for a, b in [(dense.by_distance, blocked.by_distance), (dense.by_head, blocked.by_head)]:
        np.testing.assert_allclose(b["dnll"], a["dnll"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(blocked.nll, dense.nll, rtol=0, atol=1e-5)


def test_the_hook_masks_like_the_model_and_leaves_future_keys(tiny_model, ids):
    seen = []

    def spy(pattern, hook):
        seen.append(pattern[0, :, :, :].clone())

    with tiny_model.hooks(
        fwd_hooks=[
            ("blocks.0.attn.hook_attn_scores", window_hook(2, [1])),
            ("blocks.0.attn.hook_pattern", spy),
        ]
    ):
        tiny_model(ids[:1])
    pattern = seen[0]
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    assert (pattern[1][(i - j > 2) & (j > 0)] == 0).all()
    assert (pattern[1][(i - j <= 2) & (i >= j)] > 0).all() and (pattern[1][j > i] == 0).all()
    assert (pattern[0][i >= j] > 0).all()  # other heads untouched
    torch.testing.assert_close(pattern[1].sum(-1), torch.ones(40))  # renormalised


def test_refusals(tiny_model, ids):
    with pytest.raises(InvalidArgumentError, match="head_distance"):
        window_effect(tiny_model, ids, heads="L0H0", progress=False)
    with pytest.raises(InvalidArgumentError, match="distances"):
        window_effect(tiny_model, ids, distances=[-1], progress=False)
    with pytest.raises(InvalidArgumentError, match="head_distance"):
        window_effect(tiny_model, ids, head_distance=-2, progress=False)
    with pytest.raises(InvalidArgumentError, match="edges"):
        window_effect(tiny_model, ids, edges=[5, 2], progress=False)
    with pytest.raises(InvalidArgumentError, match="3"):
        window_effect(tiny_model, ids[:, :2], progress=False)


def test_a_hook_that_never_fires_is_refused(bloom_dir, monkeypatch):
    """A hook that never fires is an error, never a ΔNLL of 0: on the blocked path (under a
    mitigation) a scores hook, on the fused path a layer's cut."""
    from headsurgeon import mitigation
    from headsurgeon.backend.fused import windowed_attention
    from headsurgeon.errors import UnsupportedArchitectureError
    from headsurgeon.evals import loss

    model = load_model(bloom_dir)
    silent = {"blocks.1.attn.hook_attn_scores"}
    real = model.hooks

    def hooks(fwd_hooks=(), **kwargs):
        return real(fwd_hooks=[(n, h) for n, h in fwd_hooks if n not in silent], **kwargs)

    tokens = torch.randint(4, 300, (1, 12))
    monkeypatch.setattr(model, "hooks", hooks)
    with (
        mitigation(model, "standard"),
        pytest.raises(UnsupportedArchitectureError, match="hook_attn_scores never fired"),
    ):
        window_effect(model, tokens, distances=[2], progress=False)
    fused = loss.fused_attention

    def skipping(model, slopes, attend):  # layer 1 attends whole, past the cut
        return fused(
            model,
            slopes,
            lambda layer, *qkv, **bias: (
                windowed_attention(*qkv, **bias) if layer == 1 else attend(layer, *qkv, **bias)
            ),
        )

    monkeypatch.setattr(loss, "fused_attention", skipping)
    with pytest.raises(UnsupportedArchitectureError, match="blocks.1.attn never fired in layer 1"):
        window_effect(model, tokens, distances=[2], progress=False)


def test_the_fused_and_blocked_paths_agree(tiny_model, ids):
    """An ALiBi model with -m (t - j) runs fused (no T x T pattern), said in attrs; under a
    mitigation, blocked (hook_attn_scores), said why; the same ΔNLL within float32 rounding."""
    from headsurgeon import mitigation

    kwargs = dict(distances=[0, 3], heads="L0H1,L1H2", head_distance=2, progress=False)
    fused = window_effect(tiny_model, ids, **kwargs)
    with mitigation(tiny_model, "standard"):
        blocked = window_effect(tiny_model, ids, **kwargs)
    assert fused.by_distance.attrs["attention"] == "fused"
    assert fused.by_head.attrs["blocked_because"] is None
    assert blocked.by_distance.attrs["attention"] == "blocked"
    assert blocked.by_head.attrs["blocked_because"] == "a standard mitigation is active"
    for a, b in [(fused.by_distance, blocked.by_distance), (fused.by_head, blocked.by_head)]:
        np.testing.assert_allclose(a["dnll"], b["dnll"], rtol=0, atol=2e-6)
        assert a["dnll"].abs().max() > 1e-4  # the cut matters
    np.testing.assert_allclose(fused.nll, blocked.nll, rtol=0, atol=1e-5)


@pytest.mark.skipif(
    "organism" not in __import__("headsurgeon.loading").loading.organism_names(),
    reason="the bundled organisms are not installed",
)
def test_a_trained_model_uses_its_window_as_the_brute_force_says():
    """The organism (trained: the cut matters) against brute_nll on its Hugging Face weights."""
    from transformers import BloomForCausalLM

    from headsurgeon.data import to_sequences
    from headsurgeon.model_names import ORGANISM_DIR

    model = load_model("organism")
    tokens = to_sequences(model, None, seq_len=96, n_seqs=2).tokens
    effect = window_effect(
        model,
        tokens,
        distances=[4],
        heads="L3H0,L3H15",
        head_distance=4,
        edges=[0, 8, 95],
        block_size=32,
        progress=False,
    )
    hf = BloomForCausalLM.from_pretrained(ORGANISM_DIR / "organism", dtype=torch.float64).eval()
    base = brute_nll(hf, tokens)
    delta = brute_nll(hf, tokens, 4)[:, 8:95] - base[:, 8:95]
    row = effect.by_distance.iloc[1]
    assert row.dnll == pytest.approx(delta.mean().item(), abs=1e-4) and row.dnll > 0.05
    for row in effect.by_head.itertuples():
        delta = brute_nll(hf, tokens, 4, heads={(row.layer, row.head)}) - base
        assert row.dnll == pytest.approx(delta[:, :95].mean().item(), abs=1e-4)


def test_window_figure_draws_each_bucket_and_the_pooled_change():
    import pandas as pd

    from headsurgeon.plots.distance import window_figure

    table = pd.DataFrame(
        {
            "distance": [1, 1, 8, 8],
            "position_lo": [0, 4, 0, 4],
            "position_hi": [4, 16, 4, 16],
            "tokens": [4, 12, 4, 12],
            "dnll": [0.1, 0.5, 0.0, 0.2],
            "dnll_se": [0.01, 0.02, 0.0, 0.03],
        }
    )
    fig = window_figure(table)
    names = [t.name for t in fig.data]
    assert names == ["positions 0–3", "positions 4–15", "all positions"]
    assert list(fig.data[1].y) == [0.5, 0.2] and list(fig.data[1].error_y.array) == [0.02, 0.03]
    np.testing.assert_allclose(fig.data[2].y, [(0.4 + 6.0) / 16, 2.4 / 16])
    assert list(fig.data[0].x) == ["1", "8"]
    with pytest.raises(InvalidArgumentError, match="window_effect"):
        window_figure(table.drop(columns="dnll_se"))


def masked_eager_nll(reference, ids, distance=None, heads=None):
    """Next-token NLL ``[seq, position]`` of a Hugging Face model with eager attention, each
    layer's attention given its own 4-D mask (transformers adds one as given): causal, and for
    the ``(layer, head)`` pairs of ``heads`` (``None``: all) only keys within ``distance`` and
    position 0."""
    from test_model_families import output_projection

    n_seqs, n_pos = ids.shape
    config = reference.config
    n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
    i, j = torch.arange(n_pos)[:, None], torch.arange(n_pos)[None, :]
    far = (i - j > distance) & (j > 0) if distance is not None else torch.zeros_like(i > j)

    def mask(layer):
        chosen = torch.tensor([heads is None or (layer, h) in heads for h in range(n_heads)]).view(
            -1, 1, 1
        )
        blocked = (j > i) | (far & chosen)  # [head, query, key]
        return torch.zeros(n_seqs, n_heads, n_pos, n_pos).masked_fill(blocked, -math.inf)

    handles = []
    for layer in range(n_layers):
        parent = _parent(reference, output_projection(reference, layer))

        def swap(module, args, kwargs, layer=layer):
            return args, {**kwargs, "attention_mask": mask(layer)}

        handles.append(parent.register_forward_pre_hook(swap, with_kwargs=True))
    try:
        with torch.no_grad():
            positions = torch.arange(n_pos).expand(n_seqs, -1)
            logits = reference(ids, attention_mask=mask(-1), position_ids=positions).logits
    finally:
        for handle in handles:
            handle.remove()
    return -logits[:, :-1].double().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def _parent(root, module):
    """The module that holds ``module`` as a direct child."""
    return next(m for m in root.modules() if any(c is module for c in m.children()))


@pytest.mark.parametrize("name", ["gpt2", "neox", "llama", "opt", "bloom"])
def test_window_effect_equals_eager_attention_family_by_family(name):
    """Every family headsurgeon converts: every head cut at 2, and L0H1 alone at 1, against
    transformers' eager attention under a custom mask (BLOOM, whose ALiBi is built from the
    2-D mask: brute_nll), or refused in one line."""
    from test_model_families import N_POS, REFUSED, loaded, tokens

    from headsurgeon.backend import MAJOR
    from headsurgeon.errors import UnsupportedArchitectureError

    model, reference = loaded(name)
    ids = tokens(4)
    kwargs = dict(distances=[2], heads="L0H1", head_distance=1, progress=False)
    if (MAJOR, name, "blindness") in REFUSED:  # its scores hook holds no scores
        with pytest.raises(UnsupportedArchitectureError, match="pre-softmax scores") as info:
            window_effect(model, ids, **kwargs)
        assert "\n" not in str(info.value)
        return
    effect = window_effect(model, ids, edges=[0, N_POS - 1], **kwargs)
    if name == "bloom":
        reference = copy.deepcopy(reference).double()
        every, one = brute_nll(reference, ids, 2), brute_nll(reference, ids, 1, {(0, 1)})
        base = brute_nll(reference, ids)
    else:
        every, one = (
            masked_eager_nll(reference, ids, 2),
            masked_eager_nll(reference, ids, 1, {(0, 1)}),
        )
        base = masked_eager_nll(reference, ids)
    assert effect.by_distance["dnll"].iloc[0] == pytest.approx(
        (every - base).mean().item(), abs=1e-5
    )
    assert effect.by_head["dnll"].iloc[0] == pytest.approx((one - base).mean().item(), abs=1e-5)
    assert abs((every - base).mean()) > 1e-3  # the cut matters: not zero against zero


def test_a_heads_pass_reuses_the_layers_below_it_bit_for_bit(tiny_model, ids, monkeypatch):
    """Fused, on 3.x, a head's pass runs its layer and those above from what the base pass fed
    them (4.x runs every layer): by_head equals every layer's run, DataFrame.equals."""
    from headsurgeon import window
    from headsurgeon.backend import MAJOR

    kwargs = dict(distances=[], heads="L0H1,L1H0,L1H3", head_distance=2, progress=False)
    seen = []  # sequences entering block 0: the model's own pass, then each head's
    with tiny_model.hooks([("blocks.0.hook_resid_pre", lambda r, hook: seen.append(len(r)))]):
        reused = window_effect(tiny_model, ids, **kwargs)
    assert sum(seen) == len(ids) * (2 if MAJOR < 4 else 4)  # the base pass and L0H1's
    monkeypatch.setattr(window, "KEPT_BYTES", 0)  # nothing may be kept: every layer per head
    every = window_effect(tiny_model, ids, **kwargs)
    assert reused.by_head.equals(every.by_head) and reused.by_head["dnll"].abs().max() > 1e-4


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_every_alibi_family_cuts_the_same_fused_as_blocked(family):
    """A transformers BLOOM, MPT and Falcon (4.x bridges their own bias of the key position to
    the fused kernel, as the model adds it): the window and sink-cache tables equal the blocked
    path's (a hook on a pattern sends them there) within float32 rounding."""
    from headsurgeon.backend import MAJOR

    if MAJOR < 4 and family != "bloom":
        pytest.skip("TransformerLens 3.x has no MPT/Falcon adapter")
    from test_fused import tiny_hf

    from headsurgeon import families, sink_cache_effect
    from headsurgeon.loading import from_hf_model

    model = from_hf_model(tiny_hf(families.family_named(family)), name=f"tiny-{family}")
    ids = torch.randint(0, 128, (2, 50), generator=torch.Generator().manual_seed(1))
    runs = {
        window_effect: dict(distances=[0, 3, 10], heads="L0H1,L1H2", head_distance=2),
        sink_cache_effect: dict(sinks=[0, 2], windows=[4, 9], heads="L0H1", head_cache=(2, 5)),
    }
    pattern = [("blocks.0.attn.hook_pattern", lambda p, hook: None)]
    for verb, kwargs in runs.items():
        fused = verb(model, ids, **kwargs, progress=False)
        with model.hooks(pattern):
            blocked = verb(model, ids, **kwargs, progress=False)
        assert fused.by_head.attrs["attention"] == "fused"
        assert blocked.by_head.attrs["attention"] == "blocked"
        tables = [t for t in vars(fused) if t.startswith("by_")]
        for table in tables:
            a, b = getattr(fused, table)["dnll"], getattr(blocked, table)["dnll"]
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
        assert getattr(fused, tables[0])["dnll"].abs().max() > 1e-4  # the cut matters
