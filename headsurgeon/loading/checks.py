"""Checkpoint validation: a folder checked before any of its weights is read (they may be many GB).

A BLOOM ``config.json`` is checked field by field (:data:`_BLOOM_FIELDS`) and against the tensors
the file headers declare (:func:`headsurgeon.loading.files.stored_tensors`); any other
architecture must name a causal language model that transformers and TransformerLens agree on.
Each refusal is one :class:`~headsurgeon.errors.CheckpointError` (or
:class:`~headsurgeon.errors.UnsupportedArchitectureError`) line naming the file and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from headsurgeon import backend, families
from headsurgeon.errors import CheckpointError, ModelNotFoundError, UnsupportedArchitectureError
from headsurgeon.loading.files import (
    METADATA_FILE,
    WEIGHT_DTYPES,
    StoredTensor,
    check_files,
    has_weights,
    is_int,
    more_names,
    read_json,
    some_names,
    stored_tensors,
)
from headsurgeon.loading.metadata import folder_metadata

__all__: list[str] = []


def check_checkpoint(directory: Path) -> None:
    """Validate a checkpoint folder before its weights are read (they may be many GB).

    Every file that will be opened (``config.json``, ``headsurgeon.json``, weights, tokenizer
    files) must be a readable regular file of plausible size: a FIFO, a device, a folder or a
    symbolic link loop in its place is one :class:`CheckpointError` line naming it.
    ``config.json`` must be one object naming a causal language model TransformerLens converts;
    a BLOOM config's every field must have its type and range (:data:`_BLOOM_FIELDS`), and its
    layers, widths and vocabulary must be those of the stored tensors (read from the file headers):
    a tensor missing, left unused or of another shape raises :class:`CheckpointError`, and so
    does a tensor that is not floating point or not of the dtype ``config.json`` states (a
    relabelled header). ``headsurgeon.json`` must pass :func:`check_metadata`, and the sizes of
    the training run it records (``training.config``) must be those of ``config.json``.
    """
    checked_folder(directory)


def checked_folder(directory: Path) -> dict[str, Any]:
    """:func:`check_checkpoint`, returning the folder's checked ``headsurgeon.json`` ({})."""
    if not directory.is_dir():
        raise ModelNotFoundError(f"{directory} is not a folder; pass a checkpoint folder")
    file = directory / "config.json"
    if not os.path.lexists(file):
        raise CheckpointError(
            f"{directory} has no config.json; pass a Hugging Face checkpoint folder "
            "(config.json, *.safetensors, tokenizer files)"
        )
    check_files(directory)
    config = read_json(file)
    bloom = bloom_config(file, config)
    metadata = folder_metadata(directory)
    if bloom is not None:
        check_training(directory, bloom, metadata)
    if not has_weights(directory):
        raise CheckpointError(
            f"{directory} has no weights (*.safetensors); re-export or re-download"
        )
    found = stored_tensors(directory)
    check_weight_family(directory, config, found)
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        tl_config(Path(tmp), source=file)  # errors name the user's file, not this copy
    if bloom is not None:
        check_bloom_tensors(directory, config, bloom, found)
    return metadata


def tl_config(
    config_dir: Path, *, dtype: torch.dtype = torch.float32, source: Path | None = None
) -> Any:
    """Check that TransformerLens converts the ``config.json`` in ``config_dir`` (a folder of ours).

    Returns 3.x's ``HookedTransformerConfig`` for it (None on 4.x, whose bridge reads the Hugging
    Face config itself). TransformerLens guesses the architecture of any path that contains
    "llama" or "gemma" from the path alone, so it is only ever shown a private temporary folder,
    never the user's; errors name ``source`` (the user's file) when given.
    """
    file = source or config_dir / "config.json"
    return backend.check_architecture(
        config_dir, read_json(config_dir / "config.json"), file, dtype=dtype
    )


# --- config.json and the weights it describes ---------------------------------------------

# A tensor-name fragment only one family's weights hold -> that family and the model_types whose
# config reads them (GPT-BigCode stores GPT-2's c_attn too).
_FAMILY_MARKS = {
    "word_embeddings_layernorm.": ("BLOOM", {"bloom"}),
    ".c_attn.": ("GPT-2", {"gpt2", "gpt_bigcode"}),
    "gpt_neox.": ("GPT-NeoX", {"gpt_neox", "gpt_neox_japanese"}),
    ".Wqkv.": ("MPT", {"mpt"}),
    "decoder.embed_positions.": ("OPT", {"opt"}),
}


def check_weight_family(directory: Path, config: dict[str, Any], found: dict[str, Any]) -> None:
    """Raise when the stored tensors are another model family's than ``config.json`` names, before
    its fields are read: a GPT-2 config over BLOOM weights would otherwise be advised on its
    GPT-2 fields. Only a config of a family known here is compared (any other is refused as
    unsupported, whatever its weights)."""
    model_type = config.get("model_type")
    if not any(model_type in types for _, types in _FAMILY_MARKS.values()):
        return
    for mark, (family, model_types) in _FAMILY_MARKS.items():
        named = next((name for name in sorted(found) if mark in name), None)
        if named is not None and model_type not in model_types:
            architecture = (config.get("architectures") or ["<none>"])[0]
            raise CheckpointError(
                f"{directory / 'config.json'} names {architecture} (model_type "
                f"{json.dumps(model_type)}) but the weights in {directory} are {family} weights "
                f"(e.g. {named}), another family's; put the config.json exported with these "
                "weights beside them"
            )


_SUPPORTED = backend.SUPPORTED


@dataclasses.dataclass(frozen=True)
class _Field:
    """What one config.json field may hold; ``aliases`` are other names transformers reads it by.

    A float never passes for an integer, not even 256.0: transformers' typed configs reject it too.
    """

    kind: str  # "int", "number", "bool" or "token" (a token id, a list of them, or null)
    low: float | None = None  # inclusive bounds
    high: float | None = None
    required: bool = False
    aliases: tuple[str, ...] = ()

    def accepts(self, value: Any) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "token":
            ids = value if isinstance(value, list) and value else [value]
            return value is None or all(is_int(i) and i >= 0 for i in ids)
        number = is_int(value) or (self.kind == "number" and isinstance(value, float))
        return number and math.isfinite(value) and self._in_range(value)

    def _in_range(self, value: float) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.kind == "bool":
            return "true or false"
        if self.kind == "token":
            return "a token id (an integer >= 0), a list of them, or null"
        what = "an integer" if self.kind == "int" else "a finite number"
        if self.low is not None and self.high is not None:
            return f"{what} from {self.low:g} to {self.high:g}"
        return what if self.low is None else f"{what} >= {self.low:g}"


# Every field of transformers' BloomConfig, and seq_length (the training context, read by
# model_shape), with the names transformers also reads them by (bigscience's own configs say
# n_embed and num_attention_heads).
_BLOOM_FIELDS: dict[str, _Field] = {
    "n_layer": _Field("int", low=1, required=True, aliases=("num_hidden_layers",)),
    "n_head": _Field("int", low=1, required=True, aliases=("num_attention_heads",)),
    "hidden_size": _Field("int", low=1, required=True, aliases=("n_embed",)),
    "vocab_size": _Field("int", low=1, required=True),
    "seq_length": _Field("int", low=1),
    "layer_norm_epsilon": _Field("number", low=0),
    "initializer_range": _Field("number", low=0),
    "hidden_dropout": _Field("number", low=0, high=1),
    "attention_dropout": _Field("number", low=0, high=1),
    "pretraining_tp": _Field("int", low=1),
    "apply_residual_connection_post_layernorm": _Field("bool"),
    "slow_but_exact": _Field("bool"),
    "tie_word_embeddings": _Field("bool"),
    "use_cache": _Field("bool"),
    "bos_token_id": _Field("token"),
    "eos_token_id": _Field("token"),
    "pad_token_id": _Field("token"),
}
_BLOOM_DEFAULTS = {"seq_length": 2048, "tie_word_embeddings": True}


def bloom_config(file: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The validated values of a BLOOM ``config.json`` by BloomConfig's names; None for a config
    of another architecture that transformers and TransformerLens may still load."""
    if not _is_bloom(file, config):
        return None
    values = dict(_BLOOM_DEFAULTS)
    for name, field in _BLOOM_FIELDS.items():
        given = [n for n in (name, *field.aliases) if n in config]
        if len({json.dumps(config[n]) for n in given}) > 1:
            both = " and ".join(f"{n} {json.dumps(config[n])}" for n in given)
            raise CheckpointError(f"{file} gives {both}; keep one of them")
        if not given:
            if field.required:
                names = " or ".join((name, *field.aliases))
                raise CheckpointError(
                    f"{file} lacks {names} ({field.describe()}); add it or re-export the checkpoint"
                )
            continue
        value = config[given[0]]
        if not field.accepts(value):
            raise CheckpointError(
                f"{file}: {given[0]} is {json.dumps(value)}, expected {field.describe()}; "
                "correct it or re-export the checkpoint"
            )
        values[name] = value
    if values["hidden_size"] % values["n_head"]:
        raise CheckpointError(
            f"{file}: hidden_size {values['hidden_size']} is not a multiple of n_head "
            f"{values['n_head']}; correct them or re-export the checkpoint"
        )
    return values


def _is_bloom(file: Path, config: dict[str, Any]) -> bool:
    """Whether a config is BLOOM's; a config transformers or TransformerLens would misread raises.

    transformers builds the model named by ``model_type`` and TransformerLens converts the one
    named by ``architectures[0]``: both must name the same causal language model.
    """
    model_type, architectures = config.get("model_type"), config.get("architectures")
    if not (isinstance(architectures, list) and architectures) or not all(
        isinstance(a, str) for a in architectures
    ):
        raise UnsupportedArchitectureError(
            f"{file} names no architecture (architectures: {json.dumps(architectures)}; "
            f"model_type: {json.dumps(model_type)}), which is not supported by TransformerLens; "
            f'{_SUPPORTED}; a BLOOM needs "architectures": ["BloomForCausalLM"]'
        )
    architecture = architectures[0]
    if model_type == families.BLOOM.name and architecture == families.BLOOM.architecture:
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    )
    if causal is None:
        raise UnsupportedArchitectureError(
            f"model_type {json.dumps(model_type)} in {file} has no causal language model in "
            f"transformers, so architecture {architecture} is not supported by TransformerLens "
            f"here; {_SUPPORTED}"
        )
    if architecture not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        raise UnsupportedArchitectureError(
            f"{file} names architecture {architecture}, which is not a causal language model: "
            f"headsurgeon analyses next-token attention heads; {_SUPPORTED}"
        )
    if causal != architecture:
        raise UnsupportedArchitectureError(
            f"{file} names architecture {architecture} but model_type {json.dumps(model_type)}, "
            f"whose causal language model is {causal}; make them agree ({_SUPPORTED})"
        )
    return False


def _bloom_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of BloomModel and its shape (BloomMLP is always 4 x hidden_size wide)."""
    h = config["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {"word_embeddings.weight": (config["vocab_size"], h)}
    layer = {
        "input_layernorm.weight": (h,),
        "input_layernorm.bias": (h,),
        "self_attention.query_key_value.weight": (3 * h, h),
        "self_attention.query_key_value.bias": (3 * h,),
        "self_attention.dense.weight": (h, h),
        "self_attention.dense.bias": (h,),
        "post_attention_layernorm.weight": (h,),
        "post_attention_layernorm.bias": (h,),
        "mlp.dense_h_to_4h.weight": (4 * h, h),
        "mlp.dense_h_to_4h.bias": (4 * h,),
        "mlp.dense_4h_to_h.weight": (h, 4 * h),
        "mlp.dense_4h_to_h.bias": (h,),
    }
    for norm in ("word_embeddings_layernorm", "ln_f"):
        shapes |= {f"{norm}.weight": (h,), f"{norm}.bias": (h,)}
    for i in range(config["n_layer"]):
        shapes |= {f"h.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _check_bloom_weights(
    directory: Path, config: dict[str, Any], found: dict[str, tuple[int, ...]]
) -> None:
    """Raise unless the stored tensors are exactly those ``config`` describes, in its shapes.

    A head count that keeps every shape (n_head 8 for 4 over the same width) cannot be seen here.
    """
    file = directory / "config.json"
    # BloomForCausalLM saves "transformer.h.0...", BloomModel (bigscience's files) "h.0...".
    prefix = "transformer." if any(k.startswith("transformer.") for k in found) else ""
    expected = {prefix + k: s for k, s in _bloom_weight_shapes(config).items()}
    if not config["tie_word_embeddings"] or "lm_head.weight" in found:
        expected["lm_head.weight"] = (config["vocab_size"], config["hidden_size"])
    layer_of = re.compile(re.escape(prefix) + r"h\.(\d+)\.")
    layers = {int(m[1]) for k in found if (m := layer_of.match(k))}
    if layers and max(layers) + 1 != config["n_layer"]:
        raise CheckpointError(
            f"{file}: n_layer is {config['n_layer']} but the weights in {directory} hold "
            f"{max(layers) + 1} layers; correct config.json or re-export the checkpoint"
        )
    wrong = [(k, found[k], s) for k, s in expected.items() if k in found and found[k] != s]
    if wrong:
        name, shape, want = wrong[0]
        more = f" ({len(wrong) - 1} more tensors too)" if len(wrong) > 1 else ""
        raise CheckpointError(
            f"{directory}: tensor {name} has shape {list(shape)} but {file} (hidden_size "
            f"{config['hidden_size']}, vocab_size {config['vocab_size']}) expects {list(want)}"
            f"{more}; correct config.json or re-export the checkpoint"
        )
    if missing := sorted(expected.keys() - found.keys()):
        raise CheckpointError(
            f"{directory} lacks {some_names(missing)} that {file} needs; "
            "re-download or re-export the checkpoint"
        )
    if unused := sorted(found.keys() - expected.keys()):
        raise CheckpointError(
            f"{directory} holds {some_names(unused)} that {file} leaves unused; "
            "correct config.json or re-export the checkpoint"
        )


def check_bloom_tensors(
    directory: Path, config: dict[str, Any], bloom: dict[str, Any], found: dict[str, StoredTensor]
) -> None:
    """:func:`_check_bloom_weights`, then the dtypes: every BLOOM weight is floating point, and
    of the dtype config.json states (``dtype`` or ``torch_dtype``), else of one dtype."""
    _check_bloom_weights(directory, bloom, {k: t.shape for k, t in found.items()})
    file = directory / "config.json"
    if odd := sorted(k for k, t in found.items() if t.dtype not in WEIGHT_DTYPES):
        raise CheckpointError(
            f"{directory}: tensor {odd[0]} is {found[odd[0]].dtype}{more_names(odd)}, not floating "
            "point (float16, bfloat16 or float32): a relabelled or corrupt header; re-download "
            "or re-export the checkpoint"
        )
    stated = [(k, config[k]) for k in ("dtype", "torch_dtype") if config.get(k) is not None]
    for key, value in stated:
        if not (isinstance(value, str) and value.removeprefix("torch.") in WEIGHT_DTYPES):
            raise CheckpointError(
                f"{file}: {key} is {json.dumps(value)}, expected one of "
                f"{', '.join(WEIGHT_DTYPES)} or null; correct it or re-export the checkpoint"
            )
    if len({v.removeprefix("torch.") for _, v in stated}) > 1:
        both = " and ".join(f"{k} {json.dumps(v)}" for k, v in stated)
        raise CheckpointError(f"{file} gives {both}; keep one of them")
    if stated:
        want, source = stated[0][1].removeprefix("torch."), f"{file} states dtype"
    else:  # no dtype stated: the dtype most tensors have
        dtypes = [t.dtype for t in found.values()]
        want, source = max(set(dtypes), key=dtypes.count), "the other tensors are"
    if wrong := sorted(k for k, t in found.items() if t.dtype != want):
        raise CheckpointError(
            f"{directory}: tensor {wrong[0]} is {found[wrong[0]].dtype}{more_names(wrong)} but "
            f"{source} {want}: a relabelled or corrupt header, or a wrong config; re-download or "
            "re-export the checkpoint"
        )


# training.config sizes that config.json must repeat: n_head 8 over weights trained with 16
# heads keeps every tensor's shape, so only this record can tell.
_TRAINED_SIZES = ("n_layer", "n_head", "hidden_size", "vocab_size")


def check_training(directory: Path, bloom: dict[str, Any], metadata: dict[str, Any]) -> None:
    """The sizes ``headsurgeon.json`` records for the training run must be config.json's."""
    trained = metadata.get("training", {}).get("config", {})
    for size in _TRAINED_SIZES:
        if size in trained and trained[size] != bloom[size]:
            raise CheckpointError(
                f"{directory / 'config.json'} gives {size} {bloom[size]} but "
                f"{directory / METADATA_FILE} records training.config.{size} {trained[size]}, "
                "the size the weights were trained with; correct config.json or re-export the "
                "checkpoint"
            )
