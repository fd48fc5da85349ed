"""headsurgeon.blindness.analytic_rounding: the ALiBi bias's rounding step, against brute force
(the value in float64 cast to the dtype, its spacing from torch.nextafter) and against the bias
each family forms in headsurgeon.precision (transformers' formulas)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import headsurgeon as hs
from headsurgeon import alibi
from headsurgeon.blindness import analytic_rounding
from headsurgeon.cli.blindness import main
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.families import config_slopes
from headsurgeon.loading import model_shape, organism_names
from headsurgeon.precision import _Family

needs_organisms = pytest.mark.skipif(
    "organism" not in organism_names(), reason="the bundled organisms are not installed"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def brute_step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing above each float64 value once cast to ``dtype``: nextafter(v, inf) - v."""
    v = values.to(dtype)
    step = (torch.nextafter(v, torch.tensor(math.inf, dtype=dtype)) - v).double()
    return torch.where(v.isinf(), math.inf, step)


@pytest.fixture(scope="module")
def bloom_560m():
    return analytic_rounding("bloom-560m", positions=GRID)


# Every position to 4,096, then a sparse grid to 2^23 (float32 counts positions exactly).
GRID = sorted(set(range(1, 4097)) | set(range(4096, 2**23, 4099)) | {2**k for k in range(24)})


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_step_is_the_spacing_of_the_dtype_at_the_bias(bloom_560m, dtype):
    table = bloom_560m.by_position
    slopes = alibi.slopes(16).double()
    positions = torch.tensor(GRID, dtype=torch.float64)
    for form in ("absolute", "relative"):
        rows = table[(table.dtype == dtype) & (table.form == form)]
        got = torch.tensor(rows.rounding_step.to_numpy()).view(16, len(GRID))
        expected = brute_step(slopes[:, None] * positions, DTYPES[dtype])
        assert torch.equal(got, expected), (form, (got != expected).nonzero()[:5])
        assert (rows.max_rounding_error <= rows.rounding_step).all()


def first_by_brute_force(slope: float, dtype: torch.dtype, p: int, over) -> None:
    """``over`` holds at ``p`` and not at ``p - 1`` (the step, a float64 value cast)."""
    values = torch.tensor([slope * (p - 1), slope * p], dtype=torch.float64)
    before, at = over(values.to(dtype), brute_step(values, dtype))
    assert not before and at, (slope, dtype, p)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head", [0, 5, 9, 15])
def test_first_positions_over_each_step_and_overflow_are_exact(bloom_560m, dtype, head):
    row = bloom_560m.by_head.query("dtype == @dtype and head == @head").iloc[0]
    slope = alibi.slopes(16)[head].double().item()
    for t in (0.1, 1.0):
        p = int(row[f"first_position_step_over_{t:g}"])
        first_by_brute_force(slope, DTYPES[dtype], p, lambda v, s, t=t: s > t)
    overflow = row.first_position_overflow
    if dtype == "float16":
        first_by_brute_force(slope, torch.float16, int(overflow), lambda v, s: v.isinf())
    else:
        assert math.isnan(overflow)


def test_bloom_560m_numbers_and_float32():
    by_head = analytic_rounding("bloom-560m", dtypes=["bf16", "float32"]).by_head
    bf16 = by_head[by_head.dtype == "bfloat16"].set_index("head")
    assert bf16.loc[[0, 15], "first_position_step_over_0.1"].tolist() == [23, 4089]
    assert bf16.loc[[0, 15], "first_position_step_over_1"].tolist() == [362, 65409]
    assert bf16.loc[0, "rounding_step_at_n_ctx"] == 8  # 0.71 x 2048 = 1,448: bfloat16 steps 8
    fp32 = by_head[by_head.dtype == "float32"].set_index("head")
    p = int(fp32.loc[0, "first_position_step_over_0.1"])
    assert p == 1482911  # 0.7071 p reaches 2^20, where float32 steps 0.125
    first_by_brute_force(alibi.slopes(16)[0].item(), torch.float32, p, lambda v, s: s > 0.1)


def test_every_published_name_runs_offline_without_weights(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name, family, heads in [
        ("bigscience/bloom", "bloom", 112),
        ("mpt-7b", "mpt", 32),
        ("mosaicml/mpt-7b", "mpt", 32),
        ("falcon-rw-1b", "falcon", 32),
        ("tiiuae/falcon-rw-7b", "falcon", 71),
    ]:
        shape = model_shape(name)
        assert (shape.family, shape.n_heads, shape.positional) == (family, heads, "alibi")
        result = hs.analytic_rounding(name, dtypes=["bfloat16"], positions=[2048])
        assert len(result.by_head) == heads and result.by_head.attrs["family"] == family
        assert result.by_head.attrs["model"] == name
    assert model_shape("falcon-rw-7b").d_model == 4544 and model_shape("mpt-7b").d_vocab == 50432


def test_mpt_stores_its_bias_in_float32_whatever_the_dtype():
    by_head = analytic_rounding("mpt-7b").by_head
    assert set(by_head.bias_dtype) == {"float32"}
    steps = by_head.pivot(index="head", columns="dtype", values="first_position_step_over_1")
    assert (steps.nunique(axis=1) == 1).all() and steps.min().min() > 2**24 - 1
    assert by_head.first_position_overflow.isna().all()


def test_falcon_rounds_its_product_and_positions_in_bfloat16():
    by_head = analytic_rounding("falcon-rw-1b", dtypes=["float32", "bfloat16"]).by_head
    # The product is bfloat16 whatever the dtype: float32 gains nothing.
    for column in ("first_position_step_over_0.1", "first_position_step_over_1"):
        assert by_head.groupby("head")[column].nunique().eq(1).all()
    # Head 0: bf16(2^-0.25) = 0.8398; at p = 2048 positions step 16 (> 8 below 2048, the
    # position's own bfloat16 spacing): 0.8398 x 16 / sqrt(64) = 1.68 logits.
    head0 = by_head[(by_head["head"] == 0) & (by_head.dtype == "float32")].iloc[0]
    assert head0.rounding_step_at_n_ctx == pytest.approx(0.83984375 * 16 / 8)


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_the_bias_is_the_one_the_family_forms(family, tmp_path, tiny_model):
    """by_position's values are those of headsurgeon.precision's bias (transformers' formulas),
    at every position up to 70,000 (past float16's overflow for the steep heads)."""
    from test_alibi_families import hf_model as family_hf

    if family == "bloom":
        from headsurgeon.checkpoints import hf_model

        hf = hf_model(tiny_model)
    else:  # d_head 12: sqrt(d_head) is no power of two, so Falcon's division rounds too
        hf = family_hf(family, n_heads=6, d_model=72)
    hf.config.save_pretrained(tmp_path)
    n = 70_000
    positions = list(range(1, 5000)) + list(range(5000, n, 13))
    table = analytic_rounding(tmp_path, positions=positions).by_position
    own = _Family(hf, config_slopes(hf.config.to_dict()))
    for dtype in ("float32", "bfloat16", "float16"):
        for form in ("absolute", "relative"):
            bias = own._bias(1, n, DTYPES[dtype], form == "relative", "cpu")
            bias = bias.reshape(own.n_heads, n).double().abs()
            # MPT's and the relative form count back from the last key, the others from key 0.
            expected = bias.flip(-1) if family == "mpt" or form == "relative" else bias
            rows = table[(table.dtype == dtype) & (table.form == form)]
            got = torch.tensor(rows.bias_value.to_numpy()).view(own.n_heads, len(positions))
            assert torch.equal(got, expected[:, positions]), (dtype, form)


def test_a_loaded_model_uses_its_own_slopes(tiny_model, bloom_dir):
    result = analytic_rounding(tiny_model, dtypes=["bfloat16"])
    by_head = result.by_head
    assert by_head.attrs["family"] == "bloom" and len(by_head) == tiny_model.cfg.n_heads
    assert by_head.slope.tolist() == hs.model_info(tiny_model).slopes.double().tolist()
    by_folder = analytic_rounding(bloom_dir, dtypes=["bfloat16"])  # its checkpoint, unread
    pd.testing.assert_frame_equal(by_head, by_folder.by_head)
    pd.testing.assert_frame_equal(result.by_position, by_folder.by_position)


@needs_organisms
def test_a_loaded_organism_has_bloom_560ms_thresholds():
    organism = hs.load_model("organism")
    by_head = analytic_rounding(organism).by_head
    by_name = analytic_rounding("bloom-560m").by_head  # 16 heads both: the same slopes
    columns = [
        "head",
        "slope",
        "dtype",
        "first_position_step_over_0.1",
        "first_position_step_over_1",
    ]
    pd.testing.assert_frame_equal(by_head[columns], by_name[columns])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtypes": ["float64"]}, "unknown dtype"),
        ({"dtypes": []}, "at least one dtype"),
        ({"positions": [0, 4]}, "integers from 1 to 2\\^40, got 0"),
        ({"positions": [2.5]}, "integers from 1 to 2\\^40, got 2.5"),
        ({"positions": []}, "at least one position"),
        ({"thresholds": [0.0]}, "number > 0"),
    ],
)
def test_bad_input_is_one_clear_line(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        analytic_rounding("bloom-560m", **kwargs)


def test_a_model_without_alibi_is_refused(tmp_path):
    from test_blindness import rotary_model
    from transformers import FalconConfig

    FalconConfig(hidden_size=16, num_attention_heads=2, alibi=False).save_pretrained(tmp_path)
    for model in (tmp_path, rotary_model()):
        with pytest.raises(UnsupportedArchitectureError, match="ALiBi models only"):
            analytic_rounding(model)


def test_cli_by_name_prints_and_writes_the_rounding_summary(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    assert main(["bloom-560m", "--dtypes", "bfloat16", "float16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "blind distance" in printed and "rounding" in printed
    line = next(x for x in printed.splitlines() if x.strip().startswith("h0 "))
    assert "0.7071" in line and "23" in line and "362" in line
    table = pd.read_csv(out / "rounding.csv")
    expected = analytic_rounding("bloom-560m", dtypes=["bfloat16", "float16"]).by_head
    pd.testing.assert_frame_equal(table, expected.reset_index(drop=True), check_dtype=False)
    assert not pd.read_csv(out / "rounding_by_position.csv").empty
    assert "rounding" in (out / "summary.txt").read_text()


def test_cli_by_name_runs_mpt_and_falcon(tmp_path, capsys):
    for name in ("mosaicml/mpt-7b", "falcon-rw-7b"):
        out = tmp_path / name.replace("/", "_")
        assert main([name, "--dtypes", "bfloat16", "--out", str(out)]) == 0
        assert len(pd.read_csv(out / "rounding.csv")) == model_shape(name).n_heads
    assert "in float32, whatever the dtype" in capsys.readouterr().out
