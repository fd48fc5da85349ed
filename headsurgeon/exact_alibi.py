"""The exact-ALiBi patch and the attention bias protocol that it and the mitigations share.

TransformerLens 3.x computes ALiBi slopes with the power-of-two formula ``2^(-8(h+1)/H)`` for
every head count ``H``; Hugging Face BLOOM interleaves a second series when ``H`` is not a power of
two. Models from :func:`headsurgeon.loading.load_model` get Hugging Face's exact slopes through a
forward pre-hook on each attention module (:func:`install_exact_alibi`). The same protocol, a
pre-hook that puts a bias tensor built for the call's query and key counts in place
(:func:`headsurgeon.backend.add_bias_hook` with :func:`shared_bias`), is how
:func:`headsurgeon.blindness.mitigation` changes the bias, on TransformerLens 3.x and 4.x alike
(4.x takes Hugging Face's exact slopes; the hook keeps the bias relative, ``-m (i - j)``, as 3.x).

MPT and Falcon with ``alibi=True`` (TransformerLens 4.x only) apply other slopes than BLOOM:
MPT's formula with ``alibi_bias_max`` (transformers always uses 8, whatever the config says:
:func:`headsurgeon.alibi.mpt_slopes`), and Falcon adds BLOOM's bias divided by ``sqrt(d_head)``
(:func:`headsurgeon.alibi.falcon_slopes`). Every slope reported or used here is the one the
model applies per token of distance, added to the scaled logits ``q.k / sqrt(d_head)``.

Exports:
    alibi_slopes(model)                      the ALiBi slopes a model applies, read from it
    exact_slopes(model)                      the slopes transformers applies for its checkpoint
    use_exact_alibi(model)                   Hugging Face's ALiBi slopes for any head count
    install_exact_alibi(model, kind, ...)    the same, silently (for models built from checkpoints),
                                             with the ALiBi variant a model was trained with
    trained_bias(metadata), TRAINABLE_BIASES the variant a headsurgeon.json records, checked
    install_hf_bias(hf_model, kind, ...)     the same variant on a transformers ALiBi model
    inexact_slopes(model)                    why a model's slopes are not BLOOM's, or None
    shared_bias(...)                         one cached ALiBi bias per kind and shape
    bias_builder(kind, params, head_slopes)  a BiasBuilder of shared_bias for one kind
    BiasBuilder                              the type of a bias builder
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headsurgeon import alibi
from headsurgeon.backend import (
    ALIBI_ATTENTION,
    MAJOR,
    BiasBuilder,
    Model,
    add_bias_hook,
    attention_family,
    builtin_slopes,
    check_model,
    hf_bias_pre_hook,
)
from headsurgeon.errors import CheckpointError, InvalidArgumentError, UnsupportedArchitectureError

__all__ = [
    "BiasBuilder",
    "alibi_slopes",
    "bias_builder",
    "exact_slopes",
    "inexact_slopes",
    "install_exact_alibi",
    "install_hf_bias",
    "shared_bias",
    "TRAINABLE_BIASES",
    "trained_bias",
    "use_exact_alibi",
]


@functools.lru_cache(maxsize=8)
def shared_bias(
    kind: str,
    params: tuple[tuple[str, Any], ...],
    head_slopes: tuple[float, ...],
    n_queries: int,
    n_keys: int,
    device: torch.device,
) -> Float[Tensor, "head_index query_pos key_pos"]:
    """One bias tensor per kind and shape, shared by all layers (TransformerLens only reads it).

    ``params`` and ``head_slopes`` are tuples so that the call can be cached.
    """
    distance = alibi.distance_rows(n_queries, n_keys, device)
    return alibi.bias_from_distance(kind, torch.tensor(head_slopes), distance, **dict(params))


def bias_builder(kind: str, params: dict[str, Any], head_slopes: tuple[float, ...]) -> BiasBuilder:
    """The builder of ``kind``'s bias for these slopes, cached across layers and calls."""
    return functools.partial(shared_bias, kind, tuple(sorted(params.items())), head_slopes)


def install_exact_alibi(model: Model, kind: str = "standard", **params: Any) -> None:
    """The exact-slope pre-hook on every attention layer, silently (idempotent).

    ``kind`` (with its ``params``) is the ALiBi variant the model was trained with (recorded in
    its ``headsurgeon.json`` by ``analyses/train_organism.py --bias``), applied for good, so the
    model computes what it was trained to compute everywhere; a mitigation still replaces it for
    the length of a ``with`` block. See :func:`trained_bias`.

    The slopes are those transformers applies (:func:`exact_slopes`). A standard Falcon gets no
    hook: transformers hands its attention its own bias already (in the attention mask, its
    bfloat16 products ``m_h j`` rounded at every position, which a relative bias would not
    reproduce), so the model computes exactly what transformers computes. MPT's
    hook also lets it run past ``max_seq_len``, where transformers' bias tensor ends.
    """
    check_model(model, "install_exact_alibi")
    if kind == "standard" and attention_family(model.blocks[0].attn) == "falcon":
        return
    head_slopes = tuple(exact_slopes(model).tolist())
    build = bias_builder(kind, params, head_slopes)
    for block in model.blocks:
        attn = block.attn
        if getattr(attn, "headsurgeon_alibi_hook", None) is None:
            attn.headsurgeon_alibi_hook = add_bias_hook(attn, build)


def install_hf_bias(hf_model: torch.nn.Module, kind: str = "standard", **params: Any) -> list:
    """Make a ``transformers`` ALiBi model (BLOOM, MPT, Falcon with ``alibi=True``) compute with
    the ALiBi variant ``kind``: the same bias :func:`install_exact_alibi` gives a TransformerLens
    model, from the slopes transformers applies (:func:`headsurgeon.alibi.config_slopes`),
    through :func:`headsurgeon.backend.hf_bias_pre_hook` on each attention layer. How
    ``analyses/train_organism.py --bias`` trains a variant and ``save_hf`` checks its export.
    Returns the hook handles (``handle.remove()`` undoes it). A standard Falcon gets none, as
    in :func:`install_exact_alibi`: its own bias is the one its checkpoint was trained with.
    """
    params = alibi.check_bias_params(kind, **params)
    if kind == "standard" and hf_model.config.model_type == "falcon":
        return []
    head_slopes = tuple(alibi.config_slopes(hf_model.config.to_dict()).tolist())
    build = bias_builder(kind, params, head_slopes)
    return [
        module.register_forward_pre_hook(hf_bias_pre_hook(build), with_kwargs=True)
        for module in hf_model.modules()
        if type(module).__name__ in ALIBI_ATTENTION
    ]


# Kinds a model can be trained with: a bias of i - j (softcap maps the logits, not a bias).
TRAINABLE_BIASES = ("standard", "clamped", "log", "robust")


def trained_bias(metadata: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ALiBi variant a ``headsurgeon.json`` records (``{"alibi": {"kind", "params"}}``),
    checked; ``("standard", {})`` when it records none.

    >>> trained_bias({"alibi": {"kind": "log", "params": {}}})
    ('log', {})
    >>> trained_bias({"alibi": {"kind": "softcap", "params": {"c": 5}}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    headsurgeon.errors.CheckpointError: headsurgeon.json records the ALiBi variant 'softcap', ...
    """
    recorded = metadata.get("alibi") or {}
    kind = recorded.get("kind", "standard") if isinstance(recorded, dict) else recorded
    params = recorded.get("params", {}) if isinstance(recorded, dict) else {}
    fix = "correct headsurgeon.json or re-export the model"
    if kind not in TRAINABLE_BIASES or not isinstance(params, dict):
        raise CheckpointError(
            f"headsurgeon.json records the ALiBi variant {kind!r}, which is not a bias a model "
            f"is trained with (use one of {', '.join(TRAINABLE_BIASES)}); {fix}"
        )
    try:
        return kind, alibi.check_bias_params(kind, **params)
    except InvalidArgumentError as e:
        raise CheckpointError(f"headsurgeon.json: ALiBi variant {kind}: {e}; {fix}") from e


def use_exact_alibi(model: Model) -> None:
    """Give every attention layer Hugging Face's exact ALiBi slopes (idempotent).

    **This changes the model's outputs** whenever its head count is not a power of two:
    TransformerLens 3.x uses ``2^(-8(h+1)/H)`` for every ``H``, Hugging Face BLOOM interleaves a
    second series (a random 6-head model's logits moved by ~1 here). Call it to make a model built
    from a TransformerLens config compute what the BLOOM checkpoint it stands for computes
    (models from :func:`~headsurgeon.loading.load_model` have it already); a warning says when
    the slopes change. Nothing in headsurgeon needs it: every tool reads the slopes the model
    uses (:func:`alibi_slopes`).

    A forward pre-hook on each attention module, so ``model.reset_hooks()`` keeps it; its handle
    is ``block.attn.headsurgeon_alibi_hook``.
    """
    check_model(model, "use_exact_alibi")
    if model.cfg.positional_embedding_type != "alibi":
        raise UnsupportedArchitectureError(
            f"use_exact_alibi applies to ALiBi models; this one uses "
            f"{model.cfg.positional_embedding_type} positions"
        )
    before, exact = alibi_slopes(model), exact_slopes(model)
    if not torch.equal(before, exact):
        warnings.warn(
            "use_exact_alibi changes this model's ALiBi slopes from "
            f"{_rounded(before)} to Hugging Face's {_rounded(exact)}: its outputs change",
            stacklevel=2,
        )
    install_exact_alibi(model)


def _rounded(values: Tensor) -> list[float]:
    return [float(f"{x:.3g}") for x in values.tolist()]


def alibi_slopes(model: Model) -> Float[Tensor, " head_index"]:
    """The ALiBi slopes ``model`` applies (float32), read from the model, never assumed.

    Models from :func:`~headsurgeon.loading.load_model` (and after :func:`use_exact_alibi`) use
    Hugging Face's exact slopes; any other model uses what its attention class builds
    (TransformerLens 3.x: ``2^(-8(h+1)/H)`` for every head count ``H``, exact only for powers of
    two). Mitigations (:func:`headsurgeon.blindness.mitigation`) change the bias, not these
    slopes.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=6, d_model=24, d_vocab=9, n_ctx=8))
    >>> [round(x, 4) for x in alibi_slopes(model).tolist()]
    [0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125]
    """
    check_model(model, "alibi_slopes")
    if model.cfg.positional_embedding_type != "alibi":
        raise UnsupportedArchitectureError(
            f"the model uses {model.cfg.positional_embedding_type} positions, not ALiBi; "
            "it has no ALiBi slopes"
        )
    attn = model.blocks[0].attn
    if getattr(attn, "headsurgeon_alibi_hook", None) is not None:
        return exact_slopes(model)
    return builtin_slopes(model)


def exact_slopes(model: Model) -> Float[Tensor, " head_index"]:
    """The slopes transformers applies for ``model``'s checkpoint (float32): on 4.x those its
    attention applies by itself (:func:`headsurgeon.backend.builtin_slopes`: BLOOM's, MPT's with
    ``alibi_bias_max`` 8, Falcon's ``bf16(m_h) / sqrt(d_head)``); on 3.x, whose models are all
    BLOOM, :func:`headsurgeon.alibi.slopes`."""
    return builtin_slopes(model) if MAJOR >= 4 else alibi.slopes(model.cfg.n_heads)


def inexact_slopes(model: Model) -> str | None:
    """Why ``model``'s ALiBi slopes are not BLOOM's for its head count, in words; else None.

    None too for a model without ALiBi (it has no slopes to compare).
    """
    cfg = model.cfg
    if cfg.positional_embedding_type != "alibi":
        return None
    applied, exact = alibi_slopes(model), exact_slopes(model)
    if torch.allclose(applied, exact, rtol=1e-6, atol=0.0):
        return None
    return (
        f"ALiBi slopes {_rounded(applied)} are not BLOOM's for {cfg.n_heads} heads "
        f"{_rounded(exact)} (TransformerLens's power-of-two formula): "
        "headsurgeon.exact_alibi.use_exact_alibi(model) switches them, changing its outputs"
    )
