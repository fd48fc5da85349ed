"""The work of ``python -m headsurgeon classify`` once its options are checked
(:mod:`headsurgeon.cli.classify`): load each model, take its census, label its heads, print the
summary and write the report folder (imports torch, TransformerLens, pandas and plotly).
"""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from torch import Tensor

from headsurgeon import plots
from headsurgeon.backend import Model
from headsurgeon.classify import Thresholds
from headsurgeon.cli.loads import load_data, load_model_from_args
from headsurgeon.cli.options import ArgumentParser, claim_out
from headsurgeon.data import Sequences
from headsurgeon.domains import classify_sequences, corpus_changes, stack_corpora
from headsurgeon.errors import shown
from headsurgeon.received import SecondarySinks, secondary_sinks
from headsurgeon.reports import write_classification, write_corpora, write_cross_scale
from headsurgeon.reports.classify import CROSS_SCALE_FORMATS, cross_scale_folders, format_summary
from headsurgeon.reports.corpora import corpus_folders, format_corpora_summary
from headsurgeon.reports.folders import default_out_dir, model_folder_name

__all__ = [
    "classify",
]

logger = logging.getLogger(__name__)


def classify(parser: ArgumentParser, args: argparse.Namespace, formats: list[str] | None) -> int:
    """The run of checked options ``args``: claim the output folder, measure, print, write."""
    thresholds = Thresholds(args.sink_threshold, args.dead_threshold, args.min_output_share)
    models = args.model
    corpora = getattr(args, "corpora", None) or []
    # Names that clash in the output folder: one line now, not after every census.
    if len(corpora) > 1:
        corpus_folders(corpus_names(corpora))
    elif len(models) > 1:
        cross_scale_folders(models)
    if len(corpora) > 1:
        default = default_out_dir(models[0], "corpora")
    else:
        default = default_out_dir(models[0] if len(models) == 1 else "cross-scale", "heads")
    with claim_out(args, default) as out:  # before the census
        if len(corpora) > 1:
            one = argparse.Namespace(**vars(args) | {"model": models[0]})
            _compare(one, thresholds, corpora, out, formats)
            files = "index.html (open it in a browser), one folder per corpus, heads.csv, "
            files += "changes.csv, differences.csv, corpora.json, summary.txt, figures"
        elif len(models) == 1:
            one = argparse.Namespace(**vars(args) | {"model": models[0]})
            classified, model, tokens, sinks = _classify(one, thresholds)
            # The report page shows the heads' attention on the run's own sequences.
            write_classification(
                classified,
                out,
                formats=formats,
                overwrite=args.overwrite,
                model=model,
                tokens=tokens,
                sinks=sinks,
            )
            files = "index.html (open it in a browser), heads.csv, heads.json, summary.txt, "
            files += "threshold_sweep.csv, "
            files += "" if sinks is None else "received.csv, secondary_sinks.csv, "
            files += "figures"
        else:
            tables = {}
            for model in models:  # one model in memory at a time
                logger.info("classifying %s (%d of %d)", model, len(tables) + 1, len(models))
                # The cross-scale folders hold no secondary sinks: not measured.
                each = argparse.Namespace(
                    **vars(args) | {"model": model, "no_secondary_sinks": True}
                )
                tables[model] = _classify(each, thresholds)[0]
                gc.collect()
            write_cross_scale(tables, out, formats=formats, overwrite=args.overwrite)
            files = "one folder per model, cross_scale.csv, summary.txt, figures"
    cross_scale = len(models) > 1 and len(corpora) <= 1
    default = CROSS_SCALE_FORMATS if cross_scale else plots.DEFAULT_FORMATS
    written = plots.split_formats(formats, default=default)[0]
    print(f"\nwrote {shown(out)}/: {files} ({', '.join(written) or 'on index.html'})")
    return 0


def _classify(
    args: argparse.Namespace, thresholds: Thresholds
) -> tuple[pd.DataFrame, Model, Tensor, SecondarySinks | None]:
    """Load ``args.model``, take its census (and importance, and secondary sinks), label its
    heads; print the summary. Returns the labelled table, the model, the sequences and the
    secondary sinks (None with ``--no-secondary-sinks``)."""
    model = load_model_from_args(args)
    classified, seqs = _classify_texts(model, args, thresholds)
    sinks = None
    if not args.no_secondary_sinks:
        sinks = secondary_sinks(
            model,
            seqs,
            threshold=args.received_threshold,
            batch_size=args.batch_size,
        )
    print(format_summary(classified, top=args.top, sinks=sinks))
    return classified, model, seqs.tokens, sinks


def _classify_texts(
    model: Model, args: argparse.Namespace, thresholds: Thresholds
) -> tuple[pd.DataFrame, Sequences]:
    """``args.texts`` cut once (census and importance share the sequences) and measured."""
    seqs = load_data(model, args)
    classified = classify_sequences(
        model,
        seqs,
        thresholds=thresholds,
        importance=args.importance,
        batch_size=args.batch_size,
        min_query_pos=args.min_query_pos,
        sink_eps=args.sink_eps,
        reach=not args.no_reach,
    )
    return classified, seqs


def corpus_names(corpora: Sequence[Sequence[Path]]) -> list[str]:
    """A name per corpus (a group of files) from its files' names: ``a.txt.gz`` -> ``a``, several
    files joined by ``-``, characters other than letters, digits, ``.``, ``_`` and ``-`` made
    ``-`` (the name is a folder name too); a name met before (letters' case aside, as some
    disks see folder names) gets ``-2``, ``-3``...

    >>> corpus_names([[Path("x/a.txt")], [Path("y/a.txt.gz"), Path("b c.txt")]])
    ['a', 'a-b-c']
    >>> corpus_names([[Path("x/a.txt")], [Path("y/a.txt")], [Path("A.txt")]])
    ['a', 'a-2', 'A-3']
    """
    names: list[str] = []
    for files in corpora:
        stems = [p.name.removesuffix(".gz").removesuffix(".txt") or p.name for p in files]
        base = model_folder_name("-".join(stems)).strip(".") or "corpus"
        name, n = base, 2
        while name.casefold() in {other.casefold() for other in names}:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def _compare(
    args: argparse.Namespace,
    thresholds: Thresholds,
    corpora: Sequence[Sequence[Path]],
    out: Path,
    formats: Sequence[str] | None,
) -> None:
    """Each corpus measured on the one model as a single-corpus run measures it; the summary
    printed and everything written to ``out``."""
    model = load_model_from_args(args)
    tables, tokens = {}, {}
    for name, files in zip(corpus_names(corpora), corpora, strict=True):
        logger.info("corpus %s (%d of %d)", name, len(tables) + 1, len(corpora))
        each = argparse.Namespace(**vars(args) | {"texts": list(files)})
        tables[name], seqs = _classify_texts(model, each, thresholds)
        tokens[name] = seqs.tokens
    compared = stack_corpora(tables)
    changes = corpus_changes(compared)
    print(format_corpora_summary(compared, changes, top=args.top))
    write_corpora(
        compared,
        out,
        changes=changes,
        formats=formats,
        overwrite=args.overwrite,
        model=model,
        tokens=tokens,
    )
