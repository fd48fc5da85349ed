"""A TransformerLens user's own model: built from a config, no tokenizer, TransformerLens's slopes.

Every tool must read what the model does (its ALiBi slopes, its BOS convention) instead of
assuming a BLOOM loaded by headsurgeon, and must leave the model as it found it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tl3_only

import headsurgeon.repair.pipeline as repair_module
from headsurgeon import (
    FinetuneConfig,
    HeadSet,
    analytic_blindness,
    classify_heads,
    measure_blindness,
    perplexity,
    run_census,
    save_hf,
)
from headsurgeon.backend import MAJOR
from headsurgeon.errors import DataError, UnsupportedArchitectureError
from headsurgeon.loading import alibi_slopes, use_exact_alibi
from headsurgeon.repair import repair

# TransformerLens 3.x's slopes for 6 heads (2^(-8(h+1)/6)); Hugging Face's differ.
TL_SLOPES_6 = [2 ** (-8 * (h + 1) / 6) for h in range(6)]
HF_SLOPES_6 = [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]


tl4_only = pytest.mark.skipif(MAJOR < 4, reason="TransformerBridge is TransformerLens 4.x's")


def user_model(n_heads: int = 6, **overrides):
    """What a TransformerLens 3.x user builds: a config, random weights, no tokenizer (4.x has no
    HookedTransformer; :func:`user_bridge` is its user's own model)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = dict(
        n_layers=2,
        d_model=8 * n_heads,
        d_head=8,
        n_heads=n_heads,
        n_ctx=256,
        d_vocab=97,
        act_fn="gelu_new",
        normalization_type="LN",
        positional_embedding_type="alibi",
        seed=0,
    )
    return HookedTransformer(HookedTransformerConfig(**(cfg | overrides))).eval()


def user_bridge(n_heads: int = 6):
    """What a TransformerLens 4.x user builds: a transformers BLOOM of their own, wrapped in a
    TransformerBridge, no tokenizer."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module
    from transformers import BloomConfig, BloomForCausalLM

    # A setting only the Hugging Face config holds: save_hf must write it.
    config = BloomConfig(
        vocab_size=97,
        hidden_size=8 * n_heads,
        n_layer=2,
        n_head=n_heads,
        apply_residual_connection_post_layernorm=True,
    )
    torch.manual_seed(0)
    hf = BloomForCausalLM(config).eval()
    return build_bridge_from_module(hf, "BloomForCausalLM", hf_config=config, model_name="mine")


def own_model():
    """A user's own 6-head ALiBi model of the installed TransformerLens, without a tokenizer."""
    return user_model() if MAJOR < 4 else user_bridge()


def tokens(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (n, length), generator=torch.Generator().manual_seed(seed))


def snapshot(model) -> dict:
    """Everything a tool could leave behind: weights, attributes, hooks, cached biases."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "attributes": set(vars(model)),
        "attn_attributes": [set(vars(block.attn)) for block in model.blocks],
        "pre_hooks": [len(block.attn._forward_pre_hooks) for block in model.blocks],
        "hooks": sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values()),
        "prepend_bos": model.cfg.default_prepend_bos,
    }


def assert_unchanged(model, before: dict) -> None:
    after = snapshot(model)
    assert after.pop("state").keys() == before["state"].keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before["state"][name]), name
    assert after == {k: v for k, v in before.items() if k != "state"}


@tl3_only
def test_the_slopes_are_the_models_own():
    model = user_model()
    assert model.cfg.default_prepend_bos is True and model.tokenizer is None  # TL's defaults
    torch.testing.assert_close(alibi_slopes(model), torch.tensor(TL_SLOPES_6))
    before = snapshot(model)
    logits = model(tokens(2, 32))

    census = run_census(model, tokens(4, 64), progress=False)
    assert census["slope"].tolist() == pytest.approx(TL_SLOPES_6 * 2, rel=1e-6)
    analytic = analytic_blindness(model, dtypes=["float16"], limits=["zero"])
    assert analytic["slope"].tolist() == pytest.approx(TL_SLOPES_6 * 2, rel=1e-6)
    assert_unchanged(model, before)
    # Not bit-equal: TransformerLens caches the bias of the longest sequence seen (the census's
    # 64 tokens) and slices it, which shifts each row's logits by a constant, as any forward does.
    torch.testing.assert_close(model(tokens(2, 32)), logits, rtol=0, atol=1e-4)


@tl3_only
def test_measured_zeros_agree_with_the_analytic_distance_of_the_models_slopes():
    model = user_model()
    measured = measure_blindness(model, tokens(2, 160), dtypes=["float16"], progress=False)
    heads = measured.by_head
    assert heads["slope"].tolist() == pytest.approx(TL_SLOPES_6 * 2, rel=1e-6)
    # A head must be blind from its analytic distance on (random weights: small content logits).
    reachable = heads[heads.analytic_distance < 150]
    assert len(reachable) >= 4
    assert (reachable.first_zero_distance <= reachable.analytic_distance).all()
    beyond = heads[heads.analytic_distance > 1000]
    assert beyond.first_zero_distance.isna().all()


@tl3_only
def test_use_exact_alibi_warns_that_it_changes_outputs():
    model = user_model()
    plain = model(tokens(2, 40))
    with pytest.warns(UserWarning, match="outputs change"):
        use_exact_alibi(model)
    torch.testing.assert_close(alibi_slopes(model), torch.tensor(HF_SLOPES_6))
    assert (model(tokens(2, 40)) - plain).abs().max() > 1e-2
    eight = user_model(n_heads=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        use_exact_alibi(eight)  # a power of two: the same slopes, no warning


@tl3_only
def test_token_tensors_work_everywhere_without_a_tokenizer():
    model = user_model()
    data = tokens(8, 48)
    before = snapshot(model)
    census = run_census(model, data, progress=False)
    assert census.attrs["prepend_bos"] is False and census.attrs["seq_len"] == 48
    expected = torch.exp(model(data, return_type="loss")).item()
    assert perplexity(model, data, window=48) == pytest.approx(expected, rel=1e-5)
    measure_blindness(model, data, dtypes=["float16"], progress=False)
    assert_unchanged(model, before)
    with pytest.raises(DataError, match="no tokenizer"):
        run_census(model, data, prepend_bos=True, progress=False)
    with pytest.raises(DataError, match="no tokenizer"):
        run_census(model, None, progress=False)  # the bundled corpora are text


def test_the_bos_convention_is_read_at_each_call(tiny_model):
    from headsurgeon.data import to_sequences

    bos = tiny_model.tokenizer.bos_token_id
    text = "a text to cut into sequences " * 20
    assert (to_sequences(tiny_model, text, seq_len=8).tokens[:, 0] != bos).all()
    tiny_model.cfg.default_prepend_bos = True  # after a first use
    assert (to_sequences(tiny_model, text, seq_len=8).tokens[:, 0] == bos).all()
    census = run_census(tiny_model, text, seq_len=16, n_seqs=2, progress=False)
    assert census.attrs["prepend_bos"] is True and "convention" in census.attrs["bos_rule"]
    # A token tensor is used exactly as given (one BOS rule for every model).
    given = run_census(tiny_model, tokens(2, 16), progress=False)
    assert given.attrs["prepend_bos"] is False and given.attrs["seq_len"] == 16


def test_repair_takes_token_tensors():
    model = own_model()
    data = tokens(40, 32)
    result = repair(
        model,
        data,
        heads=HeadSet.parse("L1H2"),
        passes=1,
        progress=False,
        finetune_config=FinetuneConfig(steps=2, batch_size=4),
    )
    settings = result.settings
    assert settings["train_data"] == "token tensor of shape [40, 32]"
    assert settings["train_sequences"] == [35, 32] and settings["eval_sequences"] == [5, 32]
    assert "held out" in settings["eval_data"]
    assert result.passes[0].targeted == HeadSet.parse("L1H2")


@tl3_only
def test_operations_a_model_cannot_support_fail_before_any_work(monkeypatch):
    def no_census(*args, **kwargs):
        raise AssertionError("the census ran before the model was checked")

    monkeypatch.setattr(repair_module, "run_census", no_census)
    gqa = user_model(n_key_value_heads=2)
    with pytest.raises(UnsupportedArchitectureError, match="grouped-query"):
        repair(gqa, tokens(40, 32), heads=HeadSet.parse("L0H0"), progress=False)
    rotary = user_model(positional_embedding_type="rotary", rotary_dim=8)
    with pytest.raises(UnsupportedArchitectureError, match="rotary"):
        analytic_blindness(rotary)
    with pytest.raises(UnsupportedArchitectureError, match="rotary"):
        alibi_slopes(rotary)


@tl4_only
def test_a_bridge_a_tool_cannot_support_fails_before_any_work(monkeypatch):
    from transformer_lens.model_bridge.sources import build_bridge_from_module
    from transformers import LlamaConfig, LlamaForCausalLM

    def no_census(*args, **kwargs):
        raise AssertionError("the census ran before the model was checked")

    monkeypatch.setattr(repair_module, "run_census", no_census)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    llama = LlamaForCausalLM(config).eval()  # grouped-query attention, rotary positions
    model = build_bridge_from_module(llama, "LlamaForCausalLM", hf_config=config)
    with pytest.raises(UnsupportedArchitectureError, match="grouped-query"):
        repair(model, tokens(40, 32), heads=HeadSet.parse("L0H0"), progress=False)
    with pytest.raises(UnsupportedArchitectureError, match="rotary"):
        analytic_blindness(model)
    with pytest.raises(UnsupportedArchitectureError, match="rotary"):
        alibi_slopes(model)


def test_repair_settings_as_keywords_or_as_one_config():
    from headsurgeon import RepairConfig
    from headsurgeon.errors import InvalidArgumentError

    data, training = tokens(40, 32), FinetuneConfig(steps=2, batch_size=4)
    by_keywords = repair(
        own_model(),
        data,
        heads="L1H2",
        passes=1,
        finetune_config=training,
        census_n_seqs=4,
        progress=False,
    )
    config = RepairConfig(passes=1, finetune=training, census_n_seqs=4)
    by_config = repair(own_model(), data, heads="L1H2", config=config, progress=False)
    assert by_config.to_dict() == by_keywords.to_dict()
    with pytest.raises(InvalidArgumentError, match="passes"):
        repair(own_model(), data, heads="L1H2", config=config, passes=3, progress=False)


@tl4_only
def test_a_users_own_bridge_is_read_and_left_as_it_was(tmp_path):
    from transformers import BloomForCausalLM

    model = user_bridge()
    assert model.tokenizer is None
    # Its own attention applies Hugging Face's slopes, exact for 6 heads: nothing to switch.
    torch.testing.assert_close(alibi_slopes(model), torch.tensor(HF_SLOPES_6))
    data = tokens(8, 48)
    before = snapshot(model)
    with torch.no_grad():
        logits = model(data)
    census = run_census(model, data, progress=False)
    assert census["slope"].tolist() == pytest.approx(HF_SLOPES_6 * 2, rel=1e-6)
    assert len(classify_heads(census)) == 12
    assert census.attrs["prepend_bos"] is False and census.attrs["seq_len"] == 48
    with torch.no_grad():
        expected = torch.exp(model(data, return_type="loss")).item()
    assert perplexity(model, data, window=48) == pytest.approx(expected, rel=1e-5)
    measure_blindness(model, data, dtypes=["float16"], progress=False)
    out = save_hf(model, tmp_path / "export")
    assert_unchanged(model, before)
    with torch.no_grad():
        torch.testing.assert_close(model(data), logits, rtol=0, atol=0)
        hf = BloomForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert hf.config.apply_residual_connection_post_layernorm is True
        assert (hf(data).logits - logits).abs().max() < 1e-4
    with pytest.raises(DataError, match="no tokenizer"):
        run_census(model, None, progress=False)
    with pytest.raises(DataError, match="no tokenizer"):
        run_census(model, data, prepend_bos=True, progress=False)
