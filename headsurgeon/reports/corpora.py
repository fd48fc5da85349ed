"""The files and summary of one model on several corpora (``classify --texts A --texts B``)."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from headsurgeon import plots
from headsurgeon.backend import Model
from headsurgeon.domains import CHANGE_COLUMNS, corpus_changes, split_corpora
from headsurgeon.errors import InvalidArgumentError, shown
from headsurgeon.importance import DORMANT_SE
from headsurgeon.outputs import MARK_FILE, atomic_directory, atomic_write_text
from headsurgeon.reports.classify import format_summary, subfolder_figures, write_classification
from headsurgeon.reports.folders import model_folder_name, named_folders
from headsurgeon.reports.page import PAGE, write_page
from headsurgeon.reports.records import json_safe, package_versions

__all__ = [
    "corpus_folders",
    "write_corpora",
]

CORPORA_FILES = {
    "<corpus>/": "that corpus's classification, as a single-corpus run writes it (its own page "
    "shows the heads' attention on its sequences)",
    "heads.csv": "one row per head per corpus (the corpus column first)",
    "differences.csv": "per head, each corpus against the first: both labels, BOS masses, "
    "importances and what changed (corpus_changes)",
    "changes.csv": "the rows of differences.csv whose label or dormancy changed",
    "corpora.json": "run metadata, each corpus's files and settings, the change rule, the changes",
    "summary.txt": "what the tool prints",
    PAGE: "the corpora's metrics per head side by side, the difference grid, the figures",
}
# The change table's columns in the summary (those present).
_SHOWN = [
    "layer",
    "head",
    "label_a",
    "label_b",
    "bos_mass_a",
    "bos_mass_b",
    "delta_loss_a",
    "delta_loss_se_a",
    "delta_loss_b",
    "delta_loss_se_b",
    "change",
]
# Changed heads listed in the summary per pair (all of them are in changes.csv).
_LISTED = 40


def _rule(importance: bool) -> str:
    rule = "a head changes when its label differs"
    if importance:
        rule += (
            f", or when it is dormant (|delta_loss| <= {DORMANT_SE:g} SE) on one corpus and not "
            f"on the other and the two delta_loss differ by more than {DORMANT_SE:g} SE of the "
            "difference (sqrt(se_a^2 + se_b^2))"
        )
    return rule


def format_corpora_summary(
    compared: pd.DataFrame, changes: pd.DataFrame | None = None, *, top: int = 10
) -> str:
    """The text summary of :func:`headsurgeon.compare_corpora`'s table: each corpus's
    :func:`format_summary` under its name, then for each other corpus against the first the
    number of heads whose label or dormancy changed, the largest BOS-mass moves and the changed
    heads (``changes``: :func:`headsurgeon.domains.corpus_changes`' table, found when not given).
    """
    changes = corpus_changes(compared) if changes is None else changes
    tables = split_corpora(compared)
    lines = [
        f"{compared.attrs.get('model', 'model')} on {len(tables)} corpora: "
        + ", ".join(f"{name} ({t.attrs.get('data', '?')})" for name, t in tables.items())
    ]
    for name, table in tables.items():
        lines += ["", f"=== corpus {name} ===", format_summary(table, top=top)]
    importance = "importance_changed" in changes.columns
    for name, pair in changes.groupby("corpus_b", sort=False):
        reference = pair["corpus_a"].iloc[0]
        changed = pair[pair["changed"]]
        moves = pair.loc[pair["d_bos_mass"].abs().sort_values(ascending=False).index].head(3)
        lines += [
            "",
            f"=== {name} against {reference} ===",
            f"rule: {_rule(importance)}",
            f"labels changed: {int(pair['label_changed'].sum())} of {len(pair)} heads"
            + (
                f"; dormancy changed: {int(pair['importance_changed'].sum())}" if importance else ""
            ),
            f"BOS mass {name} - {reference}: mean |change| {pair['d_bos_mass'].abs().mean():.4f}; "
            "largest "
            + ", ".join(f"L{r.layer}H{r.head} {r.d_bos_mass:+.3f}" for r in moves.itertuples()),
        ]
        if changed.empty:
            lines.append("no head changes")
            continue
        listed = [c for c in _SHOWN if c in changed.columns]
        lines += [
            f"heads that change ({len(changed)}):",
            changed[listed]
            .head(_LISTED)
            .to_string(
                index=False,
                float_format="{:.4f}".format,
                formatters={c: "{:.2g}".format for c in ("delta_loss_se_a", "delta_loss_se_b")},
            ),
        ]
        if len(changed) > _LISTED:
            lines.append(f"... ({len(changed) - _LISTED} more in changes.csv)")
    return shown("\n".join(lines))


def _figure_names(folders: Sequence[str], metric: str) -> list[str]:
    """The figures of ``metric`` for corpora in ``folders``: one difference per corpus after the
    first (``<metric>_diff``, with more than two corpora ``<metric>_diff_<folder>``), then the
    corpora side by side (``<metric>_corpora``)."""
    diffs = [f"{metric}_diff" + ("" if len(folders) == 2 else f"_{f}") for f in folders[1:]]
    return [*diffs, f"{metric}_corpora"]


def corpus_folders(names: Sequence[str]) -> dict[str, str]:
    """``{folder: corpus}`` of :func:`write_corpora`'s folder, checked before any work: each
    corpus's folder of its own, none hidden, none named as a file of the folder (its tables,
    page, figures in any format, plotly.js), else one-line :class:`InvalidArgumentError`
    (:func:`headsurgeon.reports.folders.named_folders`)."""
    folders = list(named_folders(names, "corpus"))
    files = {name for name in CORPORA_FILES if not name.endswith("/")}
    files |= {MARK_FILE, plots.export.CARTESIAN_BUNDLE.name, plots.export.FULL_BUNDLE}
    for metric in ("bos_mass", "delta_loss"):
        files |= {f"{f}.{fmt}" for f in _figure_names(folders, metric) for fmt in plots.FORMATS}
    return named_folders(names, "corpus", files)


def _figures(compared: pd.DataFrame) -> dict[str, Any]:
    """The folder's figures: per other corpus the BOS-mass difference against the first, and
    each corpus's BOS-mass grid side by side (and importance, with importance columns)."""
    names = list(dict.fromkeys(compared["corpus"]))
    folders = [model_folder_name(name) for name in names]
    metrics = ["bos_mass"]
    if {"delta_loss", "delta_loss_se"} <= set(compared.columns):
        metrics.append("delta_loss")
    figures = {}
    for metric in metrics:
        for figure, b in zip(_figure_names(folders, metric)[:-1], names[1:], strict=True):
            figures[figure] = plots.corpus_diff_grid(compared, metric, a=names[0], b=b)
    for metric in metrics:
        figures[f"{metric}_corpora"] = plots.corpora_grid(compared, metric)
    return figures


def write_corpora(
    compared: pd.DataFrame,
    out_dir: str | os.PathLike,
    *,
    changes: pd.DataFrame | None = None,
    formats: Sequence[str] | None = None,
    overwrite: bool = False,
    model: Model | None = None,
    tokens: Mapping[str, Tensor] | None = None,
) -> Path:
    """Write one model's classification on several corpora to a new folder, atomically.

    ``compared`` is :func:`headsurgeon.compare_corpora`'s table (or
    :func:`headsurgeon.domains.stack_corpora`'s); ``changes`` its
    :func:`headsurgeon.domains.corpus_changes` (found when not given). Files
    (:data:`CORPORA_FILES`): a folder per corpus (its name made a folder name; names that
    clash are refused first: :func:`corpus_folders`) holding :func:`write_classification`'s files,
    with ``model`` and the corpus's ``tokens`` (name -> its sequences) for its page's attention
    patterns; ``heads.csv``, ``differences.csv``, ``changes.csv``, ``corpora.json``,
    ``summary.txt``; the figures ``bos_mass_diff`` (:func:`headsurgeon.plots.corpus_diff_grid`,
    the second corpus minus the first; with more corpora one per corpus,
    ``bos_mass_diff_<folder>``) and ``bos_mass_corpora``
    (:func:`headsurgeon.plots.corpora_grid`), the same for ``delta_loss`` with importance
    columns; and ``index.html``: the difference grid (click a head for its metrics on every
    corpus side by side), the summary, the figures and links to each corpus's page. ``formats``
    and ``overwrite`` as in :func:`write_classification`.
    """
    tables = split_corpora(compared)
    if len(tables) < 2:
        raise InvalidArgumentError(
            f"write_corpora needs at least two corpora; the table holds {len(tables)} "
            "(write one with write_classification)"
        )
    folders = corpus_folders(list(tables))
    plots.split_formats(formats)  # checked before anything is written
    changes = corpus_changes(compared) if changes is None else changes
    summary = format_corpora_summary(compared, changes)
    figures = _figures(compared)
    importance = "importance_changed" in changes.columns
    info = {k: v for k, v in compared.attrs.items() if k != "corpus_attrs"}
    info |= {
        "versions": package_versions(),
        "created": datetime.datetime.now().astimezone().isoformat(),
    }
    document = {
        "metadata": info,
        "corpora": {
            name: {"folder": folder} | dict(tables[name].attrs) for folder, name in folders.items()
        },
        "reference": changes.attrs.get("reference"),
        "rule": _rule(importance),
        "columns": {c: CHANGE_COLUMNS[c] for c in changes.columns},
        "changes": [
            {k: json_safe(v) for k, v in row.items()}
            for row in changes[changes["changed"]].to_dict(orient="records")
        ],
    }
    first = next(iter(tables.values()))
    names = list(tables)
    inner, skipped_inside = subfolder_figures(
        {folder: tables[name] for folder, name in folders.items()}, formats
    )
    with atomic_directory(out_dir, overwrite=overwrite, writer="write_corpora") as tmp:
        for folder, name in folders.items():
            write_classification(
                tables[name],
                tmp / folder,
                formats=inner,
                model=model,
                tokens=None if tokens is None else tokens.get(name),
            )
        atomic_write_text(tmp / "heads.csv", compared.to_csv(index=False))
        atomic_write_text(tmp / "differences.csv", changes.to_csv(index=False))
        atomic_write_text(tmp / "changes.csv", changes[changes["changed"]].to_csv(index=False))
        atomic_write_text(
            tmp / "corpora.json", json.dumps(json_safe(document), indent=2, default=str) + "\n"
        )
        atomic_write_text(tmp / "summary.txt", summary + "\n")
        skipped = plots.save_figures(figures, tmp, formats)
        grid = next(iter(figures))
        write_page(
            tmp,
            title=f"Heads of {info.get('model', 'the model')} on {len(tables)} corpora",
            summary=summary,
            grid=figures[grid],
            shape=(int(first["layer"].max()) + 1, int(first["head"].max()) + 1),
            stages=tables,
            model=model,
            figures={k: fig for k, fig in figures.items() if k != grid},
            note=(
                f"The grid: BOS mass on {names[1]} minus on {names[0]} per head (label changes "
                "outlined); click a head for its metrics on every corpus. Each corpus's own page "
                f"({', '.join(f'{f}/{PAGE}' for f in folders)}) shows the heads' attention on "
                "that corpus's sequences."
            ),
            pages=[f"{folder}/{PAGE}" for folder in folders],
        )
    plots.warn_skipped(skipped_inside + skipped, out_dir)
    return Path(out_dir)
