"""Models trained with an ALiBi variant (issue 16): the variant a checkpoint's headsurgeon.json
records is applied on load, everywhere, with the mitigations' own bias definitions."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import headsurgeon as hs
from headsurgeon.errors import CheckpointError
from headsurgeon.exact_alibi import install_hf_bias, trained_bias
from headsurgeon.loading.facts import model_metadata
from headsurgeon.loading.files import METADATA_FILE


@pytest.fixture()
def log_dir(bloom_dir, tmp_path):
    """``bloom_dir`` recorded as trained with log-distance ALiBi."""
    folder = shutil.copytree(bloom_dir, tmp_path / "log")
    (folder / METADATA_FILE).write_text(json.dumps({"alibi": {"kind": "log", "params": {}}}))
    return folder


TOKENS = torch.randint(4, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def test_load_model_applies_the_recorded_variant(bloom_dir, log_dir):
    trained = hs.load_model(log_dir)
    standard = hs.load_model(bloom_dir)
    with torch.no_grad(), hs.mitigation(standard, "log"):
        expected = standard(TOKENS)
    with torch.no_grad():
        assert torch.equal(trained(TOKENS), expected)
        assert (standard(TOKENS) - expected).abs().max() > 1e-4  # the variant matters


def test_transformers_with_install_hf_bias_computes_the_same(log_dir):
    from transformers import BloomForCausalLM

    hf = BloomForCausalLM.from_pretrained(log_dir).eval()
    handles = install_hf_bias(hf, "log")
    with torch.no_grad():
        ours = hs.load_model(log_dir)(TOKENS)
        torch.testing.assert_close(hf(TOKENS).logits, ours, atol=1e-4, rtol=1e-5)
        for handle in handles:
            handle.remove()
        assert (hf(TOKENS).logits - ours).abs().max() > 1e-4


def test_save_hf_keeps_the_variant_and_checks_the_export_with_it(log_dir, tmp_path):
    model = hs.load_model(log_dir)
    out = hs.save_hf(model, tmp_path / "saved")
    assert trained_bias(json.loads((out / METADATA_FILE).read_text())) == ("log", {})
    with torch.no_grad():
        assert torch.equal(hs.load_model(out)(TOKENS), model(TOKENS))


def test_analytic_blindness_defaults_to_the_trained_variant(log_dir, bloom_dir):
    by_folder = hs.analytic_blindness(str(log_dir), dtypes=["float16"], limits=["normal"])
    by_model = hs.analytic_blindness(hs.load_model(log_dir), dtypes=["float16"], limits=["normal"])
    log = hs.analytic_blindness(str(bloom_dir), dtypes=["float16"], limits=["normal"], bias="log")
    standard = hs.analytic_blindness(str(bloom_dir), dtypes=["float16"], limits=["normal"])
    assert by_folder["blind_distance"].tolist() == log["blind_distance"].tolist()
    assert by_model["blind_distance"].tolist() == log["blind_distance"].tolist()
    assert by_folder["blind_distance"].tolist() != standard["blind_distance"].tolist()
    assert model_metadata(str(bloom_dir)) == {}


@pytest.mark.parametrize(
    ("recorded", "names"),
    [
        ({"kind": "softcap", "params": {"c": 5}}, "'softcap'"),
        ({"kind": "clamped", "params": {}}, "clamped needs c"),
        ({"kind": "log", "params": {"c": 1}}, "log takes no parameter c"),
    ],
)
def test_a_bad_recorded_variant_is_one_line_before_the_weights(
    bloom_dir, tmp_path, recorded, names
):
    folder = shutil.copytree(bloom_dir, tmp_path / "bad")
    (folder / METADATA_FILE).write_text(json.dumps({"alibi": recorded}))
    with pytest.raises(CheckpointError, match=names) as error:
        hs.load_model(folder)
    assert "\n" not in str(error.value) and "headsurgeon.json" in str(error.value)


@pytest.mark.slow  # a subprocess that trains for two steps
def test_train_organism_trains_a_variant_that_load_model_applies(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "analyses" / "train_organism.py"
    help_text = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--bias {standard,clamped,log,robust}" in help_text and "--retrieval-share" in help_text
    export = tmp_path / "export"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--steps",
            "2",
            "--minutes",
            "2",
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--hidden",
            "16",
            "--seq-len",
            "96",
            "--batch",
            "4",
            "--bias",
            "clamped",
            "--bias-c",
            "3",
            "--retrieval-share",
            "0.5",
            "--eval-every",
            "1",
            "--out",
            str(tmp_path / "run"),
            "--export",
            str(export),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    metadata = json.loads((export / METADATA_FILE).read_text())
    assert trained_bias(metadata) == ("clamped", {"c": 3.0})
    assert metadata["training"]["config"]["retrieval_share"] == 0.5
    model = hs.load_model(export)
    standard = hs.load_model(export)
    for block in standard.blocks:  # back to the plain exact hook: what the variant changes
        block.attn.headsurgeon_alibi_hook.remove()
        block.attn.headsurgeon_alibi_hook = None
    hs.exact_alibi.install_exact_alibi(standard)
    with torch.no_grad(), hs.mitigation(standard, "clamped", c=3.0):
        expected = standard(TOKENS[:, :8] % 64)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS[:, :8] % 64), expected, rtol=0, atol=0)


@pytest.mark.slow  # a subprocess that trains for two steps
def test_train_organism_records_the_numerics_it_trained_under(tmp_path):
    """--bias-form absolute --precision float32: transformers' own bias without autocast,
    checked before the first step and recorded; against them the model's own numerics change
    nothing, bit for bit."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "analyses" / "train_organism.py"
    export = tmp_path / "export"
    args = ["--steps", "2", "--minutes", "2", "--n-layer", "1", "--n-head", "4", "--hidden",
            "16", "--seq-len", "96", "--batch", "2", "--eval-every", "1"]  # fmt: skip
    subprocess.run(
        [sys.executable, str(script), *args, "--bias-form", "absolute", "--precision", "float32",
         "--out", str(tmp_path / "run"), "--export", str(export)],
        check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    model = hs.load_model(str(export))
    numerics = hs.loading.model_info(model).training_numerics
    assert (numerics.bias, numerics.scores_dtype, numerics.softmax_dtype) == (
        "absolute",
        "float32",
        "float32",
    )
    assert "checked bit for bit" in numerics.source
    effect = hs.precision_effect(
        model, seq_len=180, dtypes=["float32"], parts=["attention"], reference="training",
        head_table=False, progress=False,
    )  # fmt: skip
    own = effect.by_region.query("reference == 'training' and bias == 'absolute'")
    assert (own.mean_dnll == 0).all() and list(own.region) == ["inside L", "L-2L"]
