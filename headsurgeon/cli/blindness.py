"""``python -m headsurgeon blindness`` (also ``headsurgeon-blindness``): underflow blindness.

The analytic blind distances (:func:`headsurgeon.blindness.analytic_blindness`), optionally
measured on text under a mitigation (:func:`~headsurgeon.blindness.measure_blindness`,
:func:`~headsurgeon.blindness.mitigation`) beside each head's reach (a census of the same text,
:func:`headsurgeon.run_census`) and, with ``--counterfactual precision``, what
rounding in each dtype does to the outputs (:func:`headsurgeon.precision.precision_effect`),
and, with ``--sink-cache``, StreamingLLM's sink-cache test
(:func:`headsurgeon.sink_cache_effect`), printed and written by
:func:`headsurgeon.reports.write_blindness` (``--help`` lists the options).

This module parses and checks the options with light imports only (``--help``, a usage error,
a bad ``--texts`` file, a missing MODEL folder, an unknown model name or an output folder in use
answer at once); the analysis and the writing are :mod:`headsurgeon.cli.blindness_run`, imported
after that.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from headsurgeon import cli
from headsurgeon.cli import options
from headsurgeon.cli.session import tool_session
from headsurgeon.defaults import (
    ANALYSED_DTYPES,
    BIAS_KINDS,
    CONVENTIONS,
    LIMITS,
    ROBUST_MODES,
    SHAPE_NAMES,
    SINK_POSITIONS,
)
from headsurgeon.errors import InvalidArgumentError, shown
from headsurgeon.validation import check_number

__all__ = [
    "main",
    "entry",
]


# Tokens --measure reads by default: 8 sequences of the default 1,024 tokens (~10 s on the
# 16-head organism, one thread); attention work grows with the length of each sequence.
MEASURED_TOKENS = 8192


def _mitigation_params(args: argparse.Namespace) -> dict:
    if args.mitigation in ("clamped", "softcap"):
        if args.c is None:
            raise InvalidArgumentError(f"--mitigation {args.mitigation} needs --c (a logit cap)")
        return {"c": args.c}
    if args.mitigation == "robust":
        context = args.max_distance if args.robust_context is None else args.robust_context
        return {"context": context, "mode": args.robust_mode}
    return {}


def _check_sink_cache(args: argparse.Namespace) -> None:
    """The sink-cache test's lengths, refused before the model is loaded, in its options' terms
    (sink_cache_effect checks the same, in its parameters')."""
    for option, value in (("--sink-seq-len", args.sink_seq_len), ("--sink-head-seq-len", None)):
        value = args.sink_head_seq_len if value is None else value
        if value < 3:  # a cut needs a key beyond the query's neighbour
            raise InvalidArgumentError(
                f"{option} must be 3 or more (a query, its neighbour and a key to cut), got {value}"
            )
    sinks = max(args.sinks)
    if sinks == 0 or args.windows is None:  # no per-head test; or windows the model's length
        return
    window = min(args.windows)
    length = min(args.sink_seq_len, args.sink_head_seq_len)
    if length <= sinks + window + 1:
        raise InvalidArgumentError(
            f"per head, a cache of {sinks} + {window} tokens (the largest --sinks, the smallest "
            f"--windows) drops nothing from sequences of {length} tokens; give "
            f"--sink-head-seq-len and --sink-seq-len above {sinks + window + 1}, or smaller "
            "--sinks or --windows (--sinks 0 alone: no per-head test)"
        )


def _parser() -> options.ArgumentParser:
    parser = options.ArgumentParser(
        prog="python -m headsurgeon blindness",
        description="Underflow blindness of ALiBi heads per dtype: analytic, measured, mitigated.",
    )
    # No load --dtype: the model runs in float32 and the softmax is redone in each of --dtypes.
    options.add_model_args(parser, dtype=False)
    parser.add_argument(
        "--dtypes",
        nargs="+",
        type=options.dtype_name,
        default=list(ANALYSED_DTYPES),
        help="float formats to analyse (default: all three); the model itself runs in float32",
    )
    parser.add_argument(
        "--limit",
        nargs="+",
        default=list(LIMITS),
        choices=LIMITS,
        help="underflow limits: normal, subnormal, zero (rounds to exactly 0)",
    )
    parser.add_argument(
        "--max-distance",
        type=options.positive_int,
        help="context length for shares and labels (default: the model's context length, or "
        "--seq-len where --measure goes further, as ALiBi models can)",
    )
    parser.add_argument("--measure", action="store_true", help="also measure on text (loads it)")
    parser.add_argument("--convention", choices=CONVENTIONS, default="hf", help="softmax dtype")
    parser.add_argument(
        "--mitigation",
        choices=BIAS_KINDS,
        help="the ALiBi kind to analyse (default: the one the model was trained with)",
    )
    parser.add_argument(
        "--counterfactual",
        choices=["precision"],
        help="with --measure: precision runs the model through transformers in float64 and with "
        "the scores, the softmax or everything in each of --dtypes (float32, bfloat16, "
        "float16), and reports what rounding changes by position and head (under --mitigation "
        "relative: with the bias formed from distances)",
    )
    parser.add_argument(
        "--reference",
        choices=["float64", "training"],
        default="float64",
        help="with --counterfactual precision: training also measures every dtype, with the "
        "family's bias and the relative one, against the attention as the model was trained "
        "(its recorded or published training numerics); the recommendation follows it",
    )
    group = parser.add_argument_group("sink cache (StreamingLLM)")
    group.add_argument(
        "--sink-cache",
        action="store_true",
        help="perplexity of one long sequence of the text with a cache of x first (sink) plus y "
        "recent tokens, for each x in --sinks and y in --windows, against the full context; "
        "and per head, the loss when it alone loses its sinks (loads the model)",
    )
    group.add_argument(
        "--sinks",
        type=options.non_negative_int,
        nargs="+",
        default=[0, 1, 4],
        metavar="X",
        help="initial (sink) tokens kept (default: 0 1 4)",
    )
    group.add_argument(
        "--windows",
        type=options.positive_int,
        nargs="+",
        metavar="Y",
        help="recent tokens kept (default: a quarter of the training length, and all of it)",
    )
    group.add_argument(
        "--sink-positions",
        choices=SINK_POSITIONS,
        default="cache",
        help="ALiBi distance of a sink: its cache slot (StreamingLLM) or its true distance",
    )
    group.add_argument(
        "--sink-seq-len", type=options.positive_int, default=16384, help="tokens of the sequence"
    )
    group.add_argument(
        "--sink-head-seq-len",
        type=options.positive_int,
        default=2048,
        help="tokens of the per-head test (one pass per head), cache: the largest --sinks and "
        "the smallest --windows",
    )
    parser.add_argument(
        "--reach-eps",
        type=float,
        default=0.01,
        help="with --measure: a head's reach is the distance beyond which it puts at most this "
        "share of its attention (position 0 left out), from a census of the measured text",
    )
    parser.add_argument("--c", type=float, help="cap of clamped (bias >= -c) and softcap")
    parser.add_argument(
        "--robust-context", type=options.positive_int, help="robust: context kept sighted"
    )
    parser.add_argument(
        "--robust-mode",
        choices=ROBUST_MODES,
        default="scale",
        help="robust: scale lowers every slope by one factor (keeping their ratios), clip only "
        "the slopes above the limit",
    )
    parser.add_argument(
        "--batch-size", type=options.positive_int, default=1, help="sequences per forward pass"
    )
    options.add_data_args(
        parser,
        seq_len=1024,
        n_seqs=None,
        n_seqs_help=f"sequences to use (default: as many as hold "
        f"{MEASURED_TOKENS:,} tokens, at least one)",
    )
    options.add_output_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    with tool_session(parser, {"context_length": "--max-distance"}):
        return _main(parser.parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    if args.n_seqs is None:  # a fixed budget of tokens: --seq-len 16384 measures one sequence
        args.n_seqs = max(1, MEASURED_TOKENS // args.seq_len)
    formats = options.figure_formats(args)  # --format pdf without a browser: fail before any work
    params = _mitigation_params(args)
    check_number(args.reach_eps, "--reach-eps", low=0, high=1)  # before any work
    if args.measure and args.seq_len < 2:  # the census of the reach needs a query row
        raise InvalidArgumentError(
            f"--measure needs --seq-len 2 or more (no query follows a single token), got "
            f"{args.seq_len}"
        )
    if args.sink_cache:
        _check_sink_cache(args)
    if args.counterfactual and not args.measure:
        raise InvalidArgumentError(
            "--counterfactual precision needs --measure (it loads the model)"
        )
    if args.reference != "float64" and not args.counterfactual:
        raise InvalidArgumentError(
            f"--reference {args.reference} needs --counterfactual precision (it is what that "
            "counterfactual is measured against)"
        )
    if args.reference == "training" and args.mitigation == "relative":
        raise InvalidArgumentError(
            "--reference training measures the family's bias and the relative one side by "
            "side; drop --mitigation relative"
        )
    if args.counterfactual and args.mitigation not in (None, "standard", "relative"):
        raise InvalidArgumentError(
            f"--counterfactual precision measures the family's ALiBi or its relative form; "
            f"drop --mitigation {args.mitigation} or use --mitigation relative"
        )
    # A BLOOM name is analysed without its files; --measure and --sink-cache read them.
    options.check_models(args, also=SHAPE_NAMES, files=args.measure or args.sink_cache)
    options.check_out(args)
    # Only now the heavy imports (torch, TransformerLens, pandas, plotly: seconds).
    from headsurgeon.cli import blindness_run, loads

    cli.work_begins()
    default = f"blindness-{Path(str(args.model)).name}"
    with options.claim_out(args, default) as out:  # before the measurement, not after it
        loads.use_threads(args)
        blindness_run.blindness(args, out, params, formats)
    print(f"wrote {shown(out)}/")
    return 0


def entry(argv: Sequence[str] | None = None) -> None:
    """``headsurgeon-blindness`` and ``python -m headsurgeon blindness``: :func:`main` with ``argv``
    (default: the command line's arguments), through :func:`headsurgeon.cli.run`."""
    cli.run("blindness", argv)
