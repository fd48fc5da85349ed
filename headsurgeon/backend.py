"""The one module that imports TransformerLens: the same operations on its 3.x and 4.x models.

TransformerLens 3.x models are ``HookedTransformer``\\ s, whose per-head tensors ``W_Q`` ... ``W_O``
are parameters and whose attention reads an ALiBi tensor stored on the module. 4.x removed
``HookedTransformer``: its ``TransformerBridge`` wraps the Hugging Face model itself, splits BLOOM's
fused ``query_key_value`` into ``q``/``k``/``v`` linear layers (its ``W_Q`` ... are views of
those), takes ALiBi from the Hugging Face call's ``alibi`` argument and masks scores with the
float minimum instead of ``-inf``. Everything that differs is here; the rest of headsurgeon speaks
TransformerLens 3.x's names (``hook_pattern``, ``hook_z``, ``W_Q[head]``) on either major.

Exports:
    MAJOR, Model, HookPoint          TransformerLens's major version, its model class, hook type
    convert_hf(hf_model, ...)        a transformers causal LM as the major's model (unprocessed)
    hub_names()                      TransformerLens's model names and aliases -> hub names
    hf_config(model)                 the Hugging Face config a 4.x bridge computes with
    check_architecture(...)          TransformerLens's verdict on a config.json, before weights
    check_model(model, name)         one line unless ``model`` is a loaded model (not a name, a
                                     path, ``None``, a Hugging Face model or one on ``meta``)
    move(model, device)              ``model.to(device)`` without TransformerLens's printing
    without_kv_cache(model)          no key-value cache filled in the ``with`` block (4.x's default)
    offloaded(model)                 the modules whose weights Accelerate keeps on CPU or disk
    resident(module)                 those weights loaded for a ``with`` block (read them there)
    HEAD_TENSORS                     the per-head attention tensors, TransformerLens 3.x names
    HeadTensor, head_tensors(model, layer)   per-head views of the parameters attention uses
    check_head_tensors(model)        one-line error unless every head has its own Q/K/V/O
    check_unprocessed(model)         one-line error if a 4.x bridge's weights were processed
    add_bias_hook(attn, build)       make one attention layer use ``build``'s ALiBi bias
    hf_bias_pre_hook(build)          the same for a Hugging Face BLOOM/MPT/Falcon attention
    attention_family(attn)           which of those an attention layer is ("bloom", ...)
    ALIBI_ATTENTION                  transformers' ALiBi attention classes -> their family
    builtin_slopes(model)            the ALiBi slopes the attention class applies by itself
    run_to_layer(model, tokens, n)   the residual stream after block ``n - 1``, nothing after
    new_kv_cache(model, batch, device)  an empty key-value cache for ``run_to_layer(cache=)``
    hf_kv_cache()                    an empty ``DynamicCache`` for a transformers model
    cached_length(cache)             how many positions it holds
    shared_cache(cache, batch)       one prompt's cache, read by ``batch`` rows without copies
    KV_POS_DIM                       the position dimension of a cache's keys and values
    cache_contents(cache)            each layer's cached keys and values (views)
    cache_holding(model, contents, ...)  a cache already holding given keys and values
    run_from_layer(model, tokens, resid, n)  the logits of a pass entering block ``n`` with resid
    tl_state_dict(model)             the weights under TransformerLens 3.x's names and layouts
"""

from __future__ import annotations

import headsurgeon.progress  # noqa: F401  # isort: skip (tqdm set up before TransformerLens)
import contextlib
import dataclasses
import functools
import json
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
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

__all__ = [
    "ALIBI_ATTENTION",
    "HEAD_TENSORS",
    "MAJOR",
    "HeadTensor",
    "HookPoint",
    "KV_POS_DIM",
    "Model",
    "add_bias_hook",
    "attention_family",
    "builtin_slopes",
    "cache_contents",
    "cache_holding",
    "cached_length",
    "check_architecture",
    "check_head_tensors",
    "check_model",
    "check_unprocessed",
    "convert_hf",
    "head_tensors",
    "hf_bias_pre_hook",
    "hf_config",
    "hf_kv_cache",
    "hub_names",
    "move",
    "without_kv_cache",
    "offloaded",
    "resident",
    "new_kv_cache",
    "run_from_layer",
    "run_to_layer",
    "shared_cache",
    "tl_state_dict",
]

BiasBuilder = Callable[[int, int, torch.device], Float[Tensor, "head_index query_pos key_pos"]]
HEAD_TENSORS = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O")


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
    # TransformerLens reads configs from a name or folder; give it the model's own config.
    with tempfile.TemporaryDirectory(prefix="headsurgeon-") as tmp:
        hf_model.config.save_pretrained(tmp)
        # A config built in code names no architecture; TransformerLens converts by that name.
        file = Path(tmp) / "config.json"
        config = json.loads(file.read_text()) | {"architectures": [architecture]}
        file.write_text(json.dumps(config))
        try:
            cfg = tl_loading.get_pretrained_model_config(
                tmp, fold_ln=False, dtype=dtype, device="cpu", default_prepend_bos=prepend_bos
            )
        # NotImplementedError: no 3.x adapter (MPT, Falcon); AttributeError: 3.x reading a field
        # transformers 5 no longer has (GPT-2's n_ctx).
        except (NotImplementedError, AttributeError) as e:
            where = f"the in-memory {type(hf_model).__name__}"
            raise _unsupported_by_tl3(architecture, config, where, e) from e
        state_dict = tl_loading.get_pretrained_state_dict(tmp, cfg, hf_model=hf_model)
    if cfg.positional_embedding_type == "alibi":
        # Unused by ALiBi models; TransformerLens would otherwise fill it with uninitialised memory.
        state_dict["pos_embed.W_pos"] = torch.zeros(cfg.n_ctx, cfg.d_model, dtype=dtype)
    cfg.model_name = name
    # The config folder is gone: without this TransformerLens would look the tokenizer up by
    # that path on the hub.
    cfg.tokenizer_name = None
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


def hf_config(model: Model) -> dict[str, Any]:
    """The Hugging Face config a 4.x bridge computes with; ``{}`` on 3.x, whose models keep none."""
    if MAJOR < 4:
        return {}
    return model.original_model.config.to_dict()


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


# --- per-head weights -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadTensor:
    """One per-head attention tensor: the parameter the forward pass uses, and how to see it
    with heads first in TransformerLens 3.x's layout (``W_Q``: ``[head, d_model, d_head]``).

    ``heads(t)`` is a view of ``t`` (the parameter, a mask or a copy of the same shape), so
    writing ``heads(t)[h]`` writes head ``h``'s slice of ``t``.
    """

    name: str
    path: str
    param: nn.Parameter
    heads: Callable[[Tensor], Tensor]


def _same(t: Tensor) -> Tensor:
    return t


def head_tensors(model: Model, layer: int) -> dict[str, HeadTensor]:
    """``{name: HeadTensor}`` for ``W_Q, W_K, W_V, b_Q, b_K, b_V, W_O`` of one layer: those the
    model has. Attention without biases (MPT, Falcon with ``bias=False``) has no ``b_Q``, ``b_K``,
    ``b_V``: callers iterate over what is there, or test ``name in tensors``.

    On 4.x every family's bridge (BLOOM, MPT, Falcon-ALiBi) splits its fused QKV into ``q``/``k``/
    ``v`` linear layers, each ``[head * d_head, d_model]`` with heads in order (the forward pass
    reads those, never the stale fused copy), and ``o`` is the Hugging Face output projection:
    the views are the same for all three.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    >>> w = head_tensors(model, 0)["W_Q"]
    >>> tuple(w.heads(w.param).shape), torch.equal(w.heads(w.param), model.blocks[0].attn.W_Q)
    ((4, 32, 8), True)
    """
    check_head_tensors(model)
    attn = model.blocks[layer].attn
    if MAJOR < 4:
        return {
            name: HeadTensor(name, f"blocks.{layer}.attn.{name}", getattr(attn, name), _same)
            for name in HEAD_TENSORS
        }
    n, d_head, d_model = model.cfg.n_heads, model.cfg.d_head, model.cfg.d_model
    paths = _parameter_paths(model)
    out = {}
    for x in "QKV":
        linear = getattr(attn, x.lower()).original_component
        out[f"W_{x}"] = HeadTensor(
            f"W_{x}",
            paths[id(linear.weight)],
            linear.weight,
            lambda t: t.view(n, d_head, d_model).transpose(1, 2),
        )
        if linear.bias is not None:
            out[f"b_{x}"] = HeadTensor(
                f"b_{x}", paths[id(linear.bias)], linear.bias, lambda t: t.view(n, d_head)
            )
    dense = attn.o.original_component.weight
    out["W_O"] = HeadTensor(
        "W_O", paths[id(dense)], dense, lambda t: t.view(d_model, n, d_head).permute(1, 2, 0)
    )
    return {name: out[name] for name in HEAD_TENSORS if name in out}


def _parameter_paths(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def check_head_tensors(model: Model) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless every head has its own Q/K/V/O.

    Q/K/V biases may be absent (all three or none); keys and values shared by several heads
    (Falcon's ``multi_query``, grouped KV, ``new_decoder_architecture``) are refused, naming it.
    """
    reason = _shared_kv(model) or _unsplit(model)
    if reason is not None:
        raise UnsupportedArchitectureError(
            f"{type(model.blocks[0].attn).__name__} has {reason}; head surgery needs every head "
            "to have its own query, key, value and output slices"
        )


def _shared_kv(model: Model) -> str | None:
    """Why the heads share keys and values, or None if each head has its own."""
    config = model.original_model.config if MAJOR >= 4 else None  # read at every head_tensors
    n_kv = getattr(model.cfg, "n_key_value_heads", None)
    if getattr(config, "new_decoder_architecture", False):
        # Its fused QKV is grouped per KV head; TransformerLens 4.3 splits it as [Q; K; V].
        return "Falcon's new_decoder_architecture (grouped key-value heads)"
    if getattr(config, "multi_query", False):
        return f"multi-query attention (all {model.cfg.n_heads} heads share one key and value)"
    if n_kv not in (None, model.cfg.n_heads):
        return f"grouped-query attention ({n_kv} key-value heads for {model.cfg.n_heads} heads)"
    return None


def _unsplit(model: Model) -> str | None:
    """Why the attention has no per-head Q/K/V/O tensors (3.x parameters, 4.x linear layers)."""
    attn = model.blocks[0].attn
    if MAJOR < 4:
        if all(isinstance(getattr(attn, name, None), nn.Parameter) for name in HEAD_TENSORS):
            return None
        return f"no per-head {', '.join(HEAD_TENSORS)} parameters (quantised attention?)"
    linears = [getattr(getattr(attn, x, None), "original_component", None) for x in "qkvo"]
    width = model.cfg.n_heads * model.cfg.d_head
    if not all(isinstance(m, nn.Linear) for m in linears):
        return "no separate q, k, v and o linear layers (fused or quantised attention)"
    if any(m.weight.shape != (width, model.cfg.d_model) for m in linears[:3]):
        return "query, key or value projections narrower than n_heads x d_head"
    if len({m.bias is None for m in linears[:3]}) > 1:
        return "biases on some of its query, key and value projections but not all"
    return None


def check_unprocessed(model: Model) -> None:
    """Raise :class:`UnsupportedArchitectureError` if a 4.x bridge's ``process_weights`` ran.

    Its forward then skips the LayerNorm parameters it folded, so they no longer say what the
    model computes. (3.x records processing in ``cfg.normalization_type``: ``LNPre``.)
    """
    if MAJOR >= 4 and getattr(model, "_weights_processed", False):  # TransformerLens's flag
        raise UnsupportedArchitectureError(
            "the model has processed weights (process_weights folded LayerNorm into the next "
            "layer); load it with headsurgeon.load_model, which keeps weights unprocessed"
        )


def tl_state_dict(model: Model) -> dict[str, Tensor]:
    """The weights under TransformerLens 3.x's names and layouts (``blocks.0.attn.W_Q``, ...).

    3.x: ``model.state_dict()``. 4.x (BLOOM): assembled from the tensors the bridge's forward pass
    uses (its ``q``/``k``/``v`` layers, not the stale fused ``qkv`` copy); a bridge whose weights
    ``process_weights`` folded (its LayerNorm parameters are then unused) raises.
    """
    if MAJOR < 4:
        return model.state_dict()
    check_unprocessed(model)
    sd = {
        "embed.W_E": model.embed.original_component.weight,
        "embed.ln.w": model.embed_ln.original_component.weight,
        "embed.ln.b": model.embed_ln.original_component.bias,
        "ln_final.w": model.ln_final.original_component.weight,
        "ln_final.b": model.ln_final.original_component.bias,
        "unembed.W_U": model.unembed.original_component.weight.T,
        "unembed.b_U": model.unembed.b_U,  # a zero buffer: BLOOM has no unembedding bias
    }
    for layer, block in enumerate(model.blocks):
        p = f"blocks.{layer}."
        for name, tensor in head_tensors(model, layer).items():
            sd[p + "attn." + name] = tensor.heads(tensor.param)
        sd[p + "attn.b_O"] = block.attn.o.original_component.bias
        for ln in ("ln1", "ln2"):
            sd[p + f"{ln}.w"] = getattr(block, ln).original_component.weight
            sd[p + f"{ln}.b"] = getattr(block, ln).original_component.bias
        mlp_in, mlp_out = (
            block.mlp.original_component.dense_h_to_4h,
            block.mlp.original_component.dense_4h_to_h,
        )
        sd[p + "mlp.W_in"], sd[p + "mlp.b_in"] = mlp_in.weight.T, mlp_in.bias
        sd[p + "mlp.W_out"], sd[p + "mlp.b_out"] = mlp_out.weight.T, mlp_out.bias
    return {k: v.detach() for k, v in sd.items()}


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

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        batch, n_queries = hidden.shape[:2]
        family = attention_family(module)
        key_count = kwargs.get("alibi" if family == "bloom" else "attention_mask")
        n_keys = n_queries if key_count is None else key_count.shape[-1]
        bias = build(n_queries, n_keys, hidden.device).to(hidden.dtype)
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

    return hook


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
    if MAJOR >= 4:
        hook = hf_bias_pre_hook(build)
        return _BiasHandle(attn, attn.register_forward_pre_hook(hook, with_kwargs=True))

    def tl3_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
        cache_entry = inputs.get("past_kv_cache_entry")
        # Position is dim 1 with or without split per-head inputs ([batch, pos, (head,) d_model]).
        n_queries = inputs["query_input"].shape[1]
        n_keys = n_queries + (0 if cache_entry is None else cache_entry.past_keys.shape[1])
        module.alibi = build(n_queries, n_keys, inputs["query_input"].device)

    return _BiasHandle(attn, attn.register_forward_pre_hook(tl3_hook, with_kwargs=True))


def builtin_slopes(model: Model) -> Float[Tensor, " head_index"]:
    """The ALiBi slopes the model's attention applies without headsurgeon's hook (float32).

    3.x: what its attention class builds (``2^(-8(h+1)/H)`` for every head count). 4.x: what
    transformers applies for the model's config, exact for every head count: BLOOM's
    ``build_alibi_tensor``, MPT's (``alibi_bias_max`` 8, as ``MptModel`` calls it), Falcon's
    bias per token of distance (``bf16(m_h) / sqrt(d_head)``); see
    :func:`headsurgeon.alibi.config_slopes`.
    """
    from headsurgeon import alibi

    if MAJOR >= 4:
        return alibi.config_slopes(hf_config(model))
    # The bias the attention class itself builds for two positions: row 1 is [-m_h, 0].
    bias = type(model.blocks[0].attn).create_alibi_bias(model.cfg.n_heads, 2, "cpu")
    return -bias[:, 1, 0].to(torch.float32)


# --- forward passes ---------------------------------------------------------------------------


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the wanted activation is in hand."""


def new_kv_cache(model: Model, batch: int, device: torch.device) -> Any:
    """An empty key-value cache for ``batch`` sequences, as :func:`run_to_layer`'s ``cache``.

    3.x: TransformerLens's ``TransformerLensKeyValueCache``; 4.x: Hugging Face's
    ``DynamicCache``, which the bridge's attention extends (TransformerLens 4.x keeps none). Both
    keep each layer's keys and values in a buffer that doubles when full, so adding a block of
    positions copies that block only: their own ``torch.cat`` copies every earlier position
    again (65,536 tokens in blocks of 16: 490 s of copying alone, measured).
    """
    if MAJOR >= 4:
        return hf_kv_cache()
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    cache = TransformerLensKeyValueCache.init_cache(model.cfg, device, batch_size=batch)
    grow = _growing_entry_class()
    cache.entries = [grow(e.past_keys, e.past_values, e.frozen) for e in cache.entries]
    return cache


def hf_kv_cache() -> Any:
    """An empty Hugging Face ``DynamicCache`` whose layers append into doubling buffers (see
    :func:`new_kv_cache`): what a transformers model (or a 4.x bridge) takes as ``cache=``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = _growing_layer_class()
    return cache


def _pass_mpt_cache(model: Model) -> None:
    """Make a 4.x bridge's MPT attention use the key-value cache transformers hands it.

    ``MptBlock`` passes it as ``cache=``; TransformerLens 4.3's attention looks for
    ``past_key_values`` or ``layer_past`` only, so without this every cached call (blocks of a
    long sequence, continuations of a prompt) would attend to its own positions alone.
    """

    def rename(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("cache") is not None and kwargs.get("layer_past") is None:
            kwargs = dict(kwargs)
            kwargs["layer_past"] = kwargs.pop("cache")
        return args, kwargs

    for block in model.blocks:
        if attention_family(block.attn) == "mpt":
            block.attn.register_forward_pre_hook(rename, with_kwargs=True)


def _appended(store: Tensor | None, current: Tensor, new: Tensor, dim: int) -> Tensor:
    """A buffer whose first ``current.shape[dim] + new.shape[dim]`` positions along ``dim`` are
    ``current`` then ``new``: ``store`` written in place when ``current`` is its front part and
    it has room, else a new buffer of twice the size."""
    length, added = current.shape[dim], new.shape[dim]
    owned = (
        store is not None
        and current.data_ptr() == store.data_ptr()
        and current.shape[:dim] == store.shape[:dim]
        and current.dtype == new.dtype
    )
    if not owned or store.shape[dim] < length + added:
        shape = list(new.shape)
        shape[dim] = max(length + added, 2 * length)
        grown = new.new_empty(shape)
        grown.narrow(dim, 0, length).copy_(current)
        store = grown
    store.narrow(dim, length, added).copy_(new)
    return store


@functools.cache
def _growing_entry_class() -> type:
    from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry

    class GrowingEntry(TransformerLensKeyValueCacheEntry):
        """TransformerLens's cache entry, appending into doubling buffers (see new_kv_cache)."""

        stores: tuple[Tensor | None, Tensor | None] = (None, None)

        def append(self, new_keys: Tensor, new_values: Tensor) -> tuple[Tensor, Tensor]:
            if self.frozen:  # shared by continuations: TransformerLens's own copy
                return super().append(new_keys, new_values)
            n = self.past_keys.shape[1] + new_keys.shape[1]
            keys = _appended(self.stores[0], self.past_keys, new_keys, 1)
            values = _appended(self.stores[1], self.past_values, new_values, 1)
            self.stores = (keys, values)
            self.past_keys, self.past_values = keys.narrow(1, 0, n), values.narrow(1, 0, n)
            return self.past_keys, self.past_values

    return GrowingEntry


@functools.cache
def _growing_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """Hugging Face's dynamic cache layer, appending into doubling buffers (new_kv_cache)."""

        stores: tuple[Tensor | None, Tensor | None] = (None, None)

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            n = self.keys.shape[-2] + key_states.shape[-2]
            keys = _appended(self.stores[0], self.keys, key_states, self.keys.dim() - 2)
            values = _appended(self.stores[1], self.values, value_states, self.values.dim() - 2)
            self.stores = (keys, values)
            self.keys, self.values = keys.narrow(-2, 0, n), values.narrow(-2, 0, n)
            return self.keys, self.values

    return GrowingLayer


def cached_length(cache: Any) -> int:
    """How many positions a :func:`new_kv_cache` holds (0 if the attention ignored it)."""
    return cache.get_seq_length() if MAJOR >= 4 else cache.previous_attention_mask.shape[1]


def shared_cache(cache: Any, batch: int) -> Any:
    """A key-value cache holding one prompt, made to serve a call of ``batch`` continuations:
    each row reads the prompt's keys and values (a view, not a copy) and nothing is added.

    3.x: TransformerLens's ``freeze()``, the entries viewed as ``batch`` rows. 4.x: a
    ``DynamicCache`` over the prompt's layers whose ``update`` returns them before the new keys
    and values but keeps none (``DynamicCache`` itself would keep ``batch`` copies).
    """
    if MAJOR < 4:
        cache.freeze()
        for entry in cache.entries:  # 3.x reads the cache as the call's batch
            entry.past_keys = entry.past_keys[:1].expand(batch, -1, -1, -1)
            entry.past_values = entry.past_values[:1].expand(batch, -1, -1, -1)
        cache.previous_attention_mask = cache.previous_attention_mask[:1].expand(batch, -1)
        return cache
    from transformers import DynamicCache

    class Shared(DynamicCache):
        def update(
            self, keys: Tensor, values: Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[Tensor, Tensor]:
            past = self.layers[layer_idx]
            rows = (len(keys), -1, -1, -1)
            return (
                torch.cat([past.keys.expand(rows), keys], dim=-2),
                torch.cat([past.values.expand(rows), values], dim=-2),
            )

    shared = Shared()
    shared.layers = cache.layers  # the lengths, masks and ALiBi positions follow the prompt's
    return shared


# Where a cache keeps positions: 3.x's entries are [batch, pos, head, d_head], Hugging Face's
# layers [batch, head, pos, d_head].
KV_POS_DIM = 1 if MAJOR < 4 else 2


def cache_contents(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """Each layer's keys and values in a :func:`new_kv_cache` (views, positions along
    :data:`KV_POS_DIM`; empty when the attention left the cache empty)."""
    if MAJOR < 4:
        return [(entry.past_keys, entry.past_values) for entry in cache.entries]
    return [(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized]


def cache_holding(
    model: Model, contents: list[tuple[Tensor, Tensor]], batch: int, device: torch.device
) -> Any:
    """A :func:`new_kv_cache` already holding ``contents`` (each layer's keys and values, laid
    out as :func:`cache_contents` gives them, copied in): the next call continues after them,
    as if they were every earlier position. Any subset of earlier positions works for a model
    whose attention reads positions only through the cache's length (ALiBi: the bias then
    treats cache slots as positions, which the caller's bias hook can replace)."""
    cache = new_kv_cache(model, batch, device)
    n_pos = contents[0][0].shape[KV_POS_DIM] if contents else 0
    if not n_pos:
        return cache
    if MAJOR >= 4:
        for layer, (keys, values) in enumerate(contents):
            cache.update(keys, values, layer)
        return cache
    for entry, (keys, values) in zip(cache.entries, contents, strict=True):
        entry.append(keys, values)
    cache.previous_attention_mask = torch.ones(
        batch, n_pos, dtype=cache.previous_attention_mask.dtype, device=device
    )
    return cache


def run_to_layer(
    model: Model, tokens: Int[Tensor, "batch pos"], stop_at_layer: int, *, cache: Any = None
) -> Float[Tensor, "batch pos d_model"]:
    """The residual stream after block ``stop_at_layer - 1``; no later block, no unembedding.

    Hooks already on the model fire as usual. (4.x's own ``stop_at_layer`` runs the final
    LayerNorm and unembedding when it equals the number of layers.) With ``cache`` (from
    :func:`new_kv_cache`) the tokens continue the cached positions, and the cache grows by them.
    """
    if MAJOR < 4:
        if cache is None:
            return model(tokens, stop_at_layer=stop_at_layer)
        ones = torch.ones_like(tokens)  # explicit: no pad-token guessing from the tokenizer
        return model(tokens, stop_at_layer=stop_at_layer, past_kv_cache=cache, attention_mask=ones)
    found: list[Tensor] = []

    def stop(resid: Tensor, hook: HookPoint) -> None:
        found.append(resid)
        raise _Stop

    kwargs = {} if cache is None else {"cache": cache, "use_cache": True}
    with model.hooks(fwd_hooks=[(f"blocks.{stop_at_layer - 1}.hook_resid_post", stop)]):
        try:
            model(tokens, **kwargs)
        except _Stop:
            pass
    return found[0]


def run_from_layer(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    resid_pre: Float[Tensor, "batch pos d_model"],
    start_at_layer: int,
) -> Float[Tensor, "batch pos d_vocab"]:
    """The logits of a pass whose block ``start_at_layer`` gets ``resid_pre`` as its input.

    3.x starts at that block. 4.x's own ``start_at_layer`` gives wrong logits on BLOOM (off by
    2.4 nats at block 0 on the organism) and runs the earlier blocks anyway: here the pass runs
    from ``tokens`` and a hook swaps ``resid_pre`` in.
    """
    if MAJOR < 4:
        return model(resid_pre, start_at_layer=start_at_layer)

    def swap(resid: Tensor, hook: HookPoint) -> Tensor:
        return resid_pre

    with model.hooks(fwd_hooks=[(f"blocks.{start_at_layer}.hook_resid_pre", swap)]):
        return model(tokens)
