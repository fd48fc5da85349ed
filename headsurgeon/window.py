"""The window counterfactual: how much the loss depends on keys beyond a distance.

A head's reach (the census's ``reach``) says how far back its weights go; it does not say whether
the model needs what lies there. :func:`window_effect` answers that: it runs the model with
attention restricted to keys within distance ``d`` of each query (position 0 always kept; the
cut keys are masked before the softmax, so the kept weights renormalise) and reports how much
the next-token loss rises, by ``d`` and by position, for all heads at once; and, at one chosen
distance, for one head at a time: which distances the model uses, and which heads use the far
ones.

>>> from headsurgeon.loading import ModelShape, random_model
>>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
>>> tokens = torch.randint(0, 64, (2, 12))
>>> effect = window_effect(model, tokens, distances=[2, 11], progress=False)
>>> effect.by_distance.groupby("distance")["dnll"].apply(lambda x: bool((x == 0).all())).tolist()
[False, True]
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon import long_context
from headsurgeon.backend import HookPoint, Model, masked_score
from headsurgeon.backend.forward import resumes_at_layer
from headsurgeon.backend.fused import windowed_attention
from headsurgeon.backend.shared import Attend
from headsurgeon.blindness.analysis import fused_path_refusal, require_scores
from headsurgeon.data import Cut, Data, Sequences, batches, verb_sequences
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.evals.loss import (
    LayerInputs,
    check_edges,
    fused_token_nll,
    next_token_nll,
    position_edges,
)
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.inuse import holds_model
from headsurgeon.loading import ModelInfo, model_info
from headsurgeon.probes import unfired
from headsurgeon.progress import tqdm
from headsurgeon.stats import nll_change
from headsurgeon.validation import check_int

__all__ = [
    "WindowEffect",
    "WINDOW_CUT",
    "window_effect",
]

logger = logging.getLogger(__name__)

WINDOW_CUT = Cut(seq_len=1024, n_seqs=8)
"""How :func:`window_effect` cuts texts: 8 sequences of 1,024 tokens."""

# Bytes per (batch, head, query, key) entry of a forward pass with the hook: the plain pass's, the
# cut mask and the masked copy of the scores.
_BYTES_PER_ENTRY = long_context.FORWARD_BYTES_PER_ENTRY + 5
# The most the per-head test keeps of the base pass's residual stream, to start each head's
# pass at its layer (fused attention, TransformerLens 3.x).
KEPT_BYTES = 2**30

ScoresHook = Callable[[Tensor, HookPoint], Tensor | None]


def window_hook(distance: int, heads: Sequence[int] | None = None) -> ScoresHook:
    """A ``hook_attn_scores`` hook that cuts every key more than ``distance`` tokens before its
    query, except position 0, for the heads ``heads`` of the layer (``None``: all).

    The cut scores get the value the model masks future keys with (``-inf`` on TransformerLens
    3.x, the float minimum on 4.x), so the softmax gives them exactly 0 and renormalises the
    rest. Masked (future) keys stay as they are. A block of rows (:mod:`headsurgeon.long_context`)
    is cut by its own query positions. Where nothing is that far (``distance`` at least the
    block's last query position minus 1) the scores are left untouched: the pass is bit for bit
    the model's own.

    >>> scores = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4).tril().bool(), -math.inf)
    >>> row = window_hook(1)(scores, None)[0, 0, 3]  # query 3: key 1 is 2 back, cut
    >>> bool(row[1] < -1e30), row[[0, 2, 3]].tolist()  # -inf on 3.x, the float minimum on 4.x
    (True, [0.0, 0.0, 0.0])
    """
    distance = check_int(distance, "distance", minimum=0)
    chosen = None if heads is None else list(heads)

    def hook(scores: Tensor, hook: HookPoint) -> Tensor | None:
        n_queries, n_keys = scores.shape[-2:]
        if distance >= n_keys - 2:  # the farthest key but position 0: last query - 1
            return None
        query = torch.arange(n_keys - n_queries, n_keys, device=scores.device)
        key = torch.arange(n_keys, device=scores.device)
        cut = (query[:, None] - key > distance) & (key > 0)  # [query, key]
        if chosen is not None:
            only = torch.zeros(scores.shape[1], 1, 1, dtype=torch.bool, device=scores.device)
            only[chosen] = True
            cut = cut & only
        masked = masked_score(scores.dtype)
        return scores.masked_fill(cut, masked)

    return hook


@dataclasses.dataclass
class WindowEffect:
    """Result of :func:`window_effect`.

    ``by_distance``: one row per (distance, position bucket), every head cut at that distance.
    ``by_head``: one row per head cut alone at ``head_distance`` (empty without one).
    ``nll``: the model's own next-token loss ``[seq, position]`` (float64), which the ΔNLL are
    measured from.
    """

    by_distance: pd.DataFrame
    by_head: pd.DataFrame
    nll: np.ndarray


def _default_distances(seq_len: int) -> list[int]:
    """Powers of two below the farthest distance a sequence of ``seq_len`` tokens has (the last
    query to position 1), which would cut nothing.

    >>> _default_distances(1024)
    [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    """
    return [2**k for k in range(max(seq_len - 2, 1).bit_length()) if 2**k < seq_len - 2]


class _Counter:
    """Counts the hook's calls per layer, checking each block holds real scores."""

    def __init__(self, info: ModelInfo, hook: ScoresHook) -> None:
        self.name, self.inner = info.name, hook
        self.fired = [0] * info.shape.n_layers

    def __call__(self, scores: Tensor, hook: HookPoint) -> Tensor | None:
        layer = hook.layer()
        self.fired[layer] += 1
        require_scores(
            self.name, scores, layer, "window_effect", "keys cannot be cut before the softmax"
        )
        return self.inner(scores, hook)


# {layer: (distance, heads)}: the keys each layer's pass cuts (heads None: every head).
Cuts = dict[int, tuple[int, Sequence[int] | None]]


def _token_nll(
    model: Model,
    info: ModelInfo,
    tokens: Int[Tensor, "seq pos"],
    cuts: Cuts,
    *,
    fused: bool,
    batch_size: int,
    block_size: int | None,
    **kept: Any,
) -> Float[Tensor, "seq position"]:
    """Next-token NLL at every position (float64, CPU) with the keys of ``cuts`` cut: on the
    fused attention (``fused``: :func:`~headsurgeon.evals.loss.fused_token_nll`, which takes
    ``kept``: ``keep``, ``start``), else by :func:`window_hook` on the layers'
    ``hook_attn_scores``; refuses a layer whose cut never ran."""
    if fused:
        attend = _fused_cuts(cuts)
        return fused_token_nll(
            model,
            tokens,
            info.slopes,
            attend,
            analysis="window_effect",
            batch_size=batch_size,
            block_size=block_size,
            **kept,
        )
    n_seqs, n_pos = tokens.shape
    out = torch.empty(n_seqs, n_pos - 1, dtype=torch.float64)
    counters = {layer: _Counter(info, window_hook(*cut)) for layer, cut in cuts.items()}
    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", c) for layer, c in counters.items()]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        for i, batch in enumerate(batches(tokens, batch_size)):
            rows = out[i * batch_size : i * batch_size + len(batch)]  # a view
            block = block_size or long_context.block_size(
                model, n_pos, batch=len(batch), bytes_per_entry=_BYTES_PER_ENTRY
            )
            for position, nll in next_token_nll(model, batch, block):
                rows[:, position : position + nll.shape[1]] = nll.cpu()
    silent = [layer for layer, c in counters.items() if not c.fired[layer]]
    if silent:
        raise unfired(model, "window_effect", f"blocks.{silent[0]}.attn.hook_attn_scores", silent)
    return out


class _FusedCut:
    """One layer's cut on the fused attention (:func:`windowed_attention`)."""

    def __init__(self, distance: int, heads: Sequence[int] | None) -> None:
        self.distance, self.heads = distance, heads

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **bias: Any) -> Tensor:
        # Beyond the farthest key but position 0 nothing is cut: the model's own pass, exactly.
        window = self.distance if self.distance < q.shape[1] - 2 else None
        return windowed_attention(q, k, v, **bias, window=window, heads=self.heads)


def _fused_cuts(cuts: Cuts) -> Attend:
    """The fused attention of a pass: each layer of ``cuts`` cut, the others whole."""
    by_layer = {layer: _FusedCut(*cut) for layer, cut in cuts.items()}

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, **bias: Any) -> Tensor:
        if layer in by_layer:
            return by_layer[layer](q, k, v, **bias)
        return windowed_attention(q, k, v, **bias)

    return attend


def _change(
    delta: Float[Tensor, "seq position"], base: Float[Tensor, "seq position"], positions: Tensor
) -> dict[str, float]:
    """:func:`headsurgeon.stats.nll_change` over ``positions`` (a bool mask or index of
    consecutive positions) of every sequence."""
    return nll_change(delta[:, positions], base[:, positions])


@torch.no_grad()
@holds_model("window_effect")
def window_effect(
    model: Model,
    data: Data | Sequences = None,
    *,
    distances: Sequence[int] | None = None,
    heads: Heads | None = None,
    head_distance: int | None = None,
    edges: Sequence[int] | None = None,
    batch_size: int = 1,
    block_size: int | None = None,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> WindowEffect:
    """The loss when attention only sees keys within ``d`` tokens: which distances the model uses.

    ``effect = window_effect(model, hs.to_sequences(model, seq_len=4096, n_seqs=4))`` cuts every
    head at d = 1, 2, 4 ...: ``effect.by_distance`` has the ΔNLL (cut minus the model's own, per
    predicted token) by d and position bucket; ``window_effect(model, distances=[],
    head_distance=64).by_head`` cuts one head at a time. Each query keeps the keys ``t - d ... t``
    and position 0; the others are masked before the softmax (:func:`window_hook`), so the kept
    weights renormalise.

    - ``model``: any model; its exact logits, ALiBi and any mitigation included, are cut.
    - ``data``: as :func:`headsurgeon.run_census` takes it; texts cut as :data:`WINDOW_CUT`.
    - ``distances``: the d that cut every head (default: powers of two below ``seq_len - 2``).
    - ``heads``: the heads cut one by one at ``head_distance`` (any head form; default: every head).
    - ``head_distance``: the d of the per-head table (``None``: no per-head table).
    - ``edges``: position bucket edges (default: :func:`headsurgeon.evals.position_edges`).
    - ``batch_size``: sequences per forward pass.
    - ``block_size``: query rows per block (default: what memory allows).
    - ``progress``: show a progress bar.
    - ``seq_len``, ``n_seqs``, ``prepend_bos``: deprecated (they warn): ``hs.to_sequences`` cuts.

    The columns, what it tests and its cost: [Blindness: which distances the loss
    uses](../tools/blindness.md#which-distances-the-loss-uses).
    """
    info = model_info(model, "window_effect")
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if block_size is not None:
        block_size = check_int(block_size, "block_size", minimum=1)
    if heads is not None and head_distance is None:
        raise InvalidArgumentError(
            "heads are cut one at a time at head_distance; give head_distance=... as well"
        )
    if head_distance is not None:
        head_distance = check_int(head_distance, "head_distance", minimum=0)
    if distances is not None:
        distances = [check_int(d, "each of distances", minimum=0) for d in distances]
    chosen = HeadSet.of(every_head(model) if heads is None else heads, model)
    seqs = verb_sequences(info, data, "window_effect", WINDOW_CUT, seq_len, n_seqs, prepend_bos)
    seqs = sequences_to_cut(seqs)
    tokens, n_pos = seqs.tokens, seqs.seq_len
    edges = check_edges(position_edges(n_pos) if edges is None else edges, n_pos)
    distances = _default_distances(n_pos) if distances is None else distances
    per_head = [] if head_distance is None else list(chosen)
    position = torch.arange(n_pos - 1)
    layers = range(model.cfg.n_layers)
    bar = tqdm(total=1 + len(distances) + len(per_head), desc="window", disable=not progress)

    refusal = fused_path_refusal(model, info, n_pos)
    if refusal is not None:
        logger.info("window_effect: blocked attention, not fused: %s", refusal)

    # Below a head's layer its pass is the base pass: keep what enters the tested layers there.
    keep = _kept_inputs(model, refusal, per_head, tokens)

    def run(cuts: Cuts, **kept: Any) -> Tensor:
        nll = _token_nll(
            model,
            info,
            tokens,
            cuts,
            fused=refusal is None,
            batch_size=batch_size,
            block_size=block_size,
            **kept,
        )
        bar.update()
        return nll

    with bar:
        # The model's own pass carries the cuts too, cutting nothing: checked like the others.
        base = run({layer: (n_pos, None) for layer in layers}, keep=keep)
        rows = []
        for d in distances:
            change = run({layer: (d, None) for layer in layers}) - base
            for lo, hi in zip(edges[:-1], edges[1:], strict=True):
                part = (position >= lo) & (position < hi)
                rows.append(
                    {"distance": d, "position_lo": lo, "position_hi": hi}
                    | _change(change, base, part)
                )
        slopes = info.slopes.double().numpy() if info.is_alibi else None
        scored = (position >= edges[0]) & (position < edges[-1])
        head_rows = []
        for layer, head in per_head:
            start = (layer, keep) if keep and layer in keep.layers else None
            change = run({layer: (head_distance, [head])}, start=start) - base
            slope = math.nan if slopes is None else float(slopes[head])
            head_rows.append(
                {"layer": layer, "head": head, "slope": slope, "distance": head_distance}
                | _change(change, base, scored)
            )
    by_distance = pd.DataFrame(rows, columns=_DISTANCE_COLUMNS)
    by_head = pd.DataFrame(head_rows, columns=_HEAD_COLUMNS)
    attrs = {
        "model": info.name,
        "data": seqs.source,
        "n_seqs": seqs.n_seqs,
        "seq_len": n_pos,
        "prepend_bos": seqs.holds_bos,
        "edges": list(edges),
        "attention": "blocked" if refusal else "fused",
        "blocked_because": refusal,
    }
    by_distance.attrs.update(attrs)
    by_head.attrs.update(attrs, head_distance=head_distance)
    return WindowEffect(by_distance=by_distance, by_head=by_head, nll=base.numpy())


def _kept_inputs(
    model: Model, refusal: str | None, per_head: list[tuple[int, int]], tokens: Tensor
) -> LayerInputs | None:
    """Where the per-head passes can start at the head's layer (the fused attention, a backend
    that resumes there) and what enters the tested layers fits in ``KEPT_BYTES``: the record
    for the base pass to fill, else None."""
    layers = {layer for layer, _ in per_head if layer > 0}
    if refusal is not None or not layers or not resumes_at_layer(model):
        return None
    size = len(layers) * tokens.numel() * model.cfg.d_model * model.cfg.dtype.itemsize
    if size > KEPT_BYTES:
        logger.info("window_effect: every layer per head (%d MiB to keep)", size >> 20)
        return None
    return LayerInputs(layers)


def every_head(model: Model) -> list[tuple[int, int]]:
    return [(layer, h) for layer in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]


def sequences_to_cut(seqs: Sequences) -> Sequences:
    """``seqs`` if a test can cut keys in them (3 tokens at least), else one line."""
    if seqs.seq_len < 3:
        raise InvalidArgumentError(
            f"sequences of {seqs.seq_len} tokens have no key to cut; give at least 3"
        )
    return seqs


_CHANGE_COLUMNS = ["tokens", "base_nll", "dnll", "dnll_se"]
_DISTANCE_COLUMNS = ["distance", "position_lo", "position_hi", *_CHANGE_COLUMNS]
_HEAD_COLUMNS = ["layer", "head", "slope", "distance", *_CHANGE_COLUMNS]
