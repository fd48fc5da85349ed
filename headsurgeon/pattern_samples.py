"""Attention weights for pictures: some heads' query x key weights on one sequence, max-pooled
into cells as the blocks of the long-context path arrive, and every head's weights on the first
positions of a few sequences (what a report page shows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from headsurgeon import long_context
from headsurgeon.backend import HookPoint, Model
from headsurgeon.data import check_length, check_token_ids
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.inuse import holds_model
from headsurgeon.loading import model_info
from headsurgeon.probes import check_fired
from headsurgeon.validation import check_int

__all__ = [
    "PatternSample",
    "attention_weights",
    "sample_patterns",
]


@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    """The attention weights of some heads on one sequence, as :func:`attention_weights` reads
    them from ``hook_pattern``.

    ``weights[i, r, c]`` is head ``heads[i]``'s largest weight over the cell of query positions
    ``r * step ... r * step + step - 1`` and key positions ``c * step ...`` (``step`` 1: the
    weight of query ``r`` on key ``c`` itself); ``query[i, r, c]`` and ``key[i, r, c]`` are the
    positions of that largest weight (the first one on ties), so every number shown is an exact
    weight of one (query, key) pair. Cells above the diagonal hold 0 (masked: future keys).
    """

    heads: tuple[tuple[int, int], ...]
    weights: np.ndarray  # float32 [head, row, column]
    query: np.ndarray  # int64 [head, row, column]
    key: np.ndarray  # int64 [head, row, column]
    step: int
    n_pos: int

    def of(self, layer: int, head: int) -> np.ndarray:
        """The ``[row, column]`` weights of one head."""
        return self.weights[self.heads.index((layer, head))]


class _PooledPattern:
    """Max-pools the rows of chosen heads' ``hook_pattern`` into ``step`` x ``step`` cells as
    the blocks of a sequence arrive; only the pooled ``[head, cells, cells]`` arrays are kept."""

    def __init__(self, heads: Sequence[tuple[int, int]], n_pos: int, step: int) -> None:
        self.by_layer: dict[int, list[int]] = {}
        for i, (layer, _) in enumerate(heads):
            self.by_layer.setdefault(layer, []).append(i)
        self.heads, self.step = list(heads), step
        cells = -(-n_pos // step)
        shape = (len(heads), cells, cells)
        self.weights = torch.zeros(shape, dtype=torch.float32)
        # Until a block reaches it, a cell holds the weight 0 of its first (query, key) pair: the
        # cells wholly above the diagonal (future keys) keep it.
        corner = torch.arange(cells) * step
        self.query = corner[:, None].expand(shape).clone()
        self.key = corner[None, :].expand(shape).clone()
        self.fired = [0] * (max(self.by_layer) + 1)

    def hook(self, pattern: Tensor, hook: HookPoint) -> None:
        layer = hook.layer()
        self.fired[layer] += 1
        index = self.by_layer[layer]
        chosen = pattern[0, [self.heads[i][1] for i in index]].float().cpu()  # [h, Q, K]
        n_rows, n_keys = chosen.shape[-2:]
        offset, step = n_keys - n_rows, self.step
        # Pad with -1 (below every weight) so that rows and keys split into whole cells: the
        # rows from the first cell boundary at or before ``offset``, the keys from 0.
        lead = offset % step
        rows_padded = -(-(lead + n_rows) // step) * step
        keys_padded = -(-n_keys // step) * step
        padded = chosen.new_full((len(index), rows_padded, keys_padded), -1.0)
        padded[:, lead : lead + n_rows, :n_keys] = chosen
        h, r, c = len(index), rows_padded // step, keys_padded // step
        cells = padded.view(h, r, step, c, step).permute(0, 1, 3, 2, 4).reshape(h, r, c, -1)
        best, where = cells.max(-1)
        query = (offset - lead) + torch.arange(r)[:, None] * step + where // step
        key = torch.arange(c) * step + where % step
        rows = slice((offset - lead) // step, (offset - lead) // step + r)
        chosen_heads = torch.tensor(index)
        kept = self.weights[chosen_heads, rows, :c]
        better = best > kept
        self.weights[chosen_heads, rows, :c] = torch.where(better, best, kept)
        kept_query = self.query[chosen_heads, rows, :c]
        self.query[chosen_heads, rows, :c] = torch.where(better, query, kept_query)
        kept_key = self.key[chosen_heads, rows, :c]
        self.key[chosen_heads, rows, :c] = torch.where(better, key.expand_as(query), kept_key)


@holds_model("attention_weights")
def attention_weights(
    model: Model,
    tokens: Int[Tensor, "1 pos"],
    heads: Heads,
    *,
    max_cells: int | None = None,
    block_size: int | None = None,
) -> AttentionWeights:
    """The query x key attention weights of ``heads`` on one sequence, read at ``hook_pattern``
    (the census's hook: the model's exact ALiBi as :func:`headsurgeon.load_model` installs it).

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    >>> w = attention_weights(model, torch.randint(0, 64, (1, 10)), "L1H0-1")
    >>> w.weights.shape, w.step, float(w.weights[0, 9].sum().round(decimals=5))
    ((2, 10, 10), 1, 1.0)

    ``tokens`` is one sequence (``[1, pos]`` or ``[pos]``), used as given; ``heads`` any head
    form (:meth:`headsurgeon.HeadSet.of`). With ``max_cells`` and a longer sequence the weights
    are max-pooled into cells of ``step = ceil(pos / max_cells)`` positions a side, and the
    position of each cell's largest weight is kept (:class:`AttentionWeights`). The sequence
    runs in blocks of query rows (:func:`headsurgeon.long_context.run_in_blocks`; ``block_size``
    as there), only up to the last layer asked for, and each block is pooled as it arrives: no
    ``[head, pos, pos]`` tensor is held beyond one block's and the pooled one. Nothing is kept
    on the model.
    """
    info = model_info(model, "attention_weights")
    chosen = HeadSet.of(heads, info.shape)
    if isinstance(tokens, Tensor) and tokens.dim() == 1:
        tokens = tokens[None]
    tokens = check_token_ids(info, tokens)
    if tokens.shape[0] != 1:
        raise InvalidArgumentError(
            f"attention weights are read on one sequence, got {tokens.shape[0]}; pass one row"
        )
    n_pos = check_length(info, tokens.shape[1])
    step = 1 if max_cells is None else -(-n_pos // check_int(max_cells, "max_cells", minimum=1))
    pooled = _PooledPattern(list(chosen), n_pos, step)
    stop = max(chosen.layers) + 1
    hooks = [(f"blocks.{layer}.attn.hook_pattern", pooled.hook) for layer in chosen.layers]
    block = block_size or long_context.block_size(model, n_pos)
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        for _ in long_context.run_in_blocks(model, tokens, block_size=block, stop_at_layer=stop):
            pass
    check_fired(
        model,
        "attention_weights",
        {
            "blocks.{layer}.attn.hook_pattern": [
                pooled.fired[layer] if layer in chosen.layers else 1 for layer in range(stop)
            ]
        },
    )
    return AttentionWeights(
        heads=tuple(chosen),
        weights=pooled.weights.numpy(),
        query=pooled.query.numpy(),
        key=pooled.key.numpy(),
        step=step,
        n_pos=n_pos,
    )


@dataclasses.dataclass(frozen=True)
class PatternSample:
    """Every head's attention weights on a few sequences: ``tokens[i]`` (the positions read) and
    ``weights[i]`` (:class:`AttentionWeights` of all heads, layer-major) per sequence."""

    tokens: Int[Tensor, "seq pos"]
    weights: tuple[AttentionWeights, ...]


def sample_patterns(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    *,
    n_seqs: int = 2,
    n_pos: int | None = 48,
    max_cells: int | None = None,
) -> PatternSample:
    """Every head's weights on the first ``n_pos`` positions (``None``: all) of the first
    ``n_seqs`` rows of ``tokens``, max-pooled beyond ``max_cells`` (see
    :func:`attention_weights`). Causal attention makes the first positions of a sequence exactly
    what the whole sequence's first rows hold: a short sample of a run's own sequences.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    >>> sample = sample_patterns(model, torch.randint(0, 64, (3, 80)), n_pos=10)
    >>> tuple(sample.tokens.shape), sample.weights[0].weights.shape
    ((2, 10), (8, 10, 10))
    """
    tokens = check_token_ids(model_info(model, "sample_patterns"), tokens)  # every row: the door
    rows = tokens[: check_int(n_seqs, "n_seqs", minimum=1), :n_pos]
    everything = [
        (layer, head) for layer in range(model.cfg.n_layers) for head in range(model.cfg.n_heads)
    ]
    read = [attention_weights(model, row, everything, max_cells=max_cells) for row in rows]
    return PatternSample(tokens=rows.cpu(), weights=tuple(read))
