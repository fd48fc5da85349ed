"""``python -m headsurgeon.repair`` (also ``headsurgeon-repair``): surgical repair, with a report.

Parses the options, runs :func:`headsurgeon.repair.repair` with the model's recommended
fine-tuning settings (:func:`~headsurgeon.repair.recommended_config`) and its control arm (the
kept passes' heads retrained without re-initialisation; ``--no-control`` skips it), keeping
finished passes (and control passes) in
``<out>.partial/`` for ``--resume``, and writes :func:`headsurgeon.reports.write_report` on rank 0
(``--help`` lists the options). Runs data-parallel under ``torchrun``.

The work folder ``<out>.partial`` is created by this tool, marked as a repair work folder
(:data:`WORK_WRITER` in its :data:`headsurgeon.outputs.MARK_FILE`), and removed (when the run
ends, never trained, or is started over with ``--overwrite``) only when it carries that mark: a
file, symlink or folder of that name that the tool did not make is refused in one line and left
as it is. ``--resume`` of a run that finished says so (and never suggests ``--overwrite``).

Exit status: 0 repaired, no head worse (targets still sick are listed as failed heads);
2 bad input (one line, ``error: ...``); 3 (:data:`EXIT_DAMAGED`) a pass damaged the model (report
written, ``model/`` only if an earlier pass was acceptable); 4 (:data:`EXIT_WORSE`) a targeted
head that was healthy ended sick (report and ``model/`` written; the report names the heads).

Exports: main(argv) (the tool; returns its exit status), entry() (the console script:
``run(main)``), EXIT_DAMAGED (3), EXIT_WORSE (4), WORK_WRITER (the work folder's mark)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from headsurgeon.classify import Thresholds
from headsurgeon.cli import (
    ArgumentParser,
    TextFiles,
    add_data_args,
    add_dataset_args,
    add_model_args,
    add_output_args,
    claim_out,
    figure_formats,
    non_negative_int,
    placement_args,
    positive_int,
    require_tokenizer,
    run,
    seed,
)
from headsurgeon.distributed import DistInfo, setup_distributed
from headsurgeon.dtypes import check_trainable
from headsurgeon.errors import (
    CheckpointError,
    HeadsurgeonError,
    InvalidArgumentError,
    OutputExistsError,
    OutputWriteError,
    shown,
)
from headsurgeon.finetune import FinetuneConfig
from headsurgeon.heads import HeadSet
from headsurgeon.inputs import check_regular_file
from headsurgeon.loading import load_model, model_shape
from headsurgeon.outputs import atomic_directory, read_mark, resolve_output
from headsurgeon.repair import (
    DRIFT_THRESHOLD,
    MAX_PPL_INCREASE,
    RUN_FILE,
    RepairConfig,
    recommended_config,
    repair,
)
from headsurgeon.reports import default_out_dir, partial_dir, write_report
from headsurgeon.surgery import INITS

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_WORSE",
    "WORK_WRITER",
    "main",
    "entry",
]

logger = logging.getLogger(__name__)

EXIT_DAMAGED = 3  # 2 is bad input (headsurgeon.cli.run)
EXIT_WORSE = 4
_EXIT = {"ok": 0, "incomplete": 0, "failed": EXIT_DAMAGED, "worse": EXIT_WORSE}
WORK_WRITER = "repair work folder"  # the writer in the mark of <out>.partial


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m headsurgeon.repair",
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
    defaults = Thresholds()
    census.add_argument("--sink-threshold", type=float, default=defaults.sink)
    census.add_argument("--dead-threshold", type=float, default=defaults.dead)
    census.add_argument("--min-output-share", type=float, default=defaults.min_output_share)
    surgery = parser.add_argument_group("surgery")
    surgery.add_argument("--heads", help="heads to repair, e.g. L5H9,L6H10-15 (default: census)")
    surgery.add_argument("--include", help="heads to add to pass 1 even if healthy, e.g. L5-22H5")
    surgery.add_argument("--passes", type=positive_int, default=2, help="most passes (default 2)")
    surgery.add_argument("--init", choices=INITS, default="xavier_normal")
    surgery.add_argument("--drift-threshold", type=float, default=DRIFT_THRESHOLD)
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
    ft = FinetuneConfig()
    train_source = training.add_mutually_exclusive_group()
    train_source.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        action=TextFiles,
        help="training text (default: the bundled training corpora)",
    )
    add_dataset_args(training, train_source, "the training text")
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
        "--train-seq-len",
        type=positive_int,
        help="tokens per training sequence (default: training length, <= 512)",
    )
    training.add_argument("--n-eval-seqs", type=positive_int, default=32)
    training.add_argument(
        "--steps",
        type=positive_int,
        help=f"steps per pass (default: the model's recommended setting, else {ft.steps})",
    )
    training.add_argument(
        "--lr", type=float, help=f"peak learning rate (default: as --steps, else {ft.lr})"
    )
    training.add_argument("--weight-decay", type=float, default=ft.weight_decay)
    training.add_argument(
        "--warmup", type=non_negative_int, help="warm-up steps (default min(100, steps/4))"
    )
    training.add_argument(
        "--batch-size", type=positive_int, default=ft.batch_size, help="per process"
    )
    training.add_argument("--grad-accum", type=positive_int, default=ft.grad_accum)
    training.add_argument("--max-grad-norm", type=float, default=ft.max_grad_norm)
    training.add_argument(
        "--autocast",
        choices=["bfloat16"],
        help="compute a float32 model in bfloat16 autocast (the paper's setup)",
    )
    training.add_argument("--eval-every", type=positive_int, help="steps between evaluations")
    training.add_argument(
        "--patience", type=positive_int, help="early stop after N worse evaluations"
    )
    training.add_argument("--strategy", choices=["slices", "mask"], default=ft.strategy)
    training.add_argument("--seed", type=seed, default=0)
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


def _texts(paths: Sequence[Path] | None) -> list[Path] | None:
    # Paths, not their texts: the library reads files piece by piece, in bounded memory.
    return list(paths) if paths else None


def _training_texts(args: argparse.Namespace) -> tuple[Any, Any]:
    """The training and held-out texts: --corpus and --eval-corpus, or --dataset's --split and
    --eval-split (streamed; None: the bundled corpora)."""
    corpus, eval_corpus = _texts(args.corpus), _texts(args.eval_corpus)
    if args.dataset:
        from headsurgeon.corpus_sources import load_dataset_texts

        corpus = load_dataset_texts(args.dataset, args.split, args.column)
        if args.eval_split:
            eval_corpus = load_dataset_texts(args.dataset, args.eval_split, args.column)
    return corpus, eval_corpus


def _prepare_output(args: argparse.Namespace, claims: contextlib.ExitStack) -> Path:
    """The output folder, claimed for the run (held in ``claims``) before the long run, and its
    work folder ``<out>.partial``: an unfinished run there is resumed, refused, or cleared on
    --overwrite; one that never started training is cleared (a new one is made by
    :func:`_start_work_folder` once the model is loaded)."""
    if args.resume:
        _check_resume(resolve_output(args.out), args.overwrite)  # before the claim's advice
    out = claims.enter_context(claim_out(args, default_out_dir(args.model, "repaired")))
    partial = partial_dir(out)  # the claim on out covers it: no live run is using it now
    if os.path.lexists(partial):
        _check_work_folder(partial, out)
    if args.resume:
        run_file = partial / RUN_FILE
        if not os.path.lexists(run_file):
            raise CheckpointError(f"no interrupted run to resume: {partial} has no {RUN_FILE}")
        check_regular_file(run_file, "resume file", error=CheckpointError)  # a FIFO: one line
    if not args.resume and os.path.lexists(partial):
        if not _trained(partial):
            logger.info("removed %s, left by a run that never started training", partial)
        elif not args.overwrite:
            raise OutputExistsError(
                f"{partial} holds an interrupted run; continue it with --resume {out}, or pass "
                "--overwrite to start over"
            )
        shutil.rmtree(partial)
    return out


def _start_work_folder(partial: Path) -> None:
    """Create the empty work folder of a new run, whose mark says this tool made it."""
    with atomic_directory(partial, writer=WORK_WRITER):
        pass


def _check_resume(out: Path, overwrite: bool) -> None:
    """Refuse a --resume of ``out`` that a finished run holds: nothing to resume, and
    ``--overwrite`` would delete the finished run (unless an interrupted run is to replace it)."""
    if not (out / "report.md").is_file():
        return
    partial = partial_dir(out)
    if not (partial / RUN_FILE).is_file():
        raise CheckpointError(
            f"{out} holds a finished repair (report.md); nothing to resume: open it, or start a "
            "new run with another --out"
        )
    if not overwrite:
        raise OutputExistsError(
            f"{out} holds a finished repair (report.md) and {partial} an interrupted run that "
            f"would replace it when done: continue with --resume {out} --overwrite, or leave "
            "both as they are"
        )


def _is_work_folder(partial: Path) -> bool:
    """Whether ``partial`` is a folder (not a symlink) carrying this tool's work-folder mark."""
    if not partial.is_dir() or partial.is_symlink():
        return False
    mark = read_mark(partial)
    return mark is not None and mark.writer == WORK_WRITER


def _check_work_folder(partial: Path, out: Path) -> None:
    """Refuse a ``partial`` this tool did not make (no work-folder mark): a user's own file,
    symlink or folder of that name, never touched."""
    if _is_work_folder(partial):
        return
    if partial.is_dir() and not partial.is_symlink():
        what = "a folder without the mark of a repair work folder"
    else:
        what = "a symlink" if partial.is_symlink() else "a file"
    raise OutputExistsError(
        f"{partial} is in the way: the repair of {out} keeps its work there, and it is {what} "
        "(headsurgeon did not make it, so it is left as it is); move it, or choose another --out"
    )


def _trained(partial: Path) -> bool:
    """Whether the work folder holds any training (a pass folder with a file: a fine-tuning
    checkpoint or a finished pass), rather than only the run's identity and first census."""
    return any(p.is_file() for p in partial.glob("pass*/*"))


def _remove_work_folder(partial: Path) -> None:
    """Remove ``partial`` if it still carries the work-folder mark (it is the tool's own)."""
    if not _is_work_folder(partial):
        logger.warning(
            "left %s as it is: it no longer carries the mark of a repair work folder", partial
        )
        return
    shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def _keep_training(out: Path, partial: Path, rank: int):
    """On a failure: remove ``partial`` if no training happened (nothing to resume), else say
    how to continue it (with a write error, whose cause may be fixed: a full disk)."""
    try:
        yield
    except BaseException as e:
        if rank != 0 or not partial.exists():
            raise
        if not _trained(partial):
            _remove_work_folder(partial)
            raise
        hint = f"{partial} keeps the finished training: continue it with --resume {out}"
        if isinstance(e, OutputWriteError):
            raise OutputWriteError(f"{e}; {hint}") from e
        if isinstance(e, KeyboardInterrupt):
            logger.warning(hint)
        raise


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 only; its result, or its error, reaches every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except HeadsurgeonError as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.eval_split and not args.dataset:
        parser.error("--eval-split names a split of --dataset; give --dataset too")
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise InvalidArgumentError("--resume DIR continues the run writing DIR; drop --out")
    args.out = args.resume or args.out
    try:
        check_trainable(args.dtype)  # not after the census: the rule is the fine-tuner's
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"--dtype {args.dtype}: {e}") from None
    shape = model_shape(args.model) if args.heads or args.include else None
    args.heads, args.include = (  # checked against the model's shape now, not after loading
        HeadSet.parse(text, shape) if text is not None else None
        for text in (args.heads, args.include)
    )
    formats = figure_formats(args)  # --format pdf without a browser: fail before any training
    config = FinetuneConfig(
        steps=FinetuneConfig.steps if args.steps is None else args.steps,
        lr=FinetuneConfig.lr if args.lr is None else args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        max_grad_norm=args.max_grad_norm,
        autocast=args.autocast,
        eval_every=args.eval_every,
        patience=args.patience,
        min_query_pos=args.min_query_pos,
        strategy=args.strategy,
        seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing,
        loss_chunk=args.loss_chunk,
    )
    settings = RepairConfig(  # every setting checked here, before any model is loaded
        passes=args.passes,
        init=args.init,
        seed=args.seed,
        thresholds=Thresholds(args.sink_threshold, args.dead_threshold, args.min_output_share),
        census_seq_len=args.seq_len,
        census_n_seqs=args.n_seqs,
        min_query_pos=args.min_query_pos,
        prepend_bos=args.prepend_bos,
        train_seq_len=args.train_seq_len,
        n_eval_seqs=args.n_eval_seqs,
        drift_threshold=args.drift_threshold,
        finetune=config,
        save_dtype=args.save_dtype,
        max_ppl_increase=args.max_ppl_increase,
        max_collateral=args.max_collateral,
        control=args.control,
    )
    dist_info = setup_distributed(args.device or "cpu")
    try:
        return _run(args, settings, formats, dist_info)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _run(
    args: argparse.Namespace,
    settings: RepairConfig,
    formats: list[str] | None,
    dist_info: DistInfo,
) -> int:
    """Claim the output, load the model, repair it and write the report (rank 0)."""
    with contextlib.ExitStack() as claims:
        # One decision on rank 0, before any rank writes; rank 0 holds the claim to the end.
        out = _on_rank0(lambda: _prepare_output(args, claims))
        partial = partial_dir(out)
        placement = placement_args(args)
        if not args.device_map and not args.max_memory:
            placement["device"] = dist_info.device  # this rank's GPU under torchrun
        model = load_model(args.model, dtype=args.dtype, **placement)
        require_tokenizer(
            model,
            args,
            "its text (--texts, --corpus, --eval-corpus, --dataset or the bundled corpora)",
        )
        finetune = recommended_config(model, settings.finetune, steps=args.steps, lr=args.lr)
        settings = dataclasses.replace(settings, finetune=finetune)
        with _keep_training(out, partial, dist_info.rank):
            if dist_info.rank == 0 and not args.resume:
                _start_work_folder(partial)
            corpus, eval_corpus = _training_texts(args)
            result = repair(
                model,
                corpus,
                eval_corpus=eval_corpus,
                census_data=_texts(args.texts),
                heads=args.heads,
                include=args.include,
                config=settings,
                work_dir=partial,
                resume=bool(args.resume),
                progress=not args.quiet,
            )
            if dist_info.rank == 0:
                write_report(result, out, formats=formats, overwrite=args.overwrite)
                _remove_work_folder(partial)
    if dist_info.rank == 0:
        print(shown((out / "report.md").read_text().split("## Pass")[0].rstrip()))
        model_dir = ", model/" if result.best_pass is not None else " (no model/)"
        print(f"\nwrote {shown(out)}/: report.md, report.json, censuses, figures{model_dir}")
        if not result.ok:
            print(f"repair failed: {shown(result.failure_reason)}", file=sys.stderr)
    return _EXIT[result.verdict]


def entry(argv: Sequence[str] | None = None) -> None:
    """The console script ``headsurgeon-repair``, ``python -m headsurgeon repair`` and
    ``python -m headsurgeon.repair``: :func:`main` with ``argv`` (default: the command
    line's arguments)."""
    run(main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    entry()
