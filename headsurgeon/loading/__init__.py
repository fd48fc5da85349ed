"""Loading models (by name, bundled organism or local folder) and the facts the tools need.

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

from headsurgeon.loading.facts import (
    ALIBI_SHAPES,
    BLOOM_SHAPES,
    ModelInfo,
    ModelShape,
    applied_slopes,
    model_info,
    model_shape,
)
from headsurgeon.loading.files import read_json
from headsurgeon.loading.loaders import from_hf_model, load_model, random_hf_bloom, random_model
from headsurgeon.loading.metadata import check_metadata
from headsurgeon.loading.numerics import TrainingNumerics
from headsurgeon.loading.slopes import alibi_slopes, use_exact_alibi
from headsurgeon.loading.sources import organism_names, resolve_model

__all__ = [
    "ALIBI_SHAPES",
    "BLOOM_SHAPES",
    "ModelInfo",
    "ModelShape",
    "TrainingNumerics",
    "alibi_slopes",
    "applied_slopes",
    "check_metadata",
    "from_hf_model",
    "load_model",
    "model_info",
    "model_shape",
    "organism_names",
    "random_hf_bloom",
    "random_model",
    "read_json",
    "resolve_model",
    "use_exact_alibi",
]
