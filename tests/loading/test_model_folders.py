"""Model folders whose side files contradict or break their weights: one CheckpointError line
each, before any weight is read where the headers tell (issue 41)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import transformers

from headsurgeon import load_model
from headsurgeon.errors import CheckpointError


@pytest.fixture()
def folder(bloom_dir, tmp_path):
    return Path(shutil.copytree(bloom_dir, tmp_path / "ckpt"))


@pytest.fixture()
def no_weight_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the folder was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def one_line(error) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


def rewrite_metadata(file: Path, metadata) -> None:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length]) | {"__metadata__": metadata}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"format": "pt", "step": 3}, "field 'step' holds 3, not a string"),
        ({"format": {"nested": "x"}}, "field 'format' holds"),
        (["pt"], "its __metadata__ is list"),
    ],
)
def test_safetensors_metadata_that_is_not_strings(folder, no_weight_reads, metadata, expected):
    rewrite_metadata(folder / "model.safetensors", metadata)
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert expected in one_line(error)
    assert "model.safetensors is not a valid safetensors file" in one_line(error)


def edit_tokenizer(folder: Path, edit) -> None:
    file = folder / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    edit(tokenizer)
    file.write_text(json.dumps(tokenizer))


def drop_unknown(tokenizer: dict) -> None:
    del tokenizer["model"]["vocab"]["<unk>"]
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<unk>"]


def rename_unknown(tokenizer: dict) -> None:
    tokenizer["model"]["unk_token"] = "<missing>"


@pytest.mark.parametrize("edit", [drop_unknown, rename_unknown])
def test_a_tokenizer_without_its_unknown_token(folder, edit):
    edit_tokenizer(folder, edit)
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    message = one_line(error)
    assert "names the unknown token" in message and "vocabulary lacks it" in message
    assert "re-export the tokenizer" in message


def test_a_gpt2_config_over_bloom_weights_names_the_family(folder, no_weight_reads):
    bloom = json.loads((folder / "config.json").read_text())
    gpt2 = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": bloom["vocab_size"],
        "n_embd": bloom["hidden_size"],
        "n_layer": bloom["n_layer"],
        "n_head": bloom["n_head"],
        "n_positions": 128,
    }
    (folder / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    message = one_line(error)
    assert "names GPT2LMHeadModel" in message and "are BLOOM weights" in message
    assert "another family's" in message and "n_ctx" not in message
