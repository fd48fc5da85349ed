"""``python -m headsurgeon.classify`` (also ``headsurgeon-classify``): census, labels, report.

Loads a model, runs :func:`headsurgeon.census.run_census`, labels every head with
:func:`headsurgeon.classify.classify_heads`, prints :func:`headsurgeon.reports.format_summary`
and writes :func:`headsurgeon.reports.write_classification` (``--help`` lists the options).

Exports: main(argv) (the tool; returns its exit status), entry() (the console script: ``run(main)``)
"""

from __future__ import annotations

from collections.abc import Sequence

from headsurgeon import plots
from headsurgeon.census import run_census
from headsurgeon.classify import Thresholds, classify_heads
from headsurgeon.cli import (
    ArgumentParser,
    add_data_args,
    add_model_args,
    add_output_args,
    claim_out,
    figure_formats,
    load_model_from_args,
    non_negative_int,
    positive_int,
    run,
)
from headsurgeon.reports import default_out_dir, format_summary, write_classification

__all__ = [
    "main",
    "entry",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m headsurgeon.classify",
        description="Census of every attention head, a label per head (healthy, BOS-sink, dead), "
        "tables and head-grid figures.",
    )
    add_model_args(parser)
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

    thresholds = Thresholds(args.sink_threshold, args.dead_threshold, args.min_output_share)
    formats = figure_formats(args)  # --format svg/pdf without a browser: fail before the census
    with claim_out(args, default_out_dir(args.model, "heads")) as out:  # before the census
        model = load_model_from_args(args)
        census = run_census(
            model,
            args.texts,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            n_seqs=args.n_seqs,
            min_query_pos=args.min_query_pos,
            prepend_bos=args.prepend_bos,
        )
        classified = classify_heads(census, thresholds)
        print(format_summary(classified, top=args.top))
        written = plots.split_formats(formats)[0]
        write_classification(classified, out, formats=formats, overwrite=args.overwrite)
    print(
        f"\nwrote {out}/: heads.csv, heads.json, summary.txt, threshold_sweep.csv, figures "
        f"({', '.join(written)})"
    )
    return 0


def entry() -> None:
    """The console script ``headsurgeon-classify`` and ``python -m headsurgeon.classify``."""
    run(main)


if __name__ == "__main__":
    entry()
