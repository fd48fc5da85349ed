"""The files of a checkpoint folder, checked and read without reading a weight.

Every file that will be opened is first checked to be a readable regular file of plausible size
(a FIFO would block transformers for ever, ``/dev/zero`` fill memory), and a corrupt one is one
:class:`~headsurgeon.errors.CheckpointError` line naming it and the fix. The weights' headers tell
the folder's tensors before any of their bytes are read (:mod:`headsurgeon.loading.checks`
compares them with ``config.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from headsurgeon import inputs
from headsurgeon.errors import CheckpointError

__all__ = [
    "read_json",
]


METADATA_FILE = "headsurgeon.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file, which must be a regular file of at most
    :data:`~headsurgeon.inputs.MAX_JSON_BYTES` holding one JSON object (else one
    :class:`CheckpointError` line that begins with the path)."""
    return inputs.read_json(path, "", error=CheckpointError, fix="re-export the checkpoint")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no layer count


# safetensors' dtype names, as torch names them; the floating ones are what weights may be.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
}
_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}
WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")
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
        if name == "__metadata__":
            _check_header_metadata(entry, invalid)
        else:
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


def _check_header_metadata(metadata: Any, invalid: Any) -> None:
    """A header's ``__metadata__`` is a string-to-string map (safetensors refuses anything else
    with a traceback of its own)."""
    if not isinstance(metadata, dict):
        raise invalid(f"its __metadata__ is {type(metadata).__name__}, not a string-to-string map")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise invalid(
                f"its __metadata__ field {key!r} holds {json.dumps(value)[:40]}, not a string"
            )


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
        and all(is_int(n) and n >= 0 for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(is_int(n) for n in offsets)
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
    missing = sorted(
        name for name in set(weight_map.values()) if not os.path.lexists(file.parent / name)
    )
    if missing:
        raise CheckpointError(
            f"{file.parent} lacks the shard {missing[0]}{more_names(missing, 'shards')} that "
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
                f"{directory}: tensor {twice[0]}{more_names(twice)} is stored in {file.name} and "
                "in another weight file; remove the stale file or re-export the checkpoint"
            )
        found |= tensors
    if index is not None and (odd := sorted(index.keys() ^ found.keys())):
        raise CheckpointError(
            f"{index_file} and its shards disagree on {some_names(odd)} (each must be "
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
        raise CheckpointError(corrupt_bin(file.parent)) from e
    if not isinstance(state, dict):
        raise CheckpointError(corrupt_bin(file.parent))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


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


def check_files(directory: Path) -> None:
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


def corrupt_bin(directory: Path) -> str:
    return (
        f"the PyTorch weights (*.bin) in {directory} are truncated or corrupt; "
        "re-download the checkpoint or re-export it as safetensors"
    )


def more_names(names: list[str], what: str = "tensors") -> str:
    return f" ({len(names) - 1} more {what} too)" if len(names) > 1 else ""


def some_names(names: list[str], shown: int = 3) -> str:
    """``n weight(s): a, b, c and k more``: a few names, then a count."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} weight(s): {', '.join(names[:shown])}{more}"
