"""Training numerics: recorded in headsurgeon.json, published for BLOOM, MPT and Falcon-RW,
checked, and carried by every model's ModelInfo."""

from __future__ import annotations

import json
import shutil

import pytest

import headsurgeon as hs
from headsurgeon.errors import CheckpointError
from headsurgeon.loading import model_info
from headsurgeon.loading.numerics import BIAS_FORMS, PUBLISHED_NUMERICS, training_numerics


@pytest.mark.parametrize(
    ("name", "bias", "scores"),
    [
        ("bloom-560m", "absolute", "bfloat16"),
        ("bigscience/bloom-7b1", "absolute", "bfloat16"),
        ("bigscience/bloom", "absolute", "bfloat16"),
        ("tiiuae/falcon-rw-1b", "absolute", "bfloat16"),
        ("mosaicml/mpt-7b", "last-key", None),
    ],
)
def test_published_numerics_by_name(name, bias, scores):
    numerics = training_numerics(name, {})
    assert (numerics.bias, numerics.scores_dtype) == (bias, scores)
    assert numerics.source and numerics.bias in BIAS_FORMS


def test_every_published_model_names_its_source_and_unknown_fields():
    for name, numerics in PUBLISHED_NUMERICS.items():
        assert len(numerics.source) > 40, name
        assert numerics.unknown == [
            f for f in ("scores_dtype", "softmax_dtype") if getattr(numerics, f) is None
        ]
    assert "not published" not in training_numerics("bloom-560m", {}).describe()
    assert "unpublished" in training_numerics("mpt-7b", {}).describe()


def test_an_unknown_model_has_none():
    assert training_numerics("my-bloom", {}) is None


def test_the_bundled_organisms_were_trained_with_the_absolute_bias():
    """organism predates the bias hook of analyses/train_organism.py: transformers' own bias."""
    for name in ("organism", "organism-deep", "organism-injured"):
        numerics = hs.loading.facts.model_metadata(name)["training_numerics"]
        assert numerics["bias"] == "absolute" and numerics["scores_dtype"] == "bfloat16"
    info = model_info(hs.load_model("organism"))
    assert info.training_numerics.bias == "absolute" and info.train_ctx == 256


def test_a_recorded_record_overrides_and_is_checked(bloom_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(bloom_dir, folder)
    record = {"bias": "relative", "scores_dtype": "float16", "softmax_dtype": "float32"}
    (folder / "headsurgeon.json").write_text(json.dumps({"training_numerics": record}))
    numerics = model_info(hs.load_model(str(folder))).training_numerics
    assert (numerics.bias, numerics.scores_dtype, numerics.source) == (
        "relative",
        "float16",
        "headsurgeon.json",
    )
    assert model_info(hs.load_model(bloom_dir)).training_numerics is None


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"bias": "sideways"}, "bias must be one of absolute, relative, last-key"),
        ({"bias": "absolute", "scores_dtype": "float8"}, "scores_dtype is 'float8'"),
        ("absolute", 'training_numerics is "absolute"'),
    ],
)
def test_a_bad_record_is_one_line(bloom_dir, tmp_path, record, message):
    folder = tmp_path / "model"
    shutil.copytree(bloom_dir, folder)
    (folder / "headsurgeon.json").write_text(json.dumps({"training_numerics": record}))
    with pytest.raises(CheckpointError, match=message) as e:
        hs.load_model(str(folder))
    assert "\n" not in str(e.value) and "training_numerics" in str(e.value)


def test_the_blindness_tool_says_how_a_model_was_trained(tmp_path, capsys, monkeypatch):
    """By name, no weights: BLOOM's published numerics with their source; an organism's own."""
    from headsurgeon.cli.blindness import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["bloom-560m", "--out", str(tmp_path / "bloom")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("training numerics of bloom-560m: absolute ALiBi bias")
    assert "Megatron-DeepSpeed" in first
    assert (tmp_path / "bloom" / "summary.txt").read_text().splitlines()[0] == first
    assert main(["organism", "--out", str(tmp_path / "organism")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "training numerics of organism: absolute" in first and "d42a5bb" in first
