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
import torch.nn.functional as F

import headsurgeon as hs
from headsurgeon import alibi, long_context, precision
from headsurgeon.backend import MAJOR
from headsurgeon.blindness import mitigation
from headsurgeon.checkpoints import hf_model
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.evals.loss import position_edges
from headsurgeon.exact_alibi import install_hf_bias
from headsurgeon.families import config_family, config_slopes
from headsurgeon.precision import _Family, _Recipe, _recipe_attention, precision_effect
from headsurgeon.reports.blindness import blindness_summary, precision_verdict

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
    with _recipe_attention(_Family(hf, config_slopes(hf.config.to_dict())), recipe):
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
    # The attention part in float64 (the matrix's float64 inference numerics) is the same pass.
    attention = _logits(ours, _Recipe("attention", torch.float64), tokens)
    assert (attention - expected).abs().max().item() <= 1e-10
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
        "reference", "bias", "dtype", "part", "position_lo", "position_hi", "region", "tokens",
        "mean_dnll", "dnll_se", "mean_abs_dnll", "max_abs_dnll", "max_abs_dlogit",
        "top1_agreement", "top1_se", "nll_reference", "nll_float64",
    ]  # fmt: skip
    assert set(pos.reference) == {"float64"} and pos.bias.nunique() == 1
    assert list(dense.by_region.columns) == list(pos.columns)
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
    # Zeros are those of the dtype under test: the scores part's float64 weights, rounded to
    # the dtype, are 0 where the softmax part's are (the same rounding of nearly equal weights).
    scores = heads[heads.part == "scores"].set_index(["dtype", "layer", "head", "distance_lo"])
    softmax = heads[heads.part == "softmax"].set_index(["dtype", "layer", "head", "distance_lo"])
    assert (scores.zero_entries - softmax.zero_entries).abs().max() <= 2
    assert scores.loc["float32"].zero_entries.sum() == 0
    assert heads.groupby(["dtype", "part", "layer", "head"]).moved_mass.sum().max() <= 1
    np.testing.assert_allclose(blocks.by_head.entries, heads.entries)
    np.testing.assert_allclose(blocks.by_head.moved_mass, heads.moved_mass, rtol=1e-3, atol=1e-6)
    assert pos.attrs["seq_len"] == 40 and pos.attrs["n_seqs"] == 2
    assert pos.attrs["bias"] in ("absolute", "last-key")
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
        ({"dtypes": ["float8"]}, "dtype"),
        ({"parts": ["everything"]}, "part"),
        ({"dtypes": []}, "at least one"),
        ({"reference": "float32"}, "reference"),
        ({"bias_forms": ["log"]}, "bias form"),
        ({"bias_forms": []}, "at least one"),
        ({"reference": "training"}, "training numerics are unknown"),
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
    assert summary[0].startswith("training numerics of bloom40: unknown")
    assert [line.split(":")[0] for line in summary[1:4]] == ["precision"] * 3
    assert "underflow to exact 0" in summary[1] and "rounding" in summary[2]
    assert "no recommendation: this model's training numerics are unknown" in summary[3]
    assert summary[1] in printed
    by_position = pd.read_csv(out / "precision.csv")
    assert set(by_position.dtype) == set(precision.PRECISION_DTYPES)
    assert not pd.read_csv(out / "precision_heads.csv").empty
    assert set(pd.read_csv(out / "precision_regions.csv").region) == {
        "all (training length unknown)"
    }
    assert '"name":"precision"' in (out / "index.html").read_text()
    assert "rounding changes no output measurably" in (out / "index.html").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "needs --measure"),
        (["--measure", "--mitigation", "log"], "use --mitigation relative"),
        (["--measure", "--mitigation", "relative", "--reference", "training"], "side by side"),
    ],
)
def test_cli_refuses_a_counterfactual_it_cannot_run(bloom_dir, tmp_path, capsys, extra, message):
    from headsurgeon.cli import run

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run(
            "blindness",
            [str(bloom_dir), "--counterfactual", "precision", *extra, "--out", str(out)],
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and "\n" not in err
    assert not out.exists()


def _verdict_effect(bias, dnll, trained=None, regions=None):
    """A PrecisionEffect whose bfloat16 model costs ``dnll`` from position 8, for a model
    trained with ``trained`` (a bias form in bfloat16) and, given ``regions``, with rows
    against its training numerics: ``{(bias, dtype): [(region, mean, se), ...]}``."""
    pos = pd.DataFrame(
        {
            "reference": "float64",
            "bias": bias,
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
    if trained:
        pos.attrs["training_numerics"] = {
            "bias": trained, "scores_dtype": "bfloat16", "softmax_dtype": "float32",
            "source": "a test",
        }  # fmt: skip
    rows = [
        {"reference": "training", "bias": b, "dtype": d, "part": "attention", "region": r,
         "mean_dnll": m, "dnll_se": se}
        for (b, d), cells in (regions or {}).items()
        for r, m, se in cells
    ]  # fmt: skip
    heads = pd.DataFrame(
        {"dtype": "bfloat16", "part": "model", "layer": 0, "head": 0, "lost_mass": [1e-40]}
    )
    return precision.PrecisionEffect(by_position=pos, by_head=heads, by_region=pd.DataFrame(rows))


def test_the_verdict_recommends_nothing_for_unknown_training_numerics():
    lines = precision_verdict(_verdict_effect("absolute", 0.3))
    assert "changes no output" in lines[0]
    assert "bfloat16 from query position 8 on (|ΔNLL| 0.300, ΔNLL +0.300 nats a token" in lines[1]
    assert "from rounding the attention scores (q·k + ALiBi bias) alone" in lines[1]
    assert lines[2].startswith("precision: no recommendation")
    assert "recommend " not in lines[2] and "--reference training" in lines[2]


def test_the_verdict_and_its_table_say_what_their_terms_mean():
    """Issue 52: "from position 2", "after it" and "; scores" read as nothing; the ΔNLL table's
    header names its columns."""
    effect = _verdict_effect("absolute", 0.3)
    effect.by_position.attrs.update(n_seqs=1, seq_len=16)
    line = precision_verdict(effect)[1]
    assert "in every later bucket of positions, 0, 1, 2-3, 4-7, ..., the mean |ΔNLL|" in line
    assert "after it" not in line and "; scores" not in line
    lines = blindness_summary(None, None, effect).splitlines()
    header = next(x for x in lines if x.startswith("precision counterfactual (1 × 16 tokens"))
    for term in (
        "reference, bias form, dtype, what is rounded",
        "scores: the attention scores",
        "first query position of a bucket: its mean ΔNLL",
        "top-1 agreement with",
    ):
        assert term in header  # fmt: skip


def test_the_verdict_for_a_relative_trained_model_is_the_relative_form():
    lines = precision_verdict(_verdict_effect("absolute", 0.3, trained="relative"))
    assert "recommend its relative form" in lines[2]
    quiet = precision_verdict(_verdict_effect("relative", 0.001, trained="relative"))
    assert "no mitigation needed" in quiet[2]
    rest = _verdict_effect("relative", 0.02, trained="relative")
    rest.by_position.loc[rest.by_position.part == "scores", "mean_abs_dnll"] = 0.001
    assert "the rest of the model" in precision_verdict(rest)[1]


def test_the_verdict_for_an_absolute_trained_model_follows_its_own_numerics():
    # Against float64 alone: no recommendation, and what decides is named.
    alone = precision_verdict(_verdict_effect("absolute", 0.3, trained="absolute"))[2]
    assert "no recommendation from this run" in alone and "float64 is not" in alone
    helps = {
        ("absolute", "float32"): [("inside L", 0.0, 0.01), ("L-2L", -0.2, 0.03)],
        ("relative", "bfloat16"): [("inside L", 0.001, 0.01), ("L-2L", -0.2, 0.03)],
    }
    line = precision_verdict(_verdict_effect("absolute", 0.3, "absolute", helps))[2]
    assert "recommend the relative bias in bfloat16" in line and "also the absolute bias" in line
    hurts = {
        ("relative", "bfloat16"): [("inside L", 0.2, 0.03), ("L-2L", -0.2, 0.03)],
        ("absolute", "float32"): [("inside L", 0.0, 0.01), ("L-2L", -0.01, 0.03)],
    }
    line = precision_verdict(_verdict_effect("absolute", 0.3, "absolute", hurts))[2]
    assert "keep them" in line and "recommend" not in line
    assert "inside L +0.200 ± 0.030" in line


def test_against_its_training_numerics_the_same_numerics_change_nothing():
    """organism was trained with transformers' absolute bias under bfloat16 autocast: against
    those numerics the same attention gives ΔNLL exactly 0 at every position, and every other
    pass's loss is the float64 one shifted by the training pass's own change."""
    model = hs.load_model("organism")  # trained on 256 tokens: 400 reach beyond L
    effect = precision_effect(
        model,
        seq_len=400,
        dtypes=["bfloat16", "float32", "float64"],
        parts=["attention"],
        reference="training",
        progress=False,
    )
    pos = effect.by_position
    assert set(pos.bias) == {"absolute", "relative"} and set(pos.reference) == {
        "float64",
        "training",
    }
    assert {"inside L", "L-2L"} <= set(pos.region) and pos.attrs["train_ctx"] == 256
    own = pos[(pos.reference == "training") & (pos.bias == "absolute") & (pos.dtype == "bfloat16")]
    assert (own.mean_dnll == 0).all() and (own.max_abs_dlogit == 0).all()
    assert (own.top1_agreement == 1).all()
    key = ["bias", "dtype", "part", "position_lo"]
    f64 = pos[pos.reference == "float64"].set_index(key)
    trained = pos[pos.reference == "training"].set_index(key)
    shift = f64.loc[("absolute", "bfloat16", "attention"), "mean_dnll"]
    np.testing.assert_allclose(
        trained.nll_reference.groupby("position_lo").first(),
        f64.nll_float64.groupby("position_lo").first() + shift,
        atol=1e-9,
    )
    np.testing.assert_allclose(
        trained.mean_dnll,
        f64.mean_dnll - shift.reindex(f64.index.get_level_values("position_lo")).to_numpy(),
        atol=1e-9,
    )
    region = effect.by_region
    assert list(region.region.unique()) == ["inside L", "L-2L"]
    assert (
        region.dnll_se.notna().all()
        and (
            region.tokens.groupby([region.reference, region.bias, region.dtype]).sum() == 399
        ).all()
    )
    assert effect.by_head.groupby(["bias", "dtype"]).ngroups == 6


def test_training_reference_refuses_numerics_it_cannot_reproduce(bloom_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(bloom_dir, folder)
    numerics = {"bias": "absolute", "scores_dtype": "bfloat16", "softmax_dtype": None}
    (folder / "headsurgeon.json").write_text(json.dumps({"training_numerics": numerics}))
    model = hs.load_model(str(folder))
    assert hs.loading.model_info(model).training_numerics.unknown == ["softmax_dtype"]
    with pytest.raises(InvalidArgumentError, match="softmax_dtype") as e:
        precision_effect(model, _tokens(model), reference="training", progress=False)
    assert "\n" not in str(e.value)


def test_cli_refuses_a_training_reference_it_cannot_know(bloom_dir, tmp_path, capsys):
    from headsurgeon.cli import run

    out = tmp_path / "out"
    args = [str(bloom_dir), "--measure", "--counterfactual", "precision", "--reference", "training"]
    with pytest.raises(SystemExit) as exit_info:
        run("blindness", [*args, "--seq-len", "32", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err
    assert "training numerics are unknown" in err and "headsurgeon.json" in err
    assert not out.exists()


def _onehot_table(table, layer, q, k, mask, scores, weights):
    """The head table as it was first written (brute force, quadratic in the buckets): each
    quantity times a [query x key, bucket] one-hot matrix of the causal entries' buckets."""
    batch, n_heads, n_queries, n_keys = weights.shape
    distance = alibi.distance_rows(n_queries, n_keys)
    causal = alibi.causal_rows(n_queries, n_keys).flatten()
    bucket = torch.bucketize(distance, table.edges[1:-1], right=True).flatten()
    onehot = torch.zeros(len(bucket), len(table.edges) - 1, dtype=torch.float64)
    onehot[causal.nonzero()[:, 0], bucket[causal]] = 1.0
    if layer == 0:
        table.entries += onehot.sum(0) * batch
    module = table.family.modules[layer]
    for i, recipe in enumerate(table.recipes):
        if recipe.part == "softmax":
            rounded = F.softmax(scores, dim=-1, dtype=torch.float32).to(recipe.dtype).double()
        else:
            formed = table.family.scores(module, q, k, mask, recipe.dtype, recipe.relative)
            rounded = recipe.weights(formed, torch.float64)
        zero = rounded.to(recipe.dtype) == 0
        for j, values in enumerate(
            (zero.double(), torch.where(zero, weights, 0.0), (weights - rounded).abs())
        ):
            by_bucket = values.view(batch * n_heads, -1) @ onehot
            table.sums[i, j, layer] += by_bucket.view(batch, n_heads, -1).sum(0)


def test_head_table_by_distance_equals_the_one_hot_products(family_model, monkeypatch):
    """The head table's sums by distance (linear in the entries) equal the brute-force one-hot
    matrix products within 1e-12, in blocks with a ragged last one, both bias forms, a dtype
    that underflows (float16) and one that does not (float32)."""
    model, hf = family_model
    tokens = _tokens(model, n_pos=100)  # float16 zeros from distance ~70 in the tiny BLOOM
    own = config_family(hf.config.to_dict()).own_form
    args = dict(
        dtypes=["float16", "float32"], bias_forms=[own, "relative"],
        progress=False, block_size=16,
    )  # fmt: skip
    ours = precision_effect(model, tokens, **args).by_head
    monkeypatch.setattr(precision.HeadTable, "__call__", _onehot_table)
    brute = precision_effect(model, tokens, **args).by_head
    assert ours.attrs["block_size"] == 16 and len(ours) == len(brute)
    pd.testing.assert_frame_equal(
        ours.drop(columns=["lost_mass", "moved_mass"]),
        brute.drop(columns=["lost_mass", "moved_mass"]),
    )
    if own == "absolute" and hf.config.model_type == "bloom":  # the others' weights stay > 0
        assert (ours.zero_entries > 0).any() and (ours.lost_mass > 0).any()
    np.testing.assert_allclose(ours.lost_mass, brute.lost_mass, rtol=1e-12, atol=0)
    np.testing.assert_allclose(ours.moved_mass, brute.moved_mass, rtol=1e-12, atol=0)


def test_distance_sums_read_each_causal_entry_once():
    """A block of 3 queries (positions 2-4) over 5 keys: distance d's total is the sum of the
    entries i - j = d, the future keys never read."""
    values = torch.arange(15, dtype=torch.float64).view(1, 3, 5)  # entry (i, j) = 5 i + j
    padded = torch.cat([torch.zeros(1, 3, 3, dtype=torch.float64), values], -1)
    expected = [0.0] * 6
    for i in range(3):
        for j in range(i + 3):
            expected[i + 2 - j] += values[0, i, j].item()
    assert precision._distance_sums(padded, 3)[0].tolist() == expected


def test_blocks_stay_at_64_rows_to_8192_tokens():
    """What a block holds per entry (PRECISION_BYTES_PER_ENTRY, measured) leaves the organism's
    16 heads the fastest blocks (64 rows) to 8,192 tokens and 32 rows at 16,384."""
    model = hs.load_model("organism")
    rows = [
        long_context.block_size(model, n, bytes_per_entry=precision.PRECISION_BYTES_PER_ENTRY)
        for n in (4096, 8192, 16384)
    ]
    assert rows == [64, 64, 32]
