"""TransformerLens 3.x: the backend whose models are ``HookedTransformer``\\ s.

Its per-head tensors ``W_Q`` ... ``W_O`` are parameters, its attention reads an ALiBi tensor
stored on the module and masks scores with ``-inf``, its key-value cache is TransformerLens's own
(entries ``[batch, pos, head, d_head]``). :class:`TransformerLens3` has the same methods as
:class:`~headsurgeon.backend.tl4.TransformerLens4`; :mod:`headsurgeon.backend` picks one at import.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import tempfile
from collections.abc import Iterator
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
    KVContents,
    appended,
    fused_config_refusal,
    held_pre_hooks,
    supported_models,
    unfired_hook,
)
from headsurgeon.errors import CheckpointError, UnsupportedArchitectureError, first_line

__all__ = [
    "TransformerLens3",
]

_ATTENTION_ARGS = ("query_input", "key_input", "value_input", "past_kv_cache_entry")


class TransformerLens3:
    """The operations that differ between TransformerLens majors, as 3.x does them (each
    method's contract is the public function of :mod:`headsurgeon.backend` of its name)."""

    supported = supported_models(3, "; MPT and Falcon need 4.x")
    wraps_hf_model = False  # it computes with its own copies of the weights
    loads_into_device_map = False  # a placed model is built, then dispatched
    kv_pos_dim = 1  # cache entries are [batch, pos, head, d_head]
    resumes_at_layer = True  # run_layers: its own start_at_layer, with a key-value cache
    bounded_architectures = ("BloomForCausalLM",)  # built one part at a time (backend.bounded)

    # --- models -----------------------------------------------------------------------------

    def model_class(self) -> type:
        from transformer_lens import HookedTransformer

        return HookedTransformer

    def check_built(self, model: nn.Module, where: str) -> None:
        """Nothing: a ``HookedTransformer`` converts only what it supports."""

    def check_architecture(
        self, config_dir: Path, hf_config: dict[str, Any], file: Path, dtype: torch.dtype
    ) -> Any:
        from huggingface_hub.errors import StrictDataclassError
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
            architecture = (hf_config.get("architectures") or ["<none>"])[0]
            raise _unsupported(architecture, hf_config, file, e) from e

    def convert_hf(
        self, hf_model: nn.Module, tokenizer: Any, *, name: str, prepend_bos: bool | None
    ) -> nn.Module:
        """The weights copied into a new ``HookedTransformer``."""
        from transformer_lens import HookedTransformer, loading_from_pretrained as tl_loading

        architecture = (hf_model.config.architectures or [type(hf_model).__name__])[0]
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

    def original_config(self, model: nn.Module) -> Any:
        """None: a ``HookedTransformer`` keeps no Hugging Face config."""
        return None

    def hf_architecture(self, model: nn.Module) -> str:
        return "BloomForCausalLM"  # the only family headsurgeon exports on 3.x

    def masked_score(self, dtype: torch.dtype) -> float:
        return -math.inf

    @contextlib.contextmanager
    def without_kv_cache(self, model: nn.Module) -> Iterator[nn.Module]:
        yield model  # 3.x keeps no cache unless given one

    def move(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device, print_details=False)

    def add_bias_hook(self, attn: nn.Module, build: BiasBuilder) -> Any:
        """A pre-hook leaving exactly this call's bias rows on the module as ``attn.alibi``."""
        handle = attn.register_forward_pre_hook(_BiasHook(build), with_kwargs=True)
        return _BiasHandle(attn, handle)

    def own_alibi_slopes(self, n_heads: int) -> Float[Tensor, " head_index"] | None:
        """``2^(-8(h+1)/H)`` for every head count, read from the attention class."""
        from transformer_lens.components import AbstractAttention

        # The bias the attention class itself builds for two positions: row 1 is [-m_h, 0].
        bias = AbstractAttention.create_alibi_bias(n_heads, 2, "cpu")
        return -bias[:, 1, 0].to(torch.float32)

    # --- weights ----------------------------------------------------------------------------

    def head_tensors(self, model: nn.Module, layer: int) -> dict[str, HeadTensor]:
        """The per-head parameters themselves."""
        attn = model.blocks[layer].attn
        return {
            name: HeadTensor(name, f"blocks.{layer}.attn.{name}", getattr(attn, name), _same)
            for name in HEAD_TENSORS
        }

    def unsplit(self, model: nn.Module) -> str | None:
        attn = model.blocks[0].attn
        if all(isinstance(getattr(attn, name, None), nn.Parameter) for name in HEAD_TENSORS):
            return None
        return f"no per-head {', '.join(HEAD_TENSORS)} parameters (quantised attention?)"

    def processed(self, model: nn.Module) -> bool:
        return False  # 3.x records processing in cfg.normalization_type (LNPre)

    def tl_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        return model.state_dict()

    # --- key-value caches ---------------------------------------------------------------------

    def new_kv_cache(self, model: nn.Module, batch: int, device: torch.device) -> Any:
        """TransformerLens's ``TransformerLensKeyValueCache``, its entries growing in place."""
        from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

        cache = TransformerLensKeyValueCache.init_cache(model.cfg, device, batch_size=batch)
        grow = _growing_entry_class()
        cache.entries = [grow(e.past_keys, e.past_values, e.frozen) for e in cache.entries]
        return cache

    def cached_length(self, cache: Any) -> int:
        return cache.previous_attention_mask.shape[1]

    def shared_cache(self, cache: Any, batch: int) -> Any:
        """TransformerLens's ``freeze()``, the entries viewed as ``batch`` rows."""
        cache.freeze()
        for entry in cache.entries:  # 3.x reads the cache as the call's batch
            entry.past_keys = entry.past_keys[:1].expand(batch, -1, -1, -1)
            entry.past_values = entry.past_values[:1].expand(batch, -1, -1, -1)
        cache.previous_attention_mask = cache.previous_attention_mask[:1].expand(batch, -1)
        return cache

    def cache_contents(self, cache: Any) -> list[tuple[Tensor, Tensor]]:
        return [(entry.past_keys, entry.past_values) for entry in cache.entries]

    def fill_cache(
        self, cache: Any, contents: KVContents, batch: int, device: torch.device, first: int
    ) -> Any:
        n_pos = contents[0][0].shape[self.kv_pos_dim]
        for entry, (keys, values) in zip(cache.entries[first:], contents, strict=True):
            entry.append(keys, values)
        cache.previous_attention_mask = torch.ones(
            batch, n_pos, dtype=cache.previous_attention_mask.dtype, device=device
        )
        return cache

    # --- the fused attention ------------------------------------------------------------------

    def fused_refusal(self, model: nn.Module) -> str | None:
        """Why ``model``'s attention cannot be replaced by the fused statistics path, or None:
        standard causal ALiBi attention, float32/float64 on CPU, no hook that would not fire."""
        cfg = model.cfg
        why = fused_config_refusal(cfg)
        if why is not None:
            return why
        flags = {
            "use_attn_result": cfg.use_attn_result,
            "attn_scores_soft_cap": (cfg.attn_scores_soft_cap or 0) > 0,
            "use_logn_attn": cfg.use_logn_attn,
            "clip_qkv": cfg.clip_qkv is not None,
            "use_attention_sinks": cfg.use_attention_sinks,
            "load_in_4bit": cfg.load_in_4bit,
            "attention_dir": cfg.attention_dir != "causal",
        }
        if any(flags.values()):
            return f"its config sets {next(name for name, on in flags.items() if on)}"
        reasons = (
            _attention_refusal(layer, block.attn) for layer, block in enumerate(model.blocks)
        )
        return next((reason for reason in reasons if reason), None)

    @contextlib.contextmanager
    def fused_attention(self, model: nn.Module, slopes: Tensor, attend: Attend) -> Iterator[None]:
        """Each attention layer's ``hook_z`` is ``attend(layer, q, k, v, slopes=...,
        scale=...)`` of its ``hook_q/k/v`` for the ``with`` block.

        headsurgeon's own bias hooks are held for the block: they would build the ``[head, pos,
        pos]`` bias the fused kernel forms per block of rows (``slopes``: its ``-m (t - j)``)."""
        attns = [block.attn for block in model.blocks]
        with held_pre_hooks(attns, _BiasHook):
            for layer, attn in enumerate(attns):
                attn.forward = functools.partial(_fused_forward, attn, layer, slopes, attend)
            try:
                yield
            finally:
                for attn in attns:
                    vars(attn).pop("forward", None)

    # --- passes cut at a block ----------------------------------------------------------------

    def run_to_layer(
        self, model: nn.Module, tokens: Int[Tensor, "batch pos"], stop_at_layer: int, cache: Any
    ) -> Float[Tensor, "batch pos d_model"]:
        """TransformerLens's own ``stop_at_layer``."""
        if cache is None:
            return model(tokens, stop_at_layer=stop_at_layer)
        ones = torch.ones_like(tokens)  # explicit: no pad-token guessing from the tokenizer
        return model(tokens, stop_at_layer=stop_at_layer, past_kv_cache=cache, attention_mask=ones)

    def run_from_layer(
        self, model: nn.Module, tokens: Tensor, resid_pre: Tensor, start_at_layer: int
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """TransformerLens's own ``start_at_layer``."""
        return model(resid_pre, start_at_layer=start_at_layer)

    def run_layers(
        self, model: nn.Module, resid_pre: Tensor, start: int, stop: int, cache: Any
    ) -> Float[Tensor, "batch pos d_model"]:
        """TransformerLens's own ``start_at_layer`` and ``stop_at_layer``, the cache's mask grown
        as its pass from tokens grows it (every block gets the mask that pass gives it)."""
        mask = None
        if cache is not None:
            ones = torch.ones(resid_pre.shape[:2], dtype=torch.long, device=resid_pre.device)
            mask = cache.append_attention_mask(ones)
        return model(
            resid_pre,
            start_at_layer=start,
            stop_at_layer=stop,
            past_kv_cache=cache,
            attention_mask=mask,
        )


def _attention_refusal(layer: int, attn: nn.Module) -> str | None:
    """Why one 3.x attention layer cannot take the fused path, or None."""
    from transformer_lens.components import Attention

    if type(attn) is not Attention or attn._attention_dir_override not in (None, "causal"):
        return f"blocks.{layer}.attn is a {type(attn).__name__}"
    if "forward" in vars(attn):  # Accelerate's offload wraps it: the weights load there
        return f"blocks.{layer}.attn's forward is wrapped (a device map's offload)"
    hooks = [*attn._forward_hooks.values(), *attn._forward_pre_hooks.values()]
    if any(not isinstance(hook, _BiasHook) for hook in hooks):
        return f"blocks.{layer}.attn has a hook of its own"
    return unfired_hook(attn, layer)


def _fused_forward(
    attn: nn.Module,
    layer: int,
    slopes: Tensor,
    attend: Attend,
    query_input: Tensor,
    key_input: Tensor,
    value_input: Tensor,
    past_kv_cache_entry: Any = None,
    additive_attention_mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    position_bias: Tensor | None = None,
) -> Float[Tensor, "batch pos d_model"]:
    """:meth:`TransformerLens3.fused_attention`'s forward: TransformerLens's own but for the
    pattern (``hook_q/k/v``, ``hook_z`` and the output projection as it computes them)."""
    given = (past_kv_cache_entry, additive_attention_mask, position_bias)
    padded = attention_mask is not None and not bool(attention_mask.all())
    if padded or any(x is not None for x in given):
        raise UnsupportedArchitectureError(
            "the fused attention takes whole sequences: no key-value cache, padding mask or "
            "position bias"
        )
    q, k, v = attn.calculate_qkv_matrices(query_input, key_input, value_input)
    z = attn.hook_z(
        attend(layer, q, k, v, slopes=slopes.to(q.device, q.dtype), scale=1 / attn.attn_scale)
    )
    w = attn.W_O.reshape(-1, attn.W_O.shape[-1]).T.contiguous()  # [d_model, head * d_head]
    return torch.nn.functional.linear(z.reshape(*z.shape[:2], -1), w, attn.b_O)


def _same(t: Tensor) -> Tensor:
    return t


def _unsupported(
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
        f"not supported by TransformerLens 3.x ({first_line(error)}); {TransformerLens3.supported}"
    )


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
            raise _unsupported(architecture, values, where, e) from e
        cfg.model_name = name
        # The config folder goes: without this TransformerLens would look the tokenizer up by
        # that path on the hub.
        cfg.tokenizer_name = None
        yield Path(tmp), cfg


def unused_positions(cfg: Any) -> Tensor:
    """``pos_embed.W_pos`` of an ALiBi model: unused, zeros (TransformerLens would otherwise fill
    it with uninitialised memory)."""
    return torch.zeros(cfg.n_ctx, cfg.d_model, dtype=cfg.dtype)


class _BiasHandle:
    """Removes a bias hook and the bias tensor it left on the module."""

    def __init__(self, attn: nn.Module, handle: Any) -> None:
        self.attn, self.handle = attn, handle
        self.saved = getattr(attn, "alibi", None)

    def remove(self) -> None:
        self.handle.remove()
        self.attn.alibi = self.saved


class _BiasHook:
    """:meth:`TransformerLens3.add_bias_hook`'s hook: leaves exactly this call's bias rows on the
    module (a class, not a closure: picklable, as
    :class:`~headsurgeon.backend.shared.HFBiasHook`)."""

    def __init__(self, build: BiasBuilder) -> None:
        self.build = build

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = dict(zip(_ATTENTION_ARGS, args, strict=False)) | kwargs
        cache_entry = inputs.get("past_kv_cache_entry")
        # Position is dim 1 with or without split per-head inputs ([batch, pos, (head,) d_model]).
        n_queries = inputs["query_input"].shape[1]
        n_keys = n_queries + (0 if cache_entry is None else cache_entry.past_keys.shape[1])
        module.alibi = self.build(n_queries, n_keys, inputs["query_input"].device)


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
            keys = appended(self.stores[0], self.past_keys, new_keys, 1)
            values = appended(self.stores[1], self.past_values, new_values, 1)
            self.stores = (keys, values)
            self.past_keys, self.past_values = keys.narrow(1, 0, n), values.narrow(1, 0, n)
            return self.past_keys, self.past_values

    return GrowingEntry
