"""MPT and Falcon-ALiBi, weights side: per-head slices, surgery, masked fine-tuning, export.

Every check is against ``transformers`` eager on an independent copy of the same tiny model.
TransformerLens 3.x has no adapter for either family: the module runs on 4.x only.
"""

from __future__ import annotations

import copy

import pytest
import torch

from headsurgeon.backend import MAJOR
from headsurgeon.backend.weights import check_head_tensors, head_tensors

pytestmark = [
    pytest.mark.skipif(
        MAJOR < 4, reason="TransformerLens 3.x has no MPT or Falcon adapter (4.x's bridge has)"
    ),
    # Said once per model loaded; the slopes do not matter to the weights.
    pytest.mark.filterwarnings("ignore:the MPT config sets attn_config.alibi_bias_max"),
]

ATOL = 1e-5
FAMILIES = ("mpt", "falcon", "falcon-nobias")


def hf_model(family: str, seed: int = 0, **changes):
    """A tiny random ``transformers`` model of ``family`` (eager attention), biases randomised."""
    from transformers import FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM

    torch.manual_seed(seed)
    if family == "mpt":
        config = MptConfig(
            d_model=64,
            n_heads=4,
            n_layers=2,
            vocab_size=128,
            max_seq_len=64,
            attn_config={"alibi": True, "alibi_bias_max": 16},
            **changes,
        )
        model = MptForCausalLM(config)
    else:
        args = dict(
            hidden_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=128,
            alibi=True,
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
            bias=family == "falcon",
        )
        model = FalconForCausalLM(FalconConfig(**(args | changes)))
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # constant initial biases and LayerNorms would hide a wrong mapping
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name or "ln_f" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def pair(family: str, **changes):
    """``(transformers reference, headsurgeon model)``: the same weights, separate copies."""
    from headsurgeon.loading import from_hf_model

    hf = hf_model(family, **changes)
    reference = copy.deepcopy(hf)
    return reference, from_hf_model(hf, name=family)


def hf_attention(hf, layer: int):
    blocks = hf.transformer.blocks if hasattr(hf.transformer, "blocks") else hf.transformer.h
    block = blocks[layer]
    return block.attn if hasattr(block, "attn") else block.self_attention


def hf_output_projection(hf, layer: int) -> torch.nn.Linear:
    attn = hf_attention(hf, layer)
    return attn.out_proj if hasattr(attn, "out_proj") else attn.dense


def toks(n_seqs: int = 2, n_pos: int = 12) -> torch.Tensor:
    return torch.randint(0, 128, (n_seqs, n_pos), generator=torch.Generator().manual_seed(1))


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def hf_logits(hf, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens).logits


def bridge_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_head_slices_are_what_transformers_computes_per_head(family):
    """Each head's V and O slices rebuild the attention output transformers computes from its own
    pattern; its Q and K slices give logits that differ from transformers' by the ALiBi bias
    alone (linear in the key position), head by head."""
    reference, model = pair(family)
    tokens = toks()
    layer = 1
    seen = {}
    hook = hf_attention(reference, layer).register_forward_hook(
        lambda m, args, kwargs, out: seen.update(
            x=kwargs.get("hidden_states", args and args[0]), out=out[0], pattern=out[1]
        ),
        with_kwargs=True,
    )
    with torch.no_grad():
        reference(tokens, output_attentions=True)
    hook.remove()
    x, pattern = seen["x"], seen["pattern"]  # [batch, pos, d_model], [batch, head, query, key]
    tensors = head_tensors(model, layer)
    assert ("b_Q" in tensors) == (family == "falcon")  # MPT and bias=False have no Q/K/V biases

    def project(name: str, head: int) -> torch.Tensor:
        t = tensors[f"W_{name}"]
        out = x @ t.heads(t.param)[head]
        if f"b_{name}" in tensors:
            out = out + tensors[f"b_{name}"].heads(tensors[f"b_{name}"].param)[head]
        return out

    w_o = tensors["W_O"].heads(tensors["W_O"].param)
    out = hf_output_projection(reference, layer).bias
    out = torch.zeros_like(x) if out is None else out.expand_as(x).clone()
    n_pos, d_head = tokens.shape[1], model.cfg.d_head
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    for head in range(model.cfg.n_heads):
        out = out + (pattern[:, head] @ project("V", head)) @ w_o[head]
        scores = project("Q", head) @ project("K", head).transpose(-1, -2) / d_head**0.5
        bias = pattern[:, head].log() - scores  # ALiBi + a per-row constant, where unmasked
        steps = (bias[..., 1:] - bias[..., :-1])[:, causal[:, 1:]]  # both keys unmasked
        assert steps.std() < 1e-4 and steps.mean() > 0, (family, head)  # one slope per head
    torch.testing.assert_close(out, seen["out"], atol=ATOL, rtol=0)


def without_head_output(hf, layer: int, head: int, d_head: int):
    """A copy of ``hf`` whose head ``layer, head`` writes nothing: its columns of the output
    projection zeroed (the output bias, shared by all heads, kept)."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        hf_output_projection(hf, layer).weight[:, head * d_head : (head + 1) * d_head] = 0
    return hf


@pytest.mark.parametrize("family", FAMILIES)
def test_ablating_a_head_equals_transformers_without_its_output(family):
    from headsurgeon.importance import ablate_heads

    reference, model = pair(family)
    tokens = toks()
    expected = hf_logits(without_head_output(reference, 1, 2, model.cfg.d_head), tokens)
    with ablate_heads(model, "L1H2", "zero"):
        pruned = logits(model, tokens)
    assert (hf_logits(reference, tokens) - expected).abs().max() > 1e-3  # the head mattered
    torch.testing.assert_close(pruned, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_reinit_changes_only_the_heads_slices_and_silences_them(family):
    from headsurgeon.surgery import reinit_heads

    reference, model = pair(family)
    tokens = toks()
    before = bridge_state(model)
    old = {name: t.heads(t.param.detach()).clone() for name, t in head_tensors(model, 1).items()}
    reinit_heads(model, "L1H2", seed=3)
    # The head's W_O slice is zero: the model computes transformers' model without that head.
    expected = hf_logits(without_head_output(reference, 1, 2, model.cfg.d_head), tokens)
    torch.testing.assert_close(logits(model, tokens), expected, atol=ATOL, rtol=0)
    for name, t in head_tensors(model, 1).items():
        new = t.heads(t.param.detach())
        assert torch.equal(new[[0, 1, 3]], old[name][[0, 1, 3]]), name
        assert not torch.equal(new[2], old[name][2]) or not old[name][2].any(), name
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {t.path for t in head_tensors(model, 1).values()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["slices", "mask"])
def test_masked_finetuning_moves_only_the_chosen_slices(family, strategy):
    from headsurgeon.finetune import FinetuneConfig, finetune
    from headsurgeon.surgery import head_masks

    _, model = pair(family)
    before = bridge_state(model)
    decay = 0.1 if strategy == "slices" else 0.0  # slices: decay reaches only the copies
    config = FinetuneConfig(
        steps=3,
        batch_size=2,
        lr=1e-2,
        eval_every=3,
        eval_seqs=2,
        strategy=strategy,
        weight_decay=decay,
    )
    finetune(model, "L0H1,L1H3", toks(8, 16), config=config, progress=False)
    masks = head_masks(model, "L0H1,L1H3")
    for name, p in model.named_parameters():
        mask = masks.get(name, torch.zeros_like(p, dtype=torch.bool))
        assert torch.equal(p[~mask], before[name][~mask]), name  # bit-identical outside
    trained = {
        name: (p[masks[name]] != before[name][masks[name]]).any()
        for name, p in model.named_parameters()
        if name in masks
    }
    # Every chosen tensor moved, except b_K (no gradient: it shifts a whole row of logits).
    expected = {
        t.path for layer in (0, 1) for n, t in head_tensors(model, layer).items() if n != "b_K"
    }
    assert {name for name, moved in trained.items() if moved} == expected


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(multi_query=True), "multi-query"),
        (dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True), "new_decoder"),
        (dict(new_decoder_architecture=True, num_kv_heads=4, parallel_attn=True), "new_decoder"),
    ],
)
def test_heads_sharing_keys_and_values_are_refused_in_one_line(changes, match):
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    from headsurgeon.errors import UnsupportedArchitectureError
    from headsurgeon.finetune import finetune
    from headsurgeon.surgery import reinit_heads

    hf = hf_model("falcon", **changes)
    # Built by hand: load_model and from_hf_model refuse new_decoder_architecture outright.
    model = build_bridge_from_module(hf, "FalconForCausalLM", hf_config=hf.config)
    before = bridge_state(model)
    for call in (
        lambda: check_head_tensors(model),
        lambda: reinit_heads(model, "L0H0"),
        lambda: finetune(model, "L0H0", toks(4, 8), progress=False),
    ):
        with pytest.raises(UnsupportedArchitectureError, match=match) as error:
            call()
        assert "\n" not in str(error.value)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("family", [*FAMILIES, "falcon-multi-query"])
def test_export_writes_the_familys_own_layout_and_transformers_computes_the_model(family, tmp_path):
    """After surgery on one head, the export reloads as the family's own class (config and
    safetensors) and computes what the model computes; untouched heads' fused rows are the
    source's, bit for bit."""
    import json

    from safetensors.torch import load_file

    from headsurgeon.checkpoints import save_hf
    from headsurgeon.surgery import reinit_heads

    changes = dict(multi_query=True) if family == "falcon-multi-query" else {}
    reference, model = pair(family.removesuffix("-multi-query"), **changes)
    source = {k: v.clone() for k, v in reference.state_dict().items()}
    if "multi" not in family:
        reinit_heads(model, "L1H2", seed=1)
    folder = save_hf(model, tmp_path / "export", dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [type(reference).__name__]
    assert config["model_type"] == reference.config.model_type
    exported = type(reference).from_pretrained(folder, dtype=torch.float32).eval()
    exported.config._attn_implementation = "eager"
    tokens = toks(3, 20)
    torch.testing.assert_close(
        hf_logits(exported, tokens), logits(model, tokens), atol=ATOL, rtol=0
    )
    written = load_file(folder / "model.safetensors")
    assert set(written) <= set(source) and "lm_head.weight" not in written  # tied, as the source
    for name, tensor in written.items():
        if "multi" in family or not name.startswith(("transformer.h.1.", "transformer.blocks.1.")):
            assert torch.equal(tensor, source[name]), name  # the fused QKV rebuilt exactly
    if "multi" not in family:
        # Head 2's rows: one block of (q, k, v) x d_head (Falcon), a d_head block per third (MPT).
        mpt = family == "mpt"
        qkv = f"transformer.{'blocks.1.attn.Wqkv' if mpt else 'h.1.self_attention.query_key_value'}"
        rows = torch.arange(3 * model.cfg.d_model)
        head = (rows.view(3, 4, -1)[:, 2] if mpt else rows.view(4, 3, -1)[2]).flatten()
        others = rows[~torch.isin(rows, head)]
        for suffix in (".weight", ".bias") if family == "falcon" else (".weight",):
            assert torch.equal(written[qkv + suffix][others], source[qkv + suffix][others])
            assert not torch.equal(written[qkv + suffix][head], source[qkv + suffix][head])


def test_export_refuses_what_its_format_cannot_hold(tmp_path):
    from headsurgeon.checkpoints import save_hf
    from headsurgeon.errors import UnsupportedArchitectureError

    _, model = pair("mpt")
    with torch.no_grad():
        model.unembed.b_U.add_(0.5)  # MPT's lm_head has no bias
    with pytest.raises(UnsupportedArchitectureError, match="as an MPT checkpoint: .*b_U"):
        save_hf(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_repair_end_to_end_changes_only_the_targets_and_exports(family, tmp_path):
    from headsurgeon.checkpoints import save_hf
    from headsurgeon.finetune import FinetuneConfig
    from headsurgeon.repair import repair
    from headsurgeon.surgery import head_masks

    _, model = pair(family)
    before = bridge_state(model)
    data = torch.randint(0, 128, (40, 32), generator=torch.Generator().manual_seed(2))
    result = repair(
        model,
        data,
        heads="L1H2",
        passes=1,
        progress=False,
        finetune_config=FinetuneConfig(steps=2, batch_size=4, lr=1e-2),
    )
    assert str(result.passes[0].targeted) == "L1H2"
    assert set(result.census_after["head"]) == set(range(4))  # every head measured after
    masks = head_masks(model, "L1H2")
    for name, p in model.named_parameters():
        mask = masks.get(name, torch.zeros_like(p, dtype=torch.bool))
        assert torch.equal(p[~mask], before[name][~mask]), name
    assert any(
        not torch.equal(p[masks[n]], before[n][masks[n]])
        for n, p in model.named_parameters()
        if n in masks
    )
    folder = save_hf(model, tmp_path / "repaired", dtype="float32")  # checked by reloading
    assert (folder / "model.safetensors").is_file()
