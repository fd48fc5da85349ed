"""Head importance: exact ablation against a brute-force hook loop, attribution as a derivative."""

from __future__ import annotations

from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tl3_only

import headsurgeon
from headsurgeon import load_model
from headsurgeon.data import to_sequences
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.importance import COLUMNS, compare_importance, head_importance
from headsurgeon.loading import ModelShape, from_hf_model, random_hf_bloom, random_model


@pytest.fixture(scope="module")
def injured():
    return load_model("organism-injured")


@pytest.fixture(scope="module")
def injured_tokens(injured):
    return to_sequences(
        injured, n_seqs=5, seq_len=16
    ).tokens  # BOS-first, as the organism's convention


def seq_losses(model, tokens, fwd_hooks=()):
    """Each sequence's mean loss by TransformerLens's own loss, on a full forward pass."""
    with torch.no_grad():
        losses = model.run_with_hooks(
            tokens, return_type="loss", loss_per_token=True, fwd_hooks=list(fwd_hooks)
        )
    return losses.double().mean(-1)


def brute_force(model, tokens, ablation):
    """delta_loss and its standard error per head: one full forward per head, z set by a hook."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        _, donor_cache = model.run_with_cache(tokens.roll(-1, 0))  # sequence i takes i + 1's z
    clean = seq_losses(model, tokens)
    delta = np.zeros((model.cfg.n_layers, model.cfg.n_heads))
    se = np.zeros_like(delta)
    for layer in range(model.cfg.n_layers):
        replacement = {
            "zero": torch.zeros_like(cache["z", layer]),
            "mean": cache["z", layer].mean((0, 1)).expand_as(cache["z", layer]),
            "resample": donor_cache["z", layer],
        }[ablation]
        for head in range(model.cfg.n_heads):

            def hook(z, hook, head=head, replacement=replacement):
                z[:, :, head] = replacement[:, :, head]
                return z

            name = f"blocks.{layer}.attn.hook_z"
            d = seq_losses(model, tokens, [(name, hook)]) - clean
            delta[layer, head] = d.mean().item()
            se[layer, head] = (d.std() / len(d) ** 0.5).item()
    return delta, se


def grid(df, column="delta_loss"):
    return df[column].to_numpy().reshape(df.attrs["n_layers"], df.attrs["n_heads"])


def test_silenced_head_costs_exactly_nothing(injured, injured_tokens):
    df = head_importance(injured, injured_tokens, method="zero", batch_size=3, progress=False)
    assert list(df.columns) == list(COLUMNS)
    silenced = df[(df["layer"] == 3) & (df["head"] == 4)].iloc[0]
    assert silenced["delta_loss"] == 0.0 and silenced["delta_loss_se"] == 0.0
    # ... while the model's other heads matter (a zero everywhere would pass the line above).
    assert (df["delta_loss"].abs() > 1e-4).sum() > 40
    assert df.attrs["prepend_bos"] is True and df.attrs["n_tokens"] == 5 * 15


@pytest.mark.parametrize("ablation", ["zero", "mean", "resample"])
def test_exact_ablation_equals_a_brute_force_hook_loop(injured, injured_tokens, ablation):
    # Batches of 2 of 5 sequences (a short last one), 3 heads per stacked pass (16 = 5*3 + 1):
    # streaming, stacking and the cyclic resample donors across batches are all exercised.
    df = head_importance(
        injured, injured_tokens, method=ablation, batch_size=2, heads_per_pass=3, progress=False
    )
    delta, se = brute_force(injured, injured_tokens, ablation)
    np.testing.assert_allclose(grid(df), delta, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(grid(df, "delta_loss_se"), se, atol=2e-5, rtol=1e-3)
    np.testing.assert_allclose(
        df["clean_loss"], seq_losses(injured, injured_tokens).mean(), rtol=1e-6
    )
    assert (df["method"] == ablation).all() and (df["ablation"] == ablation).all()


def test_attribution_ranks_heads_like_exact_ablation(injured):
    tokens = to_sequences(injured, n_seqs=8, seq_len=32).tokens
    exact = head_importance(injured, tokens, method="mean", progress=False)
    estimate = head_importance(injured, tokens, method="attribution", progress=False)
    assert (estimate["ablation"] == "mean").all()
    np.testing.assert_allclose(estimate["clean_loss"], exact["clean_loss"], rtol=1e-6)
    agreement = compare_importance(exact, estimate)
    # Measured: Spearman 0.87, Pearson 0.67, top-6 overlap 4/6. A first-order estimate of a
    # large change cannot be exact; a shuffled ranking would give about 0 and 0.1.
    assert agreement["spearman"] > 0.6 and agreement["top_k_overlap"] >= 0.3


def float64_model():
    """A random BLOOM in float64, the installed major's model (a bridge on 4.x)."""
    shape = ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=40, n_ctx=16)
    return from_hf_model(random_hf_bloom(shape).double())


def hooked_transformer_without_tokenizer():
    """A user's own 3.x HookedTransformer: standard positions, default_prepend_bos True."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=2, d_model=16, d_head=4, n_heads=3, n_ctx=12, d_vocab=30, act_fn="gelu"
    )
    return HookedTransformer(cfg)


def bloom_without_tokenizer():
    """random_model has no tokenizer; asking for a BOS token must still prepend nothing."""
    model = random_model(ModelShape(n_layers=2, n_heads=3, d_model=24, d_vocab=30, n_ctx=12))
    model.cfg.default_prepend_bos = True
    return model


@pytest.mark.parametrize("ablation", ["zero", "resample"])
def test_attribution_is_the_derivative_of_a_partial_ablation(ablation):
    """Attribution = d/d eps of the loss with z -> z + eps (z' - z), at eps = 0 (float64)."""
    model = float64_model()
    tokens = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    estimate = head_importance(
        model, tokens, method="attribution", ablation=ablation, batch_size=2, progress=False
    )
    with torch.no_grad():
        _, donors = model.run_with_cache(tokens.roll(-1, 0))
    # A central difference: 4.x's BLOOM attention takes its softmax in float32 even in a float64
    # model, so the step must stay well above that rounding.
    eps = 1e-2
    for layer, head in [(0, 1), (1, 3)]:

        def nudge(z, hook, step, layer=layer, head=head):
            target = 0 * z[:, :, head] if ablation == "zero" else donors["z", layer][:, :, head]
            z[:, :, head] += step * (target - z[:, :, head])
            return z

        up, down = (
            seq_losses(model, tokens, [(f"blocks.{layer}.attn.hook_z", partial(nudge, step=step))])
            for step in (eps, -eps)
        )
        slope = (up - down) / (2 * eps)
        row = estimate[(estimate["layer"] == layer) & (estimate["head"] == head)].iloc[0]
        assert row["delta_loss"] == pytest.approx(slope.mean().item(), rel=1e-4, abs=1e-8)
        assert row["delta_loss_se"] == pytest.approx((slope.std() / 3**0.5).item(), rel=1e-3)


@pytest.mark.parametrize(
    "build",
    [pytest.param(hooked_transformer_without_tokenizer, marks=tl3_only), bloom_without_tokenizer],
)
def test_model_without_tokenizer_takes_token_tensors(build):
    model = build()
    tokens = torch.randint(0, 30, (3, 10), generator=torch.Generator().manual_seed(1))
    df = head_importance(model, tokens, method="zero", progress=False)
    assert df.attrs["prepend_bos"] is False and df.attrs["seq_len"] == 10
    delta, _ = brute_force(model, tokens, "zero")
    np.testing.assert_allclose(grid(df), delta, atol=1e-5, rtol=1e-4)
    with pytest.raises(DataError, match="no tokenizer"):
        head_importance(model, ["some text"], seq_len=8, progress=False)


def test_top_level_export_and_bad_arguments(injured, injured_tokens):
    assert headsurgeon.head_importance is head_importance
    with pytest.raises(InvalidArgumentError, match="zero, mean, resample, attribution"):
        head_importance(injured, injured_tokens, method="gradient")
    with pytest.raises(InvalidArgumentError, match="attribution"):
        head_importance(injured, injured_tokens, method="zero", ablation="mean")
    with pytest.raises(InvalidArgumentError, match="heads_per_pass"):
        head_importance(injured, injured_tokens, heads_per_pass=0)
    with pytest.raises(DataError, match="at least 2 sequences"):
        head_importance(injured, injured_tokens[:1], method="resample")
    for data, seq_len in [(None, 1), (injured_tokens[:, :1], 128)]:
        with pytest.raises(DataError, match="predict nothing"):
            head_importance(injured, data, seq_len=seq_len)
    with pytest.raises(InvalidArgumentError, match="same heads"):
        df = head_importance(injured, injured_tokens, method="zero", progress=False)
        compare_importance(df, df.iloc[:10])


def test_importance_figures_draw_the_numbers():
    from headsurgeon import plots

    rng = np.random.default_rng(0)
    layer, head = np.divmod(np.arange(12), 4)
    df = pd.DataFrame(
        {
            "layer": layer,
            "head": head,
            "delta_loss": rng.normal(0, 0.1, 12),
            "delta_loss_se": 0.01,
            "clean_loss": 3.0,
            "method": "mean",
            "ablation": "mean",
        }
    )
    df["bos_mass"] = rng.uniform(0, 1, 12)
    df["label"] = ["healthy"] * 9 + ["BOS-sink", "BOS-sink", "dead"]
    grid_fig = plots.importance_grid(df)
    heat = grid_fig.data[0]
    np.testing.assert_allclose(np.asarray(heat.z, float), df["delta_loss"].to_numpy().reshape(3, 4))
    assert heat.zmin == -heat.zmax == -df["delta_loss"].abs().max()  # centred on 0
    scatter = plots.bos_vs_importance(df)
    by_name = {t.name: t for t in scatter.data}
    assert set(by_name) == {"healthy (9)", "BOS-sink (2)", "dead (1)"}
    sinks = by_name["BOS-sink (2)"]
    assert list(sinks.x) == list(df["bos_mass"][9:11])
    assert list(sinks.y) == list(df["delta_loss"][9:11])
    with pytest.raises(InvalidArgumentError, match="bos_mass"):
        plots.bos_vs_importance(df.drop(columns="bos_mass"))


def test_ablate_heads_matches_hooks_and_leaves_the_model_as_it_was(tiny_model):
    """Zero: the heads' z is 0; mean: it is the mean of z over the data (computed independently
    here with run_with_cache); outside the block the model is unchanged."""
    from headsurgeon.importance import ablate_heads

    tokens = torch.randint(0, tiny_model.cfg.d_vocab, (4, 12))
    clean = tiny_model(tokens)
    _, cache = tiny_model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
    replacements = {
        "zero": lambda z: torch.zeros_like(z),
        "mean": lambda z: z.mean((0, 1), keepdim=True).expand_as(z),
    }
    for ablation, value in replacements.items():

        def replace(z, hook, value=value):
            layer_z = cache["blocks.0.attn.hook_z"]  # (4.x names the hook blocks.0.attn.o.hook_in)
            z[:, :, 1] = value(layer_z)[:, :, 1]
            return z

        expected = tiny_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", replace)])
        with ablate_heads(tiny_model, "L0H1", ablation, tokens, progress=False):
            torch.testing.assert_close(tiny_model(tokens), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiny_model(tokens), clean, rtol=0, atol=0)
    with pytest.raises(InvalidArgumentError, match="unknown ablation 'resample'"):
        with ablate_heads(tiny_model, "L0H1", "resample"):
            pass
