"""Does low precision change an ALiBi model's outputs? The precision counterfactual.

Underflow to exact zero carries almost nothing (a row of ``T`` keys loses less than ``T`` times
the dtype's smallest weight, see :mod:`headsurgeon.blindness`). What changes outputs is
*rounding*: transformers' BLOOM adds ALiBi as ``slope x key position`` (softmax is
shift-invariant), casts that bias to the model's dtype and forms the scores
``alibi.baddbmm(q, k)`` in it. At key position 2,048 a slope-0.71 bias is ~1,450, where
bfloat16's spacing is 8: the content logits of a few units are rounded away.
:func:`precision_effect` measures it per dtype, part of the computation, position and head,
each against the same forward pass entirely in float64; ``with mitigation(model, "relative")``
it measures the cure, the bias formed from distances ``-m (i - j)``. A model trained under the
absolute bias in bfloat16 (BLOOM) learnt under that rounding: ``reference="training"`` measures
each inference numerics against the attention it was trained with as well.

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
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from headsurgeon import families, long_context
from headsurgeon.backend import Model
from headsurgeon.backend.cache import hf_kv_cache
from headsurgeon.blindness.analysis import active_mitigations, dtype_name
from headsurgeon.checkpoints import hf_model
from headsurgeon.data import Cut, Data, Sequences, verb_sequences
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.evals.loss import check_edges, position_edges
from headsurgeon.exact_alibi import bias_builder, trained_bias
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.loading.numerics import BIAS_MEANINGS
from headsurgeon.progress import tqdm
from headsurgeon.stats import SE_BLOCK, batch_means_se, nll_change
from headsurgeon.validation import check_bool, check_choice, check_int

__all__ = [
    "ALL_PARTS",
    "INFERENCE_DTYPES",
    "PARTS",
    "PRECISION_DTYPES",
    "PRECISION_CUT",
    "PrecisionEffect",
    "precision_effect",
    "HeadTable",
    "PRECISION_BYTES_PER_ENTRY",
]

logger = logging.getLogger(__name__)

PRECISION_DTYPES = ("float32", "bfloat16", "float16")
PRECISION_CUT = Cut(seq_len=1024, n_seqs=1)
"""How :func:`precision_effect` cuts texts: one sequence of 1,024 tokens."""
# Also measurable: float64, the dtype transformers' own float64 model computes in (its softmax
# in float32).
INFERENCE_DTYPES = ("bfloat16", "float16", "float32", "float64")
PARTS = ("scores", "softmax", "model")
ALL_PARTS = ("scores", "softmax", "attention", "model")
PART_MEANINGS = {
    "scores": "the attention scores (ALiBi bias + q.k) formed and rounded in the dtype exactly "
    "as the family does; everything else float64",
    "softmax": "the attention weights rounded as the family does (softmax in float32, weights "
    "cast to the dtype) from float64 scores; everything else float64",
    "attention": "the attention as the family computes it in the dtype (scores with the bias "
    "in the dtype, softmax in float32, weights cast to the dtype); everything else float64",
    "model": "the whole forward pass in the dtype, as transformers computes it",
}
REFERENCES = ("float64", "training")
# Bytes a block holds per (batch, head, query, key) entry at its peak, in the float64
# reference's pass: its scores and weights, and the head table's temporaries for a quarter of
# the heads (HEAD_GROUPS). Measured: organism, 2,048 tokens, the process's peak resident set
# with blocks of 1,024 rows less that with blocks of 16, over the entries of the largest block:
# 28 bytes (analyses/benchmarks/precision.py --lengths 2048 --peak-rss 16, then 1024).
PRECISION_BYTES_PER_ENTRY = 32
# Heads of a layer whose head-table temporaries are held at once: a quarter of them.
HEAD_GROUPS = 4


@dataclasses.dataclass
class PrecisionEffect:
    """What rounding does to a model (see :func:`precision_effect`).

    ``by_position``: one row per (reference, bias, dtype, part, position bucket). ``by_head``:
    one row per (bias, dtype, part, layer, head, distance bucket). ``by_region``: one row per
    (reference, bias, dtype, part, region of the training length: inside L, L-2L, 2L-4L,
    4L-8L, beyond). Run metadata in each table's ``attrs``.
    """

    by_position: pd.DataFrame
    by_head: pd.DataFrame
    by_region: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """Where one pass rounds: ``part`` ``"float64"`` (the reference: everything float64, the
    softmax too) or one of :data:`ALL_PARTS` in ``dtype``; ``relative``: the ALiBi bias formed
    from distances ``-m (i - j)`` (the hook's form) instead of the family's own; ``softmax``:
    the dtype an ``attention`` pass computes its softmax in (the families: float32)."""

    part: str
    dtype: torch.dtype
    relative: bool = False
    softmax: torch.dtype = torch.float32

    @property
    def model_dtype(self) -> torch.dtype:
        return self.dtype if self.part == "model" else torch.float64

    def scores_dtype(self, compute: torch.dtype) -> torch.dtype:
        return self.dtype if self.part in ("scores", "attention", "model") else compute

    def weights(self, scores: Tensor, compute: torch.dtype) -> Tensor:
        """The attention weights from the masked scores, in the pass's ``compute`` dtype."""
        if self.part in ("float64", "scores"):
            return torch.softmax(scores.to(compute), dim=-1)
        # Every family: softmax in float32, weights cast to the dtype (BLOOM, Falcon:
        # F.softmax(dtype=float32).to(dtype); MPT: softmax(scores.float()).to(dtype)).
        softmax = self.softmax if self.part == "attention" else torch.float32
        return F.softmax(scores, dim=-1, dtype=softmax).to(self.dtype).to(compute)


class _Family:
    """The attention modules of one transformers ALiBi model ``hf``, computing op for op as its
    family's eager code (:class:`headsurgeon.families.AlibiFamily`, as transformers 5.x
    ``modeling_bloom``, ``modeling_falcon``, ``modeling_mpt``), with the scores' dtype, the bias
    form and the weights' rounding chosen by a :class:`_Recipe`; ``slopes``: the ALiBi slopes
    per token the model applies (:func:`headsurgeon.loading.facts.applied_slopes`)."""

    def __init__(self, hf: nn.Module, slopes: Tensor) -> None:
        config = hf.config.to_dict()
        self.kind = families.family_named(config["model_type"])
        if not self.kind.applies_alibi(config):
            raise UnsupportedArchitectureError(
                f"precision_effect measures ALiBi models; this {self.kind.title} uses rotary "
                "positions"
            )
        if config.get("pretraining_tp", 1) > 1 and config.get("slow_but_exact"):
            raise UnsupportedArchitectureError(
                "precision_effect follows BLOOM's eager attention; this config asks for its "
                "slow_but_exact tensor-parallel sums: set slow_but_exact to false"
            )
        self.n_heads = config[self.kind.heads_field]
        self.d_head = config[self.kind.width_field] // self.n_heads
        # What the family multiplies positions by (Falcon: BLOOM's slopes, in bfloat16), and
        # the relative form's bias (the bias hooks').
        self.factors = self.kind.factors(slopes, self.d_head)
        self.relative_bias = bias_builder("relative", {}, tuple(slopes.tolist()))
        self.modules = [m for m in hf.modules() if type(m).__name__ in families.ALIBI_ATTENTION]

    def _bias(
        self, n_queries: int, n_keys: int, dtype: torch.dtype, relative: bool, device: Any
    ) -> Tensor:
        """The ALiBi bias as the family (or, ``relative``, the bias hook) hands it to its
        attention, cast to ``dtype`` where the family casts it."""
        if relative:  # backend.hf_bias_pre_hook: built in float32, cast to the hidden dtype
            return self.relative_bias(n_queries, n_keys, device).to(dtype)
        return self.kind.own_bias(self.factors, n_keys, dtype, self.d_head, device)

    def qkv(self, module: nn.Module, hidden: Tensor, args: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[batch, head, pos, d_head]``, as the family forms them."""
        return self.kind.qkv(module, hidden, args, self.n_heads, self.d_head)

    def scores(
        self,
        module: nn.Module,
        q: Tensor,
        k: Tensor,
        mask: Tensor | None,
        dtype: torch.dtype,
        relative: bool,
        heads: slice = slice(None),
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        """The masked pre-softmax scores, formed from ``q``, ``k`` cast to ``dtype`` and the bias
        exactly as the family forms them (their dtype is the family's: ``dtype``, or float32
        where MPT adds its float32 bias, or float64 where a float64 mask is added); ``q`` and
        ``k`` of the module's ``heads``."""
        q, k = q.to(dtype), k.to(dtype)
        bias = self._bias(q.shape[2], k.shape[2], dtype, relative, q.device)[heads]
        return self.kind.scores(module, q, k, mask, bias)

    def output(
        self, module: nn.Module, weights: Tensor, v: Tensor, args: dict
    ) -> tuple[Tensor, Tensor]:
        """The attention module's return value from the weights, as the family computes it."""
        return self.kind.output(module, weights, v, args, self.d_head)


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
    weights rounded to its dtype, the float64 weight they held (lost mass) and half the
    absolute difference of the weights (moved mass: the total variation over a row's keys)."""

    def __init__(
        self, family: _Family, recipes: list[_Recipe], n_layers: int, edges: list[int]
    ) -> None:
        self.family, self.recipes = family, recipes
        self.edges = torch.tensor(edges)
        shape = (len(recipes), 3, n_layers, family.n_heads, len(edges) - 1)
        self.sums = torch.zeros(shape, dtype=torch.float64)
        self.entries = torch.zeros(len(edges) - 1, dtype=torch.float64)

    def __call__(
        self, layer: int, q: Tensor, k: Tensor, mask: Tensor | None, scores: Tensor, weights: Tensor
    ) -> None:
        batch, n_heads, n_queries, n_keys = weights.shape
        # The bucket of each distance 0 ... n_keys (a block's queries are its last n_queries keys).
        bucket = torch.bucketize(torch.arange(n_keys + 1), self.edges[1:-1], right=True)
        if layer == 0:  # causal entries at distance d: the rows at position d or later
            rows = (n_keys - torch.arange(n_keys + 1)).clamp(min=0, max=n_queries)
            self.entries.index_add_(0, bucket, rows.double() * batch)
        bucket = bucket.to(weights.device)
        # A group of heads at a time: its temporaries, not the table's, bound the block size.
        group = -(-n_heads // HEAD_GROUPS)
        # Each quantity is written into these and summed by distance (_distance_sums): every
        # query row left-padded with n_queries zeros.
        shape = (batch * group, n_queries, n_queries + n_keys)
        values = torch.empty(shape, dtype=torch.float64, device=weights.device)
        zeros = torch.empty(shape, dtype=torch.bool, device=weights.device)
        values[..., :n_queries] = 0.0
        zeros[..., :n_queries] = False
        for first in range(0, n_heads, group):
            heads = slice(first, min(first + group, n_heads))
            size = batch * (heads.stop - first)
            padded = values[:size], zeros[:size]
            self._add(layer, heads, bucket, padded, q, k, mask, scores, weights)

    def _add(
        self,
        layer: int,
        heads: slice,
        bucket: Tensor,
        padded: tuple[Tensor, Tensor],
        q: Tensor,
        k: Tensor,
        mask: Tensor | None,
        scores: Tensor,
        weights: Tensor,
    ) -> None:
        """The sums of the ``heads`` of one layer's block, every recipe, into :attr:`sums`."""
        q, k, scores, weights = (t[:, heads] for t in (q, k, scores, weights))
        if mask is not None and mask.shape[1] > 1:  # Falcon's mask: one per head
            mask = mask[:, heads]
        n_queries = weights.shape[2]
        values, zeros = padded
        inside = values[..., n_queries:].view(weights.shape)
        zero = zeros[..., n_queries:].view(weights.shape)
        nothing = weights.new_zeros(())

        def add(i: int, j: int, padded: Tensor) -> None:
            by_distance = _distance_sums(padded, n_queries).to(torch.float64)
            by_bucket = torch.zeros(len(by_distance), len(self.edges) - 1, dtype=torch.float64)
            by_bucket = by_bucket.to(weights.device).index_add_(1, bucket, by_distance)
            sums = by_bucket.view(weights.shape[0], weights.shape[1], -1).sum(0)
            self.sums[i, j, layer, heads] += sums.cpu()

        module = self.family.modules[layer]
        softmax32 = None  # the float32 softmax of the float64 scores, shared by every dtype
        formed: dict[tuple[torch.dtype, bool], Tensor] = {}  # one dtype's scores at a time
        for i, recipe in enumerate(self.recipes):
            rounded = None  # the recipe's float64 weights where they are not its dtype's
            if recipe.part == "softmax":
                if softmax32 is None:
                    softmax32 = F.softmax(scores, dim=-1, dtype=torch.float32)
                low = softmax32.to(recipe.dtype)
            else:  # the scores (or the whole pattern) formed in the dtype from q and k
                key = (recipe.dtype, recipe.relative)
                if key not in formed:
                    formed = {key: self.family.scores(module, q, k, mask, *key, heads)}
                if recipe.part == "scores":  # float64 softmax of the rounded scores
                    rounded = recipe.weights(formed[key], torch.float64)
                    low = rounded.to(recipe.dtype)
                else:
                    low = recipe.weights(formed[key], recipe.dtype)
            torch.eq(low, 0, out=zero)  # zeros of the dtype under test
            add(i, 0, zeros)
            torch.where(zero, weights, nothing, out=inside)
            add(i, 1, values)
            torch.sub(weights, low if rounded is None else rounded, out=inside).abs_()
            add(i, 2, values)

    def table(
        self, n_rows: int, head_slopes: list[float], form_of: dict[bool, str]
    ) -> pd.DataFrame:
        """One row per (bias, dtype, part, layer, head, distance bucket); masses per query
        row (``form_of``: the bias form's name by the recipe's ``relative``)."""
        n_layers, n_heads, n_buckets = self.sums.shape[2:]
        rows = []
        for i, recipe in enumerate(self.recipes):
            for layer in range(n_layers):
                for head in range(n_heads):
                    zero, lost, moved = self.sums[i, :, layer, head]
                    for b in range(n_buckets):
                        rows.append(
                            {
                                "bias": form_of[recipe.relative],
                                "dtype": _dtype_name(recipe.dtype),
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


def _distance_sums(padded: Tensor, n_queries: int) -> Tensor:
    """Per row of ``padded`` (``[batch x head, query, n_queries + n_keys]``: a block's entries,
    each query row left-padded with ``n_queries`` zeros) and distance ``d = 0 ... n_keys``: the
    sum of its causal entries at distance ``d``, linear in the entries. Query ``i`` (position
    ``n_keys - n_queries + i``) holds distance ``d`` at column ``n_keys - d + i``, so a view
    whose rows step one column further than the tensor's puts each distance in one column (the
    padding: keys before 0); later keys are never read."""
    rows, _, width = padded.shape
    n_keys = width - n_queries
    skew = padded.as_strided((rows, n_queries, n_keys + 1), (n_queries * width, width + 1, 1))
    return skew.sum(1).flip(-1)


@holds_model("precision_effect")
def precision_effect(
    model: Model,
    data: Data | Sequences = None,
    *,
    dtypes: Sequence[str] = PRECISION_DTYPES,
    parts: Sequence[str] = PARTS,
    bias_forms: Sequence[str] | None = None,
    reference: str = "float64",
    edges: Sequence[int] | None = None,
    block_size: int | None = None,
    head_table: bool = True,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> PrecisionEffect:
    """How rounding in each dtype changes an ALiBi model's outputs, per part, position and head.

    ``effect = hs.precision_effect(model, hs.to_sequences(model, seq_len=4096, n_seqs=1))``;
    ``effect.by_region`` has the ΔNLL and top-1 agreement inside and beyond the training length,
    ``effect.by_position`` per position bucket, ``effect.by_head`` the exact zeros and attention
    mass lost and moved (see :class:`PrecisionEffect`). Each (bias form, dtype, part) is a forward
    pass of the model's ``transformers`` family (BLOOM; MPT and Falcon with ``alibi=True`` on
    TransformerLens 4.x) with one part rounded as the family's eager code rounds it
    (:data:`PART_MEANINGS`), compared per position with the same pass in float64.

    - ``model``: a BLOOM, MPT or Falcon ALiBi model.
    - ``data``: texts, a token tensor or :class:`Sequences`; texts cut as :data:`PRECISION_CUT`.
    - ``dtypes``: of :data:`INFERENCE_DTYPES`.
    - ``parts``: of :data:`ALL_PARTS`.
    - ``bias_forms``: of ``absolute``, ``last-key``, ``relative`` (default: the family's own).
    - ``reference``: ``float64``, or ``training`` for both (needs known training numerics).
    - ``edges``: position buckets (default: powers of two, split at multiples of ``train_ctx``).
    - ``block_size``: query rows per block (default: what memory allows).
    - ``head_table``: ``False`` leaves ``by_head`` empty (it adds about half the passes' time).
    - ``progress``: show a progress bar.
    - ``seq_len``, ``n_seqs``, ``prepend_bos``: deprecated (they warn): ``hs.to_sequences`` cuts.

    The parts, the columns, the costs and measured numbers: [Blindness: the tables of
    precision_effect](../tools/blindness.md#the-tables-of-precision_effect).
    """
    info = model_info(model, "precision_effect", writes=True)
    names, parts = _checked_choices(dtypes, parts, reference, head_table, progress)
    if not info.is_alibi:
        raise UnsupportedArchitectureError(
            f"precision_effect measures ALiBi models; {info.name} uses "
            f"{info.shape.positional} positions"
        )
    device = torch.device(model.cfg.device or "cpu")
    reference_model = hf_model(model, torch.float64).to(device)
    family = _Family(reference_model, info.slopes)
    forms = _bias_forms(model, info, family, bias_forms, both=reference == "training")
    trained = _training_recipe(info, family) if reference == "training" else None
    seqs = verb_sequences(
        info, data, "precision_effect", PRECISION_CUT, seq_len, n_seqs, prepend_bos
    )
    tokens, (n_rows, n_pos) = seqs.tokens, seqs.tokens.shape
    check_int(n_pos, "the sequence length", minimum=2)
    edges = training_edges(n_pos, info.train_ctx) if edges is None else check_edges(edges, n_pos)
    block = long_context.block_size(
        model, n_pos, batch=n_rows, bytes_per_entry=PRECISION_BYTES_PER_ENTRY
    )
    block = block if block_size is None else check_int(block_size, "block_size", minimum=1)

    recipes = [
        _Recipe(part, getattr(torch, d), form == "relative")
        for form in forms
        for d in names
        for part in parts
    ]
    models = _dtype_models(reference_model, recipes)
    per_dtype = {dtype: _Family(hf, info.slopes) for dtype, hf in models.items()}
    heads = HeadTable(family, recipes, model.cfg.n_layers, position_edges(n_pos + 1))
    stats = _run(
        models, per_dtype, recipes, trained, heads if head_table else None, tokens, block, progress
    )

    own = family.kind.own_form
    form_of = {False: own, True: "relative"}
    by_position = _position_table(stats, recipes, form_of, edges, info.train_ctx)
    by_region = _position_table(
        stats, recipes, form_of, region_edges(n_pos, info.train_ctx), info.train_ctx
    )
    head_slopes = info.slopes.tolist()
    by_head = heads.table(n_rows * n_pos, head_slopes, form_of) if head_table else pd.DataFrame()
    attrs = _effect_attrs(
        info, family, forms, parts, trained, n_seqs=n_rows, seq_len=n_pos, block=min(block, n_pos)
    )
    for table in (by_position, by_region, by_head):
        table.attrs.update(attrs)
    return PrecisionEffect(by_position=by_position, by_head=by_head, by_region=by_region)


def _checked_choices(
    dtypes: Sequence[str], parts: Sequence[str], reference: str, head_table: bool, progress: bool
) -> tuple[list[str], list[str]]:
    """The dtype names and the parts to measure, every choice checked (one line otherwise)."""
    names = [_dtype_name(d) for d in ([dtypes] if isinstance(dtypes, str) else list(dtypes))]
    for name in names:
        check_choice(name, "dtype", INFERENCE_DTYPES)
    parts = [parts] if isinstance(parts, str) else list(parts)
    for part in parts:
        check_choice(part, "part", ALL_PARTS)
    if not names or not parts:
        raise InvalidArgumentError("give at least one dtype and one part")
    check_choice(reference, "reference", REFERENCES)
    check_bool(head_table, "head_table")
    check_bool(progress, "progress")
    return names, parts


def _dtype_models(
    reference_model: nn.Module, recipes: list[_Recipe]
) -> dict[torch.dtype, nn.Module]:
    """The ``transformers`` model in each dtype the recipes run in; float64's is the reference."""
    models = {torch.float64: reference_model}
    for recipe in recipes:
        if recipe.model_dtype not in models:  # float64 holds the weights exactly: one rounding
            models[recipe.model_dtype] = copy.deepcopy(reference_model).to(recipe.model_dtype)
    return models


def _effect_attrs(
    info: ModelInfo,
    family: _Family,
    forms: list[str],
    parts: list[str],
    trained: _Recipe | None,
    *,
    n_seqs: int,
    seq_len: int,
    block: int,
) -> dict[str, Any]:
    """The attrs of every table of the effect: the model, the passes and their reference."""
    numerics = info.training_numerics
    return {
        "model": info.name,
        "family": family.kind.name,
        "bias": ", ".join(forms),
        "bias_forms": {form: BIAS_MEANINGS[form] for form in forms},
        "seq_len": seq_len,
        "n_seqs": n_seqs,
        "train_ctx": info.train_ctx,
        "block_size": block,
        "parts": {part: PART_MEANINGS[part] for part in parts},
        "reference": "the same transformers forward entirely in float64 (softmax included), "
        "the family's own ALiBi bias"
        + (
            "; and (reference 'training') the attention as the model was trained: "
            + numerics.describe()
            if trained
            else ""
        ),
        "training_numerics": None if numerics is None else dataclasses.asdict(numerics),
        "standard_errors": f"batch means over {SE_BLOCK}-token blocks of each sequence",
    }


def _dtype_name(dtype: str | torch.dtype) -> str:
    """:func:`dtype_name`, and float64 (which the precision passes also run in)."""
    if dtype in (torch.float64, "float64", "fp64", "double"):
        return "float64"
    return dtype_name(dtype)


def training_edges(length: int, train_ctx: int | None) -> list[int]:
    """Position buckets: powers of two (:func:`position_edges`) and the multiples ``L, 2L, 4L,
    ...`` of the training length ``train_ctx``, so no bucket straddles one of them.

    >>> training_edges(40, 12)
    [0, 1, 2, 4, 8, 12, 16, 24, 32, 39]
    """
    edges = set(position_edges(length))
    while train_ctx and train_ctx < length - 1:
        edges.add(train_ctx)
        train_ctx *= 2
    return sorted(edges)


def region_edges(length: int, train_ctx: int | None) -> list[int]:
    """The regions of ``by_region``: inside the training length, then ``L-2L``, ``2L-4L``,
    ``4L-8L`` and beyond (one region when the training length is unknown).

    >>> region_edges(100, 10)
    [0, 10, 20, 40, 80, 99]
    """
    last = length - 1
    if not train_ctx:
        return [0, last]
    multiples = [train_ctx * 2**k for k in range(4) if train_ctx * 2**k < last]
    return [0, *multiples, last]


def region_name(lo: int, hi: int, train_ctx: int | None) -> str:
    """A bucket's place against the training length ``L``.

    >>> region_name(0, 10, 10), region_name(10, 20, 10), region_name(80, 99, 10)
    ('inside L', 'L-2L', 'beyond 8L')
    """
    if not train_ctx:
        return "all (training length unknown)"
    if hi <= train_ctx:
        return "inside L"
    if lo >= 8 * train_ctx:
        return "beyond 8L"
    for k in range(3):
        if train_ctx * 2**k <= lo and hi <= train_ctx * 2 ** (k + 1):
            return f"{2**k if k else ''}L-{2 ** (k + 1)}L"
    return f"{lo / train_ctx:g}L-{hi / train_ctx:g}L"  # edges given across a multiple of L


def _bias_forms(
    model: Model,
    info: ModelInfo,
    family: _Family,
    bias_forms: Sequence[str] | None,
    both: bool,
) -> list[str]:
    """The bias forms to measure, checked: the family's own and ``relative`` (default: the
    family's, both if ``both``, or ``relative`` in a relative mitigation block); one line for
    anything else."""
    relative = _bias_mode(model, info)
    own = family.kind.own_form
    if bias_forms is None and relative:
        return ["relative"]
    if bias_forms is None:
        return [own, "relative"] if both else [own]
    if relative:
        raise InvalidArgumentError(
            "bias_forms chooses the bias of every pass; leave the mitigation(model, "
            "'relative') block or leave bias_forms out"
        )
    forms = [bias_forms] if isinstance(bias_forms, str) else list(bias_forms)
    if not forms:
        raise InvalidArgumentError("give at least one bias form")
    for form in forms:
        check_choice(form, "bias form", (own, "relative"))
    return list(dict.fromkeys(forms))


def _training_recipe(info: ModelInfo, family: _Family) -> _Recipe:
    """The attention pass as the model was trained; one line where that is unknown."""
    numerics = info.training_numerics
    if numerics is None:
        raise InvalidArgumentError(
            f"{info.name}'s training numerics are unknown: record them in its headsurgeon.json "
            "(training_numerics: bias, scores_dtype, softmax_dtype) or use reference='float64'"
        )
    if numerics.unknown:
        raise InvalidArgumentError(
            f"{info.name}'s published training numerics do not give its "
            f"{' or '.join(numerics.unknown)}, so no pass can reproduce them; use "
            "reference='float64'"
        )
    if numerics.bias not in (family.kind.own_form, "relative"):
        raise UnsupportedArchitectureError(
            f"{info.name} was trained with the {numerics.bias} bias, which its family "
            f"({family.kind.name}) does not form; use reference='float64'"
        )
    return _Recipe(
        "attention",
        getattr(torch, numerics.scores_dtype),
        numerics.bias == "relative",
        getattr(torch, numerics.softmax_dtype),
    )


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
    per_dtype: dict[torch.dtype, _Family],
    recipes: list[_Recipe],
    trained: _Recipe | None,
    heads: HeadTable | None,
    tokens: Int[Tensor, "batch pos"],
    block: int,
    progress: bool,
) -> dict[str, dict[str, Tensor]]:
    """Every pass, block by block, each with its own key-value cache; per reference (float64,
    and the training numerics' pass when ``trained``), recipe and predicting position: the loss
    change, the largest logit change and whether the top token agrees."""
    n_rows, n_pos = tokens.shape
    references = {"float64": _Recipe("float64", torch.float64)}
    if trained is not None:
        references["training"] = trained
    passes = [*references.values(), *recipes]  # the references first
    caches = [hf_kv_cache() for _ in passes]
    shape = (len(recipes), n_rows, n_pos - 1)
    stats = {
        name: {
            "dnll": torch.zeros(shape, dtype=torch.float64),
            "dlogit": torch.zeros(shape, dtype=torch.float64),
            "agree": torch.zeros(shape, dtype=torch.bool),
            "nll": torch.zeros(n_rows, n_pos - 1, dtype=torch.float64),
        }
        for name in references
    }
    starts = range(0, n_pos, block)
    device = next(models[torch.float64].parameters()).device
    for offset in tqdm(starts, desc="precision", disable=not progress, unit="block"):
        chunk = tokens[:, offset : offset + block].to(device)
        # Positions of this block that predict a token (the last position predicts none).
        n = min(chunk.shape[1], n_pos - 1 - offset)
        targets = tokens[:, offset + 1 : offset + 1 + n].to(device)
        exact = {}  # per reference: its logits and loss, which every pass is compared with
        for i, recipe in enumerate(passes):
            dtype = recipe.model_dtype
            # The head table reads the float64 reference's q, k and weights.
            probe = heads if recipe.part == "float64" else None
            with _recipe_attention(per_dtype[dtype], recipe, probe):
                logits = models[dtype](chunk, cache=caches[i], use_cache=True).logits
            rounded = logits[:, :n].double()
            loss = -rounded.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
            where = (slice(None), slice(offset, offset + n))
            if i < len(references):
                name = list(references)[i]
                exact[name] = rounded, loss
                stats[name]["nll"][where] = loss.cpu()
                continue
            for name, (reference, nll) in exact.items():
                at = (i - len(references), *where)
                stats[name]["dnll"][at] = (loss - nll).cpu()
                stats[name]["dlogit"][at] = (rounded - reference).abs().amax(-1).cpu()
                stats[name]["agree"][at] = (rounded.argmax(-1) == reference.argmax(-1)).cpu()
    return stats


def _position_table(
    references: dict[str, dict[str, Tensor]],
    recipes: list[_Recipe],
    form_of: dict[bool, str],
    edges: list[int],
    train_ctx: int | None,
) -> pd.DataFrame:
    """``by_position`` (or ``by_region``) from the per-position statistics."""
    rows = []
    for name, stats in references.items():
        for i, recipe in enumerate(recipes):
            for lo, hi in zip(edges[:-1], edges[1:], strict=True):
                dnll = stats["dnll"][i, :, lo:hi]
                change = nll_change(dnll, stats["nll"][:, lo:hi])
                agree = stats["agree"][i, :, lo:hi].double()
                rows.append(
                    {
                        "reference": name,
                        "bias": form_of[recipe.relative],
                        "dtype": _dtype_name(recipe.dtype),
                        "part": recipe.part,
                        "position_lo": lo,
                        "position_hi": hi,
                        "region": region_name(lo, hi, train_ctx),
                        "tokens": change["tokens"],
                        "mean_dnll": change["dnll"],
                        "dnll_se": change["dnll_se"],
                        "mean_abs_dnll": dnll.abs().mean().item(),
                        "max_abs_dnll": dnll.abs().max().item(),
                        "max_abs_dlogit": stats["dlogit"][i, :, lo:hi].max().item(),
                        "top1_agreement": agree.mean().item(),
                        "top1_se": batch_means_se(agree),
                        "nll_reference": change["base_nll"],
                        "nll_float64": references["float64"]["nll"][:, lo:hi].mean().item(),
                    }
                )
    return pd.DataFrame(rows)
