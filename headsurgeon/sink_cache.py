"""The sink-cache test: does the model need its first tokens once the cache has dropped the rest?

StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024)
keeps a key-value cache of ``x`` initial ("sink") tokens plus the ``y`` most recent ones and
evicts everything in between; a window-only cache (``x = 0``) broke their ALiBi model (MPT-7B
perplexity 460 with 0 + 2,048 tokens, 15 with 1 + 2,047), one kept initial token restored it.
:func:`sink_cache_effect` runs that test exactly, on the model's own forward pass: the
perplexity of long text with each cache ``(x, y)`` against the full-context perplexity, and,
per head, the loss when that head alone loses its sink tokens: the heads that carry the need.

**The cache, exactly.** Query ``t`` sees the keys ``j <= t`` with ``j < x`` (sinks) or
``t - j <= y`` (the ``y`` previous tokens and itself). This is StreamingLLM's own evaluation loop
(``examples/eval_long_ppl.py``: a token runs against the cache, then the cache is cut back to
``start_size + recent_size``), so their ``1 + 2047`` is ``sinks=1, window=2047`` here. Every
position's keys and values are those computed when it was the query, under its own cache, as in
a real stream. Queries ``t <= x + y`` have lost nothing: their predictions are the full-context
ones.

**ALiBi distances** (``positions``): ``"cache"`` (default) counts distance in cache slots, as
StreamingLLM does for ALiBi (MosaicML's MPT builds its bias from the key's index in the cache;
transformers' ``MptAttention`` slices its bias by the cache's length; their paper: "a contiguous
linear bias instead of a jumping one"). With the cache full the query sits in slot ``x + y``,
its ``y`` recent keys in the slots just before it, the sinks in slots ``0 ... x - 1``: a recent
key keeps its true distance ``t - j``, sink ``j`` gets ``x + y - j`` (in general
``min(t, x + y) - j``): the sinks look adjacent to the window, however long ago they came.
``"true"`` gives every key its true distance ``t - j``: the sink then carries the penalty of
its real age (for steep heads, weight ~0 at any useful length), so ``"true"`` tests the sink
as far-away content. The bias is the model's trained kind (standard, or the variant its
``headsurgeon.json`` records) at these distances.

>>> from headsurgeon.loading import ModelShape, random_model
>>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
>>> tokens = torch.randint(0, 64, (2, 40))
>>> effect = sink_cache_effect(model, tokens, sinks=[0, 2], windows=[8, 60], progress=False)
>>> effect.by_cache[["sinks", "window", "evicted"]].values.tolist()
[[0, 8, 60], [0, 60, 0], [2, 8, 56], [2, 60, 0]]
>>> bool((effect.by_cache.query("window == 60")["dnll"].abs() < 1e-5).all())
True
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon import alibi, long_context
from headsurgeon.backend import Model, add_bias_hook
from headsurgeon.backend.forward import resumes_at_layer
from headsurgeon.backend.fused import windowed_attention
from headsurgeon.blindness.analysis import active_mitigations, fused_path_refusal
from headsurgeon.data import Cut, Data, Sequences, batches, verb_sequences
from headsurgeon.defaults import SINK_POSITIONS as POSITIONS
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.evals.loss import LayerInputs, fused_token_nll, next_token_nll
from headsurgeon.exact_alibi import trained_bias
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.probes import unfired
from headsurgeon.progress import tqdm
from headsurgeon.stats import nll_change
from headsurgeon.validation import check_choice, check_int
from headsurgeon.window import every_head, sequences_to_cut

__all__ = [
    "SINK_CACHE_CUT",
    "SinkCacheEffect",
    "sink_cache_effect",
]

logger = logging.getLogger(__name__)

SINK_CACHE_CUT = Cut(seq_len=16384, n_seqs=1)
"""How :func:`sink_cache_effect` cuts texts: one sequence of 16,384 tokens."""


@dataclasses.dataclass
class SinkCacheEffect:
    """Result of :func:`sink_cache_effect`.

    ``by_cache``: one row per (sinks, window). ``by_head``: one row per head, the heads that
    carry the need for sinks first (empty when no head was asked for). ``nll``: the full-context
    next-token loss ``[seq, position]`` (float64), the reference of ``by_cache``.
    """

    by_cache: pd.DataFrame
    by_head: pd.DataFrame
    nll: np.ndarray


def cache_keys(sinks: int, window: int) -> long_context.KeyChooser:
    """The earlier positions the block of queries ``offset ... offset + n - 1`` reads with a
    cache of ``sinks`` initial and ``window`` recent tokens: the union over its queries (each
    query's own cut is the bias's mask), for :func:`headsurgeon.long_context.run_in_blocks`.

    >>> cache_keys(2, 3)(10, 4).tolist()  # sinks 0, 1; query 10 reads back to 7
    [0, 1, 7, 8, 9]
    """

    def keys(offset: int, n: int) -> Int[Tensor, " kept"]:
        recent = max(0, offset - window)
        return torch.cat([torch.arange(min(sinks, recent)), torch.arange(recent, offset)])

    return keys


class _CacheBias:
    """One pass's bias: per layer, each head's sinks; the cut keys get ``-inf``.

    ``keys`` records the block being run; ``builder(layer)`` is that layer's
    :data:`~headsurgeon.backend.BiasBuilder`, counting its calls (a layer whose bias was never
    built is refused, never read as no change).
    """

    def __init__(
        self, slopes: Tensor, sinks: list[list[int]], window: int, positions: str, kind: tuple
    ) -> None:
        self.sinks, self.window, self.positions = sinks, window, positions
        self.kind, self.params = kind
        self.slopes = slopes
        self.chooser = cache_keys(max(map(max, sinks)), window)
        self.fired = [0] * len(sinks)
        self.block: tuple[int, Tensor] | None = None
        self.built: dict[tuple[int, ...], Tensor] = {}

    def keys(self, offset: int, n: int) -> Int[Tensor, " kept"]:
        kept = self.chooser(offset, n)
        self.block, self.built = (offset, kept), {}
        return kept

    def builder(self, layer: int):  # -> BiasBuilder
        def build(n_queries: int, n_keys: int, device: torch.device) -> Tensor:
            self.fired[layer] += 1
            offset, kept = self.block
            if n_keys != len(kept) + n_queries:
                raise UnsupportedArchitectureError(
                    f"sink_cache_effect: layer {layer} attends to {n_keys} keys where its cache "
                    f"holds {len(kept) + n_queries}; this model's attention does not read the "
                    "cache it is given"
                )
            heads = tuple(self.sinks[layer])
            if heads not in self.built:
                self.built[heads] = self._bias(heads, offset, n_queries, kept, device)
            return self.built[heads]

        return build

    def _bias(
        self, heads: tuple[int, ...], offset: int, n: int, kept: Tensor, device: torch.device
    ) -> Float[Tensor, "head_index query_pos key_pos"]:
        query = torch.arange(offset, offset + n, device=device)[:, None]
        key = torch.cat([kept.to(device), query[:, 0]])[None, :]
        recent = query - key <= self.window
        bias = torch.empty(len(heads), n, key.shape[1], device=device)
        for x in set(heads):  # at most two values: the layer's sinks and a head's 0
            sink = key < x
            distance = query - key
            if self.positions == "cache":
                distance = torch.where(sink, query.clamp(max=x + self.window) - key, distance)
            full = alibi.bias_from_distance(
                self.kind, self.slopes, distance.clamp(min=0), **self.params
            ).to(device)
            # Past keys neither sinks nor recent are out of the cache (future keys: the model's
            # own causal mask).
            full = full.masked_fill(~(sink | recent) & (key <= query), -math.inf)
            chosen = torch.tensor([h == x for h in heads], device=device)
            bias[chosen] = full[chosen]
        return bias


def _trained_kind(model: Model, info: ModelInfo) -> tuple[str, dict]:
    """The model's trained bias kind, or one line: no ALiBi, or a mitigation the bias replaces."""
    if not info.is_alibi:
        raise UnsupportedArchitectureError(
            f"sink_cache_effect needs ALiBi (or no) positions; {info.name} uses "
            f"{info.shape.positional} positions, which a cache of sinks plus recent "
            "tokens would have to re-encode (StreamingLLM re-rotates rotary keys): not supported"
        )
    replaced = [kind for kind in active_mitigations(model) if kind not in ("standard", "softcap")]
    if replaced:
        raise UnsupportedArchitectureError(
            f"sink_cache_effect builds the ALiBi bias of each cache itself from the model's "
            f"trained kind; a {replaced[-1]} mitigation is active, whose bias it would replace: "
            "leave its block"
        )
    return trained_bias(info.metadata)


@torch.no_grad()
@holds_model("sink_cache_effect")
def sink_cache_effect(
    model: Model,
    data: Data | Sequences = None,
    *,
    sinks: Sequence[int] = (0, 1, 4),
    windows: Sequence[int] | None = None,
    positions: str = "cache",
    heads: Heads | None = None,
    head_cache: tuple[int, int] | None = None,
    head_seq_len: int | None = 2048,
    batch_size: int = 1,
    block_size: int | None = None,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> SinkCacheEffect:
    """Perplexity with a StreamingLLM cache of sinks plus recent tokens, and the heads that need
    the sinks.

    ``effect = sink_cache_effect(model)`` (16,384 held-out tokens, sinks 0, 1, 4):
    ``effect.by_cache`` has ppl and ΔNLL against the full context per (sinks, window),
    ``effect.by_head`` the ΔNLL when one head alone loses its sinks, ranked. Refused in one line:
    a model without ALiBi, an active mitigation other than softcap, sinks below 0, windows below 1,
    a per-head cache that drops nothing.

    - ``model``: an ALiBi model (its trained bias kind is kept at the cache's distances).
    - ``data``: as in :func:`headsurgeon.window_effect`; texts cut as :data:`SINK_CACHE_CUT`.
    - ``sinks``: the numbers ``x`` of initial tokens kept.
    - ``windows``: the numbers ``y`` of recent tokens kept (default: ``train_ctx`` and a quarter).
    - ``positions``: distances in cache slots (``"cache"``, StreamingLLM's) or ``"true"`` ones.
    - ``heads``: the heads tested one by one (default every head; ``[]`` skips the test). On
      TransformerLens 3.x each reruns only its layer and those above, from the base pass's
      residual stream, kept: layers x tested tokens x ``d_model`` numbers (organism: 6 MiB).
    - ``head_cache``: the ``(x, y)`` every other head keeps (default: most sinks, least window).
    - ``head_seq_len``: the tokens of each sequence the per-head test reads (``None``: all).
    - ``batch_size``: sequences per forward pass.
    - ``block_size``: query rows per block (default: ``y`` clamped to 64 ... 512).
    - ``progress``: show a progress bar.
    - ``seq_len``, ``n_seqs``, ``prepend_bos``: deprecated (they warn): ``hs.to_sequences`` cuts.

    The cache, the columns, what it tests and its cost: [Long contexts: the sink-cache
    test](../long-contexts.md#the-sink-cache-test-streamingllm).
    """
    info = model_info(model, "sink_cache_effect")
    kind = _trained_kind(model, info)
    positions = check_choice(positions, "positions", POSITIONS)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if block_size is not None:
        block_size = check_int(block_size, "block_size", minimum=1)
    sinks = sorted({check_int(x, "each of sinks", minimum=0) for x in sinks})
    train_ctx = info.train_ctx
    if windows is None:
        windows = [max(1, (train_ctx or model.cfg.n_ctx) // 4), train_ctx or model.cfg.n_ctx]
    windows = sorted({check_int(y, "each of windows", minimum=1) for y in windows})
    if not sinks or not windows:
        raise InvalidArgumentError("give at least one value in sinks and in windows")
    seqs = verb_sequences(
        info, data, "sink_cache_effect", SINK_CACHE_CUT, seq_len, n_seqs, prepend_bos
    )
    seqs = sequences_to_cut(seqs)
    tokens, n_pos = seqs.tokens, seqs.seq_len
    chosen, (head_x, head_y), head_pos = _per_head(
        model, heads, head_cache, head_seq_len, (sinks[-1], windows[0]), n_pos
    )
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    configs = [(x, y) for x in sinks for y in windows]
    bar = tqdm(
        total=1 + len(configs) + (1 + len(chosen) if chosen else 0),
        desc="sink cache",
        disable=not progress,
    )

    refusal = fused_path_refusal(model, info, n_pos)
    if refusal is not None:
        logger.info("sink_cache_effect: blocked attention, not fused: %s", refusal)

    def run(cut: list[list[int]] | None, window: int, tokens: Tensor, **more: object) -> Tensor:
        start = time.perf_counter()
        nll = _cache_nll(
            model,
            tokens,
            cut,
            window,
            positions,
            (info.slopes, kind),
            batch_size,
            block_size,
            **more,
            fused=refusal is None,
        )
        what = "full context" if cut is None else f"cache {max(map(max, cut))} + {window}"
        logger.debug("%s, %d tokens: %.1f s", what, tokens.numel(), time.perf_counter() - start)
        bar.update()
        return nll

    with bar:
        full = run(None, 0, tokens)
        rows = []
        for x, y in configs:
            nll = run([[x] * n_heads] * n_layers, y, tokens)
            rows.append(_cache_row(x, y, positions, nll, full))
        head_rows = []
        if chosen:
            short = tokens[:, :head_pos]
            # Below a head's layer its pass is the base pass: keep what enters each block there
            # (where the backend can start a pass at a block) and run only the layers above.
            inputs = LayerInputs({layer for layer, _ in chosen} if resumes_at_layer(model) else ())
            base = run([[head_x] * n_heads] * n_layers, head_y, short, keep=inputs)
            slopes = info.slopes.double().numpy()
            for layer, head in chosen:
                cut = [[head_x] * n_heads for _ in range(n_layers)]
                cut[layer][head] = 0
                start = (layer, inputs) if layer in inputs.layers else None
                nll = run(cut, head_y, short, start=start)
                change = nll_change(nll - base, base)
                head_rows.append(
                    {"layer": layer, "head": head, "slope": float(slopes[head])}
                    | {"sinks": head_x, "window": head_y}
                    | change
                )
    by_cache = pd.DataFrame(rows, columns=_CACHE_COLUMNS)
    by_head = pd.DataFrame(head_rows, columns=_HEAD_COLUMNS[:-1])
    by_head = by_head.sort_values("dnll", ascending=False, kind="stable", ignore_index=True)
    by_head["rank"] = np.arange(1, len(by_head) + 1)
    attrs = {
        "model": info.name,
        "data": seqs.source,
        "n_seqs": seqs.n_seqs,
        "seq_len": n_pos,
        "prepend_bos": seqs.holds_bos,
        "positions": positions,
        "bias": kind[0],
        "train_ctx": train_ctx,
        "full_nll": full.mean().item(),
        "full_ppl": math.exp(full.mean().item()),
        "tests": _TESTS,
        "attention": "blocked" if refusal else "fused",
        "blocked_because": refusal,
    }
    by_cache.attrs.update(attrs)
    by_head.attrs.update(attrs, head_seq_len=head_pos)
    return SinkCacheEffect(by_cache=by_cache, by_head=by_head, nll=full.numpy())


def _per_head(
    model: Model,
    heads: Heads | None,
    head_cache: tuple[int, int] | None,
    head_seq_len: int | None,
    default: tuple[int, int],
    n_pos: int,
) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """The per-head test's heads, cache and length, checked (no heads: ``heads=[]``)."""
    chosen = [] if heads is not None and not list(heads) else None
    if chosen is None and heads is None and head_cache is None and default[0] == 0:
        # sinks=[0] alone asks about window-only caches: no head has sinks to lose.
        logger.info("no per-head test: with 0 sinks no head has sinks to lose")
        chosen = []
    if chosen is None:
        chosen = list(HeadSet.of(every_head(model) if heads is None else heads, model))
    x, y = default if head_cache is None else head_cache
    x = check_int(x, "head_cache's sinks", minimum=1 if chosen else 0)
    y = check_int(y, "head_cache's window", minimum=1)
    length = n_pos
    if head_seq_len is not None:
        length = min(n_pos, check_int(head_seq_len, "head_seq_len", minimum=3))
    if chosen and length <= x + y + 1:
        raise InvalidArgumentError(
            f"per head, a cache of {x} + {y} tokens drops nothing from sequences of {length} "
            f"tokens; give head_seq_len above {x + y + 1} or a smaller head_cache (or heads=[] "
            "to skip the per-head test)"
        )
    return chosen, (x, y), length


def _cache_row(
    x: int,
    y: int,
    positions: str,
    nll: Float[Tensor, "seq position"],
    full: Float[Tensor, "seq position"],
) -> dict:
    """One row of ``by_cache``."""
    change = nll_change(nll - full, full)
    late = torch.arange(nll.shape[1]) > x + y  # predictions whose cache has dropped keys
    return {
        "sinks": x,
        "window": y,
        "positions": positions,
        "tokens": change["tokens"],
        "nll": nll.mean().item(),
        "ppl": math.exp(nll.mean().item()),
        "dnll": change["dnll"],
        "dnll_se": change["dnll_se"],
        "full_nll": full.mean().item(),
        "full_ppl": math.exp(full.mean().item()),
        "evicted": int(late.sum()) * len(nll),
        "dnll_evicted": (nll - full)[:, late].mean().item() if late.any() else math.nan,
    }


_TESTS = (
    "whether the model's loss on this text needs its first tokens once a StreamingLLM cache "
    "(x sinks + y recent) has dropped the middle, against the full context; windows below the "
    "training length test in-distribution distances, above it far ones; not what the model "
    "does with the whole far context (window_effect), nor a model trained to stream"
)
_CACHE_COLUMNS = [
    "sinks",
    "window",
    "positions",
    "tokens",
    "nll",
    "ppl",
    "dnll",
    "dnll_se",
    "full_nll",
    "full_ppl",
    "evicted",
    "dnll_evicted",
]
_HEAD_COLUMNS = [
    "layer",
    "head",
    "slope",
    "sinks",
    "window",
    "tokens",
    "base_nll",
    "dnll",
    "dnll_se",
    "rank",
]


def _cache_nll(
    model: Model,
    tokens: Int[Tensor, "seq pos"],
    sinks: list[list[int]] | None,
    window: int,
    positions: str,
    bias_of: tuple[Tensor, tuple[str, dict]],
    batch_size: int,
    block_size: int | None,
    keep: LayerInputs | None = None,
    start: tuple[int, LayerInputs] | None = None,
    fused: bool = False,
) -> Float[Tensor, "seq position"]:
    """Next-token NLL at every position (float64, CPU): the model's own full-context pass
    (``sinks`` None), or with the cache ``sinks[layer][head]`` + ``window`` through each layer's
    bias (``bias_of``: the model's slopes and trained bias kind); refuses a layer whose bias was
    never built. With a cache: ``keep`` records what enters each of its layers per block;
    ``start`` (``(layer, inputs)``) runs only the layers from ``layer`` on, from what ``inputs``
    recorded (in a pass whose earlier layers had the same cut). ``fused``: on the fused
    attention (:func:`_fused_cache_nll`)."""
    if fused:
        return _fused_cache_nll(
            model, tokens, sinks, window, positions, bias_of[0], batch_size, block_size, keep, start
        )
    n_seqs, n_pos = tokens.shape
    out = torch.empty(n_seqs, n_pos - 1, dtype=torch.float64)
    slopes, kind = bias_of
    bias = None if sinks is None else _CacheBias(slopes, sinks, window, positions, kind)
    first, inputs = start or (0, None)
    blocks = list(enumerate(model.blocks))[first:]
    handles = [] if bias is None else [add_bias_hook(b.attn, bias.builder(i)) for i, b in blocks]
    record = [] if keep is None else sorted(keep.layers)
    try:
        for i, batch in enumerate(batches(tokens, batch_size)):
            rows = out[i * batch_size : i * batch_size + len(batch)]  # a view
            if bias is None:
                block = block_size or long_context.block_size(model, n_pos, batch=len(batch))
            else:
                block = block_size or min(max(window, 64), 512)
            keys = None if bias is None else bias.keys
            resume = None if inputs is None else (first, functools.partial(inputs.read, first, i))
            hooks = [
                (f"blocks.{layer}.hook_resid_pre", keep.writer(layer, i, lambda: bias.block[0]))
                for layer in record
            ]
            with model.hooks(fwd_hooks=hooks):
                for position, nll in next_token_nll(model, batch, block, keys=keys, start=resume):
                    rows[:, position : position + nll.shape[1]] = nll.cpu()
    finally:
        for handle in handles:
            handle.remove()
    if bias is not None:
        silent = [layer for layer, n in enumerate(bias.fired) if not n and layer >= first]
        if silent:
            hook = f"the bias pre-hook of blocks.{silent[0]}.attn"
            raise unfired(model, "sink_cache_effect", hook, silent)
    return out


def _fused_cache_nll(
    model: Model,
    tokens: Int[Tensor, "seq pos"],
    sinks: list[list[int]] | None,
    window: int,
    positions: str,
    slopes: Tensor,
    batch_size: int,
    block_size: int | None,
    keep: LayerInputs | None,
    start: tuple[int, LayerInputs] | None,
) -> Float[Tensor, "seq position"]:
    """:func:`_cache_nll` on the fused attention: whole sequences, each block of 64 query rows
    against the keys its cache holds (:func:`windowed_attention`, the bias ``-m d`` of
    ``slopes`` at the cache's distances); ``keep`` and ``start`` hold whole sequences."""

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, **own: Tensor) -> Tensor:
        if sinks is None:  # the model's own bias, as its full-context pass adds it
            return windowed_attention(q, k, v, **own, scale=scale)
        return windowed_attention(
            q,
            k,
            v,
            slopes.to(q.device, q.dtype),
            scale=scale,
            window=window,
            sinks=sinks[layer],
            cache_distance=positions == "cache",
        )

    return fused_token_nll(
        model,
        tokens,
        slopes,
        attend,
        analysis="sink_cache_effect",
        batch_size=batch_size,
        block_size=block_size,
        keep=keep,
        start=start,
    )
