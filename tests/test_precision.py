"""The precision counterfactual against transformers' eager forward, family by family.

Every pass of :func:`headsurgeon.precision.precision_effect` runs the family's attention op for
op (:class:`headsurgeon.precision._Family`): with the family's own softmax (float32) the float64
pass IS transformers' eager float64 forward (bit for bit), and the ``model`` pass in each dtype
IS transformers' eager forward in that dtype (bit for bit), with the family's bias or, under
``mitigation(model, "relative")``, the bias hook's. BLOOM on TransformerLens 3.x and 4.x; MPT
and Falcon (alibi=True, three layouts) on 4.x.
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

import headsurgeon as hs
from headsurgeon import precision
from headsurgeon.backend import MAJOR
from headsurgeon.blindness import mitigation
from headsurgeon.checkpoints import hf_model
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.evals import position_edges
from headsurgeon.exact_alibi import install_hf_bias
from headsurgeon.precision import _Family, _Recipe, _recipe_attention, precision_effect

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FAMILIES = ["bloom"] + (["mpt", "falcon", "falcon-parallel", "falcon-mq"] if MAJOR >= 4 else [])


@pytest.fixture(params=FAMILIES)
def family_model(request, tiny_model):
    """``(model, hf)``: a headsurgeon model of the family and an untouched transformers copy of
    what it computes (float32, eager)."""
    if request.param == "bloom":
        return tiny_model, hf_model(tiny_model)
    from test_alibi_families import converted, hf_model as family_hf

    hf = family_hf(request.param, scale=3.0)  # peaked patterns: low precision shows
    return converted(hf), hf


def _tokens(model, n_seqs=2, n_pos=40):
    return torch.randint(
        0, model.cfg.d_vocab, (n_seqs, n_pos), generator=torch.Generator().manual_seed(0)
    )


@torch.no_grad()
def _logits(hf, recipe=None, tokens=None):
    if recipe is None:
        return hf(tokens).logits
    with _recipe_attention(_Family(hf), recipe):
        return hf(tokens).logits


def test_float64_pass_is_transformers_float64(family_model):
    """With the family's float32 softmax the float64 pass equals transformers' eager float64
    forward bit for bit; the reference (float64 softmax) differs only by that rounding."""
    model, hf = family_model
    tokens = _tokens(model)
    hf64 = copy.deepcopy(hf).double()
    expected = _logits(hf64, tokens=tokens)
    ours = hf_model(model, torch.float64)
    as_family = _logits(ours, _Recipe("softmax", torch.float64), tokens)
    assert (as_family - expected).abs().max().item() <= 1e-10
    reference = _logits(ours, _Recipe("float64", torch.float64), tokens)
    # float32 weights: relative error 2^-24 per weight, through two layers
    assert (reference - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("relative", [False, True], ids=["family-bias", "relative"])
def test_model_pass_is_transformers_eager_in_the_dtype(family_model, dtype, relative):
    """The ``model`` pass is transformers' eager forward in the dtype, bit for bit: with the
    family's own bias, or with the relative bias hook (install_hf_bias) installed."""
    model, hf = family_model
    tokens = _tokens(model)
    eager = copy.deepcopy(hf).to(dtype)
    if relative:
        install_hf_bias(eager, "relative")
    expected = _logits(eager, tokens=tokens)
    # As precision_effect makes it: the float64 copy rounded once to the dtype.
    ours = hf_model(model, torch.float64).to(dtype)
    ours = _logits(ours, _Recipe("model", dtype, relative), tokens)
    assert torch.equal(ours, expected)


def test_tables_columns_and_blocks(family_model):
    """One row per (dtype, part, bucket) and per (dtype, part, layer, head, distance bucket);
    the float64 loss is the same in blocks of query rows as in one dense pass."""
    model, _ = family_model
    tokens = _tokens(model)
    dense = precision_effect(model, tokens, progress=False, block_size=tokens.shape[1])
    blocks = precision_effect(model, tokens, progress=False, block_size=16)
    pos = dense.by_position
    assert list(pos.columns) == [
        "dtype", "part", "position_lo", "position_hi", "tokens", "mean_dnll", "mean_abs_dnll",
        "max_abs_dnll", "max_abs_dlogit", "top1_agreement", "nll_float64",
    ]  # fmt: skip
    n_buckets = len(position_edges(tokens.shape[1])) - 1
    assert len(pos) == 9 * n_buckets
    assert (pos.tokens.groupby([pos.dtype, pos.part]).sum() == tokens.numel() - 2).all()
    np.testing.assert_allclose(blocks.by_position.nll_float64, pos.nll_float64, rtol=0, atol=1e-10)
    f32 = pos[pos.dtype == "float32"]
    assert f32.max_abs_dnll.max() < 1e-3 and (f32.top1_agreement == 1).all()
    heads = dense.by_head
    n_heads = model.cfg.n_heads
    assert len(heads) == 9 * model.cfg.n_layers * n_heads * (len(position_edges(41)) - 1)
    # Every causal entry is in one bucket.
    one = heads[(heads.dtype == "float32") & (heads.part == "model") & (heads.layer == 0)]
    assert one.groupby("head").entries.sum().eq(2 * 40 * 41 / 2).all()
    # scores: the softmax is float64, nothing is 0; moved mass is at most 1 per row.
    assert heads[heads.part == "scores"].zero_entries.sum() == 0
    assert heads.groupby(["dtype", "part", "layer", "head"]).moved_mass.sum().max() <= 1
    np.testing.assert_allclose(blocks.by_head.entries, heads.entries)
    np.testing.assert_allclose(blocks.by_head.moved_mass, heads.moved_mass, rtol=1e-3, atol=1e-6)
    assert pos.attrs["seq_len"] == 40 and pos.attrs["n_seqs"] == 2
    assert pos.attrs["bias"] in ("absolute", "relative to the last key")
    assert set(pos.attrs["parts"]) == set(precision.PARTS)


def test_softmax_zeros_of_layer_0_equal_transformers_float64_weights(family_model):
    """Brute force: layer 0's inputs are the same in transformers' float64 forward; its
    attention weights (float32 softmax) cast to float16 are 0 exactly where the table says."""
    model, hf = family_model
    tokens = _tokens(model)
    with torch.no_grad():
        out = copy.deepcopy(hf).double()(tokens, output_attentions=True)
    weights = out.attentions[0].float().to(torch.float16)  # transformers: F.softmax(dtype=f32)
    n_pos = tokens.shape[1]
    distance = torch.arange(n_pos)[:, None] - torch.arange(n_pos)[None, :]
    causal = distance >= 0
    effect = precision_effect(model, tokens, dtypes=["float16"], parts=["softmax"], progress=False)
    table = effect.by_head[effect.by_head.layer == 0]
    for row in table.itertuples():
        where = causal & (distance >= row.distance_lo) & (distance < row.distance_hi)
        assert (weights[:, row.head][:, where] == 0).sum().item() == row.zero_entries


def test_relative_bias_equals_the_model_in_float64(family_model):
    """``relative`` changes where the bias is formed, not the function: the headsurgeon model's
    logits are unchanged, and the float64 pass with the relative bias equals the family's."""
    model, _ = family_model
    tokens = _tokens(model)
    with torch.no_grad():
        before = model(tokens)
        with mitigation(model, "relative"):
            after = model(tokens)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    ours = hf_model(model, torch.float64)
    family = _logits(ours, _Recipe("float64", torch.float64), tokens)
    relative = _logits(ours, _Recipe("float64", torch.float64, relative=True), tokens)
    # Only the float32 products m x position differ (Falcon's bfloat16 ones are exact for
    # these power-of-two slopes under 256 positions).
    assert (relative - family).abs().max().item() < 1e-5


def test_relative_mode_follows_the_mitigation(tiny_model):
    tokens = _tokens(tiny_model)
    with mitigation(tiny_model, "relative"):
        effect = precision_effect(
            tiny_model, tokens, dtypes=["bfloat16"], parts=["model"], progress=False
        )
    assert effect.by_position.attrs["bias"] == "relative"
    with mitigation(tiny_model, "log"), pytest.raises(UnsupportedArchitectureError) as e:
        precision_effect(tiny_model, tokens, progress=False)
    assert "log mitigation is active" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtypes": ["float64"]}, "dtype"),
        ({"parts": ["attention"]}, "part"),
        ({"dtypes": []}, "at least one"),
    ],
)
def test_bad_arguments_are_one_line(tiny_model, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message) as e:
        precision_effect(tiny_model, _tokens(tiny_model), progress=False, **kwargs)
    assert "\n" not in str(e.value)


def test_a_model_without_alibi_is_refused():
    from test_model_families import family

    model, _ = family("llama")
    with pytest.raises(UnsupportedArchitectureError, match="ALiBi") as e:
        precision_effect(model, _tokens(model), progress=False)
    assert "\n" not in str(e.value)


def test_relative_cures_bfloat16_on_the_organism():
    """At 512 tokens the organism's absolute bias already costs bfloat16 loss from position 256;
    the relative form keeps it within 0.01 nats of float32."""
    model = hs.load_model("organism")
    args = dict(seq_len=512, dtypes=["float32", "bfloat16"], parts=["model"], progress=False)
    plain = precision_effect(model, **args).by_position
    with mitigation(model, "relative"):
        cured = precision_effect(model, **args).by_position

    def late(table, dtype):
        rows = table[(table.dtype == dtype) & (table.position_lo >= 256)]
        return (rows.mean_dnll * rows.tokens).sum() / rows.tokens.sum()

    assert late(plain, "bfloat16") > 0.02
    assert abs(late(cured, "bfloat16") - late(cured, "float32")) < 0.01


def test_cli_writes_the_counterfactual_and_leads_with_its_verdict(bloom_dir, tmp_path, capsys):
    from headsurgeon.cli.blindness import main

    out = tmp_path / "out"
    args = [str(bloom_dir), "--measure", "--seq-len", "48", "--n-seqs", "1", "--out", str(out)]
    assert main([*args, "--counterfactual", "precision", "--limit", "zero"]) == 0
    printed = capsys.readouterr().out.splitlines()
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary[:3]] == ["precision"] * 3
    assert "underflow to exact 0" in summary[0] and "rounding" in summary[1]
    assert summary[0] in printed
    by_position = pd.read_csv(out / "precision.csv")
    assert set(by_position.dtype) == set(precision.PRECISION_DTYPES)
    assert not pd.read_csv(out / "precision_heads.csv").empty
    assert '"name":"precision"' in (out / "index.html").read_text()
    assert "rounding changes no output measurably" in (out / "index.html").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "needs --measure"),
        (["--measure", "--mitigation", "log"], "use --mitigation relative"),
    ],
)
def test_cli_refuses_a_counterfactual_it_cannot_run(bloom_dir, tmp_path, capsys, extra, message):
    from headsurgeon.cli import run
    from headsurgeon.cli.blindness import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run(main, [str(bloom_dir), "--counterfactual", "precision", *extra, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and "\n" not in err
    assert not out.exists()


def test_the_verdict_recommends_relative_only_when_rounding_costs():
    from headsurgeon.reports.blindness import precision_verdict

    def effect(bias, dnll):
        pos = pd.DataFrame(
            {
                "dtype": "bfloat16",
                "part": ["scores", "softmax", "model"] * 2,
                "position_lo": [0, 0, 0, 8, 8, 8],
                "position_hi": [8, 8, 8, 15, 15, 15],
                "tokens": 8,
                "mean_dnll": [0, 0, 0, dnll, 0, dnll],
                "mean_abs_dnll": [0, 0, 0, dnll, 0.001, dnll],
                "max_abs_dnll": [0, 0, 0, dnll, 0.001, dnll],
                "top1_agreement": 1.0,
            }
        )
        pos.attrs["bias"] = bias
        heads = pd.DataFrame(
            {"dtype": "bfloat16", "part": "model", "layer": 0, "head": 0, "lost_mass": [1e-40]}
        )
        return precision.PrecisionEffect(by_position=pos, by_head=heads)

    lines = precision_verdict(effect("absolute", 0.3))
    assert "changes no output" in lines[0]
    assert "bfloat16 from position 8" in lines[1] and "scores" in lines[1]
    assert "recommend the relative mitigation" in lines[2]
    assert "no mitigation needed" in precision_verdict(effect("relative", 0.001))[2]
    rest = effect("relative", 0.02)
    rest.by_position.loc[rest.by_position.part == "scores", "mean_abs_dnll"] = 0.001
    assert "the rest of the model" in precision_verdict(rest)[1]
