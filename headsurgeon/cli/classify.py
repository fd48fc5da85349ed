"""``python -m headsurgeon classify`` (also ``headsurgeon-classify``): census, labels, report.

Loads a model, cuts the data into token sequences once, runs
:func:`headsurgeon.census.run_census` on them, labels every head with
:func:`headsurgeon.classify.classify_heads`, and with ``--importance [METHOD]`` measures every
head's :func:`headsurgeon.importance.head_importance` on the same sequences (merged as separate
columns: the labels stay as they are), and unless ``--no-secondary-sinks`` the received mass of
every key position and the secondary sinks (:func:`headsurgeon.secondary_sinks`) on the same
sequences; prints :func:`headsurgeon.reports.classify.format_summary` and writes
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

Several models (``python -m headsurgeon classify bloom-560m bloom-1b7 bloom-3b``) are classified
in turn on the same options, one in memory at a time, and written together by
:func:`headsurgeon.reports.write_cross_scale`: one folder per model and the paper's cross-scale
table and figure (sick share per model and layer band).

This module parses and checks the options with light imports only (``--help``, a usage error,
a bad ``--texts`` file, a missing MODEL folder, an unknown model name or an ``--out`` folder it
may not write answer at once); the census and the writing are
:mod:`headsurgeon.cli.classify_run`, imported after that.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from headsurgeon.cli import run, work_begins
from headsurgeon.cli.options import (
    ArgumentParser,
    add_data_args,
    add_model_args,
    add_output_args,
    add_threshold_args,
    check_models,
    check_out,
    figure_formats,
    non_negative_int,
    positive_int,
)
from headsurgeon.cli.session import tool_session
from headsurgeon.defaults import GU_PROTOCOL, IMPORTANCE_METHODS, RECEIVED_THRESHOLD
from headsurgeon.validation import check_number

__all__ = [
    "main",
    "entry",
]

# --preset NAME: census settings (argparse destinations) that become the options' defaults.
PRESETS = {"gu": dict(GU_PROTOCOL)}


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m headsurgeon classify",
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
        "--no-reach",
        action="store_true",
        help="leave out reach and its baseline, the columns that need every attention weight: "
        "the rest comes from a fused attention where the model allows it (faster; census "
        "attrs and heads.json say which path ran)",
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
        choices=IMPORTANCE_METHODS,
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
        default=RECEIVED_THRESHOLD,
        help="a position after 0 is a secondary sink in a layer where some head gives it a "
        f"received mass (mean weight from later queries) above this (default "
        f"{RECEIVED_THRESHOLD}: Gu et al.'s epsilon)",
    )
    limits = parser.add_argument_group("thresholds")
    add_threshold_args(limits)
    add_output_args(parser)
    parser.add_argument(
        "--top", type=non_negative_int, default=10, help="sinks listed in the summary"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    with tool_session(parser):
        return _main(parser, argv)


def _main(parser: ArgumentParser, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(argv)
    if args.preset:  # the preset's values as defaults; what the command line says wins
        parser.set_defaults(**PRESETS[args.preset])
        args = parser.parse_args(argv)
    _check_importance_args(parser, args)
    check_number(args.sink_eps, "--sink-eps", low=0, high=1)
    check_number(args.received_threshold, "--received-threshold", low=0, high=1)
    if args.seq_len < 2 and not args.no_secondary_sinks:
        parser.error(
            "secondary sinks need --seq-len 2 or more (no query follows a single token); "
            "or give --no-secondary-sinks"
        )
    corpora = getattr(args, "corpora", None) or []
    if len(corpora) > 1 and len(args.model) > 1:
        parser.error(
            f"several corpora (--texts given {len(corpora)} times) are compared on one model; "
            f"got {len(args.model)} models: run one model at a time"
        )
    formats = figure_formats(args)  # --format svg/pdf without a browser: fail before the census
    check_models(args)
    check_out(args)
    # Only now the heavy imports (torch, TransformerLens, pandas, plotly: seconds).
    from headsurgeon.cli import classify_run, loads

    work_begins()
    loads.use_threads(args)
    return classify_run.classify(parser, args, formats)


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
    """``headsurgeon-classify`` and ``python -m headsurgeon classify``: :func:`main` with ``argv``
    (default: the command line's arguments), through :func:`headsurgeon.cli.run`."""
    run("classify", argv)
