"""The exact-ALiBi patch and the attention bias protocol that it and the mitigations share.

TransformerLens 3.x computes ALiBi slopes with the power-of-two formula ``2^(-8(h+1)/H)`` for
every head count ``H``; Hugging Face BLOOM interleaves a second series when ``H`` is not a power of
two. Models from :func:`headsurgeon.loading.load_model` get Hugging Face's exact slopes through a
forward pre-hook on each attention module (:func:`install_exact_alibi`; the slopes a model
applies are a field of its record, ``model_info(model).slopes``, decided in
:func:`headsurgeon.loading.applied_slopes`; :func:`headsurgeon.loading.use_exact_alibi`
switches a model you built). The same protocol, a
pre-hook that puts a bias tensor built for the call's query and key counts in place
(:func:`headsurgeon.backend.add_bias_hook` with :func:`shared_bias`), is how
:func:`headsurgeon.blindness.mitigation` changes the bias, on TransformerLens 3.x and 4.x alike
(4.x takes Hugging Face's exact slopes; the hook keeps the bias relative, ``-m (i - j)``, as 3.x).

MPT and Falcon with ``alibi=True`` (TransformerLens 4.x only) apply other slopes than BLOOM:
MPT's formula with ``alibi_bias_max`` (transformers always uses 8, whatever the config says:
:func:`headsurgeon.alibi.mpt_slopes`), and Falcon adds BLOOM's bias divided by ``sqrt(d_head)``
(:func:`headsurgeon.alibi.falcon_slopes`). Every slope reported or used here is the one the
model applies per token of distance, added to the scaled logits ``q.k / sqrt(d_head)``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headsurgeon import alibi, backend, families
from headsurgeon.backend import BiasBuilder, Model, add_bias_hook, check_model, hf_bias_pre_hook
from headsurgeon.errors import CheckpointError, InvalidArgumentError
from headsurgeon.families import ALIBI_ATTENTION, attention_family

__all__ = [
    "install_exact_alibi",
    "install_hf_bias",
    "TRAINABLE_BIASES",
    "trained_bias",
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

    The slopes are those transformers applies (:func:`headsurgeon.families.transformers_slopes`).
    A standard Falcon gets no hook: transformers hands its attention its own bias already (in
    the attention mask, its bfloat16 products ``m_h j`` rounded at every position, which a
    relative bias would not reproduce), so the model computes exactly what transformers
    computes. MPT's hook also lets it run past ``max_seq_len``, where transformers' bias
    tensor ends.
    """
    check_model(model, "install_exact_alibi")
    if kind == "standard" and attention_family(model.blocks[0].attn).keeps_own_standard_bias:
        return
    hf_config = backend.hf_config(model)
    head_slopes = tuple(families.transformers_slopes(hf_config, model.cfg.n_heads).tolist())
    build = bias_builder(kind, params, head_slopes)
    for block in model.blocks:
        attn = block.attn
        if getattr(attn, "headsurgeon_alibi_hook", None) is None:
            attn.headsurgeon_alibi_hook = add_bias_hook(attn, build)


def install_hf_bias(hf_model: torch.nn.Module, kind: str = "standard", **params: Any) -> list:
    """Make a ``transformers`` ALiBi model (BLOOM, MPT, Falcon with ``alibi=True``) compute with
    the ALiBi variant ``kind``: the same bias :func:`install_exact_alibi` gives a TransformerLens
    model, from the slopes transformers applies (:func:`headsurgeon.families.config_slopes`),
    through :func:`headsurgeon.backend.hf_bias_pre_hook` on each attention layer. How
    ``analyses/train_organism.py --bias`` trains a variant and ``save_hf`` checks its export.
    Returns the hook handles (``handle.remove()`` undoes it). A standard Falcon gets none, as
    in :func:`install_exact_alibi`: its own bias is the one its checkpoint was trained with.
    """
    params = alibi.check_bias_params(kind, **params)
    config = hf_model.config.to_dict()
    family = families.FAMILIES.get(config.get("model_type"))
    if kind == "standard" and family is not None and family.keeps_own_standard_bias:
        return []
    head_slopes = tuple(families.config_slopes(config).tolist())
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
