"""Which weights differ between two BLOOM checkpoints, inside and outside given heads' slices:
the check that surgery touched only the heads it was told to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from headsurgeon.errors import (
    CheckpointError,
    InvalidArgumentError,
    UnsupportedArchitectureError,
)
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.loading import model_shape, resolve_model
from headsurgeon.loading.checks import check_checkpoint
from headsurgeon.loading.files import pickled_tensors, safetensors_header, weight_files
from headsurgeon.validation import check_int

__all__ = [
    "weight_changes",
]


StateDict = Mapping[str, Tensor]


class _SafetensorsState(Mapping[str, Tensor]):
    """Tensors of safetensors files (a checkpoint's shards), read one at a time when asked for."""

    def __init__(self, files: list[Path]) -> None:
        self._files: dict[str, Path] = {}
        for file in files:
            # The header read bounded, a regular file only: never map a FIFO or a device.
            self._files.update(dict.fromkeys(safetensors_header(file), file))

    def __getitem__(self, name: str) -> Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _pickled_state(files: list[Path]) -> dict[str, Tensor]:
    """Tensors of pickled ``pytorch_model*.bin`` files, memory-mapped: pages are read on access."""
    state: dict[str, Tensor] = {}
    for file in files:
        state |= pickled_tensors(file, map_location="cpu", mmap=True)
    return state


# The one key scheme weight_changes compares in: BloomForCausalLM's, as save_hf writes it.
# BloomModel's names (bigscience's published files: "h.0...", "word_embeddings.weight") gain
# the "transformer." prefix; a checkpoint without lm_head ties it to the word embeddings.
_PREFIX = "transformer."
_LM_HEAD, _EMBEDDINGS = "lm_head.weight", "transformer.word_embeddings.weight"


class _BloomNames(Mapping[str, Tensor]):
    """A BLOOM state under BloomForCausalLM's names (see :func:`weight_changes`)."""

    def __init__(self, state: StateDict, which: str) -> None:
        self._state = state
        self._names: dict[str, str] = {}  # ours -> the state's
        for name in state:
            ours = name if name.startswith((_PREFIX, "lm_head.")) else _PREFIX + name
            if ours in self._names:
                raise CheckpointError(
                    f"the {which} checkpoint holds both {self._names[ours]} and {name}: two "
                    "layouts of one tensor; re-export it (load_model, then save_hf)"
                )
            self._names[ours] = name

    def tie_lm_head(self) -> None:
        """Read an absent ``lm_head.weight`` as the word embeddings, as BLOOM ties them."""
        if _LM_HEAD not in self._names and _EMBEDDINGS in self._names:
            self._names[_LM_HEAD] = self._names[_EMBEDDINGS]

    def __getitem__(self, name: str) -> Tensor:
        return self._state[self._names[name]]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _checkpoint_state(
    checkpoint: StateDict | str | os.PathLike, which: str
) -> tuple[_BloomNames, int | None]:
    """A checkpoint's state under BloomForCausalLM's names (lazy for folders) and its head width
    (when known). A folder is validated as :func:`~headsurgeon.loading.load_model` does first."""
    if isinstance(checkpoint, Mapping):
        return _BloomNames(checkpoint, which), None
    _, directory = resolve_model(checkpoint)
    check_checkpoint(directory)
    files = weight_files(directory)
    state: StateDict = (
        _SafetensorsState(files) if files[0].suffix == ".safetensors" else _pickled_state(files)
    )
    shape = model_shape(directory)  # the config read as load_model reads it, aliases included
    return _BloomNames(state, which), shape.d_model // shape.n_heads


def weight_changes(
    before: StateDict | str | os.PathLike,
    after: StateDict | str | os.PathLike,
    heads: Heads = (),
    *,
    d_head: int | None = None,
) -> pd.DataFrame:
    """Which weights changed between two BLOOM checkpoints, inside and outside ``heads``' slices.

    One row per tensor: ``tensor`` (named as ``BloomForCausalLM`` names it), ``dtype_before``,
    ``dtype_after``, ``elements``, ``head_elements``, ``head_changed``, ``other_changed``; values
    are compared exactly in the wider dtype, so a repair that must leave every other weight
    bit-identical sums ``other_changed`` to 0. A tensor only one side has raises
    :class:`CheckpointError`.

    - ``before``, ``after``: state dicts, or folders and names as ``load_model`` takes them.
    - ``heads``: the heads whose slices count as inside (any head form).
    - ``d_head``: the head width (default: read from a folder's ``config.json``).

    Key schemes, slices and cost: [Repair: checking the
    weights](../tools/repair.md#checking-the-weights-weight_changes).

    >>> qkv = "transformer.h.0.self_attention.query_key_value.weight"
    >>> dense = "transformer.h.0.self_attention.dense.weight"
    >>> before = {qkv: torch.zeros(12, 4), dense: torch.zeros(4, 4)}  # 2 heads of width 2
    >>> after = {name.removeprefix("transformer."): w.clone() for name, w in before.items()}
    >>> after["h.0.self_attention.query_key_value.weight"][0, 0] = 1.0  # head 0's query
    >>> after["h.0.self_attention.dense.weight"][0, 3] = 1.0  # head 1's output column
    >>> changes = weight_changes(before, after, [(0, 1)], d_head=2)
    >>> changes[["head_changed", "other_changed"]].values.tolist()
    [[0, 1], [1, 0]]
    """
    heads = list(HeadSet.of(heads))  # any form HeadSet.of takes, checked before any reading
    before_state, before_width = _checkpoint_state(before, "first")
    after_state, after_width = _checkpoint_state(after, "second")
    d_head = d_head or before_width or after_width
    if d_head is not None:
        d_head = check_int(d_head, "d_head", minimum=1)
    if heads and d_head is None:
        raise InvalidArgumentError("d_head is unknown for state dicts; pass d_head=")
    _check_heads(before_state, heads, d_head)
    if (_LM_HEAD in before_state) != (_LM_HEAD in after_state):
        before_state.tie_lm_head()
        after_state.tie_lm_head()
    for which, lacking, other in (
        ("second", after_state, before_state),
        ("first", before_state, after_state),
    ):
        if missing := sorted(set(other) - set(lacking)):
            raise CheckpointError(
                f"the {which} checkpoint lacks {len(missing)} tensor(s) of the other, e.g. "
                f"{missing[0]}; compare checkpoints of the same model"
            )
    # One tensor pair at a time, inside a call, so none outlives its row (a lazy folder then
    # holds at most the largest tensor of each checkpoint).
    rows = [
        _tensor_changes(name, before_state[name], after_state[name], heads, d_head)
        for name in before_state
    ]
    return pd.DataFrame(rows)


def _check_heads(state: Mapping[str, Tensor], heads: list[tuple[int, int]], d_head: int) -> None:
    """One line unless every head is in ``state``'s BLOOM-layout query_key_value."""
    other_layout = UnsupportedArchitectureError(
        "weight_changes splits BLOOM's per-head query_key_value rows; this checkpoint's fused "
        "attention (MPT's Wqkv, or multi-query keys and values) has another layout: compare "
        "it with heads=() (every change then counts as other_changed)"
    )
    if heads and any(".attn.Wqkv." in name for name in state):
        raise other_layout
    qkv_rows = {}  # per layer of the heads: read once, not once per head
    for layer in {layer for layer, _ in heads}:
        qkv = state.get(f"{_PREFIX}h.{layer}.self_attention.query_key_value.weight")
        dense = state.get(f"{_PREFIX}h.{layer}.self_attention.dense.weight")
        qkv_rows[layer] = 0 if qkv is None else qkv.shape[0]
        if dense is not None and qkv_rows[layer] != 3 * dense.shape[1]:  # not q, k, v per head
            raise other_layout
    for layer, head in heads:
        if not 0 <= head < qkv_rows[layer] // (3 * d_head):
            raise InvalidArgumentError(
                f"head L{layer}H{head} is not in the first checkpoint; pass heads of its model"
            )


def _tensor_changes(
    name: str, old: Tensor, new: Tensor, heads: list[tuple[int, int]], d_head: int | None
) -> dict[str, Any]:
    """One row of :func:`weight_changes`: ``name``'s changed elements inside / outside heads."""
    if old.shape != new.shape:
        raise CheckpointError(
            f"{name} has shape {tuple(old.shape)} before and {tuple(new.shape)} after; "
            "compare checkpoints of the same model"
        )
    common = torch.promote_types(old.dtype, new.dtype)
    changed = old.to(common) != new.to(common)
    if common.is_floating_point:  # NaN != NaN: a NaN left where it was is no change
        changed &= ~(old.isnan() & new.isnan())
    in_heads = torch.zeros(old.shape, dtype=torch.bool)
    for layer, head in heads:
        prefix = f"{_PREFIX}h.{layer}.self_attention."
        if name in (prefix + "query_key_value.weight", prefix + "query_key_value.bias"):
            in_heads[head * 3 * d_head : (head + 1) * 3 * d_head] = True
        elif name == prefix + "dense.weight":
            in_heads[:, head * d_head : (head + 1) * d_head] = True
    # count_nonzero, not sum: summing a bool tensor first copies it to int64 (8x its size).
    head_changed = int((changed & in_heads).count_nonzero())
    return {
        "tensor": name,
        "dtype_before": str(old.dtype).removeprefix("torch."),
        "dtype_after": str(new.dtype).removeprefix("torch."),
        "elements": old.numel(),
        "head_elements": int(in_heads.count_nonzero()),
        "head_changed": head_changed,
        "other_changed": int(changed.count_nonzero()) - head_changed,
    }
