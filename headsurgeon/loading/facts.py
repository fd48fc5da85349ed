"""The facts the tools need about a model: its shape, where it came from, its conventions.

>>> model_shape("bloom-560m").n_layers, model_shape("bigscience/bloom-560m").d_model
(24, 1024)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from jaxtyping import Float
from torch import Tensor

from headsurgeon import backend, families, long_context
from headsurgeon.backend import Model
from headsurgeon.errors import (
    CheckpointError,
    UnknownModelError,
    UnsupportedArchitectureError,
    first_line,
)
from headsurgeon.loading.checks import bloom_config, check_bloom_tensors, check_training
from headsurgeon.loading.files import check_files, has_weights, is_int, read_json, stored_tensors
from headsurgeon.loading.metadata import folder_metadata
from headsurgeon.loading.numerics import TrainingNumerics, training_numerics
from headsurgeon.loading.sources import organism_names
from headsurgeon.model_names import ORGANISM_DIR, unknown_message

__all__ = [
    "ALIBI_SHAPES",
    "BLOOM_SHAPES",
    "ModelInfo",
    "ModelShape",
    "applied_slopes",
    "model_info",
    "model_shape",
]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that weight-free analyses need; ``family`` says whose ALiBi an ALiBi model
    applies (a ``model_type`` of :data:`headsurgeon.families.FAMILIES`: ``bloom``, ``mpt`` or
    ``falcon``; :attr:`alibi_family` is its class)."""

    n_layers: int
    n_heads: int
    d_model: int
    d_vocab: int
    n_ctx: int
    positional: str = "alibi"
    family: str = families.BLOOM.name

    @property
    def alibi_family(self) -> families.AlibiFamily:
        """The family's class (:mod:`headsurgeon.families`): its slopes, bias, layout."""
        return families.family_named(self.family)


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
# Published ALiBi models of the other families (their Hugging Face config.json), so that the
# weight-free analyses run on them by name. MPT-7B: max_seq_len 2048, alibi_bias_max 8 (the
# value transformers applies anyway); Falcon-RW: alibi true, 2048 positions, d_head 64.
ALIBI_SHAPES: dict[str, ModelShape] = {
    "mpt-7b": ModelShape(32, 32, 4096, 50432, 2048, family=families.MPT.name),
    "falcon-rw-1b": ModelShape(24, 32, 2048, 50304, 2048, family=families.FALCON.name),
    "falcon-rw-7b": ModelShape(36, 71, 4544, 65024, 2048, family=families.FALCON.name),
}
_ALIBI_OFFICIAL = {
    "mosaicml/mpt-7b": "mpt-7b",
    "tiiuae/falcon-rw-1b": "falcon-rw-1b",
    "tiiuae/falcon-rw-7b": "falcon-rw-7b",
}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The one record of what the tools need to know about a model, made at a verb's door.

    ``info = model_info(model, "run_census")`` checks the model once and returns this record;
    everything below the door reads its fields instead of asking the model again.

    Where the model came from (fixed when it was loaded): ``name``, ``source`` (its folder),
    ``train_ctx`` (the sequence length it was trained on, when known: bundled organisms record
    it), ``hf_config`` (its Hugging Face config; ``{}`` for a TransformerLens 3.x model built from
    a TransformerLens config), ``metadata`` (its ``headsurgeon.json``), ``tokenizer`` (the
    checkpoint's own, else TransformerLens's, else ``None``).

    Read from the model at each :func:`model_info` call, because they change with its settings:
    ``shape`` (:class:`ModelShape`), ``slopes`` (the ALiBi slopes it applies per token of
    distance, float32, after headsurgeon's exact-slope hook if installed; ``None`` without
    ALiBi), ``max_length`` (the longest sequence it takes: ``None`` for ALiBi, whose ``n_ctx``
    is nominal, else ``cfg.n_ctx``), ``prepend_bos`` (its position-0 convention,
    ``cfg.default_prepend_bos``; BLOOM: no BOS token) and ``bos_token_id`` (``None`` without a
    tokenizer or a BOS token). ``transformer_lens``: the TransformerLens major it runs on
    (``"TransformerLens 3.x"``); what differs between majors is asked of
    :mod:`headsurgeon.backend` by name. ``training_numerics``: how its attention was computed in
    training (:class:`~headsurgeon.loading.numerics.TrainingNumerics`: its ``headsurgeon.json``,
    else the published table by name; ``None``: unknown).
    """

    name: str
    source: Path | None
    train_ctx: int | None
    hf_config: dict[str, Any]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Any = None
    shape: ModelShape | None = None
    slopes: Tensor | None = None
    max_length: int | None = None
    prepend_bos: bool = False
    bos_token_id: int | None = None
    transformer_lens: str = backend.TRANSFORMER_LENS
    training_numerics: TrainingNumerics | None = None

    @property
    def is_alibi(self) -> bool:
        """Whether the model adds an ALiBi bias (its ``slopes`` are then known)."""
        return self.slopes is not None


def model_shape(model: str | os.PathLike | Model) -> ModelShape:
    """Shape of a model, a BLOOM, MPT-7B or Falcon-RW name (no weights needed), a bundled
    organism or a folder.

    >>> model_shape("bloom-176b").n_heads
    112
    """
    if isinstance(model, Model):
        return model_info(model, "model_shape").shape
    name = str(model)
    key = name.lower()
    if key in BLOOM_SHAPES:
        return BLOOM_SHAPES[key]
    if key in _BLOOM_OFFICIAL:
        return BLOOM_SHAPES[_BLOOM_OFFICIAL[key]]
    if key in ALIBI_SHAPES or key in _ALIBI_OFFICIAL:
        return ALIBI_SHAPES[_ALIBI_OFFICIAL.get(key, key)]
    if name in organism_names():
        return _local_shape(ORGANISM_DIR / name)
    if Path(name).is_dir() and os.path.lexists(Path(name) / "config.json"):
        return _local_shape(Path(name))
    known = [*BLOOM_SHAPES, *ALIBI_SHAPES, *organism_names()]
    raise UnknownModelError(unknown_message(name, known))


def model_metadata(model: str | os.PathLike | Model) -> dict[str, Any]:
    """The ``headsurgeon.json`` of a model, a bundled organism or a local folder (no weights
    read), checked by :func:`check_metadata`; ``{}`` for a hub name or a folder without one."""
    if isinstance(model, Model):
        return model_info(model, "model_metadata").metadata
    name = str(model)
    folder = ORGANISM_DIR / name if name in organism_names() else Path(name)
    return folder_metadata(folder) if folder.is_dir() else {}


def model_info(
    model: Model, caller: str = "model_info", *, writes: bool = False, argument: str = "model"
) -> ModelInfo:
    """The :class:`ModelInfo` of ``model``, after checking that it is a usable model: the door
    of every verb (``caller`` names the verb and ``argument`` the parameter in the one-line
    error; ``writes``: the verb changes weights, see :func:`headsurgeon.backend.check_model`).

    Models loaded here carry the fields fixed at loading; for any other model they are made
    from its config and tokenizer, and nothing is stored on the model. The fields that follow
    the model's settings are read again at each call, so ``model.cfg.default_prepend_bos =
    True`` or :func:`~headsurgeon.loading.use_exact_alibi` take effect at once.

    >>> from headsurgeon.loading import random_model
    >>> info = model_info(random_model(ModelShape(1, 6, 24, 9, n_ctx=8)))
    >>> [round(x, 4) for x in info.slopes.tolist()], info.max_length, info.prepend_bos
    ([0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125], None, False)
    """
    backend.check_model(model, caller, writes=writes, argument=argument)
    loaded = getattr(model, "headsurgeon_info", None)
    if loaded is None:
        loaded = ModelInfo(
            name=model.cfg.model_name,
            source=None,
            train_ctx=None,
            hf_config=backend.hf_config(model),
            tokenizer=model.tokenizer,
        )
    tokenizer = loaded.tokenizer or model.tokenizer
    cfg = model.cfg
    is_alibi = cfg.positional_embedding_type == "alibi"
    return dataclasses.replace(
        loaded,
        tokenizer=tokenizer,
        shape=_shape(cfg, loaded.hf_config),
        slopes=applied_slopes(model, loaded.hf_config) if is_alibi else None,
        max_length=long_context.max_length(model),
        prepend_bos=bool(cfg.default_prepend_bos),
        bos_token_id=None if tokenizer is None else tokenizer.bos_token_id,
        training_numerics=training_numerics(loaded.name, loaded.metadata),
    )


def applied_slopes(model: Model, hf_config: dict[str, Any]) -> Float[Tensor, " head_index"]:
    """The ALiBi slopes an ALiBi ``model`` applies (float32): the one place that decides which
    formula of :mod:`headsurgeon.alibi` holds.

    With headsurgeon's exact-slope hook (every model from :func:`load_model`, and after
    :func:`use_exact_alibi`), or where the backend's attention applies the slopes of the
    model's Hugging Face config by itself (TransformerLens 4.x), they are the slopes
    transformers applies for the checkpoint (:func:`headsurgeon.families.transformers_slopes`:
    its family's, BLOOM's for a 3.x model built without a config); otherwise those
    TransformerLens 3.x builds (``2^(-8(h+1)/H)`` for every head count, exact only for powers of
    two: :func:`headsurgeon.backend.own_alibi_slopes`).
    """
    hooked = getattr(model.blocks[0].attn, "headsurgeon_alibi_hook", None) is not None
    own = None if hooked else backend.own_alibi_slopes(model.cfg.n_heads)
    if own is not None:
        return own
    return families.transformers_slopes(hf_config, model.cfg.n_heads)


def _shape(cfg: Any, hf_config: dict[str, Any]) -> ModelShape:
    """The shape of the model whose TransformerLens config is ``cfg``."""
    # TransformerLens sets n_ctx = 2048 for every BLOOM; the checkpoint's own value wins.
    # A model of no ALiBi family (GPT-2, ...) has BLOOM's, which its positions never use.
    family = families.FAMILIES.get(hf_config.get("model_type"), families.BLOOM)
    return ModelShape(
        cfg.n_layers,
        cfg.n_heads,
        cfg.d_model,
        cfg.d_vocab,
        hf_config.get("seq_length", cfg.n_ctx),
        cfg.positional_embedding_type,
        family.name,
    )


def _local_shape(directory: Path) -> ModelShape:
    """A folder's shape from its validated config, checked against its weights when present."""
    check_files(directory)
    file = directory / "config.json"
    config = read_json(file)
    family = families.FAMILIES.get(config.get("model_type"))
    if family is not None and family.reads_config_class:
        return _config_shape(file, config, family)
    bloom = bloom_config(file, config)
    if bloom is None:
        raise UnsupportedArchitectureError(
            f"{file} is not a BLOOM, MPT or Falcon config and shapes by folder are known for "
            "BLOOM, MPT and Falcon only; pass the loaded model (load_model) instead"
        )
    check_training(directory, bloom, folder_metadata(directory))
    if has_weights(directory):
        check_bloom_tensors(directory, config, bloom, stored_tensors(directory))
    return ModelShape(
        n_layers=bloom["n_layer"],
        n_heads=bloom["n_head"],
        d_model=bloom["hidden_size"],
        d_vocab=bloom["vocab_size"],
        n_ctx=bloom["seq_length"],
    )


def _config_shape(file: Path, config: dict[str, Any], family: families.AlibiFamily) -> ModelShape:
    """An MPT or Falcon config's shape, its values checked by its transformers config class."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.for_model(**config)
        sizes = [
            hf.num_hidden_layers,
            hf.num_attention_heads,
            hf.hidden_size,
            hf.vocab_size,
            getattr(hf, family.context_field),
        ]
    except Exception as e:  # transformers' validation: TypeError, ValueError, its own errors
        raise CheckpointError(f"{file}: {first_line(e)}; correct it or re-export it") from e
    if not all(is_int(size) and size > 0 for size in sizes) or sizes[2] % sizes[1]:
        raise CheckpointError(
            f"{file}: layers, heads, width, vocabulary and context {sizes} are not positive "
            "integers with the width a multiple of the heads; correct it or re-export it"
        )
    alibi = family.applies_alibi(hf.to_dict())
    return ModelShape(*sizes, positional="alibi" if alibi else "rotary", family=family.name)
