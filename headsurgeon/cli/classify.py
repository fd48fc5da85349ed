"""``python -m headsurgeon.classify`` (also ``headsurgeon-classify``): census, labels, report.

Loads a model, cuts the data into token sequences once, runs
:func:`headsurgeon.census.run_census` on them, labels every head with
:func:`headsurgeon.classify.classify_heads`, and with ``--importance [METHOD]`` measures every
head's :func:`headsurgeon.importance.head_importance` on the same sequences (merged as separate
columns: the labels stay as they are), and unless ``--no-secondary-sinks`` the received mass of
every key position and the secondary sinks (:func:`headsurgeon.secondary_sinks`) on the same
sequences; prints :func:`headsurgeon.reports.format_summary` and writes
:func:`headsurgeon.reports.write_classification` (``--help`` lists the options).

Several corpora (``--texts A.txt --texts B.txt``: each ``--texts`` one corpus, of one file or
more) are measured in turn on the one model, each exactly as a single-corpus run, and written by
:func:`headsurgeon.reports.write_corpora`: one folder per corpus (named after its files), the
long table, the heads whose label or importance changes between corpora
(:func:`headsurgeon.domains.corpus_changes`), the difference grids and one page.

``--preset gu`` sets the census to Gu et al.'s sink-rate protocol
(:data:`headsurgeon.census.GU_PROTOCOL`: ``--n-seqs 100 --seq-len 64 --sink-eps 0.3``) as
defaults: options given explicitly win, and the summary says where the run differs from the
protocol.

Several models (``python -m headsurgeon.classify bloom-560m bloom-1b7 bloom-3b``) are classified
in turn on the same options, one in memory at a time, and written together by
:func:`headsurgeon.reports.write_cross_scale`: one folder per model and the paper's cross-scale
table and figure (sick share per model and layer band).

Exports: main(argv) (the tool; returns its exit status), entry() (the console script:
``run(main)``), corpus_names(groups) (a folder-safe name per corpus from its files' names)
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from torch import Tensor

from headsurgeon import plots
from headsurgeon.backend import Model
from headsurgeon.census import GU_PROTOCOL
from headsurgeon.classify import Thresholds
from headsurgeon.cli import (
    ArgumentParser,
    add_data_args,
    add_model_args,
    add_output_args,
    claim_out,
    figure_formats,
    load_data,
    load_model_from_args,
    non_negative_int,
    positive_int,
    run,
)
from headsurgeon.data import Sequences
from headsurgeon.domains import classify_sequences, corpus_changes, stack_corpora
from headsurgeon.errors import shown
from headsurgeon.importance import METHODS
from headsurgeon.received import THRESHOLD, SecondarySinks, secondary_sinks
from headsurgeon.reports import (
    default_out_dir,
    format_corpora_summary,
    format_summary,
    model_folder_name,
    write_classification,
    write_corpora,
    write_cross_scale,
)
from headsurgeon.validation import check_number

__all__ = [
    "main",
    "entry",
    "corpus_names",
]

logger = logging.getLogger(__name__)

# --preset NAME: census settings (argparse destinations) that become the options' defaults.
PRESETS = {"gu": dict(GU_PROTOCOL)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m headsurgeon.classify",
        description="Census of every attention head, a label per head (healthy, BOS-sink, dead), "
        "tables and head-grid figures.",
    )
    add_model_args(parser, many=True)
    add_data_args(parser, corpora=True)
    census_args = parser.add_argument_group("census")
    census_args.add_argument(
        "--min-query-pos",
        type=non_negative_int,
        default=1,
        help="first query row averaged (0 = the surgery paper's metric; default 1)",
    )
    census_args.add_argument(
        "--batch-size", type=positive_int, default=8, help="sequences per forward"
    )
    census_args.add_argument(
        "--sink-eps",
        type=float,
        default=GU_PROTOCOL["sink_eps"],
        help="Gu et al.'s epsilon: a head is a sink in a sequence when its sink_score there "
        "exceeds it (the sink_share column, the sink rate of the summary; default 0.3)",
    )
    census_args.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="gu: Gu et al.'s sink-rate protocol as the defaults of --n-seqs 100 --seq-len 64 "
        "--sink-eps 0.3 (options given explicitly win)",
    )
    census_args.add_argument(
        "--importance",
        nargs="?",
        const="mean",
        choices=METHODS,
        metavar="METHOD",
        help="also measure what removing each head costs, on the census's sequences: mean (the "
        "default), zero or resample replace the head's output by its mean, by 0 or by another "
        "sequence's (one forward per head); attribution estimates mean ablation for all heads "
        "from one backward. Adds columns and figures; the labels stay as they are. Give MODEL "
        "before a bare --importance",
    )
    census_args.add_argument(
        "--no-secondary-sinks",
        action="store_true",
        help="skip the received mass of each key position and the list of secondary sinks (one "
        "more forward over the data; written to received.csv, secondary_sinks.csv and the page)",
    )
    census_args.add_argument(
        "--received-threshold",
        type=float,
        default=THRESHOLD,
        help="a position after 0 is a secondary sink in a layer where some head gives it a "
        f"received mass (mean weight from later queries) above this (default {THRESHOLD}: Gu et "
        "al.'s epsilon)",
    )
    limits = parser.add_argument_group("thresholds")
    defaults = Thresholds()
    limits.add_argument("--sink-threshold", type=float, default=defaults.sink, help="BOS mass")
    limits.add_argument("--dead-threshold", type=float, default=defaults.dead, help="BOS mass")
    limits.add_argument(
        "--min-output-share",
        type=float,
        default=defaults.min_output_share,
        help="heads writing less than this share of their layer's attention output are dead",
    )
    add_output_args(parser)
    parser.add_argument(
        "--top", type=non_negative_int, default=10, help="sinks listed in the summary"
    )
    args = parser.parse_args(argv)
    if args.preset:  # the preset's values as defaults; what the command line says wins
        parser.set_defaults(**PRESETS[args.preset])
        args = parser.parse_args(argv)
    _check_importance_args(parser, args)
    check_number(args.sink_eps, "--sink-eps", low=0, high=1)

    thresholds = Thresholds(args.sink_threshold, args.dead_threshold, args.min_output_share)
    check_number(args.received_threshold, "--received-threshold", low=0, high=1)
    if args.seq_len < 2 and not args.no_secondary_sinks:
        parser.error(
            "secondary sinks need --seq-len 2 or more (no query follows a single token); "
            "or give --no-secondary-sinks"
        )
    formats = figure_formats(args)  # --format svg/pdf without a browser: fail before the census
    models = args.model
    if len({model_folder_name(m) for m in models}) < len(models):
        parser.error(f"two of the models {' '.join(models)} would share an output folder name")
    corpora = getattr(args, "corpora", None) or []
    if len(corpora) > 1 and len(models) > 1:
        parser.error(
            f"several corpora (--texts given {len(corpora)} times) are compared on one model; "
            f"got {len(models)} models: run one model at a time"
        )
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
    written = plots.split_formats(formats)[0]
    print(f"\nwrote {shown(out)}/: {files} ({', '.join(written)})")
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
            n_seqs=seqs.n_seqs,
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
    )
    return classified, seqs


def corpus_names(corpora: Sequence[Sequence[Path]]) -> list[str]:
    """A name per corpus (a group of files) from its files' names: ``a.txt.gz`` -> ``a``, several
    files joined by ``-``, characters other than letters, digits, ``.``, ``_`` and ``-`` made
    ``-`` (the name is a folder name too); a name met before gets ``-2``, ``-3``...

    >>> corpus_names([[Path("x/a.txt")], [Path("y/a.txt.gz"), Path("b c.txt")]])
    ['a', 'a-b-c']
    >>> corpus_names([[Path("x/a.txt")], [Path("y/a.txt")]])
    ['a', 'a-2']
    """
    names: list[str] = []
    for files in corpora:
        stems = [p.name.removesuffix(".gz").removesuffix(".txt") or p.name for p in files]
        base = model_folder_name("-".join(stems)).strip(".") or "corpus"
        name, n = base, 2
        while name in names:
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


def _check_importance_args(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """What --importance cannot measure, refused before any model is loaded."""
    if not args.importance:
        return
    if args.seq_len < 2:
        parser.error(
            f"--importance needs --seq-len 2 or more (a sequence of {args.seq_len} token "
            "predicts nothing)"
        )
    if args.importance == "resample" and args.n_seqs < 2:
        parser.error(
            "--importance resample takes each head's output from another sequence; "
            "use --n-seqs 2 or more"
        )


def entry(argv: Sequence[str] | None = None) -> None:
    """The console script ``headsurgeon-classify``, ``python -m headsurgeon classify`` and
    ``python -m headsurgeon.classify``: :func:`main` with ``argv`` (default: the command
    line's arguments)."""
    run(main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    entry()
