"""The transformers ALiBi families, BLOOM, MPT and Falcon (``alibi=True``), as one class each.

What differs between them is a method or an attribute of :class:`AlibiFamily`, overridden side
by side in :class:`Bloom`, :class:`Mpt` and :class:`Falcon`: the slopes transformers applies,
the bias each forms by itself (its form, its dtypes), the argument its attention takes the bias
in (the bias hook), its eager attention op for op (the precision counterfactual), its Hugging
Face layout (the export) and what loading reads from its config. A model's family is chosen once,
from its config (:func:`config_family`), its attention class (:func:`attention_family`) or its
:class:`~headsurgeon.loading.facts.ModelShape` (``shape.alibi_family``).

>>> config_family({"model_type": "falcon", "alibi": True}).title
'Falcon'
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from headsurgeon import alibi
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError

__all__ = [
    "BLOOM",
    "FALCON",
    "FAMILIES",
    "MPT",
    "AlibiFamily",
    "Bloom",
    "Falcon",
    "Mpt",
    "attention_family",
    "config_family",
    "config_slopes",
]


class AlibiFamily:
    """One transformers ALiBi family: the attributes and methods that differ between them (each
    subclass overrides what its family does otherwise; the methods that raise, all of them)."""

    name: str  # its config's model_type
    title: str  # as the docs and messages name it
    architecture: str  # its causal LM class
    attention: str  # its attention class
    heads_field: str  # the config field of its head count
    width_field: str  # the config field of its width
    context_field: str  # the transformers config attribute of its context length
    cache_argument = "layer_past"  # the keyword its attention takes the key-value cache as
    own_form = "absolute"  # the bias form it computes by itself (loading.numerics' names)
    own_form_words: str  # how it forms that bias, in words (the tables' attrs)
    product_dtype = torch.float32  # the dtype of its product slope x position
    divides_by_sqrt_d_head = False  # whether it divides that bias by sqrt(d_head) after the cast
    casts_bias = True  # whether it casts that bias to the model's dtype
    keeps_own_standard_bias = False  # whether headsurgeon's standard ALiBi leaves its own
    reads_config_class = True  # a folder's shape read through its transformers config class
    # Its export (checkpoints.save_hf): the fused query-key-value projection's name per layer,
    # whether its rows are per head (q, k, v) or [Q; K; V], the embedding lm_head may tie to.
    qkv_path: str
    interleaved = True
    embeddings: str
    writes_own_config = True  # the export's config.json is the model's own (4.x's bridge)
    article = "a"

    def __repr__(self) -> str:
        return f"<ALiBi family {self.title}>"

    # --- slopes -----------------------------------------------------------------------------

    def slopes(self, n_heads: int, d_head: int | None = None) -> Float[Tensor, " head_index"]:
        """The slopes transformers applies per token of distance (float32; Falcon's need
        ``d_head``)."""
        return alibi.slopes(n_heads)

    def applies_alibi(self, config: dict[str, Any]) -> bool:
        """Whether a model of this ``config.json`` adds an ALiBi bias."""
        return True

    def config_slopes(self, config: dict[str, Any]) -> Float[Tensor, " head_index"]:
        """:meth:`slopes` for a ``config.json`` of the family."""
        n_heads, width = config[self.heads_field], config.get(self.width_field)
        return self.slopes(n_heads, None if width is None else width // n_heads)

    def factors(self, per_token: Tensor, d_head: int) -> Tensor:
        """What it multiplies key positions by, from the slopes per token (float32)."""
        return per_token

    def ignored(self, config: dict[str, Any]) -> str | None:
        """A config setting transformers does not apply, in words (None: none)."""
        return None

    # --- its own bias -----------------------------------------------------------------------

    def own_bias(
        self, factors: Tensor, n_keys: int, dtype: torch.dtype, d_head: int, device: Any
    ) -> Tensor:
        """The bias it hands its attention, cast to ``dtype`` where it casts it."""
        raise NotImplementedError

    # --- the bias hook (backend.hf_bias_pre_hook) -------------------------------------------

    bias_argument = "attention_mask"  # the keyword whose last dimension counts the keys

    def with_bias(self, kwargs: dict, bias: Tensor, batch: int) -> dict:
        """The attention's keywords with ``bias`` (``[head, query, key]``) as its ALiBi bias."""
        raise NotImplementedError

    # --- its eager attention, op for op (precision) -----------------------------------------

    def qkv(
        self, module: nn.Module, hidden: Tensor, args: dict, n_heads: int, d_head: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[batch, head, pos, d_head]`` (keys and values after the
        cache, shared ones repeated per head), in the module's dtype."""
        q, k, v = self.project(module, hidden, n_heads, d_head)
        cache = args.get(self.cache_argument)
        if cache is not None:
            k, v = cache.update(k, v, module.layer_idx)
        return q, k, v

    def project(
        self, module: nn.Module, hidden: Tensor, n_heads: int, d_head: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of the new positions from its fused projection."""
        raise NotImplementedError

    def scores(
        self, module: nn.Module, q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor
    ) -> Tensor:
        """The masked pre-softmax scores ``[batch, head, query, key]`` as it forms them from ``q``,
        ``k`` (in the scores' dtype) and ``bias`` (``[head, query or 1, key]``: its own, or the
        bias hook's)."""
        raise NotImplementedError

    def output(
        self, module: nn.Module, weights: Tensor, v: Tensor, args: dict, d_head: int
    ) -> tuple[Tensor, Tensor]:
        """The attention module's return value from the weights."""
        raise NotImplementedError


class Bloom(AlibiFamily):
    """BLOOM (transformers' ``modeling_bloom``)."""

    name, title, architecture, attention = "bloom", "BLOOM", "BloomForCausalLM", "BloomAttention"
    heads_field, width_field, context_field = "n_head", "hidden_size", "seq_length"
    own_form_words = (
        "slope x key position in float32, cast to the dtype (BloomModel, Megatron-DeepSpeed)"
    )
    reads_config_class = False  # headsurgeon's own BLOOM checks (loading.checks)
    qkv_path = "transformer.h.{}.self_attention.query_key_value"
    embeddings = "transformer.word_embeddings.weight"
    writes_own_config = False  # built from TransformerLens's config (3.x has no other)
    bias_argument = "alibi"

    def own_bias(
        self, factors: Tensor, n_keys: int, dtype: torch.dtype, d_head: int, device: Any
    ) -> Tensor:
        # BloomModel.forward: slopes x key position, cast.
        keys = torch.arange(n_keys, device=device)
        return (factors.to(device)[:, None, None] * keys).to(dtype)

    def with_bias(self, kwargs: dict, bias: Tensor, batch: int) -> dict:
        n_heads, n_queries, n_keys = bias.shape
        bias = bias[None].expand(batch, -1, -1, -1)
        return kwargs | {"alibi": bias.reshape(-1, n_queries, n_keys)}

    def project(
        self, module: nn.Module, hidden: Tensor, n_heads: int, d_head: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        return module._reshape(module.query_key_value(hidden))

    def scores(
        self, module: nn.Module, q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor
    ) -> Tensor:
        batch, n_heads, n_queries, d_head = q.shape
        n_keys = k.shape[2]
        bias = bias[None].expand(batch, -1, -1, -1).reshape(batch * n_heads, -1, n_keys)
        scores = bias.baddbmm(
            batch1=q.reshape(batch * n_heads, -1, d_head),
            batch2=k.reshape(batch * n_heads, -1, d_head).transpose(-1, -2),
            beta=module.beta,
            alpha=module.inv_norm_factor,
        ).view(batch, n_heads, n_queries, -1)
        return scores if mask is None else scores + mask

    def output(
        self, module: nn.Module, weights: Tensor, v: Tensor, args: dict, d_head: int
    ) -> tuple[Tensor, Tensor]:
        from transformers.models.bloom.modeling_bloom import dropout_add

        batch, n_heads, n_queries, _ = weights.shape
        context = torch.bmm(
            weights.view(batch * n_heads, n_queries, -1), v.reshape(batch * n_heads, -1, d_head)
        )
        out = module.dense(module._merge_heads(context))
        return dropout_add(out, args["residual"], module.hidden_dropout, module.training), weights


class Mpt(AlibiFamily):
    """MPT (transformers' ``modeling_mpt``): ALiBi always, its bias float32 from the last key."""

    name, title, architecture, attention = "mpt", "MPT", "MptForCausalLM", "MptAttention"
    heads_field, width_field, context_field = "n_heads", "d_model", "max_seq_len"
    cache_argument = "cache"
    own_form = "last-key"
    own_form_words = (
        "slope x distance back from the last key in float32, whatever the dtype "
        "(build_mpt_alibi_tensor)"
    )
    casts_bias = False
    qkv_path = "transformer.blocks.{}.attn.Wqkv"
    interleaved = False  # chunked into thirds: [Q; K; V]
    embeddings = "transformer.wte.weight"
    article = "an"

    def slopes(self, n_heads: int, d_head: int | None = None) -> Float[Tensor, " head_index"]:
        # alibi_bias_max 8, the value transformers' MptModel uses whatever the config says.
        return alibi.mpt_slopes(n_heads)

    def ignored(self, config: dict[str, Any]) -> str | None:
        bias_max = (config.get("attn_config") or {}).get("alibi_bias_max", 8)
        if bias_max == 8:
            return None
        return (
            f"the MPT config sets attn_config.alibi_bias_max={bias_max}, but transformers' "
            "MptModel applies the ALiBi slopes of alibi_bias_max=8 (it never passes the config's "
            "value); headsurgeon measures what transformers computes, with those slopes"
        )

    def own_bias(
        self, factors: Tensor, n_keys: int, dtype: torch.dtype, d_head: int, device: Any
    ) -> Tensor:
        # build_mpt_alibi_tensor, the last n_keys columns: float32, relative to the last key.
        position = torch.arange(1 - n_keys, 1, dtype=torch.int32, device=device)
        return position * factors.to(device)[:, None, None]

    def with_bias(self, kwargs: dict, bias: Tensor, batch: int) -> dict:
        return kwargs | {"position_bias": bias}  # broadcast over the batch by the attention

    def project(
        self, module: nn.Module, hidden: Tensor, n_heads: int, d_head: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        batch, n_pos = hidden.shape[:2]
        mixed = module.Wqkv(hidden)
        if module.clip_qkv:
            mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
        return tuple(
            t.reshape(batch, n_pos, n_heads, d_head).transpose(1, 2) for t in mixed.chunk(3, dim=2)
        )

    def scores(
        self, module: nn.Module, q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor
    ) -> Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) * module.softmax_scale + bias
        return scores if mask is None else scores.masked_fill(mask, torch.finfo(q.dtype).min)

    def output(
        self, module: nn.Module, weights: Tensor, v: Tensor, args: dict, d_head: int
    ) -> tuple[Tensor, Tensor]:
        batch, _, n_queries, _ = weights.shape
        context = torch.matmul(weights, v)
        context = context.permute(0, 2, 1, 3).contiguous().view(batch, n_queries, -1)
        return module.out_proj(context), weights


class Falcon(AlibiFamily):
    """Falcon with ``alibi=True`` (transformers' ``modeling_falcon``): its bias in bfloat16,
    divided by ``sqrt(d_head)``, folded into the attention mask."""

    name, title, architecture, attention = (
        "falcon",
        "Falcon",
        "FalconForCausalLM",
        "FalconAttention",
    )
    heads_field, width_field, context_field = (
        "num_attention_heads",
        "hidden_size",
        "max_position_embeddings",
    )
    own_form_words = (
        "bfloat16(slope) x bfloat16(key position) in bfloat16 whatever the dtype, cast to "
        "the dtype, divided by sqrt(d_head) in it (Falcon's build_alibi_tensor)"
    )
    product_dtype = torch.bfloat16
    divides_by_sqrt_d_head = True
    # transformers hands its attention its own bias already (its bfloat16 products m_h j rounded
    # at every position, which a relative bias would not reproduce).
    keeps_own_standard_bias = True
    qkv_path = "transformer.h.{}.self_attention.query_key_value"
    embeddings = "transformer.word_embeddings.weight"

    def slopes(self, n_heads: int, d_head: int | None = None) -> Float[Tensor, " head_index"]:
        return alibi.falcon_slopes(n_heads, d_head)

    def applies_alibi(self, config: dict[str, Any]) -> bool:
        return bool(config.get("alibi"))

    def factors(self, per_token: Tensor, d_head: int) -> Tensor:
        # BLOOM's slopes: Falcon divides by sqrt(d_head) after the product.
        return (per_token.double() * math.sqrt(d_head)).float()

    def own_bias(
        self, factors: Tensor, n_keys: int, dtype: torch.dtype, d_head: int, device: Any
    ) -> Tensor:
        # build_alibi_tensor: the product in bfloat16; / sqrt(d) in the dtype.
        keys = torch.arange(n_keys, device=device)
        product = factors.to(device)[:, None].bfloat16() * keys
        return product.to(dtype)[:, None, :] / math.sqrt(d_head)

    def with_bias(self, kwargs: dict, bias: Tensor, batch: int) -> dict:
        mask = kwargs["attention_mask"]
        lowest = torch.finfo(mask.dtype).min
        # Masked cells hold the float minimum (future keys, padding), far below any bias.
        masked = torch.where(mask <= lowest / 2, lowest, bias.to(mask.dtype))
        return kwargs | {"attention_mask": masked}

    def qkv(
        self, module: nn.Module, hidden: Tensor, args: dict, n_heads: int, d_head: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        from transformers.models.falcon.modeling_falcon import repeat_kv

        q, k, v = super().qkv(module, hidden, args, n_heads, d_head)
        groups = module.num_key_value_groups
        return q, repeat_kv(k, groups), repeat_kv(v, groups)

    def project(
        self, module: nn.Module, hidden: Tensor, n_heads: int, d_head: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        batch, n_pos = hidden.shape[:2]
        fused = module.query_key_value(hidden).view(batch, n_pos, -1, d_head)
        if module.new_decoder_architecture:
            grouped = fused.view(batch, n_pos, module.num_kv_heads, -1, d_head)
            q = grouped[..., :-2, :].flatten(-3, -2)
            k, v = grouped[..., -2, :], grouped[..., -1, :]
        elif module.multi_query:
            q, k, v = fused.split([n_heads, 1, 1], dim=-2)
        else:
            q, k, v = fused.unflatten(-2, (n_heads, 3)).unbind(-2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def scores(
        self, module: nn.Module, q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor
    ) -> Tensor:
        # FalconModel folds the bias into the additive mask; its masked cells hold the minimum.
        lowest = torch.finfo(q.dtype).min
        masked = mask <= torch.finfo(mask.dtype).min / 2
        bias = torch.where(masked, lowest, bias[None])
        return torch.matmul(q, k.transpose(2, 3)) * module.scaling + bias

    def output(
        self, module: nn.Module, weights: Tensor, v: Tensor, args: dict, d_head: int
    ) -> tuple[Tensor, Tensor]:
        batch, _, n_queries, _ = weights.shape
        context = torch.matmul(weights, v).transpose(1, 2).contiguous()
        return module.dense(context.reshape(batch, n_queries, -1).contiguous()), weights


BLOOM, MPT, FALCON = Bloom(), Mpt(), Falcon()
FAMILIES = {family.name: family for family in (BLOOM, MPT, FALCON)}
ARCHITECTURES = {family.architecture: family for family in FAMILIES.values()}
ALIBI_ATTENTION = {family.attention: family for family in FAMILIES.values()}


def family_named(name: str) -> AlibiFamily:
    """The family whose ``model_type`` is ``name``; one line naming the known ones otherwise."""
    if name not in FAMILIES:
        raise InvalidArgumentError(
            f"unknown ALiBi family {name!r}; use one of {', '.join(FAMILIES)}"
        )
    return FAMILIES[name]


def config_family(config: dict[str, Any]) -> AlibiFamily:
    """The family of a Hugging Face ``config.json`` (a dict) of an ALiBi model; one
    :class:`UnsupportedArchitectureError` line for a model without ALiBi."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None or not family.applies_alibi(config):
        without = "without alibi " if family is not None else ""
        raise UnsupportedArchitectureError(
            f"model_type {model_type} {without}has no ALiBi slopes (headsurgeon knows BLOOM's, "
            "MPT's, and Falcon's with alibi: true)"
        )
    return family


def attention_family(attn: nn.Module) -> AlibiFamily:
    """The family of the Hugging Face attention class ``attn`` is or wraps (a 4.x bridge's
    attention wraps one); BLOOM for any other (3.x's attention: TransformerLens converts BLOOM
    only)."""
    name = type(getattr(attn, "original_component", None) or attn).__name__
    return ALIBI_ATTENTION.get(name, BLOOM)


def config_slopes(config: dict[str, Any]) -> Float[Tensor, " head_index"]:
    """The slopes transformers applies for a Hugging Face ``config.json`` (a dict); one
    :class:`UnsupportedArchitectureError` line for a model without ALiBi.

    >>> config_slopes({"model_type": "mpt", "n_heads": 2, "attn_config": {"alibi_bias_max": 16}})
    tensor([0.0625, 0.0039])
    """
    return config_family(config).config_slopes(config)


def transformers_slopes(hf_config: dict[str, Any], n_heads: int) -> Float[Tensor, " head_index"]:
    """:func:`config_slopes`, or BLOOM's for ``n_heads`` when there is no config (``{}``: a
    TransformerLens 3.x model built from its own config, which is always a BLOOM).

    >>> transformers_slopes({}, 2)
    tensor([0.0625, 0.0039])
    """
    return config_slopes(hf_config) if hf_config else BLOOM.slopes(n_heads)
