"""The facts the tools need about a model: its shape, where it came from, its conventions.

Exports:
    model_shape(model)      ModelShape of a model, a BLOOM name (no weights needed), a bundled
                            organism or a checkpoint folder (validated, weights unread)
    model_info(model)       ModelInfo: name, source folder, BOS convention, training context
    model_metadata(model)   a model's or folder's headsurgeon.json, weights unread
    BLOOM_SHAPES            the published BLOOM configurations by name

>>> model_shape("bloom-560m").n_layers, model_shape("bigscience/bloom-560m").d_model
(24, 1024)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from headsurgeon import backend
from headsurgeon.backend import Model
from headsurgeon.errors import (
    CheckpointError,
    UnknownModelError,
    UnsupportedArchitectureError,
    first_line,
)
from headsurgeon.loading.checks import _bloom_config, _check_bloom_tensors, _check_training
from headsurgeon.loading.files import _check_files, _has_weights, _is_int, read_json, stored_tensors
from headsurgeon.loading.metadata import _folder_metadata
from headsurgeon.loading.sources import ORGANISM_DIR, _unknown_message, organism_names

__all__ = [
    "BLOOM_SHAPES",
    "ModelInfo",
    "ModelShape",
    "model_info",
    "model_metadata",
    "model_shape",
]


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
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_model,
            cfg.d_vocab,
            n_ctx,
            cfg.positional_embedding_type,
            family if family in ("mpt", "falcon") else "bloom",
        )
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


def model_metadata(model: str | os.PathLike | Model) -> dict[str, Any]:
    """The ``headsurgeon.json`` of a model, a bundled organism or a local folder (no weights
    read), checked by :func:`check_metadata`; ``{}`` for a hub name or a folder without one."""
    if isinstance(model, Model):
        return model_info(model).metadata
    name = str(model)
    folder = ORGANISM_DIR / name if name in organism_names() else Path(name)
    return _folder_metadata(folder) if folder.is_dir() else {}


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
        sizes = [
            hf.num_hidden_layers,
            hf.num_attention_heads,
            hf.hidden_size,
            hf.vocab_size,
            hf.max_seq_len if family == "mpt" else hf.max_position_embeddings,
        ]
    except Exception as e:  # transformers' validation: TypeError, ValueError, its own errors
        raise CheckpointError(f"{file}: {first_line(e)}; correct it or re-export it") from e
    if not all(_is_int(size) and size > 0 for size in sizes) or sizes[2] % sizes[1]:
        raise CheckpointError(
            f"{file}: layers, heads, width, vocabulary and context {sizes} are not positive "
            "integers with the width a multiple of the heads; correct it or re-export it"
        )
    alibi = family == "mpt" or bool(hf.alibi)  # transformers' MPT always applies ALiBi
    return ModelShape(*sizes, positional="alibi" if alibi else "rotary", family=family)
