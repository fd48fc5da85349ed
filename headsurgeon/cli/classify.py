"""``python -m headsurgeon.classify`` (also ``headsurgeon-classify``): census, labels, report.

Loads a model, cuts the data into token sequences once, runs
:func:`headsurgeon.census.run_census` on them, labels every head with
:func:`headsurgeon.classify.classify_heads`, and with ``--importance [METHOD]`` measures every
head's :func:`headsurgeon.importance.head_importance` on the same sequences (merged as separate
columns: the labels stay as they are), and unless ``--no-secondary-sinks`` the received mass of
every key position and the secondary sinks (:func:`headsurgeon.secondary_sinks`) on the same
sequences; prints :func:`headsurgeon.reports.format_summary` and writes
:func:`headsurgeon.reports.write_classification` (``--help`` lists the options).

Several models (``python -m headsurgeon.classify bloom-560m bloom-1b7 bloom-3b``) are classified
in turn on the same options, one in memory at a time, and written together by
:func:`headsurgeon.reports.write_cross_scale`: one folder per model and the paper's cross-scale
table and figure (sick share per model and layer band).

Exports: main(argv) (the tool; returns its exit status), entry() (the console script: ``run(main)``)
"""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Sequence

import pandas as pd
from torch import Tensor

from headsurgeon import plots
from headsurgeon.backend import Model
from headsurgeon.census import run_census
from headsurgeon.classify import Thresholds, classify_heads
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
from headsurgeon.data import describe, position_zero
from headsurgeon.importance import METHODS, head_importance
from headsurgeon.received import THRESHOLD, SecondarySinks, secondary_sinks
from headsurgeon.reports import (
    IMPORTANCE_NAMES,
    default_out_dir,
    format_summary,
    model_folder_name,
    write_classification,
    write_cross_scale,
)
from headsurgeon.validation import check_number

__all__ = [
    "main",
    "entry",
]

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m headsurgeon.classify",
        description="Census of every attention head, a label per head (healthy, BOS-sink, dead), "
        "tables and head-grid figures.",
    )
    add_model_args(parser, many=True)
    add_data_args(parser)
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
    _check_importance_args(parser, args)

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
    default = default_out_dir(models[0] if len(models) == 1 else "cross-scale", "heads")
    with claim_out(args, default) as out:  # before the census
        if len(models) == 1:
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
    print(f"\nwrote {out}/: {files} ({', '.join(written)})")
    return 0


def _classify(
    args: argparse.Namespace, thresholds: Thresholds
) -> tuple[pd.DataFrame, Model, Tensor, SecondarySinks | None]:
    """Load ``args.model``, take its census (and importance, and secondary sinks), label its
    heads; print the summary. Returns the labelled table, the model, the sequences and the
    secondary sinks (None with ``--no-secondary-sinks``)."""
    model = load_model_from_args(args)
    tokens = load_data(model, args)  # cut once: census and importance share them
    census = run_census(
        model,
        tokens,
        batch_size=args.batch_size,
        n_seqs=len(tokens),
        min_query_pos=args.min_query_pos,
        prepend_bos=args.prepend_bos,
    )
    census.attrs["data"] = describe(args.texts)  # the files, not "token tensor of shape"
    census.attrs["bos_rule"] = position_zero(model, args.texts, tokens, args.prepend_bos)[1]
    classified = classify_heads(census, thresholds)
    if args.importance:
        classified = _with_importance(classified, model, tokens, args)
    sinks = None
    if not args.no_secondary_sinks:
        sinks = secondary_sinks(
            model,
            tokens,
            threshold=args.received_threshold,
            n_seqs=len(tokens),
            batch_size=args.batch_size,
            prepend_bos=args.prepend_bos,
        )
        for table in (sinks.received, sinks.sinks):
            table.attrs |= {"data": census.attrs["data"], "bos_rule": census.attrs["bos_rule"]}
    print(format_summary(classified, top=args.top, sinks=sinks))
    return classified, model, tokens, sinks


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


def _with_importance(
    classified: pd.DataFrame, model: Model, tokens: Tensor, args: argparse.Namespace
) -> pd.DataFrame:
    """``classified`` with :func:`head_importance`'s columns on the same tokens; the labels and
    census columns as they were, the importance settings in ``attrs`` (``importance_*``)."""
    importance = head_importance(
        model,
        tokens,
        method=args.importance,
        batch_size=args.batch_size,
        n_seqs=len(tokens),
        prepend_bos=args.prepend_bos,
    )
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


def entry() -> None:
    """The console script ``headsurgeon-classify`` and ``python -m headsurgeon.classify``."""
    run(main)


if __name__ == "__main__":
    entry()
