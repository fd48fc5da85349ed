"""A model folder's side files and weights are validated before use (issue 23, part 6).

``headsurgeon.json`` has one schema (:func:`headsurgeon.loading.check_metadata`); a bad value is
one line naming the file and the field, raised before any weight loads. A safetensors header
that relabels a tensor's dtype, weights holding NaN or infinity, and a head count in
``config.json`` that the training record in ``headsurgeon.json`` contradicts are refused.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from headsurgeon import load_model, model_shape
from headsurgeon.errors import CheckpointError
from headsurgeon.loading import ModelShape, check_metadata, from_hf_model, random_hf_bloom
from headsurgeon.loading.checks import check_checkpoint
from headsurgeon.loading.facts import model_metadata
from headsurgeon.loading.files import METADATA_FILE
from headsurgeon.repair import recommended_config

QKV = "transformer.h.0.self_attention.query_key_value.weight"


@pytest.fixture()
def folder(bloom_dir, tmp_path):
    """A fresh copy of the 2-layer, 4-head, 32-wide float32 checkpoint to damage."""
    return Path(shutil.copytree(bloom_dir, tmp_path / "ckpt"))


@pytest.fixture()
def no_weight_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the side files were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def one_line(error) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


# --- headsurgeon.json: one schema -------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"prepend_bos": "yes"}, 'prepend_bos is "yes"; it must be true or false or null'),
        ({"prepend_bos": 1}, "prepend_bos is 1; it must be true or false or null"),
        ({"training": "lots"}, 'training is "lots"; it must be an object'),
        ({"training": {"seq_len": "256"}}, 'training.seq_len is "256"; it must be an integer >= 1'),
        ({"training": {"seq_len": True}}, "training.seq_len is true; it must be an integer >= 1"),
        ({"training": {"config": {"seq_len": 0}}}, "training.config.seq_len is 0; it must be"),
        ({"training": {"config": {"n_head": 4.0}}}, "training.config.n_head is 4.0; it must be"),
        ({"training": {"seed": None}}, "training.seed is null; it must be an integer"),
        ({"repair": [1, 2]}, "repair is [1, 2]; it must be an object with only steps, lr"),
        ({"repair": {"steps": -5}}, "repair.steps is -5; it must be an integer >= 1"),
        ({"repair": {"lr": 0}}, "repair.lr is 0; it must be a finite number > 0 and <= 1"),
        ({"repair": {"lr": float("nan")}}, "repair.lr is NaN; it must be a finite number > 0"),
        ({"repair": {"batch_size": 4}}, "repair.batch_size is not a setting a model recommends"),
        ({"name": 7}, "name is 7; it must be a string"),
        ({"alibi": {"kind": "softcap"}}, "alibi: headsurgeon.json records the ALiBi variant"),
    ],
)
def test_a_bad_metadata_value_names_file_and_field(folder, no_weight_reads, metadata, expected):
    file = folder / METADATA_FILE
    file.write_text(json.dumps(metadata))
    messages = set()
    for call in (load_model, check_checkpoint, model_shape, model_metadata):
        with pytest.raises(CheckpointError) as error:
            call(folder)
        messages.add(one_line(error))
    assert len(messages) == 1, messages
    (message,) = messages
    assert message.startswith(f"{file}: ") and expected in message, message


def test_metadata_that_is_not_an_object(folder, no_weight_reads):
    (folder / METADATA_FILE).write_text("[1, 2]")
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert one_line(error).startswith(f"{folder / METADATA_FILE} holds a JSON list, not an object")


def test_unknown_fields_are_kept_and_a_misspelling_is_named(folder, caplog):
    metadata = {"prepend_boss": True, "notes": "trained on a Tuesday", "repair": {"steps": 3}}
    (folder / METADATA_FILE).write_text(json.dumps(metadata))
    with caplog.at_level(logging.WARNING, logger="headsurgeon.loading"):
        assert model_metadata(folder) == metadata
    warned = [r.getMessage() for r in caplog.records if "prepend_boss" in r.getMessage()]
    assert len(warned) == 1 and "did you mean prepend_bos?" in warned[0]
    assert not any("notes" in r.getMessage() for r in caplog.records)  # no near miss: quiet
    assert recommended_config(load_model(folder)).steps == 3


def test_in_memory_metadata_is_checked_too():
    hf = random_hf_bloom(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=8))
    with pytest.raises(CheckpointError) as error:
        from_hf_model(hf, metadata={"repair": [1, 2]})
    assert one_line(error).startswith("metadata=: repair is [1, 2]; it must be an object")


def test_the_bundled_organisms_follow_the_schema():
    for name in ("organism", "organism-injured", "organism-deep"):
        metadata = model_metadata(name)
        assert check_metadata(metadata, name) is metadata and "training" in metadata


# --- head count against the training record -----------------------------------------------


def test_a_head_count_that_contradicts_the_training_record(folder, no_weight_reads):
    """n_head 8 over 4-head weights keeps every shape: only headsurgeon.json can tell."""
    (folder / METADATA_FILE).write_text(json.dumps({"training": {"config": {"n_head": 4}}}))
    edit_config(folder, n_head=8)
    for call in (load_model, check_checkpoint, model_shape):
        with pytest.raises(CheckpointError) as error:
            call(folder)
        assert one_line(error) == (
            f"{folder / 'config.json'} gives n_head 8 but {folder / METADATA_FILE} records "
            "training.config.n_head 4, the size the weights were trained with; correct "
            "config.json or re-export the checkpoint"
        )


def test_sizes_that_agree_with_the_training_record_load(folder):
    record = {"n_layer": 2, "n_head": 4, "hidden_size": 32, "seq_len": 64}
    (folder / METADATA_FILE).write_text(json.dumps({"training": {"config": record}}))
    model = load_model(folder)
    assert model.cfg.n_heads == 4


# --- weights whose header lies ------------------------------------------------------------


def half_folder(folder: Path, *, stated: str | None = "float16") -> Path:
    """The checkpoint rewritten in float16, ``config.json`` stating ``stated`` (None: no dtype)."""
    weights = {k: v.half() for k, v in load_file(folder / "model.safetensors").items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if stated is not None:
        config["dtype"] = stated
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def relabel(file: Path, names: list[str] | None, dtype: str) -> None:
    """Rewrite the safetensors header so that ``names`` (None: every tensor) claim ``dtype``;
    the tensor bytes stay as they are."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    for name, entry in header.items():
        if name != "__metadata__" and (names is None or name in names):
            entry["dtype"] = dtype
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def test_the_half_copy_itself_loads(folder):
    model = load_model(half_folder(folder))
    assert model.cfg.n_heads == 4


@pytest.mark.parametrize("stated", ["float16", None])
def test_a_tensor_relabelled_as_bfloat16_is_named(folder, no_weight_reads, stated):
    relabel(half_folder(folder, stated=stated) / "model.safetensors", [QKV], "BF16")
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(folder)
    source = f"{folder / 'config.json'} states dtype" if stated else "the other tensors are"
    assert one_line(error).startswith(f"{folder}: tensor {QKV} is bfloat16 but {source} float16")


def test_every_tensor_relabelled_against_the_config(folder, no_weight_reads):
    relabel(half_folder(folder) / "model.safetensors", None, "BF16")
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    message = one_line(error)
    assert "is bfloat16" in message and "more tensors too" in message
    assert "states dtype float16" in message


def test_a_tensor_relabelled_as_an_integer_is_refused(folder, no_weight_reads):
    relabel(half_folder(folder) / "model.safetensors", [QKV], "I16")
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert one_line(error).startswith(
        f"{folder}: tensor {QKV} is int16, not floating point (float16, bfloat16 or float32)"
    )


def test_a_relabelling_that_changes_the_width_is_a_corrupt_header(folder, no_weight_reads):
    relabel(half_folder(folder) / "model.safetensors", [QKV], "F32")
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    message = one_line(error)
    assert "model.safetensors is not a valid safetensors file (tensor " in message
    assert f"{QKV}, float32 of shape [96, 32], needs 12288 bytes but its offsets span 6144" in (
        message
    )


def test_a_config_dtype_that_is_no_float_dtype(folder, no_weight_reads):
    edit_config(folder, dtype="int8")
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert one_line(error).startswith(f'{folder / "config.json"}: dtype is "int8", expected')


# --- NaN and infinity ---------------------------------------------------------------------


def poison(folder: Path, value: float) -> None:
    weights = load_file(folder / "model.safetensors")
    weights[QKV][5] = value  # one row of head 0's query
    weights["transformer.ln_f.bias"][0] = value
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused_naming_the_tensors(folder, value):
    poison(folder, value)
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert one_line(error) == (
        f"{folder} holds NaN or infinite values in 2 weight(s): {QKV}, transformer.ln_f.bias; "
        "re-export or re-train the checkpoint, or pass allow_nonfinite=True to load_model to "
        "inspect it"
    )


def test_allow_nonfinite_loads_with_a_warning(folder):
    poison(folder, float("nan"))
    with pytest.warns(UserWarning, match=f"holds NaN or infinite values in 2 weight.*{QKV}"):
        model = load_model(folder, allow_nonfinite=True)
    assert torch.isnan(model.blocks[0].attn.W_Q).any()
    with pytest.raises(Exception, match="allow_nonfinite must be True or False"):
        load_model(folder, allow_nonfinite="yes")
