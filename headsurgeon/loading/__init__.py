"""Loading models (by name, bundled organism or local folder) and the facts the tools need.

Exports:
    load_model(model, dtype, device, device_map, ...)  TransformerLens model, exact ALiBi
    from_hf_model(hf_model, tokenizer, ...)  wrap an in-memory transformers model
    random_model(shape, seed)                random-weight BLOOM of a given or named shape
    random_hf_bloom(shape, seed)             the same, as a transformers model
    model_shape(model)               ModelShape without loading weights
    model_info(model)                        ModelInfo: where a model came from, its conventions
    model_metadata(model)                    a model's or folder's headsurgeon.json, weights unread
    organism_names(), DEFAULT_MODEL, ORGANISM_DIR, BLOOM_SHAPES, ModelShape, ModelInfo
    resolve_model(model)              (display name, local checkpoint folder)
    check_checkpoint(directory)              a checkpoint folder validated before reading weights
    check_metadata(data, path)               a headsurgeon.json's contents checked (one schema)
    stored_tensors(directory), StoredTensor  dtype and shape of each stored tensor, from headers
    weight_files(directory)                  its weight files (safetensors, or pickled; shards)
    pickled_tensors(file)                    the tensors of one pickled .bin file, checked
    safetensors_header(file)                 the same for one safetensors file, checked
    read_json(path), tl_config(config_dir)   a checkpoint's JSON; TransformerLens's config for it
    METADATA_FILE, TOKENIZER_FILES           the files of a checkpoint folder besides weights

Weights stay exactly as in the checkpoint (no LayerNorm folding, no centring), so every per-head
slice of ``W_Q``/``W_K``/``W_V``/``W_O`` maps 1:1 back to the checkpoint and
:func:`headsurgeon.checkpoints.save_hf` round trips bit for bit. Models loaded here get Hugging
Face's exact ALiBi slopes for any head count (:mod:`headsurgeon.exact_alibi`).

>>> model = random_model(ModelShape(n_layers=1, n_heads=6, d_model=48, d_vocab=64, n_ctx=32))
>>> model.cfg.n_heads, model_info(model).prepend_bos
(6, False)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import pickle
import re
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from headsurgeon import backend, inputs
from headsurgeon.backend import MAJOR, Model
from headsurgeon.dtypes import parse_device, parse_dtype
from headsurgeon.errors import (
    CheckpointError,
    ModelNotFoundError,
    UnknownModelError,
    UnsupportedArchitectureError,
    first_line,
)
from headsurgeon.exact_alibi import install_exact_alibi, trained_bias
from headsurgeon.placement import adopt, check_placement, dispatch, from_pretrained_args
from headsurgeon.validation import check_bool

__all__ = [
    "BLOOM_SHAPES",
    "DEFAULT_MODEL",
    "METADATA_FILE",
    "ORGANISM_DIR",
    "TOKENIZER_FILES",
    "ModelInfo",
    "ModelShape",
    "StoredTensor",
    "check_checkpoint",
    "check_metadata",
    "from_hf_model",
    "load_model",
    "model_info",
    "model_metadata",
    "model_shape",
    "organism_names",
    "pickled_tensors",
    "random_hf_bloom",
    "random_model",
    "read_json",
    "resolve_model",
    "safetensors_header",
    "stored_tensors",
    "tl_config",
    "weight_files",
]

logger = logging.getLogger(__name__)

ORGANISM_DIR = Path(__file__).parents[1] / "organisms"
DEFAULT_MODEL = "organism-injured"
METADATA_FILE = "headsurgeon.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that weight-free analyses need; ``family`` says whose ALiBi slopes an ALiBi
    model applies (:func:`headsurgeon.alibi.family_slopes`: ``bloom``, ``mpt`` or ``falcon``)."""

    n_layers: int
    n_heads: int
    d_model: int
    d_vocab: int
    n_ctx: int
    positional: str = "alibi"
    family: str = "bloom"


# Published BLOOM configurations (Hugging Face config.json of each bigscience checkpoint).
BLOOM_SHAPES: dict[str, ModelShape] = {
    "bloom-560m": ModelShape(24, 16, 1024, 250880, 2048),
    "bloom-1b1": ModelShape(24, 16, 1536, 250880, 2048),
    "bloom-1b7": ModelShape(24, 16, 2048, 250880, 2048),
    "bloom-3b": ModelShape(30, 32, 2560, 250880, 2048),
    "bloom-7b1": ModelShape(30, 32, 4096, 250880, 2048),
    "bloom-176b": ModelShape(70, 112, 14336, 250880, 2048),
}
_BLOOM_OFFICIAL = {f"bigscience/{k}": k for k in BLOOM_SHAPES} | {"bigscience/bloom": "bloom-176b"}


@dataclasses.dataclass
class ModelInfo:
    """Where a loaded model came from and the conventions the tools apply to it.

    ``prepend_bos`` is the model's own position-0 convention (BLOOM: no BOS token, so position 0
    is the first text token). ``train_ctx`` is the sequence length the model was trained on, when
    known (bundled organisms record it).
    """

    name: str
    source: Path | None
    prepend_bos: bool
    train_ctx: int | None
    hf_config: dict[str, Any]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Any = None  # the checkpoint's own tokenizer (TransformerLens may wrap it)


def organism_names() -> list[str]:
    """Short names of the model organisms bundled with the package."""
    if not ORGANISM_DIR.is_dir():
        return []
    return sorted(p.name for p in ORGANISM_DIR.iterdir() if (p / "config.json").exists())


def _hub_names() -> dict[str, str]:
    """Map every TransformerLens name and alias (lower case) to its official hub name."""
    return backend.hub_names()


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file, which must be a regular file of at most
    :data:`~headsurgeon.inputs.MAX_JSON_BYTES` holding one JSON object (else one
    :class:`CheckpointError` line that begins with the path)."""
    return inputs.read_json(path, "", error=CheckpointError, fix="re-export the checkpoint")


def _local_shape(directory: Path) -> ModelShape:
    """A folder's shape from its validated config, checked against its weights when present."""
    _check_files(directory)
    file = directory / "config.json"
    config = read_json(file)
    if config.get("model_type") in ("mpt", "falcon"):
        return _config_shape(file, config)
    bloom = _bloom_config(file, config)
    if bloom is None:
        raise UnsupportedArchitectureError(
            f"{file} is not a BLOOM, MPT or Falcon config and shapes by folder are known for "
            "BLOOM, MPT and Falcon only; pass the loaded model (load_model) instead"
        )
    _check_training(directory, bloom, _folder_metadata(directory))
    if _has_weights(directory):
        _check_bloom_tensors(directory, config, bloom, stored_tensors(directory))
    return ModelShape(
        n_layers=bloom["n_layer"],
        n_heads=bloom["n_head"],
        d_model=bloom["hidden_size"],
        d_vocab=bloom["vocab_size"],
        n_ctx=bloom["seq_length"],
    )


def _config_shape(file: Path, config: dict[str, Any]) -> ModelShape:
    """An MPT or Falcon config's shape, its values checked by its transformers config class."""
    from transformers import AutoConfig

    family = config["model_type"]
    try:
        hf = AutoConfig.for_model(**config)
        sizes = [hf.num_hidden_layers, hf.num_attention_heads, hf.hidden_size, hf.vocab_size,
                 hf.max_seq_len if family == "mpt" else hf.max_position_embeddings]  # fmt: skip
    except Exception as e:  # transformers' validation: TypeError, ValueError, its own errors
        raise CheckpointError(f"{file}: {first_line(e)}; correct it or re-export it") from e
    if not all(_is_int(size) and size > 0 for size in sizes) or sizes[2] % sizes[1]:
        raise CheckpointError(
            f"{file}: layers, heads, width, vocabulary and context {sizes} are not positive "
            "integers with the width a multiple of the heads; correct it or re-export it"
        )
    alibi = family == "mpt" or bool(hf.alibi)  # transformers' MPT always applies ALiBi
    return ModelShape(*sizes, positional="alibi" if alibi else "rotary", family=family)


def model_metadata(model: str | os.PathLike | Model) -> dict[str, Any]:
    """The ``headsurgeon.json`` of a model, a bundled organism or a local folder (no weights
    read), checked by :func:`check_metadata`; ``{}`` for a hub name or a folder without one."""
    if isinstance(model, Model):
        return model_info(model).metadata
    name = str(model)
    folder = ORGANISM_DIR / name if name in organism_names() else Path(name)
    return _folder_metadata(folder) if folder.is_dir() else {}


def model_shape(model: str | os.PathLike | Model) -> ModelShape:
    """Shape of a model, a BLOOM name (no weights needed), a bundled organism or a folder.

    >>> model_shape("bloom-176b").n_heads
    112
    """
    if isinstance(model, Model):
        cfg = model.cfg
        # TransformerLens sets n_ctx = 2048 for every BLOOM; the checkpoint's own value wins.
        hf_config = model_info(model).hf_config
        n_ctx = hf_config.get("seq_length", cfg.n_ctx)
        family = hf_config.get("model_type")
        return ModelShape(
            cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_vocab, n_ctx,
            cfg.positional_embedding_type, family if family in ("mpt", "falcon") else "bloom",
        )  # fmt: skip
    name = str(model)
    key = name.lower()
    if key in BLOOM_SHAPES:
        return BLOOM_SHAPES[key]
    if key in _BLOOM_OFFICIAL:
        return BLOOM_SHAPES[_BLOOM_OFFICIAL[key]]
    if name in organism_names():
        return _local_shape(ORGANISM_DIR / name)
    if Path(name).is_dir() and os.path.lexists(Path(name) / "config.json"):
        return _local_shape(Path(name))
    raise UnknownModelError(_unknown_message(name, list(BLOOM_SHAPES) + organism_names()))


def _unknown_message(name: str, candidates: list[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(by_lower[c] for c in close)}? " if close else ""
    return (
        f"unknown model {name!r}: {hint}pass a TransformerLens model name, a bundled organism "
        f"({', '.join(organism_names()) or 'none installed'}) or a local checkpoint folder"
    )


def _hub_reachable(timeout: float = 2.0) -> bool:
    """One request to the hub, no retries, answered within ``timeout`` seconds.

    Uses the hub client's own session (its proxies and certificates). The request runs in a daemon
    thread because socket timeouts do not cover a name server that never answers.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    done = threading.Event()
    answered: list[bool] = []

    def probe() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout)
            answered.append(True)  # any status code: the server is there
        except Exception:  # any failure to get an HTTP answer means "unreachable"
            pass
        done.set()

    threading.Thread(target=probe, daemon=True).start()
    done.wait(timeout)
    return bool(answered)


def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def _hub_snapshot(official: str) -> Path:
    """The local folder of a hub model: from the cache, else downloaded (with progress bars)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]
    try:
        cached = Path(snapshot_download(official, allow_patterns=patterns, local_files_only=True))
        if _has_weights(cached):
            return cached
    except LocalEntryNotFoundError:
        pass
    how = (
        f"download it on a connected machine (huggingface-cli download {official}) and copy the "
        "Hugging Face cache here, or pass a local checkpoint folder"
    )
    missing = f"{official} is not in the local Hugging Face cache"
    if constants.is_offline_mode():
        raise ModelNotFoundError(f"{missing} and HF_HUB_OFFLINE=1; {how}")
    # One bounded probe rather than the hub client's own timeouts and retries.
    if not _hub_reachable():
        raise ModelNotFoundError(f"{missing} and {constants.ENDPOINT} cannot be reached; {how}")
    logger.info("downloading %s", official)
    try:
        folder = Path(snapshot_download(official, allow_patterns=patterns))
        if not _has_weights(folder):  # older repositories ship only pickled weights
            folder = Path(snapshot_download(official, allow_patterns=["pytorch_model*.bin*"]))
    except Exception as e:  # the hub client raises many types (HTTP, connection, disk)
        raise ModelNotFoundError(f"downloading {official} failed ({first_line(e)}); {how}") from e
    return folder


def resolve_model(model: str | os.PathLike) -> tuple[str, Path]:
    """Turn a user's model argument into (display name, local checkpoint folder)."""
    name = str(model)
    if name in organism_names():
        return name, ORGANISM_DIR / name
    path = Path(name).expanduser()
    looks_like_path = isinstance(model, os.PathLike) or "/" in name or os.sep in name
    looks_like_path = looks_like_path or name.startswith((".", "~"))
    if path.exists():
        return path.name or name, path
    official = _hub_names().get(name.lower())
    if official is not None:
        return name, _hub_snapshot(official)
    if looks_like_path:
        raise ModelNotFoundError(f"model folder {name} does not exist; check the path")
    raise UnknownModelError(_unknown_message(name, list(_hub_names()) + organism_names()))


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


# --- config.json and the weights it describes, checked before any weight is read --------------

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
            return value is None or all(_is_int(i) and i >= 0 for i in ids)
        number = _is_int(value) or (self.kind == "number" and isinstance(value, float))
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no layer count


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


def _bloom_config(file: Path, config: dict[str, Any]) -> dict[str, Any] | None:
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
    if model_type == "bloom" and architecture == "BloomForCausalLM":
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


# safetensors' dtype names, as torch names them; the floating ones are what weights may be.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "U8": "uint8", "BOOL": "bool", "C64": "complex64",
}  # fmt: skip
_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4,
    "uint16": 2, "uint8": 1, "bool": 1, "complex64": 8,
}  # fmt: skip
_WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A stored tensor as its file's header declares it: dtype (torch's name) and shape."""

    dtype: str
    shape: tuple[int, ...]


def safetensors_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file declares, read from its header alone (bounded, no mmap).

    The header must be a JSON object whose every tensor has a known dtype, a shape and byte
    offsets that span exactly its shape's bytes, the tensors tiling the data that follows the
    header: a truncated, padded or relabelled-to-another-width file raises here, before
    safetensors or transformers maps it.
    """
    invalid = functools.partial(_invalid_safetensors, file)
    size, length, header = _read_header(file, invalid)
    tensors: dict[str, StoredTensor] = {}
    spans = []
    for name, entry in header.items():
        if name != "__metadata__":
            tensors[name], begin, stop = _header_entry(name, entry, invalid)
            spans.append((begin, stop, name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise invalid(f"tensor {name} overlaps another or leaves a gap before it")
        end = stop
    data = size - 8 - length
    if end > data:
        raise invalid(f"its header declares {end} bytes of tensors but {data} follow: truncated")
    if end < data:
        raise invalid(f"{data - end} bytes follow the {end} bytes of tensors its header declares")
    return tensors


def _invalid_safetensors(file: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{file} is not a valid safetensors file ({why}); re-download or re-export it"
    )


def _read_header(file: Path, invalid: Any) -> tuple[int, int, dict[str, Any]]:
    """The file's size, its header's length and the header, read without mapping the file."""
    inputs.check_regular_file(file, "", error=CheckpointError)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise invalid(f"{size} bytes, shorter than the 8-byte header length")
            length = int.from_bytes(prefix, "little")
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise invalid(f"its header length {length} exceeds the file's {size} bytes")
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"cannot read {file} ({e.strerror or e}); make it readable") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are both
        raise invalid("its header is not JSON") from None
    if not isinstance(header, dict):
        raise invalid("its header is not a JSON object")
    return size, length, header


def _header_entry(name: str, entry: Any, invalid: Any) -> tuple[StoredTensor, int, int]:
    """One tensor of a safetensors header, checked: (tensor, first byte, end byte)."""
    dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and dtype is None:
        raise invalid(f"tensor {name} has dtype {entry['dtype']}, which no weight has")
    shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if dtype else (0, 0)
    if not (
        dtype
        and isinstance(shape, list)
        and all(_is_int(n) and n >= 0 for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(n) for n in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise invalid(f"tensor {name} has no valid dtype, shape and data_offsets")
    nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise invalid(
            f"tensor {name}, {dtype} of shape {shape}, needs {nbytes} bytes but its offsets "
            f"span {offsets[1] - offsets[0]}"
        )
    return StoredTensor(dtype, tuple(shape)), offsets[0], offsets[1]


# The weight files transformers reads, by preference: an index naming the shards, else the files.
_WEIGHT_FORMATS = (
    ("model.safetensors.index.json", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
)


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint folder, in the format transformers prefers.

    safetensors before pickled ``pytorch_model*.bin``; for a sharded checkpoint (an index,
    ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``), the shards its
    ``weight_map`` names, each of which must be in the folder (other files are not weights).
    [] when the folder has none.
    """
    return _weights(directory)[0]


def _weights(directory: Path) -> tuple[list[Path], Path | None, dict[str, str] | None]:
    """:func:`weight_files`, with the shard index they come from and its ``weight_map``."""
    for index_name, pattern in _WEIGHT_FORMATS:
        index = _shard_index(directory / index_name)
        if index is not None:
            files = [directory / name for name in sorted(set(index.values()))]
            return files, directory / index_name, index
        if files := sorted(directory.glob(pattern)):
            return files, None, None
    return [], None, None


def _shard_index(file: Path) -> dict[str, str] | None:
    """A shard index's ``weight_map`` (tensor -> file), checked; None without an index."""
    if not os.path.lexists(file):
        return None
    weight_map = read_json(file).get("weight_map")
    if not (
        isinstance(weight_map, dict)
        and weight_map
        and all(isinstance(v, str) and v and Path(v).name == v for v in weight_map.values())
    ):
        raise CheckpointError(
            f"{file} has no weight_map of tensor names to shard files in its folder; "
            "re-download or re-export the checkpoint"
        )
    missing = sorted(name for name in set(weight_map.values())
                     if not os.path.lexists(file.parent / name))  # fmt: skip
    if missing:
        raise CheckpointError(
            f"{file.parent} lacks the shard {missing[0]}{_more(missing, 'shards')} that "
            f"{file.name} names; re-download or re-export the checkpoint"
        )
    return weight_map


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Name -> :class:`StoredTensor` of every tensor of a checkpoint folder, from the file
    headers only (no weights are read); each file is checked to be a regular file first.

    The files are :func:`weight_files` (safetensors preferred, as transformers prefers them; the
    shards a shard index names). A corrupt file raises, and so does a tensor stored in two
    files or a shard index that names other tensors than its shards hold.
    """
    found: dict[str, StoredTensor] = {}
    files, index_file, index = _weights(directory)
    for file in files:
        if file.suffix == ".safetensors":
            tensors = safetensors_header(file)
        else:  # on the meta device torch reads the pickle, never the tensor data
            tensors = {
                k: StoredTensor(str(v.dtype).removeprefix("torch."), tuple(v.shape))
                for k, v in pickled_tensors(file, map_location="meta").items()
            }
        if twice := sorted(found.keys() & tensors.keys()):
            raise CheckpointError(
                f"{directory}: tensor {twice[0]}{_more(twice)} is stored in {file.name} and in "
                "another weight file; remove the stale file or re-export the checkpoint"
            )
        found |= tensors
    if index is not None and (odd := sorted(index.keys() ^ found.keys())):
        raise CheckpointError(
            f"{index_file} and its shards disagree on {_some(odd)} (each must be "
            "in the shard the index names); re-download or re-export the checkpoint"
        )
    return found


def pickled_tensors(file: Path, **load_args: Any) -> dict[str, torch.Tensor]:
    """The tensors of a pickled ``pytorch_model*.bin``: ``torch.load(file, weights_only=True,
    **load_args)`` of a regular file, a truncated or corrupt one one :class:`CheckpointError`."""
    inputs.check_regular_file(file, "", error=CheckpointError)
    try:
        state = torch.load(file, weights_only=True, **load_args)
    except Exception as e:  # torch raises OSError, RuntimeError, EOFError, UnpicklingError
        raise CheckpointError(_corrupt_bin(file.parent)) from e
    if not isinstance(state, dict):
        raise CheckpointError(_corrupt_bin(file.parent))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


# The files of a checkpoint folder that transformers, safetensors or headsurgeon may open, and
# how large each can plausibly be; weights are bounded by their headers instead.
_SIDE_FILES = {
    "config.json": inputs.MAX_JSON_BYTES,
    "generation_config.json": inputs.MAX_JSON_BYTES,
    "model.safetensors.index.json": inputs.MAX_JSON_BYTES,
    "pytorch_model.bin.index.json": inputs.MAX_JSON_BYTES,
    "added_tokens.json": inputs.MAX_JSON_BYTES,
    "chat_template.json": inputs.MAX_JSON_BYTES,
    "chat_template.jinja": inputs.MAX_JSON_BYTES,
    "tokenizer.model": inputs.MAX_TEXT_BYTES,
    "spiece.model": inputs.MAX_TEXT_BYTES,
    "sentencepiece.bpe.model": inputs.MAX_TEXT_BYTES,
    "vocab.txt": inputs.MAX_TEXT_BYTES,
}
_WEIGHT_PATTERNS = tuple(pattern for _, pattern in _WEIGHT_FORMATS)


def _check_files(directory: Path) -> None:
    """One line for any file of the folder that will be opened and is not a readable regular
    file of plausible size: a FIFO would block transformers for ever, /dev/zero fill memory."""
    bounds = dict(_SIDE_FILES)
    bounds[METADATA_FILE] = inputs.MAX_JSON_BYTES
    bounds |= dict.fromkeys(TOKENIZER_FILES, inputs.MAX_TEXT_BYTES)  # BLOOM's is 14 MB
    bounds |= {p.name: None for pattern in _WEIGHT_PATTERNS for p in directory.glob(pattern)}
    for name, max_bytes in bounds.items():
        path = directory / name
        if os.path.lexists(path):  # a dangling symlink or a FIFO counts as present
            inputs.check_regular_file(path, "", max_bytes=max_bytes, error=CheckpointError)


def _corrupt_bin(directory: Path) -> str:
    return (
        f"the PyTorch weights (*.bin) in {directory} are truncated or corrupt; "
        "re-download the checkpoint or re-export it as safetensors"
    )


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
            f"{directory} lacks {_some(missing)} that {file} needs; "
            "re-download or re-export the checkpoint"
        )
    if unused := sorted(found.keys() - expected.keys()):
        raise CheckpointError(
            f"{directory} holds {_some(unused)} that {file} leaves unused; "
            "correct config.json or re-export the checkpoint"
        )


def _check_bloom_tensors(
    directory: Path, config: dict[str, Any], bloom: dict[str, Any], found: dict[str, StoredTensor]
) -> None:
    """:func:`_check_bloom_weights`, then the dtypes: every BLOOM weight is floating point, and
    of the dtype config.json states (``dtype`` or ``torch_dtype``), else of one dtype."""
    _check_bloom_weights(directory, bloom, {k: t.shape for k, t in found.items()})
    file = directory / "config.json"
    if odd := sorted(k for k, t in found.items() if t.dtype not in _WEIGHT_DTYPES):
        raise CheckpointError(
            f"{directory}: tensor {odd[0]} is {found[odd[0]].dtype}{_more(odd)}, not floating "
            "point (float16, bfloat16 or float32): a relabelled or corrupt header; re-download "
            "or re-export the checkpoint"
        )
    stated = [(k, config[k]) for k in ("dtype", "torch_dtype") if config.get(k) is not None]
    for key, value in stated:
        if not (isinstance(value, str) and value.removeprefix("torch.") in _WEIGHT_DTYPES):
            raise CheckpointError(
                f"{file}: {key} is {json.dumps(value)}, expected one of "
                f"{', '.join(_WEIGHT_DTYPES)} or null; correct it or re-export the checkpoint"
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
            f"{directory}: tensor {wrong[0]} is {found[wrong[0]].dtype}{_more(wrong)} but "
            f"{source} {want}: a relabelled or corrupt header, or a wrong config; re-download or "
            "re-export the checkpoint"
        )


def _more(names: list[str], what: str = "tensors") -> str:
    return f" ({len(names) - 1} more {what} too)" if len(names) > 1 else ""


def _some(names: list[str], shown: int = 3) -> str:
    """``n weight(s): a, b, c and k more``: a few names, then a count."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} weight(s): {', '.join(names[:shown])}{more}"


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
    _checked_folder(directory)


def _checked_folder(directory: Path) -> dict[str, Any]:
    """:func:`check_checkpoint`, returning the folder's checked ``headsurgeon.json`` ({})."""
    if not directory.is_dir():
        raise ModelNotFoundError(f"{directory} is not a folder; pass a checkpoint folder")
    file = directory / "config.json"
    if not os.path.lexists(file):
        raise CheckpointError(
            f"{directory} has no config.json; pass a Hugging Face checkpoint folder "
            "(config.json, *.safetensors, tokenizer files)"
        )
    _check_files(directory)
    config = read_json(file)
    bloom = _bloom_config(file, config)
    metadata = _folder_metadata(directory)
    if bloom is not None:
        _check_training(directory, bloom, metadata)
    if not _has_weights(directory):
        raise CheckpointError(
            f"{directory} has no weights (*.safetensors); re-export or re-download"
        )
    found = stored_tensors(directory)
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        tl_config(Path(tmp), source=file)  # errors name the user's file, not this copy
    if bloom is not None:
        _check_bloom_tensors(directory, config, bloom, found)
    return metadata


# --- headsurgeon.json: one schema ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Value:
    """What one ``headsurgeon.json`` field may hold. ``fields``: a dict's known fields;
    ``closed``: other fields refused (settings that would be ignored); ``each``: every value."""

    kind: str  # "int", "number", "bool", "str", "list" or "dict"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    nullable: bool = False
    fields: dict[str, _Value] | None = None
    closed: bool = False
    each: _Value | None = None

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.kind in ("int", "number"):
            number = _is_int(value) or (self.kind == "number" and isinstance(value, float))
            return number and math.isfinite(value) and self._in_range(value)
        types = {"bool": bool, "str": str, "list": list, "dict": dict}
        return isinstance(value, types[self.kind])

    def _in_range(self, value: float) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return low_ok and (self.high is None or value <= self.high)

    def describe(self) -> str:
        what = {
            "int": "an integer", "number": "a finite number", "bool": "true or false",
            "str": "a string", "list": "a list", "dict": "an object",
        }[self.kind]  # fmt: skip
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"<= {self.high:g}")
        what += f" {' and '.join(bounds)}" if bounds else ""
        if self.kind == "dict" and self.closed and self.fields:
            what += f" with only {', '.join(self.fields)}"
        return what + (" or null" if self.nullable else "")


_COUNT = _Value("int", low=1)
_STEPS = _Value("int", low=0)
# What the tools read (prepend_bos, training's sizes and seq_len, repair, alibi), and what
# analyses/train_organism.py, plant_injuries.py and save_hf write.
_METADATA = _Value(
    "dict",
    fields={
        "name": _Value("str"),
        "description": _Value("str"),
        "exported_from": _Value("str"),
        "prepend_bos": _Value("bool", nullable=True),
        "alibi": _Value("dict"),  # checked by exact_alibi.trained_bias
        "training": _Value(
            "dict",
            fields={
                "seq_len": _COUNT,
                "config": _Value(
                    "dict",
                    fields={
                        "n_layer": _COUNT,
                        "n_head": _COUNT,
                        "hidden_size": _COUNT,
                        "vocab_size": _COUNT,
                        "seq_len": _COUNT,
                        "batch": _COUNT,
                        "parameters": _COUNT,
                        "warmup_steps": _STEPS,
                        "peak_lr": _Value("number", low=0, low_open=True),
                        "weight_decay": _Value("number", low=0),
                        "retrieval_share": _Value("number", low=0, high=1),
                    },  # fmt: skip
                ),
                "steps": _STEPS,
                "planned_steps": _STEPS,
                "tokens_seen": _STEPS,
                "seed": _Value("int"),
                "minutes": _Value("number", low=0),
                "max_bos_mass": _Value("number", low=0, high=1),
                "final_heldout_loss": _Value("dict", each=_Value("number")),
            },
        ),
        # recommended_config applies these two; any other setting would be silently ignored.
        "repair": _Value(
            "dict",
            closed=True,
            fields={"steps": _COUNT, "lr": _Value("number", low=0, high=1, low_open=True)},
        ),
        "corpus": _Value("list"),
        "injuries": _Value("list"),
    },
)
# training.config sizes that config.json must repeat: n_head 8 over weights trained with 16
# heads keeps every tensor's shape, so only this record can tell.
_TRAINED_SIZES = ("n_layer", "n_head", "hidden_size", "vocab_size")


def check_metadata(data: Any, path: str | os.PathLike) -> dict[str, Any]:
    """``data`` (a ``headsurgeon.json``'s contents) if every known field has its type and range.

    Known fields: ``name``, ``description``, ``exported_from`` (strings); ``prepend_bos``
    (true, false or null); ``alibi`` (the trained ALiBi variant, see
    :func:`~headsurgeon.exact_alibi.trained_bias`); ``training`` (``seq_len``, ``steps``,
    ``seed``, ... and ``config`` with the sizes trained, ``n_layer``, ``n_head``, ...);
    ``repair`` (``steps`` >= 1 and ``lr`` in (0, 1], the only settings a model recommends);
    ``corpus`` and ``injuries`` (lists). Other fields are accepted and kept, as a record for
    people and other tools; one that looks like a misspelt known field is logged as a warning.
    A bad value is one :class:`CheckpointError` naming ``path`` and the field, e.g.
    ``…/headsurgeon.json: repair.steps is -5; it must be an integer >= 1``.

    >>> check_metadata({"repair": {"steps": 300, "lr": 2e-3}}, "headsurgeon.json")
    {'repair': {'steps': 300, 'lr': 0.002}}
    >>> check_metadata({"prepend_bos": "yes"}, "m/headsurgeon.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    headsurgeon.errors.CheckpointError: m/headsurgeon.json: prepend_bos is "yes"; it must be ...
    """
    _check_value(data, _METADATA, "", str(path))
    if data.get("alibi") is not None:
        try:
            trained_bias(data)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: alibi: {first_line(e)}") from None
    return data


def _check_value(value: Any, spec: _Value, field: str, path: str) -> None:
    shown = field or "the file"
    if not spec.accepts(value):
        try:
            text = json.dumps(value, allow_nan=True)
        except (TypeError, ValueError):
            text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        raise CheckpointError(
            f"{path}: {shown} is {text}; it must be {spec.describe()}; correct the file or "
            "remove the field"
        )
    if not isinstance(value, dict):
        return
    known = spec.fields or {}
    for key, item in value.items():
        name = f"{field}.{key}" if field else str(key)
        if key in known:
            _check_value(item, known[key], name, path)
        elif spec.each is not None:
            _check_value(item, spec.each, name, path)
        elif spec.closed:
            raise CheckpointError(
                f"{path}: {name} is not a setting a model recommends (only "
                f"{', '.join(known)}), so it would be ignored; remove it"
            )
        elif close := difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.8):
            logger.warning("%s: unknown field %s is kept but not used; did you mean %s?",
                           path, name, close[0])  # fmt: skip


def _folder_metadata(directory: Path) -> dict[str, Any]:
    """The folder's ``headsurgeon.json``, read bounded and checked; ``{}`` without one."""
    file = directory / METADATA_FILE
    if not os.path.lexists(file):
        return {}
    return check_metadata(read_json(file), file)


def _check_training(directory: Path, bloom: dict[str, Any], metadata: dict[str, Any]) -> None:
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


def load_model(
    model: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    device_map: str | dict[str, int | str] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    allow_nonfinite: bool = False,
) -> Model:
    """Load a model with unprocessed weights and exact ALiBi.

    A ``HookedTransformer`` on TransformerLens 3.x, a ``TransformerBridge`` on 4.x.

    ``model`` is a bundled organism (``organism``, ``organism-injured``), a TransformerLens
    name or alias (``bloom-560m``, ``bigscience/bloom-560m``; from the Hugging Face cache, else
    downloaded; ``HF_HUB_OFFLINE=1`` respected), or a local Hugging Face checkpoint folder (never
    touches the network). Files are read as safetensors (``torch.load(weights_only=True)`` for
    legacy ``.bin``); remote code is never trusted.

    The folder is checked first (:func:`check_checkpoint`: regular files, config against the
    weights' shapes and dtypes, ``headsurgeon.json``). Weights that hold NaN or infinity are
    refused in one :class:`CheckpointError` line naming a few of the tensors (a census would
    report their heads as dead); ``allow_nonfinite=True`` loads them with a warning instead,
    to inspect a broken model.

    ``device`` (default cpu) puts the whole model on one device; ``device_map``, ``max_memory``
    and ``offload_folder`` spread it over GPUs, CPU memory and disk with Hugging Face Accelerate,
    as :mod:`headsurgeon.placement` describes (a model larger than the memory given to it, on
    TransformerLens 4.x).
    """
    torch_dtype = parse_dtype(dtype)
    placement = check_placement(device_map, max_memory, offload_folder, device)
    torch_device = parse_device(device if device is not None else "cpu")
    allow_nonfinite = check_bool(allow_nonfinite, "allow_nonfinite")
    name, directory = resolve_model(model)
    metadata = _checked_folder(directory)
    # 4.x reads the checkpoint straight into the map; 3.x dispatches the model it built.
    if placement and MAJOR >= 4:
        streamed, folder = from_pretrained_args(placement, directory)
    else:
        streamed, folder = {}, None
    try:
        loaded = _load_folder(directory, name, metadata, torch_dtype, allow_nonfinite, streamed)
    except BaseException:
        if folder is not None:  # ours, made above; the model it was for never came
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if folder is not None:
        return adopt(loaded, folder)
    if placement is not None:
        return dispatch(loaded, placement)
    return backend.move(loaded, torch_device)


def _load_folder(
    directory: Path,
    name: str,
    metadata: dict[str, Any],
    torch_dtype: torch.dtype,
    allow_nonfinite: bool,
    streamed: dict[str, Any],
) -> Model:
    """The checked folder's model (``streamed``: from_pretrained's placement arguments)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Reading local weights takes well under a second; its progress bar is only noise.
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        hf_model, loading = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=torch_dtype,
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
            **streamed,
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"transformers could not load {directory} ({first_line(e)}); "
            "re-download or re-export the checkpoint"
        ) from e
    except (EOFError, pickle.UnpicklingError) as e:  # legacy .bin: torch's unpickler
        raise CheckpointError(_corrupt_bin(directory)) from e
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    # transformers fills missing or misshapen tensors with random values and ignores unused ones,
    # and only logs it. check_checkpoint has compared a BLOOM's tensors already; this covers the
    # other architectures.
    bad = sorted(loading["missing_keys"]) + sorted(str(k) for k in loading["mismatched_keys"])
    if bad:
        raise CheckpointError(
            f"{directory} lacks or misshapes {_some(bad)}; re-download or re-export the checkpoint"
        )
    if unused := sorted(loading["unexpected_keys"]):
        raise CheckpointError(
            f"{directory} holds {_some(unused)} that its config.json leaves unused; "
            "correct config.json or re-export the checkpoint"
        )
    _check_finite(hf_model, directory, allow_nonfinite)
    tokenizer = None
    if any((directory / f).exists() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as e:  # JSON, tokenizers (Rust) and sentencepiece errors alike
            raise CheckpointError(
                f"the tokenizer files in {directory} are unreadable ({first_line(e)}); "
                "re-export the tokenizer, or remove its files to load the weights alone"
            ) from e
    return from_hf_model(
        hf_model,
        tokenizer,
        name=name,
        source=directory,
        prepend_bos=metadata.get("prepend_bos"),
        # analyses/train_organism.py records it under training.config.seq_len
        train_ctx=metadata.get("training", {}).get(
            "seq_len", metadata.get("training", {}).get("config", {}).get("seq_len")
        ),
        metadata=metadata,
    )


def _check_finite(hf_model: Any, directory: Path, allow: bool) -> None:
    """Refuse (or, with ``allow``, warn about) weights holding NaN or infinity: one pass over the
    weights, module by module (offloaded ones loaded one module at a time), in slices so that no
    temporary is larger than 16 M elements."""
    bad = []
    weights = {name for name, _ in hf_model.named_parameters()}  # a tied weight once
    weights |= {name for name, _ in hf_model.named_buffers()}
    for prefix, module in hf_model.named_modules():
        with backend.resident(module, recurse=False):
            own = [*module.named_parameters(prefix, recurse=False)]
            own += module.named_buffers(prefix, recurse=False)
            for name, tensor in own:
                if name not in weights or not tensor.is_floating_point():
                    continue
                flat = tensor.detach().reshape(-1)
                if not all(bool(torch.isfinite(part).all()) for part in flat.split(1 << 24)):
                    bad.append(name)
    if not bad:
        return
    message = f"{directory} holds NaN or infinite values in {_some(bad)}"
    if not allow:
        raise CheckpointError(
            f"{message}; re-export or re-train the checkpoint, or pass allow_nonfinite=True to "
            "load_model to inspect it"
        )
    warnings.warn(f"{message}; the tools' numbers for it are NaN or meaningless", stacklevel=3)


def from_hf_model(
    hf_model: Any,
    tokenizer: Any = None,
    *,
    name: str = "model",
    source: Path | None = None,
    prepend_bos: bool | None = None,
    train_ctx: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> Model:
    """An in-memory ``transformers`` causal LM as the installed TransformerLens's model.

    Weights unprocessed; on TransformerLens 4.x the bridge wraps ``hf_model`` itself.
    ``metadata`` (a ``headsurgeon.json``'s contents) is checked by :func:`check_metadata`.
    """
    label = source / METADATA_FILE if source is not None else "metadata="
    metadata = check_metadata(metadata, label) if metadata else {}
    hf_config = hf_model.config.to_dict()
    model = backend.convert_hf(hf_model, tokenizer, name=name, prepend_bos=prepend_bos)
    model.headsurgeon_info = ModelInfo(
        name=name,
        source=source,
        prepend_bos=bool(model.cfg.default_prepend_bos),
        train_ctx=train_ctx,
        hf_config=hf_config,
        metadata=metadata or {},
        tokenizer=tokenizer,
    )
    if model.cfg.positional_embedding_type == "alibi":
        kind, params = trained_bias(metadata or {})
        install_exact_alibi(model, kind, **params)
        _warn_ignored_bias_max(hf_config)
    model.eval()
    return model


def _warn_ignored_bias_max(hf_config: dict[str, Any]) -> None:
    """Warn when an MPT config asks for slopes transformers does not apply."""
    bias_max = (hf_config.get("attn_config") or {}).get("alibi_bias_max", 8)
    if hf_config.get("model_type") == "mpt" and bias_max != 8:
        warnings.warn(
            f"the MPT config sets attn_config.alibi_bias_max={bias_max}, but transformers' "
            "MptModel applies the ALiBi slopes of alibi_bias_max=8 (it never passes the config's "
            "value); headsurgeon measures what transformers computes, with those slopes",
            stacklevel=3,
        )


def model_info(model: Model) -> ModelInfo:
    """The :class:`ModelInfo` of a model: where it came from and its conventions.

    Models loaded here carry theirs; for any other model one is made from its config
    and tokenizer at each call, and nothing is stored on the model. ``prepend_bos`` is always read
    from ``model.cfg.default_prepend_bos``, so changing that setting takes effect at once.
    """
    backend.check_model(model, "model_info")
    info = getattr(model, "headsurgeon_info", None)
    prepend_bos = bool(model.cfg.default_prepend_bos)
    if info is None:
        return ModelInfo(
            name=model.cfg.model_name,
            source=None,
            prepend_bos=prepend_bos,
            train_ctx=None,
            hf_config=backend.hf_config(model),
            tokenizer=model.tokenizer,
        )
    return dataclasses.replace(info, prepend_bos=prepend_bos)


def random_hf_bloom(shape: ModelShape | str, *, seed: int = 0, dtype: str = "float32") -> Any:
    """A ``transformers`` BLOOM with random weights (its own initialisation) of a given shape."""
    from transformers import BloomConfig, BloomForCausalLM

    if isinstance(shape, str):
        shape = model_shape(shape)
    config = BloomConfig(
        vocab_size=shape.d_vocab,
        hidden_size=shape.d_model,
        n_layer=shape.n_layers,
        n_head=shape.n_heads,
        seq_length=shape.n_ctx,
        architectures=["BloomForCausalLM"],
    )
    torch.manual_seed(seed)
    return BloomForCausalLM(config).to(parse_dtype(dtype)).eval()


def random_model(shape: ModelShape | str, *, seed: int = 0, dtype: str = "float32") -> Model:
    """A BLOOM TransformerLens model with random weights of a given or named shape."""
    hf_model = random_hf_bloom(shape, seed=seed, dtype=dtype)
    cfg = hf_model.config
    return from_hf_model(hf_model, name=f"random-{cfg.n_layer}x{cfg.n_head}x{cfg.hidden_size}")
