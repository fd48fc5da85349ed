"""Received mass and secondary sinks: how much attention each key position gets from later queries.

**Received mass.** In one sequence of ``T`` tokens, the received mass of key position ``k`` in a
head is the mean, over the later query rows ``t = k + 1 ... T - 1``, of the weight ``A[t, k]``::

    received[k] = Σ_{t > k} A[t, k] / (T - 1 - k)

the average share of a later query's attention that ``k`` gets (0 to 1; NaN for the last
position, which no query follows). The mean, not the sum, makes positions comparable: a sum over
later rows grows with their number (position 0 has ``T - 1`` of them, position ``T - 2`` one),
so early positions would win by counting alone. Rows ``t > k`` only, the diagonal left out: a
query's weight on its own position is what ALiBi's steep, local heads give every token, not
something a sink attracts. So ``received`` at position 0 is exactly the census's ``bos_mass``
(default ``min_query_pos=1``), and the table is that column-0 statistic at every position. Gu et
al.'s α_k (ICLR 2025) is the mean over ``t >= k``, the diagonal included:
``α_k = ((T - 1 - k) received[k] + A[k, k]) / (T - k)``.

**Secondary sinks.** A position ``k >= 1`` of a sequence is a sink in a layer when some head of
that layer gives it a received mass above ``threshold`` (default 0.3: Gu et al.'s ε, their
per-head criterion for a sink at a position) and at least ``min_queries`` later queries exist
(default 16): a local head puts about one query's worth of attention on each key in all (its
column sums to ~1), which is a large *mean* over the last few rows of a sequence, not a sink;
with 16 rows, a mean above 0.3 needs the attention of ~5 queries. Secondary sinks (Wong et al.,
arXiv:2512.22213) appear in some layer and last a number of layers: each (sequence, position)
found is listed once, with the first layer it is a sink in, how many consecutive layers it stays
one, and its largest received mass in that run.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from headsurgeon.backend import HookPoint, Model
from headsurgeon.data import Cut, Data, Sequences, token_strings, verb_sequences
from headsurgeon.defaults import CENSUS_N_SEQS, CENSUS_SEQ_LEN, RECEIVED_THRESHOLD as THRESHOLD
from headsurgeon.errors import DataError
from headsurgeon.inuse import holds_model
from headsurgeon.loading import model_info
from headsurgeon.probes import Hook, check_fired, stream
from headsurgeon.validation import check_int, check_number

__all__ = [
    "RECEIVED_COLUMNS",
    "SINK_COLUMNS",
    "RECEIVED_CUT",
    "ReceivedMass",
    "SecondarySinks",
    "secondary_sinks",
]

logger = logging.getLogger(__name__)

MIN_QUERIES = 16
MAX_SINKS = 1000
RECEIVED_CUT = Cut(seq_len=CENSUS_SEQ_LEN, n_seqs=CENSUS_N_SEQS)
"""How :func:`secondary_sinks` cuts texts: the census's 64 sequences of 128 tokens."""

RECEIVED_COLUMNS: dict[str, str] = {
    "layer": "layer index (from 0)",
    "head": "head index within the layer (from 0)",
    "position": "key position k in the sequence (from 0)",
    "received": "mean over sequences of the mean over later query rows t > k of A[t, k] (NaN "
    "for the last position); at position 0 the census's bos_mass",
}
SINK_COLUMNS: dict[str, str] = {
    "seq": "index of the sequence among those measured (from 0)",
    "position": "its position k >= 1 in that sequence",
    "token": "the token at that position, as text",
    "first_layer": "first layer in which some head gives it a received mass above the threshold",
    "last_layer": "last layer of the run of consecutive such layers that starts at first_layer",
    "n_layers": "how many consecutive layers it lasts (last_layer - first_layer + 1)",
    "layers_above": "in how many layers in all it is above the threshold (the run and any later)",
    "peak_received": "largest received mass of any head over the run",
    "peak_layer": "layer of that largest received mass",
    "peak_head": "head of that largest received mass",
}
# Query rows received_sums adds up in float32 before its float64 sums (as probes.distance_sums).
_ROWS = 64


def received_sums(
    pattern: Float[Tensor, "batch head_index query_pos key_pos"],
) -> Float[Tensor, "batch head_index key_pos"]:
    """``S[b, h, k] = Σ_t A[b, h, t, k]`` over the pattern's rows ``t > k``, in float64.

    ``pattern`` is a causal pattern or a block of its rows (``[.., Q, K]`` holds query positions
    ``K - Q ... K - 1``, :mod:`headsurgeon.long_context`); the sums of a sequence's blocks add
    up to the dense pattern's. Rows are summed 64 at a time in float32, then in float64; the
    diagonal (``t = k``) is taken off each such sum.

    >>> uniform = torch.tril(torch.ones(3, 3)) / torch.arange(1, 4)[:, None]
    >>> received_sums(uniform[None, None])[0, 0]  # key 0: 1/2 + 1/3; key 1: 1/3; key 2: none
    tensor([0.8333, 0.3333, 0.0000], dtype=torch.float64)
    """
    n_rows, n_keys = pattern.shape[-2:]
    offset = n_keys - n_rows
    if offset < 0:
        shape = tuple(pattern.shape)
        raise ValueError(f"expected a causal pattern (query_pos <= key_pos), got {shape}")
    dtype = torch.float32 if pattern.device.type == "mps" else torch.float64  # MPS: no float64
    sums = pattern.new_zeros(*pattern.shape[:2], n_keys, dtype=dtype)
    for start in range(0, n_rows, _ROWS):
        chunk = pattern[..., start : start + _ROWS, :]
        part = chunk.sum(-2, dtype=torch.float32)
        # Row i of the chunk is query offset + start + i, whose own key is that position.
        first = offset + start
        part[..., first : first + chunk.shape[-2]] -= chunk.diagonal(
            offset=first, dim1=-2, dim2=-1
        ).float()
        sums += part
    return sums


class ReceivedMass:
    """Streamed received mass and secondary sinks of sequences of ``n_pos`` tokens.

    Use ``hooks()`` with :func:`headsurgeon.probes.stream` (or ``model.hooks``) and read
    :meth:`received` (``[layer, head, position]``, the mean over sequences), :attr:`sinks` (one
    dict per (sequence, position), at most ``max_sinks``: those with the largest peak received
    mass, ties to the earlier sequence and position; :attr:`n_found` counts them all) and
    :attr:`examples` (``[seq, layer, head, position]``: each of the first ``n_examples``
    sequences' own received mass, for a report page).

    Each ``hook_pattern`` call (one per layer and block of query rows) adds its
    :func:`received_sums` to the batch in progress, ``[layer, batch, head, position]`` in
    float64; when the next batch starts (a layer-0 block at query 0) or :meth:`finish` is called,
    the batch's sums go into the pooled ``[layer, head, position]`` sums and its sinks are found,
    so memory grows with ``n_pos``, never with the number of sequences.
    """

    def __init__(
        self,
        model: Model,
        n_pos: int,
        *,
        threshold: float = THRESHOLD,
        min_queries: int = MIN_QUERIES,
        max_sinks: int = MAX_SINKS,
        n_examples: int = 0,
    ) -> None:
        self.model, self.n_pos = model, n_pos
        self.threshold, self.min_queries = threshold, min_queries
        self.max_sinks, self.n_examples = max_sinks, n_examples
        n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
        self.device = torch.device(model.cfg.device or "cpu")
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.pooled = torch.zeros(n_layers, n_heads, n_pos, dtype=dtype, device=self.device)
        self.n_seqs = 0
        self.fired = [0] * n_layers
        self.n_found = 0
        self.sinks: list[dict[str, float | int]] = []
        self.examples = np.zeros((0, n_layers, n_heads, n_pos), dtype=np.float32)
        self._batch: Tensor | None = None  # [layer, batch, head, position] sums in progress
        self._next = [0] * n_layers  # per layer, the query offset its next block must start at
        # Later query rows of each position (0 for the last: its received mass is NaN).
        self._later = torch.arange(n_pos - 1, -1, -1, dtype=dtype, device=self.device)

    def hooks(self) -> list[Hook]:
        """A ``hook_pattern`` forward hook for every layer."""
        return [
            (f"blocks.{layer}.attn.hook_pattern", self._hook)
            for layer in range(self.model.cfg.n_layers)
        ]

    def _hook(self, pattern: Tensor, hook: HookPoint) -> None:
        layer = hook.layer()
        self.fired[layer] += 1
        n_rows, n_keys = pattern.shape[-2:]
        offset = n_keys - n_rows
        if n_keys > self.n_pos:
            raise ValueError(f"ReceivedMass: a pattern of {n_keys} keys, made for {self.n_pos}")
        if offset == 0 and layer == 0:
            self.finish()  # a new batch of sequences
        if self._batch is None:
            shape = (self.model.cfg.n_layers, len(pattern), pattern.shape[1], self.n_pos)
            self._batch = torch.zeros(shape, dtype=self.pooled.dtype, device=self.device)
            self._next = [0] * len(self._next)
        if offset != self._next[layer]:
            raise RuntimeError(
                f"ReceivedMass: layer {layer} got query rows from {offset}, expected "
                f"{self._next[layer]}: blocks must come in order"
            )
        self._next[layer] = n_keys
        self._batch[layer, :, :, :n_keys] += received_sums(pattern).to(self.device)

    def finish(self) -> None:
        """Add the batch in progress to the pooled sums and find its sinks."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        self.pooled += batch.sum(1)
        received = (batch / self._later).transpose(0, 1).float().cpu()  # [batch, layer, head, pos]
        received[..., -1] = torch.nan
        keep = max(self.n_examples - len(self.examples), 0)
        if keep:
            self.examples = np.concatenate([self.examples, received[:keep].numpy()])
        self._add_sinks(received)
        self.n_seqs += len(received)

    def _add_sinks(self, received: Float[Tensor, "batch layer head_index pos"]) -> None:
        """Find the batch's sinks (see the module's docstring) and keep the ``max_sinks`` with
        the largest peak received mass among those found so far."""
        # Positions 1 ... with at least min_queries later rows.
        last = self.n_pos - 1 - self.min_queries
        if last < 1:
            return
        best, head = received[..., 1 : last + 1].nan_to_num(0).max(2)  # [batch, layer, pos]
        best, head = best.transpose(1, 2).numpy(), head.transpose(1, 2).numpy()  # [b, pos, layer]
        above = best > self.threshold
        seq, pos = np.nonzero(above.any(-1))
        if not len(seq):
            return
        above, best, head = above[seq, pos], best[seq, pos], head[seq, pos]  # [sink, layer]
        layers = np.arange(above.shape[-1])
        first = above.argmax(-1)
        broken = ~above & (layers >= first[:, None])
        end = np.where(broken.any(-1), broken.argmax(-1), len(layers))
        in_run = (layers >= first[:, None]) & (layers < end[:, None])
        peak_layer = np.where(in_run, best, -1.0).argmax(-1)
        rows = np.arange(len(seq))
        found = pd.DataFrame(
            {
                "seq": seq + self.n_seqs,
                "position": pos + 1,
                "first_layer": first,
                "last_layer": end - 1,
                "n_layers": end - first,
                "layers_above": above.sum(-1),
                "peak_received": best[rows, peak_layer].astype(np.float64),
                "peak_layer": peak_layer,
                "peak_head": head[rows, peak_layer],
            }
        )
        self.n_found += len(found)
        kept = pd.concat([pd.DataFrame(self.sinks), found]) if self.sinks else found
        kept = kept.sort_values(
            ["peak_received", "seq", "position"], ascending=[False, True, True], kind="stable"
        ).head(self.max_sinks)
        self.sinks = kept.sort_values(["seq", "position"]).to_dict(orient="records")

    def received(self) -> np.ndarray:
        """``[layer, head, position]``: the mean over sequences of each sequence's received mass
        (NaN at the last position)."""
        self.finish()
        means = (self.pooled / self._later / max(self.n_seqs, 1)).double().cpu().numpy()
        means[..., -1] = np.nan
        return means

    def check_fired(self, analysis: str = "secondary_sinks") -> None:
        """Raise :class:`~headsurgeon.errors.UnsupportedArchitectureError` unless ``hook_pattern``
        fired in every layer (a silent layer would read as no attention received)."""
        check_fired(self.model, analysis, {"blocks.{layer}.attn.hook_pattern": self.fired})


@dataclasses.dataclass(frozen=True)
class SecondarySinks:
    """What :func:`secondary_sinks` measured.

    ``received``: one row per (layer, head, position), columns :data:`RECEIVED_COLUMNS`, the
    run's settings in ``attrs``; ``sinks``: one row per (sequence, position) found, columns
    :data:`SINK_COLUMNS` (``attrs``: the settings, ``n_found`` before the cap, ``truncated``);
    ``examples``: ``[seq, layer, head, position]`` float32, the received mass of each of the
    first sequences on its own (what a report page draws under each head's pattern).
    """

    received: pd.DataFrame
    sinks: pd.DataFrame
    examples: np.ndarray

    @property
    def by_layer(self) -> pd.DataFrame:
        """One row per (layer, position): ``received`` summed over the layer's heads (0 to the
        number of heads: how many queries' worth of each later query's attention, over all
        heads, goes to the position)."""
        summed = self.received.groupby(["layer", "position"], as_index=False)["received"].sum(
            min_count=1
        )
        summed.attrs = dict(self.received.attrs)
        return summed


@holds_model("secondary_sinks")
def secondary_sinks(
    model: Model,
    data: Data | Sequences = None,
    *,
    threshold: float = THRESHOLD,
    min_queries: int = MIN_QUERIES,
    max_sinks: int = MAX_SINKS,
    n_examples: int = 2,
    batch_size: int = 8,
    block_size: int | None = None,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> SecondarySinks:
    """Received mass of every key position in every head, and the secondary sinks it shows.

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=40))
    >>> found = secondary_sinks(model, torch.randint(0, 64, (3, 40)), progress=False)
    >>> found.received.shape, list(found.sinks.columns[:4])
    ((320, 4), ['seq', 'position', 'token', 'first_layer'])
    >>> found.examples.shape  # the first 2 sequences: [seq, layer, head, position]
    (2, 2, 4, 40)

    ``data`` is taken as :func:`headsurgeon.run_census` takes it (texts, files, or a token
    tensor used exactly as given; texts cut as :data:`RECEIVED_CUT` says; ``seq_len``,
    ``n_seqs``, ``prepend_bos``: deprecated, as there). The received mass and the sink rule are
    defined in :mod:`headsurgeon.received`: the mean over later queries ``t > k`` of ``A[t, k]``, so
    position 0's value is the census's ``bos_mass``; a position ``k >= 1`` with at least
    ``min_queries`` later queries is a sink in a layer where some head gives it more than
    ``threshold``. ``received`` is the mean over sequences (a position that is a sink in one
    sequence in ten shows a tenth of its mass there); ``sinks`` is per sequence, one row per
    (sequence, position), at most ``max_sinks`` rows (those with the largest peak received
    mass; ``sinks.attrs["n_found"]`` counts all, so the list stays bounded whatever the data).

    What it does not say: that the model needs the position (a sink can be dormant: see
    :func:`headsurgeon.head_importance`), nor why a token becomes one.

    It streams like the census: one forward per batch (blocks of ``block_size`` query rows for
    long sequences, :func:`headsurgeon.probes.stream`) with a ``hook_pattern`` hook per layer
    that keeps only ``[layer, batch, head, position]`` sums, so memory grows with the sequence
    length and not with the number of sequences. A layer whose ``hook_pattern`` never fires
    raises :class:`~headsurgeon.errors.UnsupportedArchitectureError`.
    """
    info = model_info(model, "secondary_sinks")
    threshold = check_number(threshold, "threshold", low=0, high=1)
    min_queries = check_int(min_queries, "min_queries", minimum=1)
    max_sinks = check_int(max_sinks, "max_sinks", minimum=0)
    n_examples = check_int(n_examples, "n_examples", minimum=0)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    seqs = verb_sequences(info, data, "secondary_sinks", RECEIVED_CUT, seq_len, n_seqs, prepend_bos)
    tokens, n_pos = seqs.tokens, seqs.seq_len
    if n_pos < 2:
        raise DataError(
            f"sequences of {n_pos} token have no later queries; use a --seq-len of 2 or more"
        )
    mass = ReceivedMass(
        model,
        n_pos,
        threshold=threshold,
        min_queries=min_queries,
        max_sinks=max_sinks,
        n_examples=n_examples,
    )
    stream(
        model,
        tokens,
        mass.hooks(),
        batch_size=batch_size,
        progress=progress,
        desc="received mass",
        block_size=block_size,
    )
    mass.check_fired()
    means = mass.received()
    n_layers, n_heads = info.shape.n_layers, info.shape.n_heads
    layer, head, position = np.indices((n_layers, n_heads, n_pos)).reshape(3, -1)
    received = pd.DataFrame(
        {"layer": layer, "head": head, "position": position, "received": means.ravel()}
    )
    sinks = pd.DataFrame(mass.sinks, columns=[c for c in SINK_COLUMNS if c != "token"])
    at = zip(sinks["seq"], sinks["position"], strict=True)
    sinks.insert(2, "token", pd.Series([token_strings(info, tokens[s, p])[0] for s, p in at]))
    sinks = sinks.astype({c: "int64" for c in SINK_COLUMNS if c not in ("token", "peak_received")})
    sinks["peak_received"] = sinks["peak_received"].astype("float64")
    attrs = {
        "model": info.name,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_seqs": seqs.n_seqs,
        "seq_len": n_pos,
        "prepend_bos": seqs.holds_bos,
        "bos_rule": seqs.bos_rule,
        "threshold": threshold,
        "min_queries": min_queries,
        "data": seqs.source,
    }
    received.attrs = dict(attrs)
    sinks.attrs = attrs | {
        "max_sinks": max_sinks,
        "n_found": mass.n_found,
        "truncated": mass.n_found > max_sinks,
    }
    if mass.n_found > max_sinks:
        logger.warning(
            "%d secondary sinks found; kept the %d with the largest received mass (max_sinks)",
            mass.n_found,
            max_sinks,
        )
    return SecondarySinks(received=received, sinks=sinks, examples=mass.examples)
