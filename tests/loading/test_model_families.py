"""Exact or refused, family by family: every number against ``transformers``' eager attention.

For GPT-2, GPT-NeoX (attention in parallel with the MLP), Llama (grouped-query: 4 query heads,
2 key-value heads), OPT and BLOOM, each a tiny random ``transformers`` model in float32 with eager
attention, converted by :func:`headsurgeon.loading.from_hf_model` for the installed
TransformerLens major: the census columns, the measured blindness zero counts and zero-ablation
importance equal a brute force computed from an untouched copy of the Hugging Face model
(``output_attentions=True``, its output projection's input, its loss), or the analysis refuses in
one line. Weights are drawn wide (``initializer_range``) so that patterns are peaked and float16
really rounds some weights to 0: the counts are not zero against zero.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from conftest import make_tokenizer
from test_census_reach import reference_reach

from headsurgeon import head_importance, measure_blindness, run_census
from headsurgeon.backend import MAJOR
from headsurgeon.census import COLUMNS
from headsurgeon.errors import UnsupportedArchitectureError
from headsurgeon.loading import from_hf_model

FAMILIES = ("gpt2", "neox", "llama", "opt", "bloom")
N_SEQS, N_POS = 3, 16
# Wide weights: logits of tens of nats, peaked patterns, float16 zeros.
INIT = 0.5
TOLERANCE = 1e-5
# What each family refuses on each major, and the one line it refuses with.
REFUSED = {
    (3, "gpt2", "load"): "has no n_ctx, which TransformerLens 3.x needs",
    (4, "opt", "blindness"): "does not hold the causal-masked pre-softmax scores",
    (4, "gpt2", "blocks"): "does not keep a key-value cache under TransformerLens 4",
    (4, "llama", "blocks"): "does not keep a key-value cache under TransformerLens 4",
}


# Per family: config class, model class, sizes (2 layers, 4 heads of 8), and the output
# projection of layer {}, whose input is the heads' concatenated z.
SPECS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        "transformer.h.{}.attn.c_proj",
        dict(n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=INIT),
    ),
    "neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        "gpt_neox.layers.{}.attention.dense",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            use_parallel_residual=True,
            initializer_range=INIT,
        ),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        "model.layers.{}.self_attn.o_proj",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=INIT,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        "model.decoder.layers.{}.self_attn.out_proj",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            init_std=INIT,
        ),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        "transformer.h.{}.self_attention.dense",
        dict(hidden_size=32, n_layer=2, n_head=4, initializer_range=INIT),
    ),
}


def hf_family(family: str, tokenizer) -> torch.nn.Module:
    """A tiny random causal LM of ``family`` in float32 with eager attention."""
    import transformers

    config_class, model_class, _, sizes = SPECS[family]
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[model_class],
        **sizes,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)._from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


def output_projection(hf: torch.nn.Module, layer: int) -> torch.nn.Module:
    """The module that takes the heads' concatenated outputs ``z`` in ``layer``."""
    family = next(name for name, spec in SPECS.items() if spec[1] == type(hf).__name__)
    return hf.get_submodule(SPECS[family][2].format(layer))


@functools.cache
def tokenizer():
    """The tests' byte-level tokenizer, saved and reloaded (TransformerLens 3.x reloads it by
    name to add its BOS token: an in-memory one has none)."""
    import tempfile

    from transformers import AutoTokenizer

    folder = tempfile.mkdtemp(prefix="headsurgeon-tokenizer-")
    make_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@functools.cache
def family(name: str):
    """``(model, reference)``: the family's model for this major, and an untouched copy of the
    Hugging Face model it came from (4.x's bridge wraps the original itself)."""
    hf = hf_family(name, tokenizer())
    reference = copy.deepcopy(hf)
    refusal = REFUSED.get((MAJOR, name, "load"))
    if refusal:
        with pytest.raises(UnsupportedArchitectureError, match=refusal) as info:
            from_hf_model(hf, tokenizer(), name=name)
        assert "\n" not in str(info.value)
        return None, reference
    return from_hf_model(hf, tokenizer(), name=name), reference


def loaded(name: str):
    model, reference = family(name)
    if model is None:
        pytest.skip(f"TransformerLens {MAJOR}.x refuses {name} in one line (test_loading)")
    return model, reference


def tokens(seed: int = 0) -> torch.Tensor:
    """Random ids, none of them the BOS token (``<s>``, id 1): a tensor never starts with it."""
    vocab = len(tokenizer())
    return torch.randint(4, vocab, (N_SEQS, N_POS), generator=torch.Generator().manual_seed(seed))


def eager(reference: torch.nn.Module, ids: torch.Tensor, ablate: tuple[int, int] | None = None):
    """``(patterns, zs, loss per sequence)`` of the Hugging Face model, float64; ``ablate``:
    ``(layer, head)`` whose slice of the output projection's input is zeroed."""
    n_layers = reference.config.num_hidden_layers
    d_head = reference.config.hidden_size // reference.config.num_attention_heads
    zs: dict[int, torch.Tensor] = {}

    def hook_for(layer):
        def keep(module, args):
            z = args[0].clone()
            if ablate is not None and ablate[0] == layer:
                z[..., ablate[1] * d_head : (ablate[1] + 1) * d_head] = 0
            zs[layer] = z
            return (z, *args[1:])

        return keep

    handles = [
        output_projection(reference, layer).register_forward_pre_hook(hook_for(layer))
        for layer in range(n_layers)
    ]
    try:
        with torch.no_grad():
            out = reference(ids, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    logprobs = out.logits[:, :-1].double().log_softmax(-1)
    losses = -logprobs.gather(-1, ids[:, 1:, None])[..., 0].mean(-1)
    return [a.double() for a in out.attentions], [zs[i].double() for i in range(n_layers)], losses


# The census columns an ALiBi slope decides (brute_census gives them without ALiBi only): the
# slope itself (tests/test_alibi_slopes.py) and the reach of a head that only follows it
# (tests/test_census_reach.py).
SLOPE_COLUMNS = ("slope", "reach_baseline", "reach_ratio")


def brute_census(reference: torch.nn.Module, ids: torch.Tensor, min_query_pos: int = 1) -> dict:
    """Every census column from the eager patterns and output projection, float64."""
    patterns, zs, _ = eager(reference, ids)
    n_heads = reference.config.num_attention_heads
    t = torch.arange(ids.shape[1], dtype=torch.float64)
    distance = (t[:, None] - t[None, :]).clamp(min=0)
    rows, prev_rows = slice(min_query_pos, None), slice(max(min_query_pos, 1), None)
    columns: dict[str, list] = {name: [] for name in COLUMNS if name not in ("layer", "head")}
    for layer, (A, z) in enumerate(zip(patterns, zs, strict=True)):
        proj = output_projection(reference, layer)
        weight = proj.weight.detach().double()
        # Conv1D (GPT-2) stores [in, out]; Linear [out, in].
        w_in_out = weight if type(proj).__name__ == "Conv1D" else weight.T
        W_O = w_in_out.view(n_heads, -1, w_in_out.shape[-1])  # [head, d_head, d_model]
        writes = torch.einsum("bphd,hdm->bphm", z.view(*z.shape[:2], n_heads, -1), W_O)
        head_norms = writes.norm(dim=-1)[:, rows].mean((0, 1))
        layer_norm = writes.sum(2).norm(dim=-1)[:, rows].mean()
        per_seq_bos = A[:, :, rows, 0].mean(-1)  # [seq, head]
        columns["slope"] += [np.nan] * n_heads
        columns["bos_mass"] += per_seq_bos.mean(0).tolist()
        columns["bos_mass_std"] += per_seq_bos.std(0).tolist()
        columns["sink_score"] += A[..., 0].mean((0, 2)).tolist()
        # Gu et al.: alpha_0 > 0.3 per sequence; Sandoval-Segura et al.: per sequence, each
        # head's mean |z| over every position over its layer's mean across heads
        columns["sink_share"] += (A[..., 0].mean(-1) > 0.3).double().mean(0).tolist()
        z_norms = z.view(*z.shape[:2], n_heads, -1).norm(dim=-1).mean(1)  # [seq, head]
        columns["ahon_ln"] += (z_norms / z_norms.mean(-1, keepdim=True)).mean(0).tolist()
        columns["entropy"] += torch.special.entr(A).sum(-1)[:, :, rows].mean((0, 2)).tolist()
        columns["max_weight"] += A[:, :, rows].amax(-1).mean((0, 2)).tolist()
        columns["mean_distance"] += (A * distance).sum(-1)[:, :, rows].mean((0, 2)).tolist()
        diagonal = A.diagonal(dim1=-2, dim2=-1)
        columns["self_mass"] += diagonal[..., rows].mean((0, 2)).tolist()
        previous = A.diagonal(offset=-1, dim1=-2, dim2=-1)  # A[t, t - 1] for t = 1 ...
        columns["prev_mass"] += previous[..., prev_rows.start - 1 :].mean((0, 2)).tolist()
        columns["output_norm"] += head_norms.tolist()
        columns["output_share"] += (head_norms / layer_norm).tolist()
        columns["reach"] += reference_reach(A.numpy(), 0.01, min_query_pos).tolist()
        columns["reach_baseline"] += [np.nan] * n_heads  # no ALiBi: no slope to follow
        columns["reach_ratio"] += [np.nan] * n_heads
    return columns


def test_loading_is_exact_or_refused_in_one_line():
    for name in FAMILIES:
        model, _ = family(name)  # a refusal is asserted there
        assert model is not None or (MAJOR, name, "load") in REFUSED


@pytest.mark.parametrize("name", FAMILIES)
def test_census_equals_eager_attention(name):
    model, reference = loaded(name)
    ids = tokens()
    census = run_census(model, ids, batch_size=2, progress=False)
    # One BOS rule: the tensor is used exactly as given, whatever the model's convention.
    assert census.attrs["seq_len"] == N_POS and census.attrs["prepend_bos"] is False
    assert census.attrs["bos_rule"].startswith("token tensor used exactly as given")
    expected = brute_census(reference, ids)
    for column, values in expected.items():
        if column in SLOPE_COLUMNS and name == "bloom":
            continue  # ALiBi slopes: tests/test_alibi_slopes.py, and what they decide alone
        np.testing.assert_allclose(
            census[column].to_numpy(), values, rtol=0, atol=TOLERANCE, err_msg=f"{name} {column}"
        )
    # Peaked patterns: the comparison is not between near-uniform rows.
    assert census["max_weight"].max() > 0.5


@pytest.mark.parametrize("name", FAMILIES)
def test_census_in_blocks_of_query_rows_equals_eager_attention(name):
    """Through the key-value cache, 5 rows at a time (the pattern of OPT's 4.x bridge comes
    after the block's output: the census takes its hooks in any order)."""
    model, reference = loaded(name)
    ids = tokens()
    refusal = REFUSED.get((MAJOR, name, "blocks"))
    if refusal:
        with pytest.raises(UnsupportedArchitectureError, match=refusal):
            run_census(model, ids, block_size=5, progress=False)
        return
    census = run_census(model, ids, block_size=5, progress=False)
    for column, values in brute_census(reference, ids).items():
        if column != "slope" and (column not in SLOPE_COLUMNS or name != "bloom"):
            np.testing.assert_allclose(
                census[column].to_numpy(),
                values,
                rtol=0,
                atol=TOLERANCE,
                err_msg=f"{name} {column}",
            )


@pytest.mark.parametrize("name", FAMILIES)
def test_measured_zeros_equal_the_eager_patterns_zeros(name):
    model, reference = loaded(name)
    ids = tokens(1)
    refusal = REFUSED.get((MAJOR, name, "blindness"))
    if refusal:
        with pytest.raises(UnsupportedArchitectureError, match=refusal) as info:
            measure_blindness(model, ids, dtypes=["float16"], progress=False)
        assert "\n" not in str(info.value)
        return
    heads = measure_blindness(model, ids, dtypes=["float16"], progress=False).by_head
    patterns, _, _ = eager(reference, ids)
    causal = torch.tril(torch.ones(N_POS, N_POS, dtype=torch.bool))
    # The hf convention: softmax in float32 (as eager computes it), weights cast to float16.
    expected = [((A.float().half() == 0) & causal).sum((0, 2, 3)) for A in patterns]
    expected = torch.cat(expected).double().numpy()
    measured = heads["zero_fraction"].to_numpy() * N_SEQS * N_POS * (N_POS + 1) / 2
    np.testing.assert_allclose(measured, expected, rtol=0, atol=1e-6, err_msg=name)
    assert expected.sum() > 10  # something underflowed: not zero against zero


@pytest.mark.parametrize("name", FAMILIES)
def test_zero_ablation_equals_eager_with_the_head_zeroed(name):
    model, reference = loaded(name)
    ids = tokens(2)
    df = head_importance(model, ids, method="zero", batch_size=2, progress=False)
    assert df.attrs["prepend_bos"] is False and df.attrs["seq_len"] == N_POS
    clean = eager(reference, ids)[2]
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    expected = [
        (eager(reference, ids, (layer, head))[2] - clean).mean().item()
        for layer in range(n_layers)
        for head in range(n_heads)
    ]
    np.testing.assert_allclose(
        df["delta_loss"].to_numpy(), expected, rtol=0, atol=TOLERANCE, err_msg=name
    )
    assert df["clean_loss"].iloc[0] == pytest.approx(clean.mean().item(), abs=TOLERANCE)
    assert np.abs(expected).max() > 1e-3  # heads matter: not zero against zero


def test_texts_follow_the_convention_and_the_census_records_it():
    """A model whose convention prepends BOS: texts get it, a tensor never does."""
    name = "gpt2" if MAJOR >= 4 else "llama"  # TransformerLens 3.x cannot load GPT-2
    model, reference = loaded(name)
    assert model.cfg.default_prepend_bos is True
    text = "The quick brown fox jumps over the lazy dog. " * 10
    census = run_census(model, text, seq_len=N_POS, n_seqs=2, progress=False)
    assert census.attrs["prepend_bos"] is True and "convention" in census.attrs["bos_rule"]
    ids = tokens()
    assert run_census(model, ids, progress=False).attrs["seq_len"] == N_POS
    # A tensor with its own BOS column is used as given too: 17 positions, the BOS recorded.
    with_bos = torch.cat([torch.full((N_SEQS, 1), tokenizer().bos_token_id), ids], dim=1)
    census = run_census(model, with_bos, progress=False)
    assert census.attrs["seq_len"] == N_POS + 1 and census.attrs["prepend_bos"] is True
    expected = brute_census(reference, with_bos)["bos_mass"]
    np.testing.assert_allclose(census["bos_mass"], expected, rtol=0, atol=TOLERANCE)


def test_a_hook_that_never_fired_is_one_line_never_zeros(monkeypatch):
    """Each analysis names the hook it did not see instead of reporting zeros."""
    import headsurgeon.importance
    from headsurgeon.probes import HeadStats

    model, _ = loaded("bloom")
    every = HeadStats.hooks
    monkeypatch.setattr(
        HeadStats,
        "hooks",
        lambda self: [(name, f) for name, f in every(self) if name != "blocks.1.attn.hook_pattern"],
    )
    with pytest.raises(UnsupportedArchitectureError, match="blocks.1.attn.hook_pattern never"):
        run_census(model, tokens(), batch_size=3, progress=False)
    monkeypatch.setattr(headsurgeon.importance, "stream", lambda *args, **kwargs: None)
    with pytest.raises(UnsupportedArchitectureError, match="blocks.0.attn.hook_z never fired"):
        head_importance(model, tokens(), method="mean", progress=False)


@pytest.mark.skipif(MAJOR < 4, reason="TransformerLens 3.x computes every attention itself")
def test_a_bridge_over_fused_attention_is_refused_not_zeros():
    """OPT's bridge shows only the pattern transformers returns: with sdpa (its default) none.
    from_hf_model switches to eager attention; a bridge built around sdpa is refused."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    hf = hf_family("opt", tokenizer())
    hf.set_attn_implementation("sdpa")
    model = build_bridge_from_module(hf, "OPTForCausalLM", hf_config=hf.config)
    with pytest.raises(UnsupportedArchitectureError, match="hook_pattern never fired") as info:
        run_census(model, tokens(), progress=False)
    assert "\n" not in str(info.value) and "OPTForCausalLM" in str(info.value)
    with pytest.raises(UnsupportedArchitectureError, match="hook_attn_scores never fired"):
        measure_blindness(model, tokens(), dtypes=["float16"], progress=False)
    converted = from_hf_model(hf_family("opt", tokenizer()).eval(), tokenizer(), name="opt")
    assert converted.original_model.config._attn_implementation == "eager"


def test_repair_runs_on_opt():
    """Repair reads the census of a bridge whose pattern fires after its output (OPT, 4.x)."""
    from headsurgeon import FinetuneConfig
    from headsurgeon.repair import repair

    model = from_hf_model(hf_family("opt", tokenizer()), tokenizer(), name="opt")  # repaired
    data = torch.randint(
        4, len(tokenizer()), (24, N_POS), generator=torch.Generator().manual_seed(3)
    )
    result = repair(
        model,
        data,
        heads="L1H2",
        passes=1,
        census_seq_len=N_POS,
        train_seq_len=N_POS,
        finetune_config=FinetuneConfig(steps=1, batch_size=4),
        progress=False,
    )
    assert str(result.passes[0].targeted) == "L1H2"
    assert result.passes[0].census_before["max_weight"].max() > 0.5  # patterns were read
