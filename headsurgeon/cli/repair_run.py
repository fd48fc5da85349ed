"""The work of ``python -m headsurgeon repair`` once its options are parsed
(:mod:`headsurgeon.cli.repair`): the settings checked, the output folder and its work folder
``<out>.partial`` claimed, the model loaded and repaired, the report written on rank 0 (imports
torch, TransformerLens, pandas and plotly).
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
from headsurgeon.cli import loads
from headsurgeon.cli.options import claim_out, dataset_split, placement_args
from headsurgeon.cli.session import in_option_terms
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
from headsurgeon.repair import RepairConfig, recommended_config, repair as repair_heads
from headsurgeon.repair.resume import RUN_FILE
from headsurgeon.reports import write_report
from headsurgeon.reports.folders import default_out_dir, partial_dir

__all__ = [
    "repair",
]

logger = logging.getLogger(__name__)

WORK_WRITER = "repair work folder"  # the writer in the mark of <out>.partial


def repair(args: argparse.Namespace, formats: list[str] | None) -> str:
    """The run of parsed options ``args``: every setting checked before any model is loaded,
    then (under ``torchrun``, on every rank) the repair; returns its verdict."""
    try:
        check_trainable(args.dtype)  # not after the census: the rule is the fine-tuner's
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"--dtype {args.dtype}: {e}") from None
    shape = model_shape(args.model) if args.heads or args.include else None
    args.heads, args.include = (  # checked against the model's shape now, not after loading
        HeadSet.parse(text, shape) if text is not None else None
        for text in (args.heads, args.include)
    )
    settings = _settings(args)
    dist_info = setup_distributed(args.device or "cpu")
    try:
        return _run(args, settings, formats, dist_info)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _settings(args: argparse.Namespace) -> RepairConfig:
    """The repair's settings from the options, every one checked here."""
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
    return RepairConfig(
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
        eval_on_train=args.allow_eval_on_train,
    )


def _texts(paths: Sequence[Path] | None) -> list[Path] | None:
    # Paths, not their texts: the library reads files piece by piece, in bounded memory.
    return list(paths) if paths else None


# --dataset is the repair's training text, whose text files go to --corpus (--texts is the
# census's).
_DATASET_TERMS = {
    "text files are texts: pass their paths, not load_dataset_texts": "text files go to --corpus"
}


def _training_texts(args: argparse.Namespace) -> tuple[Any, Any]:
    """The training and held-out texts: --corpus and --eval-corpus, or --dataset's --split and
    --eval-split (streamed; None: the bundled corpora)."""
    corpus, eval_corpus = _texts(args.corpus), _texts(args.eval_corpus)
    if args.dataset:
        from headsurgeon.corpus_sources import load_dataset_texts

        corpus = load_dataset_texts(args.dataset, dataset_split(args), args.column)
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


def _run(
    args: argparse.Namespace,
    settings: RepairConfig,
    formats: list[str] | None,
    dist_info: DistInfo,
) -> str:
    """Claim the output, load the model, repair it and write the report (rank 0)."""
    with contextlib.ExitStack() as claims:
        # One decision on rank 0, before any rank writes; rank 0 holds the claim to the end.
        out = _on_rank0(lambda: _prepare_output(args, claims))
        partial = partial_dir(out)
        placement = placement_args(args)
        if not args.device_map and not args.max_memory:
            placement["device"] = dist_info.device  # this rank's GPU under torchrun
        model = load_model(args.model, dtype=args.dtype, **placement)
        loads.require_tokenizer(
            model,
            args,
            "its text (--texts, --corpus, --eval-corpus, --dataset or the bundled corpora)",
        )
        finetune = recommended_config(model, settings.finetune, steps=args.steps, lr=args.lr)
        settings = dataclasses.replace(settings, finetune=finetune)
        with _keep_training(out, partial, dist_info.rank):
            if dist_info.rank == 0 and not args.resume:
                _start_work_folder(partial)
            with in_option_terms(_DATASET_TERMS):
                corpus, eval_corpus = _training_texts(args)
            result = repair_heads(
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
    return result.verdict
