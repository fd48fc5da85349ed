"""Does low precision change an ALiBi model's outputs? The precision counterfactual.

Underflow to exact zero carries almost nothing (a row of ``T`` keys loses less than ``T`` times
the dtype's smallest weight, see :mod:`headsurgeon.blindness`). What changes outputs is
*rounding*: transformers' BLOOM adds ALiBi as ``slope x key position`` (softmax is
shift-invariant), casts that bias to the model's dtype and forms the scores
``alibi.baddbmm(q, k)`` in it. At key position 2,048 a slope-0.71 bias is ~1,450, where
bfloat16's spacing is 8: the content logits of a few units are rounded away.
:func:`precision_effect` measures it per dtype, part of the computation, position and head,
each against the same forward pass entirely in float64; ``with mitigation(model, "relative")``
it measures the cure, the bias formed from distances ``-m (i - j)``.

Exports:
    precision_effect(model, data, ...)   PrecisionEffect: dNLL, logits and top-1 by position;
                                         attention mass moved and lost by head and distance
    PrecisionEffect                      its tables: by_position, by_head
    PRECISION_DTYPES, PARTS, PART_MEANINGS
    HeadTable                            exact zeros and mass moved per recipe, head and distance
    PRECISION_BYTES_PER_ENTRY            bytes a block keeps per attention entry (block sizes)

The passes run on the ``transformers`` model of the family (:func:`headsurgeon.checkpoints.
hf_model`: BLOOM, MPT, Falcon with ``alibi=True``), whose attention modules compute, for the
length of a pass, as the family's own eager code does, op for op, with the rounding of one part
chosen (:class:`_Recipe`); long sequences run in blocks of query rows through a key-value cache
(memory linear in the length).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from headsurgeon import alibi, long_context
from headsurgeon.backend import Model
from headsurgeon.backend.cache import hf_kv_cache
from headsurgeon.blindness import active_mitigations, dtype_name
from headsurgeon.checkpoints import hf_model
from headsurgeon.data import Data, Sequences, as_sequences
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.evals.loss import check_edges, position_edges
from headsurgeon.exact_alibi import bias_builder, trained_bias
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.progress import tqdm
from headsurgeon.validation import check_bool, check_choice, check_int

__all__ = [
    "PARTS",
    "PART_MEANINGS",
    "PRECISION_DTYPES",
    "PrecisionEffect",
    "precision_effect",
    "HeadTable",
    "PRECISION_BYTES_PER_ENTRY",
]

logger = logging.getLogger(__name__)

PRECISION_DTYPES = ("float32", "bfloat16", "float16")
PARTS = ("scores", "softmax", "model")
PART_MEANINGS = {
    "scores": "the attention scores (ALiBi bias + q.k) formed and rounded in the dtype exactly "
    "as the family does; everything else float64",
    "softmax": "the attention weights rounded as the family does (softmax in float32, weights "
    "cast to the dtype) from float64 scores; everything else float64",
    "model": "the whole forward pass in the dtype, as transformers computes it",
}
# Bytes a block keeps per (batch, head, query, key) entry: the float64 scores and weights of the
# reference, and per recipe of the head table its scores, weights and three reductions.
PRECISION_BYTES_PER_ENTRY = 160


@dataclasses.dataclass
class PrecisionEffect:
    """What rounding does to a model (see :func:`precision_effect`).

    ``by_position``: one row per (dtype, part, position bucket). ``by_head``: one row per
    (dtype, part, layer, head, distance bucket). Run metadata in each table's ``attrs``.
    """

    by_position: pd.DataFrame
    by_head: pd.DataFrame


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """Where one pass rounds: ``part`` ``"float64"`` (the reference: everything float64, the
    softmax too) or one of :data:`PARTS` in ``dtype``; ``relative``: the ALiBi bias formed from
    distances ``-m (i - j)`` (the hook's form) instead of the family's own."""

    part: str
    dtype: torch.dtype
    relative: bool = False

    @property
    def model_dtype(self) -> torch.dtype:
        return self.dtype if self.part == "model" else torch.float64

    def scores_dtype(self, compute: torch.dtype) -> torch.dtype:
        return self.dtype if self.part in ("scores", "model") else compute

    def weights(self, scores: Tensor, compute: torch.dtype) -> Tensor:
        """The attention weights from the masked scores, in the pass's ``compute`` dtype."""
        if self.part in ("float64", "scores"):
            return torch.softmax(scores.to(compute), dim=-1)
        # Every family: softmax in float32, weights cast to the dtype (BLOOM, Falcon:
        # F.softmax(dtype=float32).to(dtype); MPT: softmax(scores.float()).to(dtype)).
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype).to(compute)


class _Family:
    """One transformers ALiBi family's attention, op for op as its eager code (transformers
    5.x ``modeling_bloom``, ``modeling_falcon``, ``modeling_mpt``), with the scores' dtype, the
    bias form and the weights' rounding chosen by a :class:`_Recipe`."""

    def __init__(self, hf: nn.Module) -> None:
        config = hf.config.to_dict()
        self.name = config["model_type"]
        if self.name == "falcon" and not config.get("alibi"):
            raise UnsupportedArchitectureError(
                "precision_effect measures ALiBi models; this Falcon uses rotary positions"
            )
        if config.get("pretraining_tp", 1) > 1 and config.get("slow_but_exact"):
            raise UnsupportedArchitectureError(
                "precision_effect follows BLOOM's eager attention; this config asks for its "
                "slow_but_exact tensor-parallel sums: set slow_but_exact to false"
            )
        self.n_heads = config[
            {"bloom": "n_head", "mpt": "n_heads"}.get(self.name, "num_attention_heads")
        ]
        self.d_head = config[{"mpt": "d_model"}.get(self.name, "hidden_size")] // self.n_heads
        # The slopes each family multiplies positions by (Falcon: in bfloat16, see _bias), and
        # the per-token slopes of the relative form (the hooks' :func:`alibi.config_slopes`).
        self.slopes = (
            alibi.mpt_slopes(self.n_heads) if self.name == "mpt" else alibi.slopes(self.n_heads)
        )
        relative = tuple(alibi.config_slopes(config).tolist())
        self.relative_bias = bias_builder("relative", {}, relative)
        self.modules = [m for m in hf.modules() if type(m).__name__ in _ATTENTION]

    def _bias(
        self, n_queries: int, n_keys: int, dtype: torch.dtype, relative: bool, device
    ) -> Tensor:
        """The ALiBi bias as the family (or, ``relative``, the bias hook) hands it to its
        attention, cast to ``dtype`` where the family casts it."""
        if relative:  # backend.hf_bias_pre_hook: built in float32, cast to the hidden dtype
            return self.relative_bias(n_queries, n_keys, device).to(dtype)
        keys = torch.arange(n_keys, device=device)
        if self.name == "bloom":  # BloomModel.forward: slopes x key position, cast
            return (self.slopes.to(device)[:, None, None] * keys).to(dtype)
        if self.name == "falcon":  # build_alibi_tensor: the product in bfloat16; / sqrt(d)
            product = self.slopes.to(device)[:, None].bfloat16() * keys
            return product.to(dtype)[None, :, None, :] / math.sqrt(self.d_head)
        # build_mpt_alibi_tensor, the last n_keys columns: float32, relative to the last key.
        position = torch.arange(1 - n_keys, 1, dtype=torch.int32, device=device)
        return position * self.slopes.to(device)[:, None, None]

    def qkv(self, module: nn.Module, hidden: Tensor, args: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[batch, head, pos, d_head]`` (keys and values after the
        cache, Falcon's shared ones repeated per head), in the module's dtype."""
        batch, n_pos = hidden.shape[:2]
        if self.name == "bloom":
            q, k, v = module._reshape(module.query_key_value(hidden))
            cache = args.get("layer_past")
        elif self.name == "mpt":
            mixed = module.Wqkv(hidden)
            if module.clip_qkv:
                mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
            q, k, v = (
                t.reshape(batch, n_pos, self.n_heads, self.d_head).transpose(1, 2)
                for t in mixed.chunk(3, dim=2)
            )
            cache = args.get("cache")
        else:
            fused = module.query_key_value(hidden).view(batch, n_pos, -1, self.d_head)
            if module.new_decoder_architecture:
                grouped = fused.view(batch, n_pos, module.num_kv_heads, -1, self.d_head)
                q = grouped[..., :-2, :].flatten(-3, -2)
                k, v = grouped[..., -2, :], grouped[..., -1, :]
            elif module.multi_query:
                q, k, v = fused.split([self.n_heads, 1, 1], dim=-2)
            else:
                q, k, v = fused.unflatten(-2, (self.n_heads, 3)).unbind(-2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cache = args.get("layer_past")
        if cache is not None:
            k, v = cache.update(k, v, module.layer_idx)
        if self.name == "falcon":
            from transformers.models.falcon.modeling_falcon import repeat_kv

            k, v = (
                repeat_kv(k, module.num_key_value_groups),
                repeat_kv(v, module.num_key_value_groups),
            )
        return q, k, v

    def scores(
        self,
        module: nn.Module,
        q: Tensor,
        k: Tensor,
        mask: Tensor | None,
        dtype: torch.dtype,
        relative: bool,
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        """The masked pre-softmax scores, formed from ``q``, ``k`` cast to ``dtype`` and the bias
        exactly as the family forms them (their dtype is the family's: ``dtype``, or float32
        where MPT adds its float32 bias, or float64 where a float64 mask is added)."""
        batch, n_heads, n_queries, d_head = q.shape
        n_keys = k.shape[2]
        q, k = q.to(dtype), k.to(dtype)
        bias = self._bias(n_queries, n_keys, dtype, relative, q.device)
        if self.name == "bloom":
            if relative:  # the hook's [batch * head, query, key]
                bias = bias[None].expand(batch, -1, -1, -1).reshape(-1, n_queries, n_keys)
            else:
                bias = bias.repeat(batch, 1, 1)
            scores = bias.baddbmm(
                batch1=q.reshape(batch * n_heads, -1, d_head),
                batch2=k.reshape(batch * n_heads, -1, d_head).transpose(-1, -2),
                beta=module.beta,
                alpha=module.inv_norm_factor,
            ).view(batch, n_heads, n_queries, -1)
            return scores if mask is None else scores + mask
        if self.name == "falcon":
            # FalconModel folds the bias into the additive mask; its masked cells hold the minimum.
            lowest = torch.finfo(dtype).min
            masked = mask <= torch.finfo(mask.dtype).min / 2
            bias = bias[None] if relative else bias
            bias = (
                torch.where(masked, lowest, bias) if relative else bias.masked_fill(masked, lowest)
            )
            return torch.matmul(q, k.transpose(2, 3)) * module.scaling + bias
        scores = torch.matmul(q, k.transpose(-1, -2)) * module.softmax_scale + bias
        return scores if mask is None else scores.masked_fill(mask, torch.finfo(q.dtype).min)

    def output(
        self, module: nn.Module, weights: Tensor, v: Tensor, args: dict
    ) -> tuple[Tensor, Tensor]:
        """The attention module's return value from the weights, as the family computes it."""
        batch, n_heads, n_queries, _ = weights.shape
        if self.name == "bloom":
            from transformers.models.bloom.modeling_bloom import dropout_add

            context = torch.bmm(
                weights.view(batch * n_heads, n_queries, -1),
                v.reshape(batch * n_heads, -1, self.d_head),
            )
            out = module.dense(module._merge_heads(context))
            return dropout_add(
                out, args["residual"], module.hidden_dropout, module.training
            ), weights
        context = torch.matmul(weights, v)
        if self.name == "mpt":
            context = context.permute(0, 2, 1, 3).contiguous().view(batch, n_queries, -1)
            return module.out_proj(context), weights
        context = context.transpose(1, 2).contiguous().reshape(batch, n_queries, -1).contiguous()
        return module.dense(context), weights


_ATTENTION = ("BloomAttention", "MptAttention", "FalconAttention")


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


@contextlib.contextmanager
def _recipe_attention(family: _Family, recipe: _Recipe, probe: Any = None) -> Iterator[None]:
    """Every attention module of the family computes by ``recipe`` for the ``with`` block
    (``probe(layer, q, k, mask, scores, weights)``: called with the reference's tensors)."""

    def forward(module: nn.Module, layer: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        bound = _signature(type(module)).bind(module, *args, **kwargs)
        named = bound.arguments | bound.arguments.get("kwargs", {})
        hidden = named["hidden_states"]
        compute = hidden.dtype
        q, k, v = family.qkv(module, hidden, named)
        mask = named.get("attention_mask")
        scores = family.scores(module, q, k, mask, recipe.scores_dtype(compute), recipe.relative)
        weights = recipe.weights(scores, compute)
        if probe is not None:
            probe(layer, q, k, mask, scores, weights)
        return family.output(module, weights, v, named)

    for layer, module in enumerate(family.modules):
        module.forward = functools.partial(forward, module, layer)
    try:
        yield
    finally:
        for module in family.modules:
            del module.forward


class HeadTable:
    """Per recipe, layer, head and distance bucket: causal entries exactly 0 in the recipe's
    weights, the float64 weight they held (lost mass) and half the absolute difference of the
    weights (moved mass: the total variation, summed over a row's keys)."""

    def __init__(
        self, family: _Family, recipes: list[_Recipe], n_layers: int, edges: list[int]
    ) -> None:
        self.family, self.recipes = family, recipes
        self.edges = torch.tensor(edges)
        shape = (len(recipes), 3, n_layers, family.n_heads, len(edges) - 1)
        self.sums = torch.zeros(shape, dtype=torch.float64)
        self.entries = torch.zeros(len(edges) - 1, dtype=torch.float64)

    @functools.lru_cache(maxsize=1)  # noqa: B019  (one block's shape at a time, freed with it)
    def _buckets(self, n_queries: int, n_keys: int, device: torch.device) -> Tensor:
        """``[query * key, bucket]``: 1 where the entry is causal and its distance in the bucket;
        a matrix product with it sums entries by bucket in one pass over them."""
        distance = alibi.distance_rows(n_queries, n_keys, device)
        causal = alibi.causal_rows(n_queries, n_keys, device).flatten()
        bucket = torch.bucketize(distance, self.edges[1:-1].to(device), right=True).flatten()
        onehot = torch.zeros(len(bucket), len(self.edges) - 1, dtype=torch.float64, device=device)
        onehot[causal.nonzero()[:, 0], bucket[causal]] = 1.0
        return onehot

    def __call__(
        self, layer: int, q: Tensor, k: Tensor, mask: Tensor | None, scores: Tensor, weights: Tensor
    ) -> None:
        batch, n_heads, n_queries, n_keys = weights.shape
        onehot = self._buckets(n_queries, n_keys, weights.device)
        if layer == 0:
            self.entries += onehot.sum(0).cpu() * batch
        module = self.family.modules[layer]
        softmax32 = None  # the float32 softmax of the float64 scores, shared by every dtype
        formed: dict[tuple[torch.dtype, bool], Tensor] = {}
        for i, recipe in enumerate(self.recipes):
            if recipe.part == "softmax":
                if softmax32 is None:
                    softmax32 = F.softmax(scores, dim=-1, dtype=torch.float32)
                rounded = softmax32.to(recipe.dtype).double()
            else:  # the scores (or the whole pattern) formed in the dtype from q and k
                key = (recipe.dtype, recipe.relative)
                if key not in formed:
                    formed[key] = self.family.scores(module, q, k, mask, *key)
                rounded = recipe.weights(formed[key], torch.float64)
            zero = rounded == 0
            for j, values in enumerate(
                (zero.double(), torch.where(zero, weights, 0.0), (weights - rounded).abs())
            ):
                by_bucket = values.view(batch * n_heads, -1) @ onehot
                self.sums[i, j, layer] += by_bucket.view(batch, n_heads, -1).sum(0).cpu()

    def table(self, n_rows: int, head_slopes: list[float]) -> pd.DataFrame:
        """One row per (dtype, part, layer, head, distance bucket); masses per query row."""
        n_layers, n_heads, n_buckets = self.sums.shape[2:]
        rows = []
        for i, recipe in enumerate(self.recipes):
            for layer in range(n_layers):
                for head in range(n_heads):
                    zero, lost, moved = self.sums[i, :, layer, head]
                    for b in range(n_buckets):
                        rows.append(
                            {
                                "dtype": dtype_name(recipe.dtype),
                                "part": recipe.part,
                                "layer": layer,
                                "head": head,
                                "slope": head_slopes[head],
                                "distance_lo": int(self.edges[b]),
                                "distance_hi": int(self.edges[b + 1]),
                                "entries": self.entries[b].item(),
                                "zero_entries": zero[b].item(),
                                "lost_mass": lost[b].item() / n_rows,
                                "moved_mass": moved[b].item() / 2 / n_rows,
                            }
                        )
        return pd.DataFrame(rows)


@holds_model("precision_effect")
def precision_effect(
    model: Model,
    data: Data | Sequences = None,
    *,
    dtypes: Sequence[str] = PRECISION_DTYPES,
    parts: Sequence[str] = PARTS,
    seq_len: int | None = None,
    n_seqs: int | None = None,
    edges: Sequence[int] | None = None,
    block_size: int | None = None,
    prepend_bos: bool | None = None,
    progress: bool = True,
) -> PrecisionEffect:
    """How rounding in each dtype changes an ALiBi model's outputs, per part, position and head.

    Usage::

        effect = hs.precision_effect(model, seq_len=4096)
        effect.by_position.query("part == 'model'")          # dNLL and top-1 by position
        with hs.mitigation(model, "relative"):                # the cure: the bias from distances
            cured = hs.precision_effect(model, seq_len=4096)

    Each (dtype, part) is a forward pass of the ``transformers`` model of the family
    (:func:`headsurgeon.checkpoints.hf_model`: BLOOM; MPT and Falcon with ``alibi=True`` on
    TransformerLens 4.x) in which one part is computed in ``dtype`` exactly as the family's own
    eager code computes it (:data:`PART_MEANINGS`), compared with the same pass entirely in
    float64, softmax included (transformers itself computes the softmax in float32 even for a
    float64 model: the reference does not):

    * ``scores``: the ALiBi bias formed as the family forms it (BLOOM: ``slope x key position``
      cast to the dtype, Falcon: that product in bfloat16 whatever the dtype, then ``/ sqrt(d)``
      in it, MPT: float32, relative to the last key) and the scores ``q.k / sqrt(d) + bias`` in
      the dtype (BLOOM: ``alibi.baddbmm(q, k)``; MPT adds its float32 bias to the dtype's
      ``q.k``, so only ``q.k`` is rounded), then float64;
    * ``softmax``: float64 scores, softmax in float32, weights cast to the dtype (BLOOM, MPT,
      Falcon alike), then float64: what the weights' rounding alone does (float16's zeros
      below 2^-24 included);
    * ``model``: the whole model in the dtype (weights, residual stream, everything), equal to
      ``transformers``' eager forward in that dtype.

    The bias follows what transformers computes (BLOOM's and Falcon's: absolute, ``slope x key
    position``; a headsurgeon model's own relative bias hook is not used), unless ``with
    mitigation(model, "relative")`` is active: then every dtype pass forms the bias from
    distances, ``-m (i - j)``, as the bias hook (:func:`headsurgeon.backend.hf_bias_pre_hook`)
    hands it to the family's attention (built in float32, cast to the model's dtype), so each
    row's scores stay small near the diagonal; the float64 reference stays the family's own.
    Any other mitigation, a model trained with another ALiBi variant, a model without ALiBi or
    an offloaded one is refused in one line.

    ``data``: what :func:`headsurgeon.data.to_sequences` takes (default: the bundled held-out
    corpora, ``n_seqs`` sequences (default 1; every row of a token tensor) of ``seq_len``
    tokens, default 1024). Long sequences run in blocks of ``block_size`` query rows (default:
    by memory, :func:`headsurgeon.long_context.block_size`) through a key-value cache per pass,
    all passes block by block: memory is linear in ``seq_len``. The passes run on the model's
    device (``cfg.device``), on copies of its weights: one per dtype (float64, float32,
    bfloat16, float16 as asked). Blocks round as the dense pass does up to the order of sums (a
    block's matmul over fewer keys), ~1e-7 relative in float32, which can flip a low-precision
    rounding. Cost: ten passes (seven of them in float64) and the head table; 4,096 tokens of
    the 16-head organism took ~10 minutes on one shared CPU thread (see
    ``figures/benchmarks/precision.md``).

    Tables (:class:`PrecisionEffect`):

    * ``by_position``: per ``dtype``, ``part`` and bucket of predicting positions
      ``[position_lo, position_hi)`` (``edges``, default :func:`headsurgeon.evals.position_edges`:
      0, 1, 2, 4, ...): ``tokens``, ``mean_dnll`` (nats, the dtype's next-token loss minus
      float64's: positive is worse), ``mean_abs_dnll``, ``max_abs_dnll``, ``max_abs_dlogit``
      (largest change of any logit), ``top1_agreement`` (share of positions whose most likely
      next token is float64's) and ``nll_float64`` (the reference's mean loss);
    * ``by_head``: per ``dtype``, ``part``, ``layer``, ``head`` and bucket of distances
      ``[distance_lo, distance_hi)`` (0, 1, 2, 4, ..., ``seq_len``): ``entries`` (causal
      entries, summed over sequences), ``zero_entries`` (causal weights exactly
      0 in the dtype), ``lost_mass`` (the float64 weight those held) and ``moved_mass`` (half the
      absolute difference of the weights: the total variation a row's rounding moves), both
      summed over the bucket's keys and averaged over query rows, so a head's buckets add up to
      its per-row totals. The weights are compared on the reference's inputs: each layer's
      float64 ``q`` and ``k`` (from the float64 residual stream), so that only that layer's
      rounding is measured, not the earlier layers'. ``scores`` and ``softmax`` are those of the
      passes above; ``model`` here is the whole pattern in the dtype from ``q``, ``k`` rounded to
      it (the projections' own rounding is left out).

    ``attrs`` (both tables): ``model``, ``family``, ``bias`` (``absolute``, ``relative to the
    last key`` for MPT's own, or ``relative``), ``seq_len``, ``n_seqs``, ``block_size``,
    ``parts`` (what each part means) and ``reference``. It measures what transformers' eager
    ops round (exact zeros included); not other kernels (fused attention, TF32 matmuls), and not
    TransformerLens's own softmax (:func:`headsurgeon.blindness.measure_blindness` counts the
    zeros of both conventions).

    Measured on ``organism``, 4,096 held-out tokens, positions 1,024-4,094: bfloat16 model
    ``mean_dnll`` +0.568 nats, top-1 agreement 0.46 (scores alone +0.562, softmax alone
    +0.00003); float16 +0.038, 0.86; float32 < 1e-6, 1.000. Under ``mitigation(model,
    "relative")``: bfloat16 +0.0002, 0.987; float16 +0.000005, 0.9997.
    """
    info = model_info(model, "precision_effect", writes=True)
    names = [dtype_name(d) for d in ([dtypes] if isinstance(dtypes, str) else list(dtypes))]
    for name in names:
        check_choice(name, "dtype", PRECISION_DTYPES)
    parts = [parts] if isinstance(parts, str) else list(parts)
    for part in parts:
        check_choice(part, "part", PARTS)
    if not names or not parts:
        raise InvalidArgumentError("give at least one dtype and one part")
    check_bool(progress, "progress")
    relative = _bias_mode(model, info)
    if not info.is_alibi:
        raise UnsupportedArchitectureError(
            f"precision_effect measures ALiBi models; {info.name} uses "
            f"{info.shape.positional} positions"
        )
    if seq_len is None:
        seq_len = 1024
    if n_seqs is None and not isinstance(data, Tensor | Sequences):
        n_seqs = 1
    seqs = as_sequences(info, data, seq_len=seq_len, n_seqs=n_seqs, prepend_bos=prepend_bos)
    tokens, (n_rows, n_pos) = seqs.tokens, seqs.tokens.shape
    check_int(n_pos, "the sequence length", minimum=2)
    edges = position_edges(n_pos) if edges is None else check_edges(edges, n_pos)
    block = long_context.block_size(
        model, n_pos, batch=n_rows, bytes_per_entry=PRECISION_BYTES_PER_ENTRY
    )
    block = block if block_size is None else check_int(block_size, "block_size", minimum=1)

    device = torch.device(model.cfg.device or "cpu")
    reference = hf_model(model, torch.float64).to(device)
    family = _Family(reference)
    recipes = [_Recipe(part, getattr(torch, d), relative) for d in names for part in parts]
    models = {torch.float64: reference}
    for recipe in recipes:
        if recipe.model_dtype not in models:  # float64 holds the weights exactly: one rounding
            models[recipe.model_dtype] = copy.deepcopy(reference).to(recipe.model_dtype)
    families = {dtype: _Family(hf) for dtype, hf in models.items()}
    heads = HeadTable(family, recipes, model.cfg.n_layers, position_edges(n_pos + 1))
    stats = _run(models, families, recipes, heads, tokens, block, progress)

    by_position = _position_table(stats, recipes, edges)
    head_slopes = alibi.config_slopes(reference.config.to_dict()).tolist()
    by_head = heads.table(n_rows * n_pos, head_slopes)
    attrs = {
        "model": info.name,
        "family": family.name,
        "bias": "relative"
        if relative
        else "absolute"
        if family.name != "mpt"
        else "relative to the last key",
        "seq_len": n_pos,
        "n_seqs": n_rows,
        "block_size": min(block, n_pos),
        "parts": {part: PART_MEANINGS[part] for part in parts},
        "reference": "the same transformers forward entirely in float64 (softmax included), "
        "the family's own ALiBi bias",
    }
    for table in (by_position, by_head):
        table.attrs.update(attrs)
    return PrecisionEffect(by_position=by_position, by_head=by_head)


def _bias_mode(model: Model, info: ModelInfo) -> bool:
    """Whether the dtype passes form the bias from distances (``mitigation(model,
    "relative")`` active); one line for any other mitigation or a trained variant."""
    active = active_mitigations(model)
    other = [kind for kind in active if kind not in ("standard", "relative")]
    if other:
        raise UnsupportedArchitectureError(
            f"precision_effect measures the family's own ALiBi, or its relative form under "
            f"mitigation(model, 'relative'); a {other[-1]} mitigation is active: leave its block"
        )
    kind, _ = trained_bias(info.metadata)
    if kind != "standard":
        raise UnsupportedArchitectureError(
            f"{info.name} was trained with {kind} ALiBi, which transformers does not "
            "compute; precision_effect follows the family's own computation"
        )
    return bool(active) and active[-1] == "relative"


@torch.no_grad()
def _run(
    models: dict[torch.dtype, nn.Module],
    families: dict[torch.dtype, _Family],
    recipes: list[_Recipe],
    heads: HeadTable,
    tokens: Int[Tensor, "batch pos"],
    block: int,
    progress: bool,
) -> dict[str, Tensor]:
    """Every pass, block by block, each with its own key-value cache; per recipe and predicting
    position: the loss change, the largest logit change and whether the top token agrees."""
    n_rows, n_pos = tokens.shape
    reference = _Recipe("float64", torch.float64)
    caches = [hf_kv_cache() for _ in range(len(recipes) + 1)]
    shape = (len(recipes), n_rows, n_pos - 1)
    stats = {
        "dnll": torch.zeros(shape, dtype=torch.float64),
        "dlogit": torch.zeros(shape, dtype=torch.float64),
        "agree": torch.zeros(shape, dtype=torch.bool),
        "nll": torch.zeros(n_rows, n_pos - 1, dtype=torch.float64),
    }
    starts = range(0, n_pos, block)
    device = next(models[torch.float64].parameters()).device
    for offset in tqdm(starts, desc="precision", disable=not progress, unit="block"):
        chunk = tokens[:, offset : offset + block].to(device)
        # Positions of this block that predict a token (the last position predicts none).
        n = min(chunk.shape[1], n_pos - 1 - offset)
        targets = tokens[:, offset + 1 : offset + 1 + n].to(device)
        with _recipe_attention(families[torch.float64], reference, heads):
            logits = models[torch.float64](chunk, cache=caches[0], use_cache=True).logits
        exact = logits[:, :n].double().log_softmax(-1)
        nll = -exact.gather(-1, targets[..., None])[..., 0]
        stats["nll"][:, offset : offset + n] = nll.cpu()
        for i, recipe in enumerate(recipes):
            dtype = recipe.model_dtype
            with _recipe_attention(families[dtype], recipe):
                out = models[dtype](chunk, cache=caches[i + 1], use_cache=True).logits
            rounded = out[:, :n].double()
            loss = -rounded.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
            where = (i, slice(None), slice(offset, offset + n))
            stats["dnll"][where] = (loss - nll).cpu()
            stats["dlogit"][where] = (rounded - logits[:, :n]).abs().amax(-1).cpu()
            stats["agree"][where] = (rounded.argmax(-1) == logits[:, :n].argmax(-1)).cpu()
    return stats


def _position_table(
    stats: dict[str, Tensor], recipes: list[_Recipe], edges: list[int]
) -> pd.DataFrame:
    """``by_position`` from the per-position statistics (see :func:`precision_effect`)."""
    rows = []
    for i, recipe in enumerate(recipes):
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            dnll = stats["dnll"][i, :, lo:hi]
            rows.append(
                {
                    "dtype": dtype_name(recipe.dtype),
                    "part": recipe.part,
                    "position_lo": lo,
                    "position_hi": hi,
                    "tokens": dnll.numel(),
                    "mean_dnll": dnll.mean().item(),
                    "mean_abs_dnll": dnll.abs().mean().item(),
                    "max_abs_dnll": dnll.abs().max().item(),
                    "max_abs_dlogit": stats["dlogit"][i, :, lo:hi].max().item(),
                    "top1_agreement": stats["agree"][i, :, lo:hi].double().mean().item(),
                    "nll_float64": stats["nll"][:, lo:hi].mean().item(),
                }
            )
    return pd.DataFrame(rows)
