"""Heads across corpora: one census (labels, importance) per corpus, and what changes between them.

Guo et al. ("Active-Dormant Attention Heads", arXiv:2410.13835) find heads that are dormant on
one domain (their attention parked on the first token, removing them costs nothing) and active on
another. :func:`compare_corpora` measures every head on each corpus exactly as the classify tool
measures one (:func:`headsurgeon.run_census`, :func:`headsurgeon.classify_heads`,
:func:`headsurgeon.head_importance` on the same sequences), so each corpus's rows equal a
separate single-corpus run; :func:`corpus_changes` names the heads whose status differs.

What counts as a change (each corpus ``b`` against the reference ``a``, the first corpus):

* ``label_changed``: the labels differ (healthy, BOS-sink, dead by the same thresholds). A head
  near a threshold can change label on a small move of its BOS mass: ``d_bos_mass`` says how far
  it moved.
* ``importance_changed`` (only with importance columns): the head is dormant on one corpus and
  not on the other (:func:`headsurgeon.importance.is_dormant`: ``|delta_loss| <= 2 SE``) *and*
  the two ``delta_loss`` differ by more than ``DORMANT_SE`` standard errors of the difference,
  ``sqrt(se_a^2 + se_b^2)`` (the corpora are separate samples). The second condition keeps a
  head that sits at the dormancy bound on both corpora (1.9 SE on one, 2.1 SE on the other) from
  counting as a change.

Neither rule says why a head changes: a corpus can differ in its tokens' frequencies, its
sequence boundaries and its position-0 token, all of which move a sink.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import pandas as pd

from headsurgeon.backend import Model
from headsurgeon.census import CENSUS_CUT, run_census
from headsurgeon.classify import Thresholds, classify_heads
from headsurgeon.classify.labels import require_columns, with_thresholds
from headsurgeon.data import Data, Sequences, check_data, verb_sequences
from headsurgeon.errors import DataError, InvalidArgumentError
from headsurgeon.importance import DORMANT_SE, METHODS, head_importance, is_dormant, with_importance
from headsurgeon.inuse import holds_model
from headsurgeon.loading import model_info
from headsurgeon.validation import check_choice

__all__ = [
    "CHANGE_COLUMNS",
    "compare_corpora",
    "corpus_changes",
]

logger = logging.getLogger(__name__)

CHANGE_COLUMNS: dict[str, str] = {
    "layer": "layer index (from 0)",
    "head": "head index within the layer (from 0)",
    "corpus_a": "the reference corpus (the first)",
    "corpus_b": "the corpus compared with it",
    "label_a": "the head's label on corpus_a",
    "label_b": "the head's label on corpus_b",
    "bos_mass_a": "BOS mass on corpus_a",
    "bos_mass_b": "BOS mass on corpus_b",
    "d_bos_mass": "bos_mass_b - bos_mass_a",
    "delta_loss_a": "importance (loss rise when the head is removed, nats) on corpus_a",
    "delta_loss_se_a": "its standard error across corpus_a's sequences",
    "delta_loss_b": "importance on corpus_b",
    "delta_loss_se_b": "its standard error across corpus_b's sequences",
    "d_delta_loss": "delta_loss_b - delta_loss_a",
    "d_delta_loss_se": "standard error of d_delta_loss: sqrt(se_a^2 + se_b^2)",
    "dormant_a": "removing the head changes corpus_a's loss by at most 2 SE (is_dormant)",
    "dormant_b": "the same on corpus_b",
    "label_changed": "label_a != label_b",
    "importance_changed": "dormant on one corpus, not on the other, and |d_delta_loss| > "
    "2 d_delta_loss_se",
    "changed": "label_changed or importance_changed",
    "change": "what changed, in words (empty: nothing)",
}
# The columns present only when the tables carry importance.
_IMPORTANCE_CHANGE = (
    "delta_loss_a",
    "delta_loss_se_a",
    "delta_loss_b",
    "delta_loss_se_b",
    "d_delta_loss",
    "d_delta_loss_se",
    "dormant_a",
    "dormant_b",
    "importance_changed",
)


def classify_sequences(
    model: Model,
    seqs: Sequences,
    *,
    thresholds: Thresholds | None = None,
    sink_threshold: float | None = None,
    dead_threshold: float | None = None,
    min_output_share: float | None = None,
    importance: str | None = None,
    batch_size: int = 8,
    min_query_pos: int = 1,
    sink_eps: float = 0.3,
    reach: bool = True,
    progress: bool = True,
) -> pd.DataFrame:
    r"""The classify tool's measurement of one corpus: census, labels and (``importance``: one of
    :data:`headsurgeon.importance.METHODS`) importance, all on the same sequences ``seqs``
    (:func:`headsurgeon.to_sequences`; their ``source`` names the corpus in ``attrs``).

    Returns :func:`headsurgeon.classify_heads`' table, with :func:`headsurgeon.head_importance`'s
    columns merged in when ``importance`` is given (:func:`headsurgeon.importance.with_importance`).
    ``thresholds``: the labels' (default ``Thresholds()``; ``sink_threshold``,
    ``dead_threshold``, ``min_output_share`` replace its fields:
    :func:`headsurgeon.classify.labels.with_thresholds`); ``sink_eps``, ``reach``: the census's
    (:func:`headsurgeon.run_census`).
    """
    seqs = check_data(model_info(model, "classify_sequences"), seqs)
    # A bad threshold: one line before the census.
    thresholds = with_thresholds(thresholds, sink_threshold, dead_threshold, min_output_share)
    if not isinstance(seqs, Sequences):
        raise DataError(
            f"classify_sequences takes Sequences, got {type(seqs).__name__}; make them with "
            "hs.to_sequences(model, data, seq_len=...)"
        )
    census = run_census(
        model,
        seqs,
        batch_size=batch_size,
        min_query_pos=min_query_pos,
        sink_eps=sink_eps,
        reach=reach,
        progress=progress,
    )
    classified = classify_heads(census, thresholds)
    if importance:
        measured = head_importance(
            model,
            seqs,
            method=importance,
            batch_size=batch_size,
            progress=progress,
        )
        classified = with_importance(classified, measured)
    return classified


@holds_model("compare_corpora")
def compare_corpora(
    model: Model,
    corpora: Mapping[str, Data],
    *,
    thresholds: Thresholds | None = None,
    sink_threshold: float | None = None,
    dead_threshold: float | None = None,
    min_output_share: float | None = None,
    importance: str | None = None,
    batch_size: int = 8,
    min_query_pos: int = 1,
    sink_eps: float = 0.3,
    progress: bool = True,
    seq_len: int | None = None,  # deprecated: hs.to_sequences cuts (verb_sequences)
    n_seqs: int | None = None,
    prepend_bos: bool | None = None,
) -> pd.DataFrame:
    """Every head of ``model`` on each corpus: one row per head per corpus.

    ``corpora`` maps a name to data as :func:`headsurgeon.run_census` takes it (texts, text files
    as ``pathlib.Path``, a token tensor, :class:`Sequences`); texts are cut as
    :data:`headsurgeon.census.CENSUS_CUT` says (``seq_len``, ``n_seqs``, ``prepend_bos``:
    deprecated, as there), and each is measured by :func:`classify_sequences` (census, labels by
    ``thresholds`` and its
    keywords as there, and importance by the
    method ``importance`` when given), so its rows equal a separate single-corpus run. The table
    is :func:`stack_corpora`'s: a ``corpus`` column first, then the classified columns;
    :func:`corpus_changes` says which heads change between corpora, and
    :func:`headsurgeon.plots.corpus_diff_grid` draws the per-head difference.

    >>> import torch
    >>> from headsurgeon.loading import ModelShape, random_model
    >>> model = random_model(ModelShape(n_layers=1, n_heads=2, d_model=16, d_vocab=32, n_ctx=16))
    >>> g = torch.Generator().manual_seed(0)
    >>> corpora = {name: torch.randint(0, 32, (2, 8), generator=g) for name in ("a", "b")}
    >>> df = compare_corpora(model, corpora, progress=False)
    >>> df[["corpus", "layer", "head"]].values.tolist()
    [['a', 0, 0], ['a', 0, 1], ['b', 0, 0], ['b', 0, 1]]
    """
    info = model_info(model, "compare_corpora")
    if not isinstance(corpora, Mapping) or not corpora:
        raise InvalidArgumentError(
            "corpora must be a non-empty mapping {name: data}, e.g. {'prose': Path('a.txt'), "
            "'code': Path('b.txt')}"
        )
    if importance is not None:
        importance = check_choice(importance, "importance", METHODS)
    tables = {}
    for name, data in corpora.items():
        logger.info("corpus %s (%d of %d)", name, len(tables) + 1, len(corpora))
        cut = (seq_len, n_seqs, prepend_bos)  # deprecated: one warning, at the first corpus
        seqs = verb_sequences(info, data, "compare_corpora", CENSUS_CUT, *cut, warn=not tables)
        tables[name] = classify_sequences(
            model,
            seqs,
            thresholds=with_thresholds(
                thresholds, sink_threshold, dead_threshold, min_output_share
            ),
            importance=importance,
            batch_size=batch_size,
            min_query_pos=min_query_pos,
            sink_eps=sink_eps,
            progress=progress,
        )
    return stack_corpora(tables)


def stack_corpora(classified: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Several classified tables of one model (name -> :func:`headsurgeon.classify_heads`
    output, importance columns optional) as one long table: a ``corpus`` column first, the
    corpora in the mapping's order. ``attrs``: the first table's (model, thresholds, ...)
    without its per-corpus entries, ``corpora`` (the names in order) and ``corpus_attrs``
    (name -> that table's own ``attrs``)."""
    if not isinstance(classified, Mapping) or not classified:
        raise InvalidArgumentError("stack_corpora needs a non-empty mapping {name: classified}")
    names = list(classified)
    if not all(isinstance(name, str) and name.strip() for name in names):
        raise InvalidArgumentError(f"corpus names must be non-empty strings, got {names!r}")
    if len(set(names)) < len(names):
        raise InvalidArgumentError(f"two corpora share a name among {', '.join(names)}")
    tables = list(classified.values())
    for df in tables:
        require_columns(df, ["layer", "head", "bos_mass", "label"])
    heads = [sorted(zip(df["layer"], df["head"], strict=True)) for df in tables]
    if any(h != heads[0] for h in heads):
        raise InvalidArgumentError(
            "the corpora's tables cover different heads; compare one model across corpora"
        )
    stacked = pd.concat(
        [df.assign(corpus=name) for name, df in zip(names, tables, strict=True)],
        ignore_index=True,
    )
    stacked = stacked[["corpus", *[c for c in stacked.columns if c != "corpus"]]]
    per_corpus = ("data", "bos_rule", "n_seqs", "seq_len", "prepend_bos")
    shared = {k: v for k, v in tables[0].attrs.items() if k not in per_corpus}
    shared = {k: v for k, v in shared.items() if not k.startswith("importance_")}
    stacked.attrs = shared | {
        "corpora": names,
        "corpus_attrs": {name: dict(df.attrs) for name, df in zip(names, tables, strict=True)},
    }
    return stacked


def split_corpora(compared: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """:func:`compare_corpora`'s long table back into one classified table per corpus (name ->
    rows without the ``corpus`` column, its own ``attrs`` from ``corpus_attrs``), in order."""
    require_columns(compared, ["corpus", "layer", "head"])
    own = compared.attrs.get("corpus_attrs", {})
    tables = {}
    for name in dict.fromkeys(compared["corpus"]):
        table = compared[compared["corpus"] == name].drop(columns="corpus").reset_index(drop=True)
        table.attrs = dict(own.get(name, {}))
        tables[name] = table
    return tables


def _has_importance(df: pd.DataFrame) -> bool:
    return {"delta_loss", "delta_loss_se"} <= set(df.columns)


def corpus_changes(compared: pd.DataFrame, *, reference: str | None = None) -> pd.DataFrame:
    """Per head, each corpus of ``compared`` (:func:`compare_corpora`'s table) against the
    ``reference`` corpus (default: the first): one row per head per other corpus, columns
    :data:`CHANGE_COLUMNS` (the importance ones only when ``compared`` carries importance).

    ``changed`` marks the heads whose label changed or (with importance) that are dormant on
    one corpus and not on the other by a significant difference (the rule is in this module's
    docstring); ``change`` says it in words (``"healthy -> BOS-sink; active -> dormant"``).
    The changed rows, ``df[df["changed"]]``, are the table of heads that change between corpora.

    >>> rows = dict(layer=[0, 0], head=[0, 1], label=["healthy", "BOS-sink"])
    >>> a = pd.DataFrame(rows | dict(corpus="a", bos_mass=[0.1, 0.7],
    ...                  delta_loss=[0.5, 0.0], delta_loss_se=[0.01, 0.01]))
    >>> b = a.assign(corpus="b", bos_mass=[0.2, 0.3], label=["healthy", "healthy"],
    ...              delta_loss=[0.001, 0.0])
    >>> changes = corpus_changes(pd.concat([a, b]))
    >>> list(changes["change"])
    ['active -> dormant', 'BOS-sink -> healthy']
    """
    require_columns(compared, ["corpus", "layer", "head", "bos_mass", "label"])
    names = list(dict.fromkeys(compared["corpus"]))
    if len(names) < 2:
        raise InvalidArgumentError(
            f"corpus_changes needs at least two corpora; the table holds {len(names)}"
        )
    reference = names[0] if reference is None else check_choice(reference, "reference", names)
    importance = _has_importance(compared)
    keep = ["layer", "head", "label", "bos_mass"]
    keep += ["delta_loss", "delta_loss_se"] if importance else []
    a = compared[compared["corpus"] == reference][keep]
    rows = []
    for name in names:
        if name == reference:
            continue
        b = compared[compared["corpus"] == name][keep]
        both = a.merge(b, on=["layer", "head"], suffixes=("_a", "_b"), validate="one_to_one")
        both.insert(2, "corpus_a", reference)
        both.insert(3, "corpus_b", name)
        rows.append(both)
    df = pd.concat(rows, ignore_index=True)
    df["d_bos_mass"] = df["bos_mass_b"] - df["bos_mass_a"]
    df["label_changed"] = df["label_a"] != df["label_b"]
    words = np.where(df["label_changed"], df["label_a"] + " -> " + df["label_b"], "")
    changed = df["label_changed"].to_numpy()
    if importance:
        se_a, se_b = df["delta_loss_se_a"], df["delta_loss_se_b"]
        df["d_delta_loss"] = df["delta_loss_b"] - df["delta_loss_a"]
        df["d_delta_loss_se"] = np.sqrt(se_a**2 + se_b**2)
        df["dormant_a"] = is_dormant(df["delta_loss_a"], se_a)
        df["dormant_b"] = is_dormant(df["delta_loss_b"], se_b)
        significant = df["d_delta_loss"].abs() > DORMANT_SE * df["d_delta_loss_se"]
        df["importance_changed"] = (df["dormant_a"] != df["dormant_b"]) & significant
        status = {True: "dormant", False: "active"}
        moved = df["dormant_a"].map(status) + " -> " + df["dormant_b"].map(status)
        moved = np.where(df["importance_changed"], moved, "")
        words = ["; ".join(w for w in pair if w) for pair in zip(words, moved, strict=True)]
        changed = changed | df["importance_changed"].to_numpy()
    df["changed"] = changed
    df["change"] = words
    df = df[[c for c in CHANGE_COLUMNS if c in df.columns]]
    df.attrs = {
        "model": compared.attrs.get("model"),
        "reference": reference,
        "corpora": names,
        "dormant_se": DORMANT_SE if importance else None,
    }
    return df
