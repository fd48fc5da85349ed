"""TransformerLens 4.x: the backend whose models are ``TransformerBridge``\\ s.

4.x removed ``HookedTransformer``: its ``TransformerBridge`` wraps the Hugging Face model itself,
splits BLOOM's fused ``query_key_value`` into ``q``/``k``/``v`` linear layers (its ``W_Q`` ... are
views of those), takes ALiBi from the Hugging Face call's arguments, masks scores with the float
minimum instead of ``-inf`` and keeps a Hugging Face ``DynamicCache`` (layers ``[batch, head, pos,
d_head]``). :class:`TransformerLens4` has the same methods as
:class:`~headsurgeon.backend.tl3.TransformerLens3`; :mod:`headsurgeon.backend` picks one at import.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from headsurgeon.backend.shared import (
    HEAD_TENSORS,
    Attend,
    BiasBuilder,
    HeadTensor,
    HFBiasHook,
    KVContents,
    fused_config_refusal,
    held_pre_hooks,
    hf_kv_cache,
    supported_models,
    unfired_hook,
)
from headsurgeon.errors import UnsupportedArchitectureError
from headsurgeon.families import FALCON, MPT, AlibiFamily, attention_family

__all__ = ["TransformerLens4"]


class TransformerLens4:
    """The operations that differ between TransformerLens majors, as 4.x does them (each
    method's contract is the public function of :mod:`headsurgeon.backend` of its name)."""

    supported = supported_models(4, ", MptForCausalLM, FalconForCausalLM")
    wraps_hf_model = True  # it computes with the wrapped Hugging Face model's tensors
    loads_into_device_map = True  # the Hugging Face model is the model
    kv_pos_dim = 2  # Hugging Face cache layers are [batch, head, pos, d_head]
    resumes_at_layer = False  # run_layers: see there
    bounded_architectures = ()  # a device map loads straight into the map

    # --- models -----------------------------------------------------------------------------

    def model_class(self) -> type:
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge

    def check_built(self, model: nn.Module, where: str) -> None:
        """A bridge the user built, not through :meth:`convert_hf`: its variant checked."""
        _check_variant(model.original_model.config.to_dict(), where)

    def check_architecture(
        self, config_dir: Path, hf_config: dict[str, Any], file: Path, dtype: torch.dtype
    ) -> None:
        """None once the architecture is known to have a 4.x adapter."""
        from transformer_lens.factories.architecture_adapter_factory import (
            SUPPORTED_ARCHITECTURES,
        )

        architecture = (hf_config.get("architectures") or ["<none>"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {architecture} (model_type {hf_config.get('model_type')}) in "
                f"{file} is not supported by TransformerLens 4.x (no architecture adapter); "
                f"{self.supported}"
            )
        _check_variant(hf_config, file)

    def convert_hf(
        self, hf_model: nn.Module, tokenizer: Any, *, name: str, prepend_bos: bool | None
    ) -> nn.Module:
        """A bridge wrapping ``hf_model`` itself, switched to transformers' eager attention."""
        from transformer_lens.model_bridge.sources import build_bridge_from_module

        architecture = (hf_model.config.architectures or [type(hf_model).__name__])[0]
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

    def original_config(self, model: nn.Module) -> Any:
        """The wrapped Hugging Face model's config (None for a model without one)."""
        return getattr(getattr(model, "original_model", None), "config", None)

    def hf_architecture(self, model: nn.Module) -> str:
        return type(model.original_model).__name__

    def masked_score(self, dtype: torch.dtype) -> float:
        return torch.finfo(dtype).min

    @contextlib.contextmanager
    def without_kv_cache(self, model: nn.Module) -> Iterator[nn.Module]:
        """The Hugging Face config's ``use_cache`` off for the block (on by default)."""
        config = self.original_config(model)
        if config is None:
            yield model
            return
        before = config.use_cache
        config.use_cache = False
        try:
            yield model
        finally:
            config.use_cache = before

    def move(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device, print_details=False)
        model.cfg.device = str(device)  # 4.x records only the type ("cuda" for "cuda:1")
        return model

    def add_bias_hook(self, attn: nn.Module, build: BiasBuilder) -> Any:
        """The Hugging Face call's own bias argument replaced (:class:`HFBiasHook`)."""
        return attn.register_forward_pre_hook(HFBiasHook(build), with_kwargs=True)

    def own_alibi_slopes(self, n_heads: int) -> None:
        """None: the attention applies what transformers applies for the model's config."""
        return None

    # --- the fused attention ------------------------------------------------------------------

    def fused_refusal(self, model: nn.Module) -> str | None:
        """Why ``model``'s attention cannot be replaced by the fused statistics path, or None:
        BLOOM's, MPT's or Falcon's bridge attention, float32/float64 on CPU, in eval mode, no
        hook that would not fire."""
        cfg = model.cfg
        why = fused_config_refusal(cfg)
        if why is not None:
            return why
        if getattr(cfg, "use_attn_result", False):
            return "its config sets use_attn_result"
        bridges = _fused_bridges()
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            generic = type(attn) is bridges[-1] and attention_family(attn) is not FALCON
            if type(attn) not in bridges or generic:
                return (
                    f"blocks.{layer}.attn is a {type(attn).__name__} (the fused path replaces "
                    "BLOOM's, MPT's and Falcon's bridge attention)"
                )
            if attn.training:
                return f"blocks.{layer}.attn is in training mode (its dropout)"
            hooks = [*attn._forward_hooks.values(), *attn._forward_pre_hooks.values()]
            if any(not isinstance(h, HFBiasHook) and h is not _cache_as_layer_past for h in hooks):
                return f"blocks.{layer}.attn has a hook of its own"
            why = unfired_hook(attn, layer)
            if why is not None:
                return why
        return None

    @contextlib.contextmanager
    def fused_attention(self, model: nn.Module, slopes: Tensor, attend: Attend) -> Iterator[None]:
        """Each attention bridge's ``_reconstruct_attention`` (scores to output projection)
        computes its head outputs as ``attend(layer, q, k, v, slopes= or key_bias=, scale=)`` of
        its ``hook_q/k/v`` for the ``with`` block (then the bridge's ``o``: ``hook_z`` fires).

        headsurgeon's own bias hooks are held for the block: they would build the ``[head, pos,
        pos]`` bias the fused kernel forms per block of rows (``slopes``: its ``-m (t - j)``). A
        layer without one adds the family's own bias of the key position, handed on as is."""
        attns = [block.attn for block in model.blocks]
        checked: dict[str, Any] = {}  # the last mask found causal (one per pass, every layer's)
        with held_pre_hooks(attns, HFBiasHook) as ours:
            for layer, attn in enumerate(attns):
                attn._reconstruct_attention = functools.partial(
                    _fused_reconstruct,
                    attn,
                    layer,
                    slopes if ours[layer] else None,
                    attend,
                    checked,
                )
            try:
                yield
            finally:
                for attn in attns:
                    vars(attn).pop("_reconstruct_attention", None)

    # --- weights ----------------------------------------------------------------------------

    def head_tensors(self, model: nn.Module, layer: int) -> dict[str, HeadTensor]:
        """Views of the ``q``/``k``/``v`` linear layers (``[head * d_head, d_model]``, heads in
        order; the forward pass reads those, never the stale fused copy) and of ``o``, the
        Hugging Face output projection: the same for every family's bridge."""
        attn = model.blocks[layer].attn
        n, d_head, d_model = model.cfg.n_heads, model.cfg.d_head, model.cfg.d_model
        paths = {id(p): name for name, p in model.named_parameters()}
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

    def unsplit(self, model: nn.Module) -> str | None:
        attn = model.blocks[0].attn
        linears = [getattr(getattr(attn, x, None), "original_component", None) for x in "qkvo"]
        width = model.cfg.n_heads * model.cfg.d_head
        if not all(isinstance(m, nn.Linear) for m in linears):
            return "no separate q, k, v and o linear layers (fused or quantised attention)"
        if any(m.weight.shape != (width, model.cfg.d_model) for m in linears[:3]):
            return "query, key or value projections narrower than n_heads x d_head"
        if len({m.bias is None for m in linears[:3]}) > 1:
            return "biases on some of its query, key and value projections but not all"
        return None

    def processed(self, model: nn.Module) -> bool:
        return bool(getattr(model, "_weights_processed", False))  # TransformerLens's flag

    def tl_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """Assembled from the tensors the bridge's forward pass uses (BLOOM's)."""
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
            for name, tensor in self.head_tensors(model, layer).items():
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

    # --- key-value caches ---------------------------------------------------------------------

    def new_kv_cache(self, model: nn.Module, batch: int, device: torch.device) -> Any:
        """Hugging Face's ``DynamicCache``, which the bridge's attention extends."""
        return hf_kv_cache()

    def cached_length(self, cache: Any) -> int:
        return cache.get_seq_length()

    def shared_cache(self, cache: Any, batch: int) -> Any:
        """A ``DynamicCache`` over the prompt's layers whose ``update`` returns them before the
        new keys and values but keeps none (``DynamicCache`` itself would keep ``batch``
        copies)."""
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

    def cache_contents(self, cache: Any) -> list[tuple[Tensor, Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized]

    def fill_cache(
        self, cache: Any, contents: KVContents, batch: int, device: torch.device, first: int
    ) -> Any:
        for layer, (keys, values) in enumerate(contents, start=first):
            cache.update(keys, values, layer)
        return cache

    # --- passes cut at a block ----------------------------------------------------------------

    def run_to_layer(
        self, model: nn.Module, tokens: Int[Tensor, "batch pos"], stop_at_layer: int, cache: Any
    ) -> Float[Tensor, "batch pos d_model"]:
        """A hook that ends the pass at the block's output: 4.x's own ``stop_at_layer`` runs the
        final LayerNorm and unembedding when it equals the number of layers."""
        found: list[Tensor] = []

        def stop(resid: Tensor, hook: Any) -> None:
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
        self, model: nn.Module, tokens: Tensor, resid_pre: Tensor, start_at_layer: int
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """A pass from ``tokens`` whose hook swaps ``resid_pre`` in: 4.x's own
        ``start_at_layer`` gives wrong logits on BLOOM (off by 2.4 nats at block 0 on the
        organism) and runs the earlier blocks anyway."""

        def swap(resid: Tensor, hook: Any) -> Tensor:
            return resid_pre

        with model.hooks(fwd_hooks=[(f"blocks.{start_at_layer}.hook_resid_pre", swap)]):
            return model(tokens)

    def run_layers(
        self, model: nn.Module, resid_pre: Tensor, start: int, stop: int, cache: Any
    ) -> Float[Tensor, "batch pos d_model"]:
        """Refused: the bridge runs the Hugging Face model from its tokens, every block (its
        own ``start_at_layer`` too, see :meth:`run_from_layer`), so a pass from a block would
        cost the whole pass; callers check :attr:`resumes_at_layer` and run from the tokens."""
        raise UnsupportedArchitectureError(
            f"TransformerLens {version('transformer-lens')} cannot start a pass at block "
            f"{start} without running the blocks before it; run from the tokens"
        )


def _fused_bridges() -> tuple[type, ...]:
    """The attention bridges whose ``_reconstruct_attention`` :func:`_fused_reconstruct`
    replaces (their own subclasses may compute otherwise: not these); the last one, ALiBi's
    generic bridge, for Falcon only."""
    from transformer_lens.model_bridge.generalized_components.alibi_joint_qkv_attention import (
        ALiBiJointQKVAttentionBridge,
    )
    from transformer_lens.model_bridge.generalized_components.bloom_attention import (
        BloomAttentionBridge,
    )
    from transformer_lens.model_bridge.generalized_components.mpt_alibi_attention import (
        MPTALiBiAttentionBridge,
    )

    return BloomAttentionBridge, MPTALiBiAttentionBridge, ALiBiJointQKVAttentionBridge


def _fused_reconstruct(
    attn: nn.Module,
    layer: int,
    slopes: Tensor | None,
    attend: Attend,
    checked: dict[str, Any],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """:meth:`TransformerLens4.fused_attention`'s ``_reconstruct_attention``: the bridge's own
    (BLOOM's, MPT's, Falcon's) up to the scores and from the head outputs on, the bias ``-m (t -
    j)`` of ``slopes`` or, where None, the family's own one the call hands it (``alibi``: BLOOM's
    ``m j``; ``position_bias``: MPT's ``m (j - last key)``; Falcon's, in the attention mask);
    ``checked``: the last mask found causal. Returns no pattern."""
    family = attention_family(attn)
    if family is MPT and attn._clip_qkv:  # as the MPT bridge clips, before the heads are split
        from transformer_lens.utilities.attention import clamp_qkv

        q, k, v = clamp_qkv(q, k, v, attn._clip_qkv)
    n_heads = attn.config.n_heads
    n_kv = (
        (getattr(attn.config, "n_key_value_heads", None) or n_heads)
        if family is FALCON
        else n_heads
    )
    q, k, v, batch, n_pos, d_head = attn._reshape_qkv_to_heads(q, k, v, n_heads, n_kv)
    k, v = attn._update_kv_cache(k, v, **kwargs)  # the call's cache filled, as the bridge does
    if n_kv != n_heads:  # Falcon's shared keys and values, repeated per head as the bridge does
        k, v = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))
    mask = kwargs.get("attention_mask")
    whole = k.shape[-2] == n_pos and mask is not None
    mask_bias = _mask_bias(mask, n_pos, checked) if whole else None
    # Falcon's bias is in its mask; the others' masks carry none, and it has no alibi argument.
    if mask_bias is None or (family is not FALCON and bool(mask_bias.any())):
        raise UnsupportedArchitectureError(
            "the fused attention takes whole sequences: no key-value cache or padding mask"
        )
    key_bias, scale = _own_bias(attn, family, mask_bias, n_heads, n_pos, d_head, kwargs)
    bias = {"key_bias": key_bias.to(q.dtype)}
    if slopes is not None:
        bias = {"slopes": slopes.to(q.device, q.dtype)}
    z = attend(layer, *(t.transpose(1, 2) for t in (q, k, v)), **bias, scale=scale)
    return attn._apply_output_projection(z.reshape(batch, n_pos, -1)), None


def _own_bias(
    attn: nn.Module,
    family: AlibiFamily,
    mask_bias: Tensor,
    n_heads: int,
    n_pos: int,
    d_head: int,
    kwargs: dict[str, Any],
) -> tuple[Tensor, float]:
    """The ``[head, key]`` bias the bridge adds by itself (its family's own: BLOOM's ``alibi``,
    MPT's ``position_bias``, Falcon's in the mask, ``mask_bias``) and its scale of ``q.k``."""
    if family is MPT:
        scale = attn._softmax_scale
        return kwargs["position_bias"][:, 0, -n_pos:], d_head**-0.5 if scale is None else scale
    if family is FALCON:
        if kwargs.get("alibi") is not None:  # transformers 5 folds it into the mask
            raise UnsupportedArchitectureError(
                "the fused attention takes Falcon's bias in its mask"
            )
        return mask_bias.expand(n_heads, -1), d_head**-0.5
    alibi = kwargs["alibi"]
    return _batch_rows(alibi.view(-1, n_heads, alibi.shape[-1])[..., :n_pos]), d_head**-0.5


def _mask_bias(mask: Tensor, n_pos: int, checked: dict[str, Any]) -> Tensor | None:
    """The ``[head or 1, key]`` bias that the attention mask a bridge is handed adds in every
    row (``[batch, head or 1, query, key]``: additive, the float minimum where masked; or
    boolean, True where masked, no bias) when it masks exactly the future keys, else None. The
    mask found so is kept in ``checked`` (a weak reference, its version and its bias: the other
    layers of the pass get the same tensor, unchanged)."""
    seen = checked.get("mask")
    if seen is not None and seen() is mask and checked["version"] == mask._version:
        return checked["bias"]
    part = mask[..., :n_pos]
    if part.shape[-2:] != (n_pos, n_pos):
        return None
    future = torch.ones(n_pos, n_pos, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        blocked, bias = part, torch.zeros(1, n_pos, device=mask.device)
    else:
        blocked = part <= torch.finfo(mask.dtype).min / 2
        bias = part[0, :, -1]  # the last row sees every key
    if not bool((blocked == future).all()):
        return None
    if mask.dtype != torch.bool:
        rows = bias[:, None, :]
        if not bool((torch.where(blocked, rows, part) == rows).all()):
            return None  # a bias of the distance, or other sequences' bias: not one per key
    checked.update(mask=weakref.ref(mask), version=mask._version, bias=bias)
    return bias


def _batch_rows(bias: Tensor) -> Tensor:
    """The ``[head, key]`` bias of a ``[batch, head, key]`` one whose rows are all the same."""
    if not bool((bias == bias[:1]).all()):
        raise UnsupportedArchitectureError(
            "the fused attention takes one bias for every sequence; these differ (padding?)"
        )
    return bias[0]


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the wanted activation is in hand."""


def _check_variant(hf_config: dict[str, Any], where: object) -> None:
    """One line for an architecture variant that TransformerLens 4.x converts wrongly."""
    if hf_config.get("model_type") == FALCON.name and hf_config.get("new_decoder_architecture"):
        # Its fused query_key_value is grouped per key-value head (each group's queries, key,
        # value); TransformerLens 4.3 splits it as [Q; K; V] (logits off by 0.3 on a tiny model).
        raise UnsupportedArchitectureError(
            f"Falcon with new_decoder_architecture (grouped key-value heads) in {where} is not "
            f"supported: TransformerLens {version('transformer-lens')} splits its grouped "
            "query_key_value in the wrong order, so its attention would not be the model's"
        )


def _pass_mpt_cache(model: nn.Module) -> None:
    """Make a bridge's MPT attention use the key-value cache transformers hands it.

    ``MptBlock`` passes it as ``cache=``; TransformerLens 4.3's attention looks for
    ``past_key_values`` or ``layer_past`` only, so without this every cached call (blocks of a
    long sequence, continuations of a prompt) would attend to its own positions alone.
    """
    for block in model.blocks:
        if attention_family(block.attn).cache_argument != "layer_past":
            block.attn.register_forward_pre_hook(_cache_as_layer_past, with_kwargs=True)


def _cache_as_layer_past(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # A module-level function, not a closure: a model with it stays picklable (torch.save).
    if kwargs.get("cache") is not None and kwargs.get("layer_past") is None:
        kwargs = dict(kwargs)
        kwargs["layer_past"] = kwargs.pop("cache")
    return args, kwargs
