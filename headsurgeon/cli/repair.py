"""``python -m headsurgeon repair`` (also ``headsurgeon-repair``): surgical repair, with a report.

Parses the options, runs :func:`headsurgeon.repair.repair` with the model's recommended
fine-tuning settings (:func:`~headsurgeon.repair.recommended_config`) and its control arm (the
kept passes' heads retrained without re-initialisation; ``--no-control`` skips it), keeping
finished passes (and control passes) in
``<out>.partial/`` for ``--resume``, and writes :func:`headsurgeon.reports.write_report` on rank 0
(``--help`` lists the options). Runs data-parallel under ``torchrun``.

The work folder ``<out>.partial`` is created by this tool, marked as a repair work folder
(:data:`headsurgeon.cli.repair_run.WORK_WRITER` in its :data:`headsurgeon.outputs.MARK_FILE`),
and removed (when the run ends, never trained, or is started over with ``--overwrite``) only
when it carries that mark: a file, symlink or folder of that name that the tool did not make is
refused in one line and left as it is. ``--resume`` of a run that finished says so (and never
suggests ``--overwrite``).

Exit status: 0 repaired, no head worse (targets still sick are listed as failed heads);
2 bad input (one line, ``error: ...``); 3 (:data:`EXIT_DAMAGED`) a pass damaged the model (report
written, ``model/`` only if an earlier pass was acceptable); 4 (:data:`EXIT_WORSE`) a targeted
head that was healthy ended sick (report and ``model/`` written; the report names the heads).

This module parses and checks the options with light imports only (``--help``, a usage error,
a bad ``--texts``, ``--corpus`` or ``--eval-corpus`` file, a missing MODEL folder, an unknown
model name or an ``--out`` folder it may not write answer at once); the repair itself is
:mod:`headsurgeon.cli.repair_run`, imported after that.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from headsurgeon.cli import run, work_begins
from headsurgeon.cli.options import (
    ArgumentParser,
    TextFiles,
    add_data_args,
    add_dataset_args,
    add_model_args,
    add_output_args,
    add_threshold_args,
    check_models,
    check_out,
    dataset_split,
    figure_formats,
    needs_dataset,
    non_negative_int,
    positive_int,
    seed,
)
from headsurgeon.cli.session import tool_session
from headsurgeon.defaults import DRIFT_THRESHOLD, FINETUNE, INITS, MAX_PPL_INCREASE
from headsurgeon.errors import InvalidArgumentError

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_WORSE",
    "main",
    "entry",
]

EXIT_DAMAGED = 3  # 2 is bad input (headsurgeon.cli.run)
EXIT_WORSE = 4

# The library's names of options whose parameter is named otherwise (the rest: option_names).
LIBRARY_NAMES = {
    "census_seq_len": "--seq-len",
    "census_n_seqs": "--n-seqs",
    "warmup_steps": "--warmup",
    "eval_corpus": "--eval-corpus (or --eval-split)",
    "eval_on_train=True": "--allow-eval-on-train",
    "train_seq_len": "--train-seq-len",
    "finetune_config": "the fine-tuning options",
}

_EXIT = {"ok": 0, "incomplete": 0, "failed": EXIT_DAMAGED, "worse": EXIT_WORSE}


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m headsurgeon repair",
        description="Surgical repair of dead and BOS-sink heads: census, re-initialise the "
        "chosen heads, fine-tune only their slices, census again; repeat on the heads still "
        "sick. Runs data-parallel under torchrun.",
        epilog=f"exit status: 0 repaired, no head worse (targets still sick are listed as "
        f"failed heads); 2 bad input; {EXIT_DAMAGED} a pass damaged the model (held-out "
        "perplexity or collateral heads beyond the limits): the report says why, and model/ "
        "holds the best earlier pass, or is not written when no pass is acceptable; "
        f"{EXIT_WORSE} a targeted head that was healthy ended sick: the report names it",
    )
    add_model_args(parser)
    add_data_args(parser, dataset=False)  # the census data; --dataset is the training text
    census = parser.add_argument_group("census and classification")
    census.add_argument(
        "--min-query-pos", type=non_negative_int, default=1, help="first query row averaged"
    )
    add_threshold_args(census)
    surgery = parser.add_argument_group("surgery")
    surgery.add_argument("--heads", help="heads to repair, e.g. L5H9,L6H10-15 (default: census)")
    surgery.add_argument("--include", help="heads to add to pass 1 even if healthy, e.g. L5-22H5")
    surgery.add_argument("--passes", type=positive_int, default=2, help="most passes (default 2)")
    surgery.add_argument(
        "--init",
        choices=INITS,
        default="xavier_normal",
        help="how a target head's new Q, K and V weights are drawn",
    )
    surgery.add_argument(
        "--drift-threshold",
        type=float,
        default=DRIFT_THRESHOLD,
        help="a frozen head drifts when its BOS mass moves by more than this in a pass",
    )
    surgery.add_argument(
        "--max-ppl-increase",
        type=float,
        default=MAX_PPL_INCREASE,
        metavar="FRACTION",
        help="a pass raising held-out perplexity by more than this (relative; default "
        f"{MAX_PPL_INCREASE:g}, i.e. +{MAX_PPL_INCREASE:.0%}%; inf: no limit) damaged the model",
    )
    surgery.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="skip the control arm (the kept passes' heads retrained without "
        "re-initialisation, to show whether re-initialisation is what helped): half the training",
    )
    surgery.add_argument(
        "--max-collateral",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="a pass turning more than N healthy frozen heads sick damaged the model (default 0)",
    )
    training = parser.add_argument_group("fine-tuning")
    ft = FINETUNE
    train_source = training.add_mutually_exclusive_group()
    train_source.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        action=TextFiles,
        help="training text (default: the bundled training corpora)",
    )
    add_dataset_args(training, train_source, "the training text")
    needs_dataset(parser)
    parser.needs("--eval-split", "--dataset")
    eval_source = training.add_mutually_exclusive_group()
    eval_source.add_argument(
        "--eval-corpus",
        nargs="+",
        metavar="FILE",
        action=TextFiles,
        help="held-out text (default: the bundled held-out corpora)",
    )
    eval_source.add_argument(
        "--eval-split",
        metavar="SPLIT",
        help="held-out text from this split of --dataset (e.g. validation; default: "
        "--eval-corpus, else the bundled held-out corpora)",
    )
    training.add_argument(
        "--allow-eval-on-train",
        action="store_true",
        help="judge the repair on held-out text that is its training text (--eval-split the "
        "training split, or --eval-corpus the --corpus files); refused without this, and the "
        "report says so with it",
    )
    training.add_argument(
        "--train-seq-len",
        type=positive_int,
        help="tokens per training sequence (default: training length, <= 512)",
    )
    training.add_argument(
        "--n-eval-seqs",
        type=positive_int,
        default=32,
        help="held-out sequences whose perplexity judges each pass",
    )
    training.add_argument(
        "--steps",
        type=positive_int,
        help=f"steps per pass (default: the model's recommended setting, else {ft['steps']})",
    )
    training.add_argument(
        "--lr", type=float, help=f"peak learning rate (default: as --steps, else {ft['lr']})"
    )
    training.add_argument(
        "--weight-decay",
        type=float,
        default=ft["weight_decay"],
        help="AdamW's decoupled weight decay of the trained slices",
    )
    training.add_argument(
        "--warmup", type=non_negative_int, help="warm-up steps (default min(100, steps/4))"
    )
    training.add_argument(
        "--batch-size", type=positive_int, default=ft["batch_size"], help="per process"
    )
    training.add_argument(
        "--grad-accum",
        type=positive_int,
        default=ft["grad_accum"],
        help="batches whose gradients make one step",
    )
    training.add_argument(
        "--max-grad-norm",
        type=float,
        default=ft["max_grad_norm"],
        help="gradients clipped to this norm",
    )
    training.add_argument(
        "--autocast",
        choices=["bfloat16"],
        help="compute a float32 model in bfloat16 autocast (the paper's setup)",
    )
    training.add_argument("--eval-every", type=positive_int, help="steps between evaluations")
    training.add_argument(
        "--patience", type=positive_int, help="early stop after N worse evaluations"
    )
    training.add_argument(
        "--strategy",
        choices=["slices", "mask"],
        default=ft["strategy"],
        help="slices: the optimiser holds only the trained slices; mask: the paper's gradient "
        "masks on whole weights",
    )
    training.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seed of the re-initialisation, the data order and any sampling",
    )
    training.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each block in the backward pass instead of keeping its activations "
        "(less memory at large batches and long windows; each block runs twice)",
    )
    training.add_argument(
        "--loss-chunk",
        type=positive_int,
        help="compute the loss over this many positions at a time, never holding the whole "
        "batch's float32 logits (BLOOM: 1 MB per position; e.g. 1024)",
    )
    parser.add_argument(
        "--save-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the repaired model/ (default: the dtype of the checkpoint it came from); "
        "the trained slices are rounded to it before the final census",
    )
    add_output_args(parser)
    parser.add_argument(
        "--resume", metavar="DIR", help="continue the interrupted run whose --out was DIR"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    with tool_session(parser, LIBRARY_NAMES):
        return _main(parser, argv)


def _main(parser: ArgumentParser, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(argv)
    if not args.allow_eval_on_train:
        _check_held_out(args)
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise InvalidArgumentError("--resume DIR continues the run writing DIR; drop --out")
    args.out = args.resume or args.out
    formats = figure_formats(args)  # --format pdf without a browser: fail before any training
    check_models(args)
    if not args.resume:  # a resumed run's folder is checked by the run, with its own advice
        check_out(args)
    # Only now the heavy imports (torch, TransformerLens, pandas, plotly: seconds).
    from headsurgeon.cli import loads, repair_run

    work_begins()
    loads.use_threads(args)
    return _EXIT[repair_run.repair(args, formats)]


def _check_held_out(args: argparse.Namespace) -> None:
    """Held-out text named as the training text (the same split, or a --corpus file again in
    --eval-corpus), refused before any model is loaded; the repair refuses the same text under
    other names once it is cut (its sequences are training sequences)."""
    why = (
        "the verdict would judge the repair on the text it trained on; hold out other text, or "
        "give --allow-eval-on-train to judge on it anyway"
    )
    if args.dataset and args.eval_split is not None:
        if args.eval_split.strip() == dataset_split(args).strip():
            raise InvalidArgumentError(
                f"--eval-split {args.eval_split} is the training split (--split "
                f"{dataset_split(args)}): {why}"
            )
    for held_out in args.eval_corpus or []:
        for trained in args.corpus or []:
            if os.path.exists(held_out) and os.path.exists(trained):
                if os.path.samefile(held_out, trained):
                    raise InvalidArgumentError(
                        f"--eval-corpus {held_out} is the --corpus file {trained}: {why}"
                    )


def entry(argv: Sequence[str] | None = None) -> None:
    """``headsurgeon-repair`` and ``python -m headsurgeon repair``: :func:`main` with ``argv``
    (default: the command line's arguments), through :func:`headsurgeon.cli.run`."""
    run("repair", argv)
