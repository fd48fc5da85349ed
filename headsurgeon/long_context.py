"""Long sequences in bounded memory: the forward pass in blocks of query rows, exactly.

A dense forward pass holds every layer's ``[batch, head, query_pos, key_pos]`` scores and pattern,
so its memory grows as T², and a pattern hook doubles it. :func:`run_in_blocks` runs the sequence as
consecutive blocks of ``block_size`` query rows through the model's own key-value cache
(TransformerLens 3.x's ``TransformerLensKeyValueCache``, Hugging Face's ``DynamicCache`` under a 4.x
bridge): block ``b`` attends to the cached keys and values of every earlier position and to its own,
which is causal attention, computed by the model's own code with its own hooks. Memory is the cache
(two ``[batch, pos, d_model]`` tensors per layer: linear in T) plus one block's attention (``batch x
head x block x keys``); :func:`block_size` chooses the block, by speed and memory ([Long contexts:
blocks of query rows](../long-contexts.md#blocks-of-query-rows)). The numbers equal the dense pass's
up to float32 rounding (a matmul over fewer keys sums in another order): census columns agree within
1e-6, see ``tests/test_long_context.py``.

**What your hooks see on this path.** Every hook fires once per block, with the block's rows:

* ``hook_attn_scores``, ``hook_pattern``: ``[batch, head_index, block, keys]`` where
  ``keys = offset + block``; row ``i`` is query position ``offset + i``, column ``j`` key position
  ``j``. :func:`query_offset` gives ``offset`` from the tensor's shape.
* ``hook_q``, ``hook_z``, ``hook_attn_out``, ``hook_resid_*``, MLP hooks: ``[batch, block, ...]``,
  positions ``offset ... offset + block - 1``.
* ``hook_k``, ``hook_v``: the block's own new keys and values only (the earlier ones come from the
  cache).

With a single block (``block_size >= n_pos``) this is the ordinary dense forward pass: one call,
square patterns, no cache.

>>> from headsurgeon.loading import ModelShape, random_model
>>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
>>> tokens = torch.randint(0, 64, (1, 40))  # longer than n_ctx: ALiBi has no position table
>>> [(offset, tuple(resid.shape)) for offset, resid in run_in_blocks(model, tokens, block_size=16)]
[(0, (1, 16, 32)), (16, (1, 16, 32)), (32, (1, 8, 32))]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon.backend import TRANSFORMER_LENS, Model
from headsurgeon.backend.cache import (
    KV_POS_DIM,
    cache_contents,
    cache_holding,
    cached_length,
    new_kv_cache,
    shared_cache,
)
from headsurgeon.backend.forward import run_layers, run_to_layer
from headsurgeon.errors import InvalidArgumentError, UnsupportedArchitectureError
from headsurgeon.inuse import holds_model
from headsurgeon.validation import check_int

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "block_size",
    "continuation_logprobs",
    "max_length",
    "query_offset",
    "run_in_blocks",
]

# Attention temporaries of one block: scores, mask, pattern and what hooks make of them.
DEFAULT_BLOCK_BYTES = 256 * 2**20
# Bytes per (batch, head, query, key) entry a plain forward pass keeps alive at once (float32
# scores, the masked scores, the pattern, the causal mask): callers whose hooks make more pass more.
FORWARD_BYTES_PER_ENTRY = 16
# Blocks shorter than this make the per-block overhead (one model call each) dominate.
MIN_BLOCK = 16
# Fastest block measured on CPU (organism, one thread; census seconds at 512 / 4096 / 8192 tokens:
# 32 rows 0.19 / 6.2 / 19, 64 rows 0.17 / 7.2 / 23, 128 rows 0.22 / 6.9 / 41, whole sequence
# 0.31 / 15 / -): a block's scores stay in cache, and causal blocks skip the masked half.
FAST_BLOCK = 64


def max_length(model: Model) -> int | None:
    """The longest sequence ``model`` takes: ``None`` (any) for ALiBi, whose ``n_ctx`` is nominal
    (it has no position table; extrapolation is the point), else ``cfg.n_ctx``.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> print(max_length(random_model(ModelShape(1, 2, 8, 9, n_ctx=16))))
    None
    """
    return None if model.cfg.positional_embedding_type == "alibi" else model.cfg.n_ctx


def block_size(
    model: Model,
    n_pos: int,
    *,
    batch: int = 1,
    bytes_per_entry: int = FORWARD_BYTES_PER_ENTRY,
    budget: int = DEFAULT_BLOCK_BYTES,
) -> int:
    """Query rows per block: the fastest (``FAST_BLOCK`` rows: the scores stay in cache and
    causal blocks skip the masked half), fewer where one block's attention (``batch x head x
    block x n_pos`` entries of ``bytes_per_entry`` bytes) would exceed ``budget`` bytes, never
    under 16 rows; ``n_pos`` (one block: the dense pass) for a sequence of at most 64 tokens and
    for a model with learned or rotary positions, whose context bounds the dense pass's memory
    and some of whose TransformerLens 4.x bridges (GPT-2's) never fill a key-value cache.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=16, d_model=64, d_vocab=9, n_ctx=16))
    >>> block_size(model, 50), block_size(model, 4096), block_size(model, 65_536)
    (50, 64, 16)
    """
    n_pos = check_int(n_pos, "n_pos", minimum=1)
    if max_length(model) is not None:
        return n_pos
    per_row = batch * model.cfg.n_heads * n_pos * bytes_per_entry
    rows = min(budget // per_row, FAST_BLOCK)
    if rows >= n_pos:
        return n_pos
    return max(MIN_BLOCK, rows // MIN_BLOCK * MIN_BLOCK)


_block_size = block_size  # for functions whose ``block_size`` parameter hides it


def query_offset(scores: Float[Tensor, "batch head_index query_pos key_pos"]) -> int:
    """The query position of row 0 of a block's ``hook_attn_scores`` or ``hook_pattern``.

    >>> query_offset(torch.zeros(1, 4, 16, 48))
    32
    """
    return scores.shape[-1] - scores.shape[-2]


# keys(offset, n): the earlier positions (increasing, all below offset) whose keys and values the
# block of queries offset ... offset + n - 1 reads besides its own.
KeyChooser = Callable[[int, int], Int[Tensor, " kept"]]


@holds_model("run_in_blocks")
def run_in_blocks(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    *,
    block_size: int,
    stop_at_layer: int | None = None,
    keys: KeyChooser | None = None,
    start_at_layer: int = 0,
    resid_pre: Callable[[int], Float[Tensor, "batch block d_model"]] | None = None,
) -> Iterator[tuple[int, Float[Tensor, "batch block d_model"]]]:
    """Yield ``(offset, resid)`` for consecutive blocks of ``block_size`` positions: the residual
    stream after block ``stop_at_layer - 1`` (default: the last) at positions
    ``offset ... offset + block - 1``, neither the final LayerNorm nor the unembedding applied.

    Hooks already on the model fire once per block (see the module docstring). The tokens are
    used as they are (no BOS is added). Run it under ``torch.no_grad()`` unless you mean to
    back-propagate through every block.

    With ``keys`` (a :data:`KeyChooser`), block ``offset`` attends only to the earlier
    positions ``keys(offset, n)`` and its own: each layer's keys and values of every position
    are kept as its own block computed them (memory linear in the length), and the block runs
    on a cache holding just the chosen ones (:func:`headsurgeon.backend.cache.cache_holding`), so it
    costs ``block x (kept + block)`` attention entries, not ``block x offset``. The attention
    then sees cache slots, not positions: ``hook_attn_scores`` has ``len(kept) + n`` columns,
    and an ALiBi model's own bias counts distance in slots; a caller that wants another bias
    puts its own through :func:`headsurgeon.backend.add_bias_hook` (what
    :mod:`headsurgeon.sink_cache` does). ALiBi models only: positions elsewhere come from the
    cache's length. ``keys`` is asked even for a single block (offset 0).

    With ``keys`` and ``start_at_layer`` > 0 only blocks ``start_at_layer ...`` run (where
    :func:`~headsurgeon.backend.forward.resumes_at_layer`; refused elsewhere): block ``offset``'s
    input to that layer is ``resid_pre(offset)`` (what an earlier pass with the same keys and
    the same earlier layers recorded there: the numbers are then that pass's, bit for bit), and
    the caches hold those layers only.
    """
    n_pos = tokens.shape[1]
    block = check_int(block_size, "block_size", minimum=1)
    stop = model.cfg.n_layers if stop_at_layer is None else stop_at_layer
    device = torch.device(model.cfg.device or "cpu")
    start = check_int(start_at_layer, "start_at_layer", minimum=0, maximum=stop - 1)
    if start and (keys is None or resid_pre is None):
        raise InvalidArgumentError(
            "start_at_layer > 0 needs keys and resid_pre (what enters that layer per block); "
            "pass both, or start at layer 0"
        )
    if keys is not None:
        if max_length(model) is not None:
            raise UnsupportedArchitectureError(
                f"{model.cfg.original_architecture or 'this model'} has "
                f"{model.cfg.positional_embedding_type} positions, which a cache of chosen keys "
                "would shift; only ALiBi models run on chosen keys"
            )
        yield from _chosen(model, tokens, block, (start, stop), keys, resid_pre)
        return
    if block >= n_pos:
        yield 0, run_to_layer(model, tokens.to(device), stop)
        return
    cache = new_kv_cache(model, tokens.shape[0], device)
    yield from _prefill(model, tokens, block, stop, cache)


def _chosen(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    block: int,
    layers: tuple[int, int],
    keys: KeyChooser,
    resid_pre: Callable[[int], Tensor] | None,
) -> Iterator[tuple[int, Float[Tensor, "batch block d_model"]]]:
    """:func:`run_in_blocks` with ``keys``: each block on a cache of its chosen positions, in
    ``layers`` (start, stop); from ``resid_pre(offset)`` where start > 0."""
    device = torch.device(model.cfg.device or "cpu")
    batch, n_pos = tokens.shape
    start, stop = layers
    every: list[tuple[Tensor, Tensor]] = []  # each layer's keys and values, every position
    for offset in range(0, n_pos, block):
        n = min(block, n_pos - offset)
        kept = keys(offset, n).to(device)
        contents = [
            (k.index_select(KV_POS_DIM, kept), v.index_select(KV_POS_DIM, kept)) for k, v in every
        ]
        cache = cache_holding(model, contents, batch, device, first_layer=start)
        if start:
            resid = run_layers(model, resid_pre(offset).to(device), start, stop, cache=cache)
        else:
            chunk = tokens[:, offset : offset + n].to(device)
            resid = run_to_layer(model, chunk, stop, cache=cache)
        added = cache_contents(cache)[start:]
        if len(added) < stop - start or cached_length(cache) != len(kept) + n:
            raise UnsupportedArchitectureError(
                f"{model.cfg.original_architecture or 'this model'}'s attention does not keep a "
                f"key-value cache under {TRANSFORMER_LENS}, so it cannot run on chosen keys"
            )
        if not every:
            every = [
                tuple(_positions(t, n_pos) for t in (k, v)) for k, v in added[: stop - start]
            ]  # allocated once the layout is known
        for (k_all, v_all), (k, v) in zip(every, added, strict=False):
            k_all.narrow(KV_POS_DIM, offset, n).copy_(k.narrow(KV_POS_DIM, len(kept), n))
            v_all.narrow(KV_POS_DIM, offset, n).copy_(v.narrow(KV_POS_DIM, len(kept), n))
        yield offset, resid


def _positions(like: Tensor, n_pos: int) -> Tensor:
    """An empty tensor like a cache's keys or values, with room for ``n_pos`` positions."""
    shape = list(like.shape)
    shape[KV_POS_DIM] = n_pos
    return like.new_empty(shape)


def _prefill(
    model: Model, tokens: Int[Tensor, "batch pos"], block: int, stop: int, cache: object
) -> Iterator[tuple[int, Float[Tensor, "batch block d_model"]]]:
    """:func:`run_in_blocks` into a given ``cache``, refusing a model whose attention ignores it
    (after the first block, before a wrong one is computed)."""
    device = torch.device(model.cfg.device or "cpu")
    for offset in range(0, tokens.shape[1], block):
        if offset and cached_length(cache) != offset:
            raise UnsupportedArchitectureError(
                f"{model.cfg.original_architecture or 'this model'}'s attention does not keep a "
                f"key-value cache under {TRANSFORMER_LENS}, so it cannot run in blocks of "
                f"{block} positions; pass block_size={tokens.shape[1]} (one dense pass)"
            )
        chunk = tokens[:, offset : offset + block].to(device)
        yield offset, run_to_layer(model, chunk, stop, cache=cache)


@torch.no_grad()
def continuation_logprobs(
    model: Model,
    prompt: Int[Tensor, " pos"],
    continuations: Int[Tensor, "batch width"],
    *,
    block_size: int | None = None,
) -> Float[Tensor, "batch width+1 d_vocab"]:
    """Next-token log-probabilities (float32, CPU) at the prompt's last position and after each
    token of each right-padded continuation (padding after a continuation cannot change its
    causal logits).

    The prompt runs once, in blocks of ``block_size`` query rows (default: chosen by memory,
    :func:`block_size`), into a key-value cache of one sequence (3.x:
    TransformerLens's, 4.x: Hugging Face's ``DynamicCache``) that every continuation then reads,
    frozen, without copying it per row: the rows run a few at a time, as many as keep the
    keys and values one layer concatenates for them within
    :data:`DEFAULT_BLOCK_BYTES`. Memory is linear in the prompt's
    length (a 64k-token prompt costs its cache, no T² attention and no copy per row), and the
    numbers equal one dense pass of prompt + continuation up to float32 rounding. A model whose
    attention leaves the cache empty runs prompt + continuation for every row instead.
    """
    device = torch.device(model.cfg.device or "cpu")
    n_rows, width = continuations.shape
    n_layers = model.cfg.n_layers
    block = _block_size(model, len(prompt)) if block_size is None else block_size
    block = min(check_int(block, "block_size", minimum=1), len(prompt))

    def logprobs(resid: Tensor) -> Tensor:
        return model.unembed(model.ln_final(resid)).float().log_softmax(-1).cpu()

    cache = new_kv_cache(model, 1, device)
    *_, (_, resid) = _prefill(model, prompt[None], block, n_layers, cache)
    if cached_length(cache) != len(prompt):
        # A 4.x bridge whose attention ignores Hugging Face's cache (GPT-2 in TransformerLens
        # 4.3): prompt + continuation for every row, as one dense batch.
        rows = torch.cat([prompt[None].expand(n_rows, -1), continuations], dim=1).to(device)
        return logprobs(run_to_layer(model, rows, n_layers)[:, len(prompt) - 1 :])
    first = logprobs(resid[:, -1:]).expand(n_rows, -1, -1)
    if width == 0:
        return first
    # A row's keys and values as one layer concatenates them (float32 at most), and its scores.
    n_keys = len(prompt) + width
    scores = model.cfg.n_heads * width * n_keys * FORWARD_BYTES_PER_ENTRY
    per_row = 2 * n_keys * model.cfg.d_model * 4 + scores
    rows = []
    for group in continuations.split(max(1, DEFAULT_BLOCK_BYTES // per_row)):
        shared = shared_cache(cache, len(group))
        rows.append(logprobs(run_to_layer(model, group.to(device), n_layers, cache=shared)))
    return torch.cat([first, torch.cat(rows)], dim=1)
