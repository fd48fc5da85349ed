"""The one package that imports TransformerLens: the same operations on its 3.x and 4.x models.

TransformerLens 3.x models are ``HookedTransformer``\\ s, whose per-head tensors ``W_Q`` ... ``W_O``
are parameters and whose attention reads an ALiBi tensor stored on the module. 4.x removed
``HookedTransformer``: its ``TransformerBridge`` wraps the Hugging Face model itself, splits BLOOM's
fused ``query_key_value`` into ``q``/``k``/``v`` linear layers (its ``W_Q`` ... are views of
those), takes ALiBi from the Hugging Face call's ``alibi`` argument and masks scores with the
float minimum instead of ``-inf``. Everything that differs is here; the rest of headsurgeon speaks
TransformerLens 3.x's names (``hook_pattern``, ``hook_z``, ``W_Q[head]``) on either major.

Exports:
    MAJOR, Model, HookPoint          TransformerLens's major version, its model class, hook type
    TRANSFORMER_LENS                 the installed major as messages name it ("TransformerLens 3.x")
    convert_hf(hf_model, ...)        a transformers causal LM as the major's model (unprocessed)
    tl3_config(config, ...)          3.x: the HookedTransformerConfig of a Hugging Face config
    unused_positions(cfg)            3.x: the zero position table of an ALiBi model
    hub_names()                      TransformerLens's model names and aliases -> hub names
    hf_config(model)                 the Hugging Face config a 4.x bridge computes with
    hf_architecture(model)           the Hugging Face class it computes as ("BloomForCausalLM", ...)
    wraps_hf_model(model)            whether it computes with a wrapped Hugging Face model's tensors
    loads_into_device_map()          whether a device-mapped load reads the checkpoint into the map
    masked_score(dtype)              the score its attention gives a masked key (-inf or float min)
    check_architecture(...)          TransformerLens's verdict on a config.json, before weights
    check_model(model, name)         one line unless ``model`` is a loaded model (not a name, a
                                     path, ``None``, a Hugging Face model or one on ``meta``)
    move(model, device)              ``model.to(device)`` without TransformerLens's printing
    without_kv_cache(model)          no key-value cache filled in the ``with`` block (4.x's default)
    offloaded(model)                 the modules whose weights Accelerate keeps on CPU or disk
    resident(module)                 those weights loaded for a ``with`` block (read them there)
    add_bias_hook(attn, build)       make one attention layer use ``build``'s ALiBi bias
    hf_bias_pre_hook(build)          the same for a Hugging Face BLOOM/MPT/Falcon attention
    attention_family(attn)           which of those an attention layer is ("bloom", ...)
    ALIBI_ATTENTION                  transformers' ALiBi attention classes -> their family
    own_alibi_slopes(n_heads)        the ALiBi slopes TransformerLens builds by itself (None: 4.x)

The rest is in its submodules: :mod:`~headsurgeon.backend.weights` (per-head views of the
attention weights, the weights under 3.x's names), :mod:`~headsurgeon.backend.cache` (key-value
caches), :mod:`~headsurgeon.backend.forward` (passes cut at a block) and
:mod:`~headsurgeon.backend.bounded` (3.x: a placed model built one part at a time).
"""

from __future__ import annotations

import headsurgeon.progress  # noqa: F401  # isort: skip (tqdm set up before TransformerLens)
import contextlib
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from headsurgeon.errors import (
    CheckpointError,
    InvalidArgumentError,
    UnsupportedArchitectureError,
    first_line,
)

MAJOR = int(version("transformer-lens").split(".")[0])

if MAJOR >= 4:
    from transformer_lens.model_bridge import TransformerBridge as Model
else:
    from transformer_lens import HookedTransformer as Model

# The installed TransformerLens as messages name it.
TRANSFORMER_LENS = f"TransformerLens {MAJOR}.x"

__all__ = [
    "ALIBI_ATTENTION",
    "MAJOR",
    "TRANSFORMER_LENS",
    "HookPoint",
    "Model",
    "add_bias_hook",
    "attention_family",
    "own_alibi_slopes",
    "check_architecture",
    "check_model",
    "convert_hf",
    "hf_bias_pre_hook",
    "hf_architecture",
    "hf_config",
    "hub_names",
    "loads_into_device_map",
    "masked_score",
    "move",
    "without_kv_cache",
    "wraps_hf_model",
    "offloaded",
    "resident",
    "tl3_config",
    "unused_positions",
]

BiasBuilder = Callable[[int, int, torch.device], Float[Tensor, "head_index query_pos key_pos"]]


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
        if MAJOR >= 4:  # a bridge the user built, not through convert_hf
            _check_variant(model.original_model.config.to_dict(), f"{name}'s {argument}")
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
    from huggingface_hub.errors import StrictDataclassError

    architecture = (hf_config.get("architectures") or ["<none>"])[0]
    if MAJOR >= 4:
        from transformer_lens.factories.architecture_adapter_factory import (
            SUPPORTED_ARCHITECTURES,
        )

        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {architecture} (model_type {hf_config.get('model_type')}) in "
                f"{file} is not supported by TransformerLens 4.x (no architecture adapter); "
                f"{SUPPORTED}"
            )
        _check_variant(hf_config, file)
        return None
    from transformer_lens import loading_from_pretrained as tl_loading

    try:
        return tl_loading.get_pretrained_model_config(
            str(config_dir), hf_cfg=hf_config, fold_ln=False, dtype=dtype, device="cpu"
        )
    except StrictDataclassError as e:  # transformers' typed config classes
        # Its message: "Validation error for field 'x':" then "TypeError: ... (value: ...)".
        what = " ".join(line.strip() for line in str(e).splitlines()[1:]) or first_line(e)
        raise CheckpointError(f"{file}: {what}; correct it or re-export the checkpoint") from e
    # AttributeError: TransformerLens 3.x reading a field transformers 5 no longer has (GPT-2).
    except (NotImplementedError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _unsupported_by_tl3(architecture, hf_config, file, e) from e


SUPPORTED = (
    "headsurgeon loads BLOOM (model_type bloom, BloomForCausalLM) and the causal language models "
    f"TransformerLens {MAJOR}.x converts (e.g. LlamaForCausalLM, GPTNeoXForCausalLM, "
    "OPTForCausalLM"
    + (", MptForCausalLM, FalconForCausalLM)" if MAJOR >= 4 else "; MPT and Falcon need 4.x)")
)


def _unsupported_by_tl3(
    architecture: str, hf_config: dict[str, Any], where: object, error: Exception
) -> UnsupportedArchitectureError:
    if hf_config.get("model_type") == "gpt2" and "n_ctx" in str(error):
        # transformers 5 no longer writes GPT-2's n_ctx, which TransformerLens 3.x reads.
        return UnsupportedArchitectureError(
            f"GPT-2 config in {where} has no n_ctx, which TransformerLens 3.x needs; add "
            f'"n_ctx": {hf_config.get("n_positions", 1024)} (its n_positions) to config.json'
        )
    return UnsupportedArchitectureError(
        f"architecture {architecture} (model_type {hf_config.get('model_type')}) in {where} is "
        f"not supported by TransformerLens 3.x ({first_line(error)}); {SUPPORTED}"
    )


def _check_variant(hf_config: dict[str, Any], where: object) -> None:
    """One line for a 4.x architecture variant that TransformerLens 4.x converts wrongly."""
    if hf_config.get("model_type") == "falcon" and hf_config.get("new_decoder_architecture"):
        # Its fused query_key_value is grouped per key-value head (each group's queries, key,
        # value); TransformerLens 4.3 splits it as [Q; K; V] (logits off by 0.3 on a tiny model).
        raise UnsupportedArchitectureError(
            f"Falcon with new_decoder_architecture (grouped key-value heads) in {where} is not "
            f"supported: TransformerLens {version('transformer-lens')} splits its grouped "
            "query_key_value in the wrong order, so its attention would not be the model's"
        )


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
    architecture = (hf_model.config.architectures or [type(hf_model).__name__])[0]
    if MAJOR >= 4:
        from transformer_lens.model_bridge.sources import build_bridge_from_module

        _check_variant(hf_model.config.to_dict(), f"the {type(hf_model).__name__}")
        if getattr(hf_model.config, "_attn_implementation", "eager") != "eager":
            hf_model.set_attn_implementation("eager")
        # Booted from the module in memory: no hub lookup, no compatibility-mode processing.
        model = build_bridge_from_module(
            hf_model, architecture, hf_config=hf_model.config, tokenizer=tokenizer, model_name=name
        )
        _pass_mpt_cache(model)
        if prepend_bos is not None:
            model.cfg.default_prepend_bos = prepend_bos
        if model.cfg.positional_embedding_type == "alibi":
            # 4.x takes n_ctx from seq_length, the training length; ALiBi has no position table,
            # and 3.x gives every BLOOM 2048 positions: the same limit on both majors.
            model.cfg.n_ctx = max(model.cfg.n_ctx, 2048)
        return model
    return _hooked_transformer(
        hf_model, tokenizer, name=name, prepend_bos=prepend_bos, architecture=architecture
    )


def _hooked_transformer(
    hf_model: nn.Module, tokenizer: Any, *, name: str, prepend_bos: bool | None, architecture: str
) -> Model:
    from transformer_lens import HookedTransformer, loading_from_pretrained as tl_loading

    dtype = next(hf_model.parameters()).dtype
    with tl3_config(hf_model.config, architecture, dtype, name, prepend_bos) as (tmp, cfg):
        state_dict = tl_loading.get_pretrained_state_dict(str(tmp), cfg, hf_model=hf_model)
    if cfg.positional_embedding_type == "alibi":
        state_dict["pos_embed.W_pos"] = unused_positions(cfg)
    model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    return model


@contextlib.contextmanager
def tl3_config(
    config: Any, architecture: str, dtype: torch.dtype, name: str, prepend_bos: bool | None
) -> Iterator[tuple[Path, Any]]:
    """TransformerLens 3.x's ``HookedTransformerConfig`` for a Hugging Face ``config``, and the
    private folder holding that config (for the ``with`` block)."""
    from transformer_lens import loading_from_pretrained as tl_loading

    # TransformerLens reads configs from a name or folder; give it the model's own config.
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        config.save_pretrained(tmp)
        # A config built in code names no architecture; TransformerLens converts by that name.
        file = Path(tmp) / "config.json"
        values = json.loads(file.read_text()) | {"architectures": [architecture]}
        file.write_text(json.dumps(values))
        try:
            cfg = tl_loading.get_pretrained_model_config(
                tmp, fold_ln=False, dtype=dtype, device="cpu", default_prepend_bos=prepend_bos
            )
        # NotImplementedError: no 3.x adapter (MPT, Falcon); AttributeError: 3.x reading a field
        # transformers 5 no longer has (GPT-2's n_ctx).
        except (NotImplementedError, AttributeError) as e:
            where = f"the {architecture} config"
            raise _unsupported_by_tl3(architecture, values, where, e) from e
        cfg.model_name = name
        # The config folder goes: without this TransformerLens would look the tokenizer up by
        # that path on the hub.
        cfg.tokenizer_name = None
        yield Path(tmp), cfg


def unused_positions(cfg: Any) -> Tensor:
    """``pos_embed.W_pos`` of an ALiBi model: unused, zeros (TransformerLens would otherwise fill
    it with uninitialised memory)."""
    return torch.zeros(cfg.n_ctx, cfg.d_model, dtype=cfg.dtype)


def _pass_mpt_cache(model: Model) -> None:
    """Make a 4.x bridge's MPT attention use the key-value cache transformers hands it.

    ``MptBlock`` passes it as ``cache=``; TransformerLens 4.3's attention looks for
    ``past_key_values`` or ``layer_past`` only, so without this every cached call (blocks of a
    long sequence, continuations of a prompt) would attend to its own positions alone.
    """
    for block in model.blocks:
        if attention_family(block.attn) == "mpt":
            block.attn.register_forward_pre_hook(_cache_as_layer_past, with_kwargs=True)


def _cache_as_layer_past(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # A module-level function, not a closure: a model with it stays picklable (torch.save).
    if kwargs.get("cache") is not None and kwargs.get("layer_past") is None:
        kwargs = dict(kwargs)
        kwargs["layer_past"] = kwargs.pop("cache")
    return args, kwargs


def hf_config(model: Model) -> dict[str, Any]:
    """The Hugging Face config a 4.x bridge computes with; ``{}`` on 3.x, whose models keep none."""
    if MAJOR < 4:
        return {}
    return model.original_model.config.to_dict()


def hf_architecture(model: Model) -> str:
    """The Hugging Face class ``model`` computes as: 4.x's wrapped model; BLOOM's on 3.x, the
    only family headsurgeon exports there (:func:`headsurgeon.checkpoints.save_hf` checks the
    rest)."""
    return type(model.original_model).__name__ if MAJOR >= 4 else "BloomForCausalLM"


def wraps_hf_model(model: Model) -> bool:
    """Whether ``model`` computes with the tensors of the Hugging Face model it wraps (a 4.x
    bridge: read its weights there) rather than with TransformerLens's own copies (3.x)."""
    return MAJOR >= 4


def loads_into_device_map() -> bool:
    """Whether loading with a device map reads the checkpoint straight into the map (4.x: the
    Hugging Face model is the model) rather than dispatching the model built from it (3.x)."""
    return MAJOR >= 4


def masked_score(dtype: torch.dtype) -> float:
    """The score the installed major's attention gives a masked (future) key: ``-inf`` on 3.x,
    ``dtype``'s float minimum on 4.x; what a hook that masks more keys writes."""
    return -math.inf if MAJOR < 4 else torch.finfo(dtype).min


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
    config = getattr(getattr(model, "original_model", None), "config", None)
    if MAJOR < 4 or config is None:
        yield model
        return
    before = config.use_cache
    config.use_cache = False
    try:
        yield model
    finally:
        config.use_cache = before


def move(model: Model, device: torch.device) -> Model:
    """``model`` on ``device`` (in place), without TransformerLens 3.x's message."""
    model = model.to(device, print_details=False)
    if MAJOR >= 4:
        model.cfg.device = str(device)  # 4.x records only the type ("cuda" for "cuda:1")
    return model


# --- the ALiBi bias ---------------------------------------------------------------------------

_ATTENTION_ARGS = ("query_input", "key_input", "value_input", "past_kv_cache_entry")


class _BiasHandle:
    """Removes a bias hook and, on 3.x, the bias tensor it left on the module."""

    def __init__(self, attn: nn.Module, handle: Any) -> None:
        self.attn, self.handle = attn, handle
        self.saved = getattr(attn, "alibi", None)

    def remove(self) -> None:
        self.handle.remove()
        if MAJOR < 4:
            self.attn.alibi = self.saved


# transformers' ALiBi attention classes, by family; each takes its bias another way.
ALIBI_ATTENTION = {"BloomAttention": "bloom", "MptAttention": "mpt", "FalconAttention": "falcon"}


def attention_family(attn: nn.Module) -> str:
    """Which Hugging Face attention class ``attn`` is or wraps (a 4.x bridge's attention wraps
    one), as a family of :data:`ALIBI_ATTENTION`: ``"mpt"``, ``"falcon"``, else ``"bloom"`` (3.x's
    attention too). Each takes its ALiBi bias through another argument (:func:`hf_bias_pre_hook`).
    """
    name = type(getattr(attn, "original_component", None) or attn).__name__
    return ALIBI_ATTENTION.get(name, "bloom")


def hf_bias_pre_hook(build: BiasBuilder) -> Callable[[nn.Module, tuple, dict], tuple]:
    """A forward pre-hook (``with_kwargs=True``) for a Hugging Face ALiBi attention layer
    (``BloomAttention``, ``MptAttention``, ``FalconAttention``, or the 4.x bridge's wrapping
    one, which takes the same call) whose ALiBi bias becomes ``build``'s, for every row.

    Each takes it differently, all added to the already scaled ``q.k / sqrt(d_head)``:

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
    return _HFBiasHook(build)


class _HFBiasHook:
    """:func:`hf_bias_pre_hook`'s hook: a class, not a closure, so that a model carrying it can
    be pickled (``torch.save(model)``, ``copy.deepcopy``) whenever ``build`` can."""

    def __init__(self, build: BiasBuilder) -> None:
        self.build = build

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        batch, n_queries = hidden.shape[:2]
        family = attention_family(module)
        key_count = kwargs.get("alibi" if family == "bloom" else "attention_mask")
        n_keys = n_queries if key_count is None else key_count.shape[-1]
        bias = self.build(n_queries, n_keys, hidden.device).to(hidden.dtype)
        if family == "mpt":  # broadcast over the batch by the attention itself
            return args, kwargs | {"position_bias": bias}
        if family == "falcon":
            mask = kwargs["attention_mask"]
            lowest = torch.finfo(mask.dtype).min
            # Masked cells hold the float minimum (future keys, padding), far below any bias.
            masked = torch.where(mask <= lowest / 2, lowest, bias.to(mask.dtype))
            return args, kwargs | {"attention_mask": masked}
        bias = bias[None].expand(batch, -1, -1, -1)
        return args, kwargs | {"alibi": bias.reshape(-1, n_queries, n_keys)}


class _TL3BiasHook:
    """:func:`add_bias_hook`'s hook on 3.x: leaves exactly this call's bias rows on the module
    (a class, not a closure: picklable, as :class:`_HFBiasHook`)."""

    def __init__(self, build: BiasBuilder) -> None:
        self.build = build

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
        cache_entry = inputs.get("past_kv_cache_entry")
        # Position is dim 1 with or without split per-head inputs ([batch, pos, (head,) d_model]).
        n_queries = inputs["query_input"].shape[1]
        n_keys = n_queries + (0 if cache_entry is None else cache_entry.past_keys.shape[1])
        module.alibi = self.build(n_queries, n_keys, inputs["query_input"].device)


def add_bias_hook(attn: nn.Module, build: BiasBuilder) -> _BiasHandle:
    """Make attention layer ``attn`` add ``build(n_queries, n_keys, device)`` as its ALiBi bias.

    A forward pre-hook; hooks run in registration order, so the last one registered decides the
    bias. 3.x adds ``module.alibi[:, -query_ctx:, :key_ctx]`` and rebuilds it with its
    power-of-two slopes only when ``key_ctx`` outgrows it: a tensor holding exactly this call's
    rows is used as is, and keeps ``hook_attn_scores`` equal to ``q.k/sqrt(d) + bias`` (a longer
    cached one would shift every row by a constant). 4.x adds the bias the Hugging Face call
    passes (BLOOM's ``alibi``, MPT's ``position_bias``, Falcon's ``attention_mask``): it is
    replaced by the bias for every row (:func:`hf_bias_pre_hook`). ``handle.remove()`` undoes it.
    """
    hook = hf_bias_pre_hook(build) if MAJOR >= 4 else _TL3BiasHook(build)
    return _BiasHandle(attn, attn.register_forward_pre_hook(hook, with_kwargs=True))


def own_alibi_slopes(n_heads: int) -> Float[Tensor, " head_index"] | None:
    """The ALiBi slopes TransformerLens's attention builds by itself for ``n_heads`` heads
    (float32), read from its attention class: 3.x's ``2^(-8(h+1)/H)`` for every head count. None on
    4.x, whose attention applies what transformers applies for the model's config (exact for
    every head count). :func:`headsurgeon.loading.facts.applied_slopes` decides with it."""
    if MAJOR >= 4:
        return None
    from transformer_lens.components import AbstractAttention

    # The bias the attention class itself builds for two positions: row 1 is [-m_h, 0].
    bias = AbstractAttention.create_alibi_bias(n_heads, 2, "cpu")
    return -bias[:, 1, 0].to(torch.float32)
