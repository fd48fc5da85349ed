"""The one package that imports TransformerLens: the same operations on its 3.x and 4.x models.

What differs between the majors is the methods of two classes with the same methods,
:class:`~headsurgeon.backend.tl3.TransformerLens3` (``HookedTransformer``: per-head weight
parameters, an ALiBi tensor stored on the module, ``-inf`` masks) and
:class:`~headsurgeon.backend.tl4.TransformerLens4` (``TransformerBridge``: the Hugging Face model
wrapped, ALiBi from its call's arguments, float-minimum masks); :data:`BACKEND`, the installed
major's, is chosen once here, at import (as einops picks a backend). The functions below and
those of the submodules are what callers use; the rest of headsurgeon speaks TransformerLens
3.x's names (``hook_pattern``, ``hook_z``, ``W_Q[head]``) on either major.

The rest is in its submodules: :mod:`~headsurgeon.backend.weights` (per-head views of the
attention weights, the weights under 3.x's names), :mod:`~headsurgeon.backend.cache` (key-value
caches), :mod:`~headsurgeon.backend.forward` (passes cut at a block),
:mod:`~headsurgeon.backend.bounded` (3.x: a placed model built one part at a time) and
:mod:`~headsurgeon.backend.shared` (what both backends build on).
"""

from __future__ import annotations

import headsurgeon.progress  # noqa: F401  # isort: skip (tqdm set up before TransformerLens)
import contextlib
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import (
    HookPoint as HookPoint,  # for the library (only the backend imports TL)
)

from headsurgeon.backend.shared import Attend, BiasBuilder, HFBiasHook
from headsurgeon.backend.tl3 import TransformerLens3
from headsurgeon.backend.tl4 import TransformerLens4
from headsurgeon.errors import InvalidArgumentError

MAJOR = int(version("transformer-lens").split(".")[0])

# The one choice between the majors: every difference is a method of this object.
BACKEND = TransformerLens4() if MAJOR >= 4 else TransformerLens3()
Model = BACKEND.model_class()

# The installed TransformerLens as messages name it.
TRANSFORMER_LENS = f"TransformerLens {MAJOR}.x"
SUPPORTED = BACKEND.supported

__all__ = [
    "BACKEND",
    "MAJOR",
    "Model",
    "add_bias_hook",
    "own_alibi_slopes",
    "check_architecture",
    "check_model",
    "convert_hf",
    "hf_architecture",
    "hf_config",
    "hub_names",
    "loads_into_device_map",
    "masked_score",
    "move",
    "without_kv_cache",
    "wraps_hf_model",
    "fused_refusal",
    "fused_attention",
    "offloaded",
    "resident",
]


def check_model(model: object, name: str, *, argument: str = "model", writes: bool = False) -> None:
    """One :class:`~headsurgeon.errors.InvalidArgumentError` line unless ``model`` is a loaded
    model of this TransformerLens major; ``name`` is the function that was called. With
    ``writes`` (the function changes weights), also for a model whose ``device_map`` offloads
    weights to CPU or disk (:mod:`headsurgeon.placement`): Accelerate reloads those from their
    offload copy at every forward, so an update to them would be lost.

    >>> check_model(None, "run_census")
    Traceback (most recent call last):
    ...
    headsurgeon.errors.InvalidArgumentError: run_census: model is None, not a model; ...
    """
    if isinstance(model, Model):
        parameter = next(model.parameters(), None)
        away = offloaded(model)
        if parameter is not None and parameter.device.type == "meta" and not away:
            raise InvalidArgumentError(
                f"{name}: {argument} is on the meta device (no weights); load its weights, e.g. "
                "with load_model or load_state_dict(..., assign=True)"
            )
        BACKEND.check_built(model, f"{name}'s {argument}")
        if writes and away:
            raise InvalidArgumentError(
                f"{name}: {argument} keeps weights offloaded to CPU or disk by its device_map "
                f"({away[0]}{' and more' if len(away) > 1 else ''}), where an update would be "
                "lost; load it with device=, or a device_map and max_memory that fit it on GPUs"
            )
        return
    if isinstance(model, str | Path):
        got = f"the name {str(model)!r}, not a model"
        fix = f"load it first: {name}(load_model({str(model)!r}), ...)"
    elif isinstance(model, nn.Module):
        got = f"a {type(model).__name__}, not a TransformerLens {Model.__name__}"
        fix = "convert it with headsurgeon.loading.from_hf_model(...) or load it with load_model"
    else:
        got = f"{'None' if model is None else 'a ' + type(model).__name__}, not a model"
        fix = "pass a model from headsurgeon.load_model(...)"
    raise InvalidArgumentError(f"{name}: {argument} is {got}; {fix}")


# --- building models --------------------------------------------------------------------------


def hub_names() -> dict[str, str]:
    """Map every TransformerLens model name and alias (lower case) to its official hub name."""
    from transformer_lens.supported_models import MODEL_ALIASES, OFFICIAL_MODEL_NAMES

    names = {}
    for official in OFFICIAL_MODEL_NAMES:
        names[official.lower()] = official
        names.update((alias.lower(), official) for alias in MODEL_ALIASES.get(official, []))
    return names


def check_architecture(
    config_dir: Path, hf_config: dict[str, Any], file: Path, *, dtype: torch.dtype = torch.float32
) -> Any:
    """TransformerLens's config for ``config_dir``'s ``config.json`` (3.x), or None (4.x) once the
    architecture is known to have a 4.x adapter; one line naming ``file`` otherwise."""
    return BACKEND.check_architecture(config_dir, hf_config, file, dtype)


def convert_hf(
    hf_model: nn.Module, tokenizer: Any, *, name: str, prepend_bos: bool | None
) -> Model:
    """``hf_model`` as the installed major's model, weights unprocessed (no folding, no centring).

    3.x copies the weights into a new ``HookedTransformer``; 4.x wraps ``hf_model`` itself (its
    modules become the bridge's: do not use ``hf_model`` on its own afterwards), switched to
    ``transformers``' eager attention: a bridge that delegates attention to the Hugging Face
    module (OPT's) can only show the pattern that module returns, and fused kernels (sdpa)
    return none.
    """
    return BACKEND.convert_hf(hf_model, tokenizer, name=name, prepend_bos=prepend_bos)


def hf_config(model: Model) -> dict[str, Any]:
    """The Hugging Face config a 4.x bridge computes with; ``{}`` on 3.x, whose models keep none."""
    config = BACKEND.original_config(model)
    return {} if config is None else config.to_dict()


def hf_architecture(model: Model) -> str:
    """The Hugging Face class ``model`` computes as: 4.x's wrapped model; BLOOM's on 3.x, the
    only family headsurgeon exports there (:func:`headsurgeon.checkpoints.save_hf` checks the
    rest)."""
    return BACKEND.hf_architecture(model)


def wraps_hf_model(model: Model) -> bool:
    """Whether ``model`` computes with the tensors of the Hugging Face model it wraps (a 4.x
    bridge: read its weights there) rather than with TransformerLens's own copies (3.x)."""
    return BACKEND.wraps_hf_model


def loads_into_device_map() -> bool:
    """Whether loading with a device map reads the checkpoint straight into the map (4.x: the
    Hugging Face model is the model) rather than dispatching the model built from it (3.x)."""
    return BACKEND.loads_into_device_map


def masked_score(dtype: torch.dtype) -> float:
    """The score the installed major's attention gives a masked (future) key: ``-inf`` on 3.x,
    ``dtype``'s float minimum on 4.x; what a hook that masks more keys writes."""
    return BACKEND.masked_score(dtype)


def offloaded(model: nn.Module) -> list[str]:
    """The modules whose weights Accelerate keeps offloaded (loaded only in their forward)."""
    from accelerate.utils import has_offloaded_params

    # Named as a user's device_map names them, without a 4.x bridge's wrapper attributes.
    return [
        name.replace("._original_component", "").replace("original_model.", "")
        for name, module in model.named_modules()
        if has_offloaded_params(module)
    ]


@contextlib.contextmanager
def resident(module: nn.Module, *, recurse: bool = True) -> Iterator[nn.Module]:
    """``module`` with every Accelerate-offloaded weight beneath it (``recurse=False``: its own)
    loaded for the ``with`` block.

    A model dispatched with a ``device_map`` that offloads to ``cpu`` or ``disk`` keeps those
    weights on the meta device and loads them only inside the owning module's forward; a hook
    that reads a weight of another module (the census reads ``W_O`` in ``hook_z``, before the
    output projection ran) goes through this. A no-op for weights already resident: a module
    whose own forward is running (and loaded them) keeps them through it.
    """
    from accelerate.utils import align_module_device, has_offloaded_params

    with contextlib.ExitStack() as stack:
        for sub in module.modules() if recurse else [module]:
            own = sub.parameters(recurse=False)
            if has_offloaded_params(sub) and any(p.device.type == "meta" for p in own):
                stack.enter_context(align_module_device(sub))
        yield module


@contextlib.contextmanager
def without_kv_cache(model: Model) -> Iterator[Model]:
    """``model`` keeping no key-value cache in its forward passes, for the ``with`` block.

    A 4.x bridge's Hugging Face model fills a cache in every pass by default; a block run again
    (activation checkpointing) would append its keys a second time. 3.x keeps none unless given.
    """
    with BACKEND.without_kv_cache(model):
        yield model


def move(model: Model, device: torch.device) -> Model:
    """``model`` on ``device`` (in place), without TransformerLens 3.x's message."""
    return BACKEND.move(model, device)


# --- the ALiBi bias ---------------------------------------------------------------------------


def hf_bias_pre_hook(build: BiasBuilder) -> Callable[[nn.Module, tuple, dict], tuple]:
    """A forward pre-hook (``with_kwargs=True``) for a Hugging Face ALiBi attention layer
    (``BloomAttention``, ``MptAttention``, ``FalconAttention``, or the 4.x bridge's wrapping
    one, which takes the same call) whose ALiBi bias becomes ``build``'s, for every row.

    Each takes it differently (:meth:`headsurgeon.families.AlibiFamily.with_bias`), all added to
    the already scaled ``q.k / sqrt(d_head)``:

    * BLOOM: ``alibi``, ``slope x key position`` (``[batch * head, 1, key]``), becomes
      ``[batch * head, query, key]``;
    * MPT: ``position_bias`` (``[head, 1, max_seq_len]``, sliced to the keys) becomes
      ``[head, query, key]``: ``build`` covers every length, also past ``max_seq_len``, where
      transformers' own tensor ends;
    * Falcon: the bias is in the additive ``attention_mask`` (``[batch, head, query, key]``, the
      float minimum where masked); its unmasked cells become the bias.

    So any function of ``i - j`` works, in training (``analyses/train_organism.py --bias``) as
    in inference.
    """
    return HFBiasHook(build)


def add_bias_hook(attn: nn.Module, build: BiasBuilder) -> Any:
    """Make attention layer ``attn`` add ``build(n_queries, n_keys, device)`` as its ALiBi bias.

    A forward pre-hook; hooks run in registration order, so the last one registered decides the
    bias. 3.x adds ``module.alibi[:, -query_ctx:, :key_ctx]`` and rebuilds it with its
    power-of-two slopes only when ``key_ctx`` outgrows it: a tensor holding exactly this call's
    rows is used as is, and keeps ``hook_attn_scores`` equal to ``q.k/sqrt(d) + bias`` (a longer
    cached one would shift every row by a constant). 4.x adds the bias the Hugging Face call
    passes (BLOOM's ``alibi``, MPT's ``position_bias``, Falcon's ``attention_mask``): it is
    replaced by the bias for every row (:func:`hf_bias_pre_hook`). ``handle.remove()`` undoes it.
    """
    return BACKEND.add_bias_hook(attn, build)


def fused_refusal(model: Model) -> str | None:
    """Why ``model``'s attention cannot compute through :mod:`headsurgeon.backend.fused` (its
    statistics without the pattern), in words, or None when it can.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=9, n_ctx=8))
    >>> fused_refusal(model) is None
    True
    """
    return BACKEND.fused_refusal(model)


def fused_attention(
    model: Model, slopes: Float[Tensor, " head_index"], attend: Attend
) -> contextlib.AbstractContextManager[None]:
    """For the ``with`` block, each attention layer of ``model`` (one :func:`fused_refusal`
    passes) computes its head outputs as ``attend(layer, q, k, v, slopes=... or key_bias=...,
    scale=...)`` of its ``hook_q/k/v`` (``[batch, pos, head, d_head]``): a function of
    :mod:`headsurgeon.backend.fused`. The bias: ``-m (t - j)`` of ``slopes``, or on 4.x, in a
    layer without headsurgeon's bias hook, its family's own bias of the key position
    (``key_bias``). ``hook_z`` fires; ``hook_attn_scores`` and ``hook_pattern`` do not. Whole
    sequences: no key-value cache, no padding."""
    return BACKEND.fused_attention(model, slopes, attend)


def own_alibi_slopes(n_heads: int) -> Float[Tensor, " head_index"] | None:
    """The ALiBi slopes TransformerLens's attention builds by itself for ``n_heads`` heads
    (float32), read from its attention class: 3.x's ``2^(-8(h+1)/H)`` for every head count. None on
    4.x, whose attention applies what transformers applies for the model's config (exact for
    every head count). :func:`headsurgeon.loading.facts.applied_slopes` decides with it."""
    return BACKEND.own_alibi_slopes(n_heads)
