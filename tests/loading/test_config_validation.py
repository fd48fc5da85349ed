"""A model folder's config.json is checked, and compared with its weights, before any weight loads.

Every bad value, missing field, unsupported architecture or disagreement between config and
tensors is one ``headsurgeon.errors`` line naming the field, the value and the file, raised alike
by :func:`load_model` (before transformers reads a weight) and by :func:`model_shape` (which never
reads weights).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from headsurgeon import load_model, model_shape
from headsurgeon.errors import CheckpointError, UnsupportedArchitectureError
from headsurgeon.loading import organism_names
from headsurgeon.loading.checks import check_checkpoint


@pytest.fixture()
def folder(bloom_dir, tmp_path):
    """A fresh copy of the 2-layer, 4-head, 32-wide, 320-token checkpoint to damage."""
    return shutil.copytree(bloom_dir, tmp_path / "ckpt")


@pytest.fixture()
def no_weight_reads(monkeypatch):
    """Fail the test if transformers is asked to read weights: the error must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the config was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def edit_config(folder, changes=None, remove=()):
    config = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in remove} | (changes or {})
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder, change):
    """Rewrite model.safetensors as ``change`` leaves its name -> tensor dict."""
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def same_error_everywhere(folder, kind) -> str:
    """The one-line message that load_model, check_checkpoint and model_shape all raise."""
    messages = set()
    for call in (load_model, check_checkpoint, model_shape):
        with pytest.raises(kind) as error:
            call(folder)
        messages.add(str(error.value))
    assert len(messages) == 1, messages
    (message,) = messages
    assert message and "\n" not in message
    return message


# --- category 2: a value of the wrong type or range ----------------------------------------


@pytest.mark.parametrize(
    ("changes", "remove", "shown"),
    [
        ({"hidden_size": 32.5}, (), "hidden_size is 32.5"),
        ({"hidden_size": 32.0}, (), "hidden_size is 32.0"),  # integral floats are refused too
        ({"n_layer": "four"}, (), 'n_layer is "four"'),
        ({"n_head": "4"}, (), 'n_head is "4"'),
        ({"n_head": None}, (), "n_head is null"),
        ({"n_layer": -1}, (), "n_layer is -1"),
        ({"n_layer": 0}, (), "n_layer is 0"),
        ({"n_layer": True}, (), "n_layer is true"),  # a bool is an int in Python, not here
        ({"vocab_size": False}, (), "vocab_size is false"),
        ({"vocab_size": [320]}, (), "vocab_size is [320]"),
        ({"hidden_size": float("nan")}, (), "hidden_size is NaN"),
        ({"seq_length": 0}, (), "seq_length is 0"),
        ({"seq_length": "128"}, (), 'seq_length is "128"'),
        ({"layer_norm_epsilon": "1e-5"}, (), 'layer_norm_epsilon is "1e-5"'),
        ({"layer_norm_epsilon": -1e-5}, (), "layer_norm_epsilon is -1e-05"),
        ({"layer_norm_epsilon": float("inf")}, (), "layer_norm_epsilon is Infinity"),
        ({"hidden_dropout": 1.5}, (), "hidden_dropout is 1.5"),
        ({"tie_word_embeddings": "yes"}, (), 'tie_word_embeddings is "yes"'),
        ({"use_cache": 1}, (), "use_cache is 1"),
        ({"eos_token_id": [2, "a"]}, (), 'eos_token_id is [2, "a"]'),
        ({"bos_token_id": -1}, (), "bos_token_id is -1"),
        # bigscience's own configs name two fields differently; those names are checked too.
        ({"n_embed": 32.5}, ("hidden_size",), "n_embed is 32.5"),
        ({"num_attention_heads": 0}, ("n_head",), "num_attention_heads is 0"),
        ({"num_hidden_layers": None}, ("n_layer",), "num_hidden_layers is null"),
    ],
)
def test_a_bad_value_names_field_value_and_file(folder, no_weight_reads, changes, remove, shown):
    edit_config(folder, changes, remove)
    message = same_error_everywhere(folder, CheckpointError)
    assert message.startswith(f"{folder / 'config.json'}: {shown}, expected ")


@pytest.mark.parametrize("field", ["n_layer", "n_head", "hidden_size", "vocab_size"])
def test_a_missing_size_is_an_error_not_a_default(folder, no_weight_reads, field):
    # transformers would fill in BloomConfig's defaults (2 layers, 8 heads, 64 wide, 250880).
    edit_config(folder, remove=(field,))
    message = same_error_everywhere(folder, CheckpointError)
    assert message.startswith(f"{folder / 'config.json'} lacks {field}")


def test_width_must_split_into_heads(folder, no_weight_reads):
    edit_config(folder, {"n_head": 3})
    message = same_error_everywhere(folder, CheckpointError)
    assert "hidden_size 32 is not a multiple of n_head 3" in message


def test_two_names_for_one_field_must_agree(folder, no_weight_reads):
    edit_config(folder, {"n_embed": 64})
    message = same_error_everywhere(folder, CheckpointError)
    assert "gives hidden_size 32 and n_embed 64" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[]", "holds a JSON list, not an object"),
        ("null", "holds a JSON NoneType, not an object"),
        ('"bloom"', "holds a JSON str, not an object"),
        ("{oops", "is not readable JSON"),
        ("", "is not readable JSON"),
    ],
)
def test_config_that_is_not_a_json_object(folder, no_weight_reads, text, expected):
    (folder / "config.json").write_text(text)
    message = same_error_everywhere(folder, CheckpointError)
    assert message.startswith(f"{folder / 'config.json'} ") and expected in message


def test_undecodable_config(folder, no_weight_reads):
    (folder / "config.json").write_bytes(b'{"n_layer": "\xff"}')
    assert "is not readable JSON" in same_error_everywhere(folder, CheckpointError)


def test_bigscience_style_config_and_unprefixed_weights_load(folder, bloom_dir):
    """bigscience's files: n_embed and num_attention_heads, tensors saved without "transformer."."""
    config = json.loads((folder / "config.json").read_text())
    edit_config(
        folder,
        {"n_embed": config["hidden_size"], "num_attention_heads": config["n_head"]},
        remove=("hidden_size", "n_head"),
    )
    edit_weights(
        folder, lambda w: w.update({k.removeprefix("transformer."): w.pop(k) for k in list(w)})
    )
    assert model_shape(folder) == model_shape(bloom_dir)
    assert torch.equal(load_model(folder).W_Q, load_model(bloom_dir).W_Q)


# --- category 2: architectures -------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model_type": "bert"}, ['model_type "bert"', "BloomForCausalLM", "BertLMHeadModel"]),
        (
            {"model_type": "bert", "architectures": ["BertForMaskedLM"]},
            ["BertForMaskedLM, which is not a causal language model"],
        ),
        ({"model_type": None}, ["model_type null", "BloomForCausalLM"]),
        ({"architectures": ["GPT2LMHeadModel"]}, ['model_type "bloom"', "GPT2LMHeadModel"]),
        ({"architectures": []}, ["architectures: []"]),
        ({"architectures": "BloomForCausalLM"}, ['architectures: "BloomForCausalLM"']),
    ],
    ids=["bert-type", "bert", "no-type", "type-and-architecture-disagree", "empty", "not-a-list"],
)
def test_unsupported_or_contradictory_architecture(folder, no_weight_reads, changes, named):
    edit_config(folder, changes)
    message = same_error_everywhere(folder, UnsupportedArchitectureError)
    assert all(part in message for part in named), message
    assert str(folder / "config.json") in message and "headsurgeon loads BLOOM" in message
    assert "hidden size" not in message.lower()  # the misleading "not a multiple of 12"


def test_gpt2_config(folder):
    """A genuine GPT-2 config over BLOOM weights: one line saying the weights are another
    family's, before any GPT-2 field (TransformerLens 3.x's n_ctx) is asked for."""
    gpt2 = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=320).to_dict()
    gpt2 |= {"architectures": ["GPT2LMHeadModel"]}
    (folder / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(UnsupportedArchitectureError, match="shapes by folder are known for BLOOM"):
        model_shape(folder)
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    message = str(error.value)
    assert "\n" not in message and "are BLOOM weights" in message and "n_ctx" not in message


# --- category 3: a config that disagrees with its weights ----------------------------------


@pytest.mark.parametrize("n_layer", [1, 3])
def test_layer_count_must_match_the_weights(folder, no_weight_reads, n_layer):
    edit_config(folder, {"n_layer": n_layer})
    message = same_error_everywhere(folder, CheckpointError)
    assert message == (
        f"{folder / 'config.json'}: n_layer is {n_layer} but the weights in {folder} hold 2 "
        "layers; correct config.json or re-export the checkpoint"
    )


def test_layer_count_checked_in_legacy_bin_weights(folder, no_weight_reads):
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    edit_config(folder, {"n_layer": 1})
    assert "n_layer is 1 but the weights" in same_error_everywhere(folder, CheckpointError)


@pytest.mark.parametrize(
    ("changes", "tensor", "shape", "expected"),
    [
        ({"vocab_size": 300}, "transformer.word_embeddings.weight", [320, 32], [300, 32]),
        ({"hidden_size": 64}, "transformer.word_embeddings.weight", [320, 32], [320, 64]),
    ],
)
def test_sizes_must_match_the_weights(folder, no_weight_reads, changes, tensor, shape, expected):
    edit_config(folder, changes)
    message = same_error_everywhere(folder, CheckpointError)
    assert f"tensor {tensor} has shape {shape} but " in message
    assert f"expects {expected}" in message


def test_one_misshapen_tensor_is_named(folder, no_weight_reads):
    name = "transformer.h.1.mlp.dense_h_to_4h.bias"
    edit_weights(folder, lambda w: w.update({name: torch.zeros(5)}))
    message = same_error_everywhere(folder, CheckpointError)
    assert f"tensor {name} has shape [5] but" in message and "expects [128]" in message


def test_unused_weights_are_named_then_counted(folder, no_weight_reads):
    extra = [f"transformer.h.0.extra{i}.weight" for i in range(5)]
    edit_weights(folder, lambda w: w.update({name: torch.zeros(2) for name in extra}))
    message = same_error_everywhere(folder, CheckpointError)
    assert f"holds 5 weight(s): {', '.join(extra[:3])} and 2 more that " in message
    assert "leaves unused" in message


def test_untied_head_needs_its_weights(folder, no_weight_reads):
    edit_config(folder, {"tie_word_embeddings": False})
    message = same_error_everywhere(folder, CheckpointError)
    assert "lacks 1 weight(s): lm_head.weight that" in message


def test_bundled_organisms_pass(no_weight_reads):
    for name in organism_names():
        shape = model_shape(name)
        assert shape.n_layers >= 1 and shape.d_model % shape.n_heads == 0


def test_other_architectures_still_load_and_their_unused_weights_are_refused(tmp_path):
    """A Llama loads as before; with a layer dropped from its config, the weights left over fail."""
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=320,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert load_model(tmp_path).cfg.n_layers == 2
    edit_config(tmp_path, {"num_hidden_layers": 1})
    with pytest.raises(CheckpointError) as error:
        load_model(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "model.layers.1." in message and "leaves unused" in message


# --- through the command line --------------------------------------------------------------


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize(
    ("changes", "expected"),
    [({"n_layer": "four"}, 'n_layer is "four"'), ({"n_layer": 1}, "n_layer is 1 but the weights")],
    ids=["bad-value", "disagrees-with-weights"],
)
def test_classify_cli_exits_2_with_one_line(folder, tmp_path, changes, expected):
    edit_config(folder, changes)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "headsurgeon",
            "classify",
            str(folder),
            "--threads",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()
