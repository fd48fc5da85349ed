"""Loading models (by name, bundled organism or local folder) and the facts the tools need.

Exports:
    load_model(model, dtype, device, device_map, ...)  TransformerLens model, exact ALiBi
    from_hf_model(hf_model, tokenizer, ...)  wrap an in-memory transformers model
    random_model(shape, seed)                random-weight BLOOM of a given or named shape
    random_hf_bloom(shape, seed)             the same, as a transformers model
    model_shape(model)               ModelShape without loading weights
    model_info(model, caller)                the door of every verb: the model checked, and its
                                             ModelInfo (shape, ALiBi slopes, length limit, BOS)
    alibi_slopes(model)                      the ALiBi slopes a model applies (its info's field)
    use_exact_alibi(model), inexact_slopes(info)   Hugging Face's exact slopes for any head count
    model_metadata(model)                    a model's or folder's headsurgeon.json, weights unread
    organism_names(), DEFAULT_MODEL, ORGANISM_DIR, BLOOM_SHAPES, ALIBI_SHAPES, ModelShape,
    ModelInfo
    resolve_model(model)              (display name, local checkpoint folder)
    check_checkpoint(directory)              a checkpoint folder validated before reading weights
    check_metadata(data, path)               a headsurgeon.json's contents checked (one schema)
    TrainingNumerics, PUBLISHED_NUMERICS     how a model's attention was trained (info's field)
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

The package, layer by layer (each module imports only those above it):

    files      a checkpoint folder's files: checked as regular files, weights read from headers
    numerics   TrainingNumerics: how a model's attention was computed in training (the
               published models' table, with sources)
    metadata   ``headsurgeon.json``'s one schema
    checks     checkpoint validation: config.json against the stored tensors
    sources    names to folders: bundled organisms, the Hugging Face hub, local folders
    facts      ModelShape, ModelInfo and the functions that find them (which ALiBi formula a
               model applies is decided here, once: applied_slopes)
    slopes     alibi_slopes, use_exact_alibi, inexact_slopes
    loaders    load_model, from_hf_model, random_model

>>> model = random_model(ModelShape(n_layers=1, n_heads=6, d_model=48, d_vocab=64, n_ctx=32))
>>> model.cfg.n_heads, model_info(model).prepend_bos
(6, False)
"""

from headsurgeon.loading.checks import check_checkpoint, tl_config
from headsurgeon.loading.facts import (
    ALIBI_SHAPES,
    BLOOM_SHAPES,
    ModelInfo,
    ModelShape,
    applied_slopes,
    model_info,
    model_metadata,
    model_shape,
)
from headsurgeon.loading.files import (
    METADATA_FILE,
    TOKENIZER_FILES,
    StoredTensor,
    pickled_tensors,
    read_json,
    safetensors_header,
    stored_tensors,
    weight_files,
)
from headsurgeon.loading.loaders import from_hf_model, load_model, random_hf_bloom, random_model
from headsurgeon.loading.metadata import check_metadata
from headsurgeon.loading.numerics import PUBLISHED_NUMERICS, TrainingNumerics
from headsurgeon.loading.slopes import alibi_slopes, inexact_slopes, use_exact_alibi
from headsurgeon.loading.sources import DEFAULT_MODEL, ORGANISM_DIR, organism_names, resolve_model

__all__ = [
    "ALIBI_SHAPES",
    "BLOOM_SHAPES",
    "DEFAULT_MODEL",
    "METADATA_FILE",
    "ORGANISM_DIR",
    "PUBLISHED_NUMERICS",
    "TOKENIZER_FILES",
    "ModelInfo",
    "ModelShape",
    "StoredTensor",
    "TrainingNumerics",
    "alibi_slopes",
    "applied_slopes",
    "check_checkpoint",
    "check_metadata",
    "from_hf_model",
    "inexact_slopes",
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
    "use_exact_alibi",
    "weight_files",
]
