"""Causal head importance: how much the loss rises when one head's output is replaced.

``delta_loss`` is the increase of the mean next-token cross-entropy (nats) when the head's output
``z`` (``blocks.{l}.attn.hook_z``, before ``W_O``) is replaced at every position of every sequence:

* ``zero``: by 0; ``mean``: by its mean over all positions of all sequences of the data (one mean
  per head, found in a first streaming pass); ``resample``: by its value on another sequence at
  the same position (sequence ``i`` takes sequence ``i + 1``'s, the last takes the first's);
* ``attribution``: attribution patching, the first-order estimate ``grad_z L . (z' - z)`` of one
  of those ablations (``ablation``, default mean), from one forward and one backward pass for
  all heads at once.

The loss is that of :func:`headsurgeon.evals.perplexity`: every token of a sequence except the
one at position 0 is predicted (so a prepended BOS token is never a target, and the first text
token is, given it); each sequence's loss is the mean over its predicted tokens, and
``delta_loss`` the mean of the per-sequence changes, with ``delta_loss_se`` its standard error
across sequences. Data follows the census (:func:`headsurgeon.run_census`): texts, text files
or a token tensor, position 0 by the model's BOS convention, the bundled held-out corpora by
default.

Exact ablation costs one forward per head: several heads' ablations of the same sequences are
stacked along the batch (``heads_per_pass``), each layer's clean residual stream is cached once
per batch so the ablated passes start at the head's layer, and batches stream through with
per-head running sums, so memory does not grow with the data.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headsurgeon.backend import HookPoint, Model
from headsurgeon.backend.forward import run_from_layer
from headsurgeon.data import Cut, Data, Sequences, check_data, verb_sequences
from headsurgeon.defaults import CENSUS_N_SEQS, CENSUS_SEQ_LEN, IMPORTANCE_METHODS
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.heads import Heads, HeadSet
from headsurgeon.inuse import holds_model, hooked
from headsurgeon.loading import model_info
from headsurgeon.probes import check_fired, stream
from headsurgeon.progress import tqdm
from headsurgeon.validation import check_bool, check_choice, check_int

__all__ = [
    "METHODS",
    "ABLATIONS",
    "COLUMNS",
    "IMPORTANCE_CUT",
    "head_importance",
    "compare_importance",
    "DORMANT_SE",
    "is_dormant",
    "ablate_heads",
]

logger = logging.getLogger(__name__)

METHODS = IMPORTANCE_METHODS
ABLATIONS = tuple(method for method in METHODS if method != "attribution")
IMPORTANCE_CUT = Cut(seq_len=CENSUS_SEQ_LEN, n_seqs=CENSUS_N_SEQS)
"""How :func:`head_importance` and :func:`ablate_heads` cut texts: the census's 64 x 128."""
COLUMNS: dict[str, str] = {
    "layer": "layer index (from 0)",
    "head": "head index within the layer (from 0)",
    "delta_loss": "increase of the mean next-token cross-entropy (nats) with the head's z replaced"
    " (attribution: its first-order estimate)",
    "delta_loss_se": "standard error of delta_loss across sequences",
    "clean_loss": "mean next-token cross-entropy of the unchanged model on the same data (nats)",
    "method": "how delta_loss was found: zero, mean, resample (exact ablation) or attribution",
    "ablation": "what replaced the head's z: zero, its mean over the data, or another sequence's",
}
# A head is dormant when removing it changes the loss by at most this many standard errors.
DORMANT_SE = 2.0


def is_dormant(delta_loss: Any, delta_loss_se: Any) -> Any:
    """Whether removing a head changes the loss by at most :data:`DORMANT_SE` standard errors
    (either way): numbers, arrays or pandas columns alike.

    >>> bool(is_dormant(0.001, 0.002)), bool(is_dormant(-0.01, 0.002))
    (True, False)
    """
    return abs(delta_loss) <= DORMANT_SE * delta_loss_se


# head_importance's columns as a classified table names them (method alone would be ambiguous).
IMPORTANCE_NAMES = {
    "delta_loss": "delta_loss",
    "delta_loss_se": "delta_loss_se",
    "clean_loss": "clean_loss",
    "method": "importance_method",
    "ablation": "importance_ablation",
}


def with_importance(classified: pd.DataFrame, importance: pd.DataFrame) -> pd.DataFrame:
    """``classified`` (a census, labelled or not) with :func:`head_importance`'s columns merged
    on ``layer`` and ``head`` under :data:`IMPORTANCE_NAMES`; its own columns and labels as they
    were, the importance settings added to ``attrs`` (``importance_method``,
    ``importance_ablation``, ``importance_clean_loss``, ``importance_n_tokens``)."""
    merged = classified.merge(
        importance[["layer", "head", *IMPORTANCE_NAMES]].rename(columns=IMPORTANCE_NAMES),
        on=["layer", "head"],
        how="left",
        validate="one_to_one",
    )
    a = importance.attrs
    merged.attrs = dict(classified.attrs) | {
        "importance_method": a["method"],
        "importance_ablation": a["ablation"],
        "importance_clean_loss": a["clean_loss"],
        "importance_n_tokens": a["n_tokens"],
    }
    return merged


# Elements of the stacked logits one ablation pass may hold (float32: 256 MiB): decides the
# default number of heads per pass, since the unembedding dominates memory for a large vocabulary.
LOGIT_BUDGET = 2**26

# (layer, z [batch pos head_index d_head]) -> what replaces every head's z in that layer.
Fill = Callable[[int, Tensor], Tensor]


def _seq_losses(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"]
) -> Float[Tensor, " batch"]:
    """Each sequence's mean cross-entropy over its predicted tokens (positions 1..), float32."""
    logprobs = logits[:, :-1].float().log_softmax(-1)
    nll = -logprobs.gather(-1, tokens[:, 1:, None].to(logits.device))[..., 0]
    return nll.mean(-1)


def _z_hooks(model: Model, fn: Callable) -> list[tuple[str, Callable]]:
    return [(f"blocks.{layer}.attn.hook_z", fn) for layer in range(model.cfg.n_layers)]


def _require(model: Model, seen: Sequence[int] | dict[int, Any], hook: str = "attn.hook_z") -> None:
    """One line unless ``blocks.{layer}.`` + ``hook`` fired in every layer (``seen``: the
    layers it fired in)."""
    fired = [int(layer in seen) for layer in range(model.cfg.n_layers)]
    check_fired(model, "head_importance", {f"blocks.{{layer}}.{hook}": fired})


def _mean_z(
    model: Model, tokens: Tensor, batch_size: int, progress: bool
) -> Float[Tensor, "layer head_index d_head"]:
    """Every head's ``z`` averaged over all positions of all sequences (summed in float64)."""
    sums: dict[int, Tensor] = {}

    def add(z: Tensor, hook: HookPoint) -> None:
        total = z.double().sum((0, 1))
        sums[hook.layer()] = sums[hook.layer()] + total if hook.layer() in sums else total

    stream(
        model, tokens, _z_hooks(model, add), batch_size=batch_size, progress=progress, desc="mean z"
    )
    _require(model, sums)
    means = torch.stack([sums[layer] for layer in range(model.cfg.n_layers)])
    return (means / (tokens.shape[0] * tokens.shape[1])).to(model.cfg.dtype)


def _donor_z(model: Model, donors: Tensor) -> list[Tensor]:
    """Every layer's ``z`` on the donor sequences (resample ablation)."""
    found: dict[int, Tensor] = {}

    def keep(z: Tensor, hook: HookPoint) -> None:
        found[hook.layer()] = z.clone()

    stream(model, donors, _z_hooks(model, keep), batch_size=len(donors), progress=False)
    _require(model, found)
    return [found[layer] for layer in range(model.cfg.n_layers)]


def _fills(
    model: Model, ablation: str, tokens: Tensor, batch_size: int, progress: bool
) -> Callable[[Tensor], Fill]:
    """``rows -> fill``: the replacement of every head's ``z`` for the sequences ``rows``."""
    if ablation == "zero":
        return lambda rows: lambda layer, z: torch.zeros_like(z)
    if ablation == "mean":
        means = _mean_z(model, tokens, batch_size, progress)
        return lambda rows: lambda layer, z: means[layer].to(z.device).expand_as(z)

    def resample(rows: Tensor) -> Fill:
        # Sequence i takes sequence i + 1's z (cyclic), whatever the batching.
        donors = _donor_z(model, tokens[(rows + 1) % len(tokens)])
        return lambda layer, z: donors[layer]

    return resample


class _Totals:
    """Per-head running sums over sequences of a per-sequence change, and the clean losses."""

    def __init__(self, n_layers: int, n_heads: int):
        self.sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.sum_sq = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.clean = 0.0
        self.n = 0

    def add(self, layer: int, heads: Sequence[int], deltas: Float[Tensor, "head batch"]) -> None:
        deltas = deltas.double().cpu()
        self.sum[layer, list(heads)] += deltas.sum(-1)
        self.sum_sq[layer, list(heads)] += deltas.square().sum(-1)

    def add_clean(self, losses: Float[Tensor, " batch"]) -> None:
        self.clean += losses.double().sum().item()
        self.n += len(losses)

    def mean_se(self) -> tuple[np.ndarray, np.ndarray]:
        mean = self.sum / self.n
        var = (self.sum_sq - self.n * mean.square()).clamp(min=0) / max(self.n - 1, 1)
        return mean.numpy(), (var / self.n).sqrt().numpy()


@torch.no_grad()
def _clean_pass(model: Model, batch: Tensor) -> tuple[Float[Tensor, " batch"], list[Tensor]]:
    """Per-sequence clean losses and every layer's ``resid_pre`` (where ablated passes start)."""
    resid: dict[int, Tensor] = {}

    def keep(x: Tensor, hook: HookPoint) -> None:
        resid[hook.layer()] = x.clone()

    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(model.cfg.n_layers)]
    with model.hooks(fwd_hooks=[(name, keep) for name in names]):
        losses = _seq_losses(model(batch), batch)
    _require(model, resid, "hook_resid_pre")
    return losses, [resid[layer] for layer in range(model.cfg.n_layers)]


@torch.no_grad()
def _ablated_losses(
    model: Model,
    batch: Tensor,
    resid_pre: Tensor,
    layer: int,
    heads: Sequence[int],
    fill: Fill,
) -> Float[Tensor, "head batch"]:
    """Per-sequence losses with each of ``heads`` ablated in turn, in one stacked pass.

    Copy ``i`` of the batch has head ``heads[i]`` replaced. The pass starts at ``layer`` from the
    clean ``resid_pre``, except for shortformer models, whose positional embedding enters every
    layer and is only computed from tokens.
    """
    n, copies = len(batch), len(heads)
    fired: list[int] = []

    def ablate(z: Tensor, hook: HookPoint) -> Tensor:
        fired.append(layer)
        stacked = z.unflatten(0, (copies, n))
        for i, head in enumerate(heads):
            stacked[i, :, :, head] = fill(layer, stacked[i])[:, :, head]
        return z

    tokens = batch.repeat(copies, 1)
    with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate)]):
        if model.cfg.positional_embedding_type == "shortformer":
            logits = model(tokens)
        else:
            logits = run_from_layer(model, tokens, resid_pre.repeat(copies, 1, 1), layer)
    if not fired:  # the pass ran without the ablation: its loss change would read as 0
        _require(model, [other for other in range(model.cfg.n_layers) if other != layer])
    return _seq_losses(logits, tokens).view(copies, n)


def _exact(
    model: Model,
    tokens: Tensor,
    fills: Callable[[Tensor], Fill],
    batch_size: int,
    heads_per_pass: int,
    bar: tqdm,
) -> _Totals:
    cfg = model.cfg
    totals = _Totals(cfg.n_layers, cfg.n_heads)
    chunks = [
        range(h, min(h + heads_per_pass, cfg.n_heads))
        for h in range(0, cfg.n_heads, heads_per_pass)
    ]
    for rows in torch.arange(len(tokens)).split(batch_size):
        batch = tokens[rows].to(cfg.device)
        clean, resid = _clean_pass(model, batch)
        totals.add_clean(clean)
        fill = fills(rows)
        for layer in range(cfg.n_layers):
            for heads in chunks:
                losses = _ablated_losses(model, batch, resid[layer], layer, heads, fill)
                totals.add(layer, heads, losses - clean)
            bar.update()
    return totals


def _attribution(
    model: Model,
    tokens: Tensor,
    fills: Callable[[Tensor], Fill],
    batch_size: int,
    bar: tqdm,
) -> _Totals:
    """Per-sequence ``grad_z loss . (z' - z)``, summed over positions, from one backward."""
    cfg = model.cfg
    totals = _Totals(cfg.n_layers, cfg.n_heads)
    actual: dict[int, Tensor] = {}  # per layer, for the current batch
    shifts: dict[int, Tensor] = {}

    def tap(z: Tensor, hook: HookPoint) -> Tensor:
        # A zero leaf added to z: its gradient is the loss's gradient at z, and the model's own
        # weights need none (they may not even require one).
        actual[hook.layer()] = z.detach()
        shifts[hook.layer()] = torch.zeros_like(z, requires_grad=True)
        return z + shifts[hook.layer()]

    for rows in torch.arange(len(tokens)).split(batch_size):
        batch = tokens[rows].to(cfg.device)
        fill = fills(rows)
        with torch.enable_grad(), model.hooks(fwd_hooks=_z_hooks(model, tap)):
            losses = _seq_losses(model(batch), batch)
            _require(model, shifts)
            layers = range(cfg.n_layers)
            grads = torch.autograd.grad(losses.sum(), [shifts[layer] for layer in layers])
        totals.add_clean(losses.detach())
        with torch.no_grad():
            for layer, grad in zip(layers, grads, strict=True):
                z = actual[layer]
                change = (fill(layer, z) - z).double()
                per_head = torch.einsum("bphd,bphd->hb", grad.double(), change)
                totals.add(layer, range(cfg.n_heads), per_head)
        bar.update(cfg.n_layers)
    return totals


def _check_predicts(n_pos: int) -> None:
    if n_pos < 2:
        raise DataError(
            f"sequences of {n_pos} token predict nothing; use sequences of at least 2 tokens"
        )


@holds_model("head_importance")
def head_importance(
    model: Model,
    data: Data | Sequences = None,
    *,
    method: str = "mean",
    ablation: str | None = None,
    batch_size: int = 8,
    heads_per_pass: int | None = None,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> pd.DataFrame:
    """What each head of ``model`` costs to remove: one row per head, columns :data:`COLUMNS`.

    ``hs.head_importance(model, data, method="mean")``; compare an estimate with exact ablation by
    :func:`compare_importance`.

    - ``model``: any model whose ``hook_z`` and ``hook_resid_pre`` fire in every layer.
    - ``data``: as in :func:`headsurgeon.run_census`; texts cut as :data:`IMPORTANCE_CUT`.
    - ``method``: ``"zero"``, ``"mean"``, ``"resample"`` (exact) or ``"attribution"`` (estimated).
    - ``ablation``: the ablation ``"attribution"`` estimates (default ``"mean"``).
    - ``batch_size``: sequences per forward pass.
    - ``heads_per_pass``: heads ablated in one stacked pass (default: logits within 2^26 elements).
    - ``progress``: show a progress bar.
    - ``seq_len``, ``n_seqs``, ``prepend_bos``: deprecated (they warn): ``hs.to_sequences`` cuts.

    The methods, ``attrs`` and which models: [Importance](../tools/importance.md).

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=16))
    >>> tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    >>> df = head_importance(model, tokens, method="zero", progress=False)
    >>> list(df.columns)
    ['layer', 'head', 'delta_loss', 'delta_loss_se', 'clean_loss', 'method', 'ablation']
    >>> len(df), df.attrs["n_tokens"]
    (8, 44)
    """
    info = model_info(model, "head_importance")
    method = check_choice(method, "method", METHODS)
    if method != "attribution" and ablation not in (None, method):
        raise InvalidArgumentError(
            f"ablation={ablation!r} applies to method='attribution' only; method={method!r} "
            "is its own ablation"
        )
    if ablation is None:
        ablation = "mean" if method == "attribution" else method
    ablation = check_choice(ablation, "ablation", ABLATIONS)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    progress = check_bool(progress, "progress")
    if seq_len is not None and not isinstance(data, Tensor | Sequences):  # before a corpus
        _check_predicts(check_int(seq_len, "seq_len", minimum=1))
    seqs = verb_sequences(
        info, data, "head_importance", IMPORTANCE_CUT, seq_len, n_seqs, prepend_bos
    )
    tokens = seqs.tokens
    _check_predicts(seqs.seq_len)
    if ablation == "resample" and len(tokens) < 2:
        raise DataError("resample ablation needs at least 2 sequences; give more data")
    cfg = model.cfg
    n, pos = tokens.shape
    if heads_per_pass is None:
        heads_per_pass = max(
            1, min(cfg.n_heads, LOGIT_BUDGET // (min(batch_size, n) * pos * cfg.d_vocab))
        )
    heads_per_pass = check_int(heads_per_pass, "heads_per_pass", minimum=1)

    fills = _fills(model, ablation, tokens, batch_size, progress)
    n_steps = -(-n // batch_size) * cfg.n_layers
    with tqdm(total=n_steps, desc=f"importance ({method})", disable=not progress) as bar:
        if method == "attribution":
            totals = _attribution(model, tokens, fills, batch_size, bar)
        else:
            totals = _exact(model, tokens, fills, batch_size, heads_per_pass, bar)
    delta, se = totals.mean_se()
    clean_loss = totals.clean / totals.n
    layer, head = np.divmod(np.arange(cfg.n_layers * cfg.n_heads), cfg.n_heads)
    df = pd.DataFrame(
        {
            "layer": layer,
            "head": head,
            "delta_loss": delta.ravel(),
            "delta_loss_se": se.ravel(),
            "clean_loss": clean_loss,
            "method": method,
            "ablation": ablation,
        }
    )
    df.attrs = {
        "model": info.name,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_seqs": int(n),
        "seq_len": int(pos),
        "n_tokens": int(n * (pos - 1)),
        "prepend_bos": seqs.holds_bos,
        "bos_rule": seqs.bos_rule,
        "data": seqs.source,
        "method": method,
        "ablation": ablation,
        "clean_loss": clean_loss,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "device": str(cfg.device),
    }
    logger.info("head importance (%s): clean loss %.4f nats", method, clean_loss)
    return df


def compare_importance(
    exact: pd.DataFrame, estimate: pd.DataFrame, *, k: int | None = None
) -> dict[str, float | int]:
    """How well ``estimate`` (e.g. attribution) ranks heads like ``exact`` ablation.

    Both are :func:`head_importance` results for the same heads. Returns ``spearman`` and
    ``pearson`` correlations of ``delta_loss``, and ``top_k_overlap``: the share of the ``k``
    most important heads by ``exact`` that are also among the ``k`` most important by
    ``estimate`` (``k`` default: a tenth of the heads, at least 1).

    >>> a = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0], "delta_loss": [0.1, 0.5, 0.0]})
    >>> b = a.assign(delta_loss=[0.2, 0.4, 0.1])
    >>> agreement = compare_importance(a, b, k=1)
    >>> agreement["spearman"], round(agreement["pearson"], 3), agreement["top_k_overlap"]
    (1.0, 0.99, 1.0)
    """
    keys = ["layer", "head"]
    for what, df in (("exact", exact), ("estimate", estimate)):
        if not isinstance(df, pd.DataFrame) or not {*keys, "delta_loss"} <= set(df.columns):
            raise InvalidArgumentError(
                f"{what} must be a head_importance DataFrame (layer, head, delta_loss)"
            )
    both = exact[[*keys, "delta_loss"]].merge(
        estimate[[*keys, "delta_loss"]], on=keys, suffixes=("_exact", "_estimate")
    )
    if len(both) != len(exact) or len(both) != len(estimate) or len(both) < 2:
        raise InvalidArgumentError(
            "exact and estimate must cover the same heads (at least 2); compare one model"
        )
    n = len(both)
    k = max(1, n // 10) if k is None else check_int(k, "k", minimum=1, maximum=n)
    x, y = both["delta_loss_exact"], both["delta_loss_estimate"]
    top_x = set(x.nlargest(k).index)
    top_y = set(y.nlargest(k).index)
    return {
        "n_heads": n,
        "spearman": float(x.rank().corr(y.rank())),  # Pearson of ranks; needs no scipy
        "pearson": float(x.corr(y)),
        "k": k,
        "top_k_overlap": len(top_x & top_y) / k,
    }


@contextlib.contextmanager
def ablate_heads(
    model: Model,
    heads: Heads,
    ablation: str = "mean",
    data: Data | Sequences = None,
    *,
    batch_size: int = 8,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> Iterator[Model]:
    """Inside the block, ``heads`` are pruned: their ``z`` is 0 (``"zero"``) or its mean over
    ``data`` (``"mean"``, the default: what :func:`head_importance` calls mean ablation; ``data``
    as there, the bundled held-out corpora by default) at every position. Hooks only: the weights
    are untouched and the model is as before once the block ends. The block holds the model, as
    :func:`headsurgeon.mitigation` does (another thread's verb on it is refused in one line).

    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=8, d_vocab=16, n_ctx=8))
    >>> tokens = torch.randint(0, 16, (2, 8))
    >>> clean = model(tokens)
    >>> with ablate_heads(model, "L0H1", "zero"):
    ...     pruned = model(tokens)
    >>> bool((pruned != clean).any()), bool(torch.equal(model(tokens), clean))
    (True, True)
    """
    info = model_info(model, "ablate_heads")
    check_choice(ablation, "ablation", ("zero", "mean"))
    data = check_data(info, data)  # given, it is checked even where "zero" does not read it
    chosen = HeadSet.of(heads, info.shape).by_layer()
    # Held for the whole block, the means' forwards included: hooks act on every thread; and
    # not copied inside it (a copy would keep the hooks).
    with hooked(model, "ablate_heads"):
        means = None
        if ablation == "mean":
            seqs = verb_sequences(
                info, data, "ablate_heads", IMPORTANCE_CUT, seq_len, n_seqs, prepend_bos
            )
            batch_size = check_int(batch_size, "batch_size", minimum=1)
            means = _mean_z(model, seqs.tokens, batch_size, progress)

        def replace(z: Float[Tensor, "batch pos head_index d_head"], hook: HookPoint) -> Tensor:
            layer, index = hook.layer(), chosen[hook.layer()]
            z = z.clone()
            z[:, :, index] = 0 if means is None else means[layer, index].to(z.device)
            return z

        hooks = [(f"blocks.{layer}.attn.hook_z", replace) for layer in chosen]
        with model.hooks(fwd_hooks=hooks):
            yield model
